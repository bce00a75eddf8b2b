"""GRPO/PPO training as one readable function: generate -> reward -> advantages -> pack -> forward_backward ->
optim_step -> sync -> log -> checkpoint.

    comp, state, history = run_rl_training(model, buffer, RLTrainingConfig(...), engines=engines, sender=sender,
                                           tokenizer=tokenizer, reward_fn="arithmetic")

Rollouts come from inference engines (engine objects built by engines.registry: embedded, SGLang, vLLM) through
`trainer.rollout.manager.AsyncRolloutManager` behind `trainer.rollout.service.RolloutService`; the engines get the
new weights every `sync_every` steps by broadcast or shared memory (engines.weight_sync.wire); a disk sync happens
only when the caller passes a trainer.weight_sync.DiskWeightSync as `sender` (the CLI's opt-in [engines] sync =
"disk"). In async mode the batch of step n+1 is generated (in a worker thread, by the engine processes) while step n
trains; the weights that generated it lag by at most `max_staleness` versions (trainer.rollout.staleness). Whenever
the engines may lag (async, or sync_every > 1) the loss's off-policy correction ([rl.loss] rollout_correction, "tis"
by default there) weights each token by the engine-vs-trainer ratio; the trainer side of that ratio is pi_old, the
weights at the start of the step, which with one optimizer step per batch are the weights of the update's own
forward (old log-probs are recomputed by a separate forward only for ppo_epochs > 1).
The engine-vs-trainer mismatch metrics (mismatch/*) are logged on every step where the engine returned its
log-probs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engines.protocol import InferenceEngine
from engines.weight_sync.wire import WeightSyncError
from kernels.advantages import advantage_estimator
from trainer.backend.checkpoint import Checkpointer, load_latest
from trainer.backend.critic import build_critic
from trainer.backend.heap import frozen_heap
from trainer.backend.local import LocalBackend, to_datums
from trainer.backend.lora import is_lora
from trainer.backend.protocol import TrainingBackend
from trainer.backend.remote import RemoteCheckpointer, remote_resume
from trainer.backend.steps import (
    TrainerConfig,
    TrainingComponents,
    advanced,
    build_components,
    frozen_copy,
    trainer_config_from,
)
from trainer.config import DataConfig, RLTrainingConfig, RolloutConfig
from trainer.evaluation import Evaluation
from trainer.metrics import MetricsLogger, open_logger, progress
from trainer.rollout.dumps import RolloutDumps, rollout_rows, table_rows, write_rollouts
from trainer.rollout.resume import ResumePoints
from trainer.rollout.samples import build_batch_metadata, group_ids, pad_token_id, restart_group, sample_to_dict
from trainer.rollout.service import rollout_service
from trainer.rollout.staleness import within_staleness
from trainer.stops import RunStopped, interrupts_held
from trainer.types import RolloutBatch, Sample, Status, TrainingState

if TYPE_CHECKING:
    from trainer.rewards.sources import RewardSources
    from trainer.rollout.manager import AsyncRolloutManager
    from trainer.weight_sync import WeightSync


def compute_advantages(samples: Sequence[Sample], estimator: str) -> list[float | None]:
    """One advantage per sample from its reward and its group (samples of one prompt share their group_index).

    A FAILED sample has no reward: it gets advantage 0 and stays out of its group's mean and std. `estimator`
    names an entry of kernels.advantages.ADVANTAGE_ESTIMATORS; for a per-token one ("gae") a sample has no one
    advantage (they come per token in the step, from the critic's values: trainer.backend.critic), so each is None.
    """
    est = advantage_estimator(estimator)
    if est.per_token:
        return [None] * len(samples)
    scored = [i for i, s in enumerate(samples) if s.status != Status.FAILED]
    out = [0.0] * len(samples)
    if not scored:
        return out
    rewards = torch.tensor([0.0 if samples[i].reward is None else samples[i].reward for i in scored],
                           dtype=torch.float64)
    all_uids = group_ids(samples)
    uids = [all_uids[i] for i in scored]
    remap = {u: k for k, u in enumerate(dict.fromkeys(uids))}
    groups = torch.tensor([remap[u] for u in uids], dtype=torch.int64)
    adv = est.fn(rewards, groups)
    for i, a in zip(scored, adv.tolist()):
        out[i] = a
    return out


def trained_samples(samples: Sequence[Sample], estimator: str, *,
                    mask_truncated: bool = False) -> tuple[list[int], dict[str, float]]:
    """Indices of the samples the loss trains on, and counts of the ones it leaves out.

    Left out: FAILED samples (the reward function or the episode's environment raised, or generation failed:
    there is no reward to learn from), for group estimators every sample of a group left with fewer than two
    scored samples (no baseline), and with `mask_truncated` every TRUNCATED sample (it still counts in its group's
    baseline: compute_advantages sees it). Left-out samples are not packed at all, so they count in neither the
    token nor the sequence normaliser of the loss. A warning names the first error. "gae" has no groups.
    """
    needs_groups = advantage_estimator(estimator).needs_groups
    failed = [s for s in samples if s.status == Status.FAILED]
    if failed:
        first = next((s.metadata.get("reward_error") or s.metadata["env_error"] for s in failed
                      if "reward_error" in s.metadata or "env_error" in s.metadata), "generation failed")
        warnings.warn(f"{len(failed)} of {len(samples)} samples FAILED and are left out of the loss; first error: "
                      f"{first}", stacklevel=2)
    uids = group_ids(samples)
    scored_per_group = collections.Counter(u for u, s in zip(uids, samples) if s.status != Status.FAILED)
    keep = [i for i, (u, s) in enumerate(zip(uids, samples)) if s.status != Status.FAILED
            and (not needs_groups or scored_per_group[u] >= 2)
            and not (mask_truncated and s.status == Status.TRUNCATED)]
    n = len(samples)
    return keep, {"rollout/failed_fraction": len(failed) / n, "train/excluded_fraction": (n - len(keep)) / n}


def needs_old_logprobs(config: RLTrainingConfig) -> bool:
    """Whether the trainer recomputes old log-probs (pi_old: the weights at the start of this step) in a forward
    of their own before the update.

    Only with ppo_epochs > 1, where the policy moves between the epochs. With one epoch the batch's one optimizer
    step comes after every micro-batch's forward, so pi_old is the update's own forward: the loss takes old = the
    current log-probs, detached (one forward fewer, the same numbers, as TRL does for num_iterations = 1). That holds
    when the engines lag too (async rollouts, sync_every > 1): the samples come from older weights, and the loss's
    rollout correction and the engine-vs-trainer metrics compare the engine's log-probs with pi_old all the same.
    """
    return config.ppo_epochs > 1


# A step warns (stderr, beside the progress line) when more than this fraction of its samples was truncated or failed.
MOSTLY_UNFINISHED = 0.5
# What each episode end reason ("truncated_by"; a single-turn sample cut by the engine has none) asks a user to raise.
_LIMIT_OF = {"length": "max_new_tokens", "context": "max_context_tokens", "max_turns": "max_turns"}


class TruncatedRunError(RunStopped):
    """The run stopped: [rl.rollout] max_truncated_steps steps in a row gave it nothing to learn from (every sample
    truncated or failed, the rewards all equal). A configuration problem found at run time: `python -m trainer`
    prints it as `error: <message>` and exits 1."""


def _limits(rollout: RolloutConfig) -> str:
    return (f"[rl.rollout] max_new_tokens = {rollout.max_new_tokens} (per turn in multi-turn episodes), "
            f"max_context_tokens = {rollout.max_context_tokens} (0: none), max_turns = {rollout.max_turns}")


def check_finishing(samples: Sequence[Sample], streak: int, rollout: RolloutConfig, *,
                    step: int) -> tuple[int, str | None]:
    """How many steps in a row, this one (`step`) included, had nothing to learn from (every sample TRUNCATED or
    FAILED, the others' rewards all equal and not above 0: every advantage is 0, the loss 0), given `streak` before
    it; and a warning when more than MOSTLY_UNFINISHED of its samples were truncated or failed (None otherwise). Raises
    TruncatedRunError naming the length limits once that streak reaches rollout.max_truncated_steps (0: never).

    Why "and the rewards all equal": a batch whose cut samples still score differently trains (tests and tasks with
    short dense rewards do this on purpose); one whose cut samples all score the same trains nothing, not even
    later (the weights do not move), which a run that exits 0 with loss=0 hid from its user."""
    n = len(samples)
    truncated = [s for s in samples if s.status == Status.TRUNCATED]
    failed = sum(s.status == Status.FAILED for s in samples)
    scored = {s.reward for s in samples if s.status != Status.FAILED}
    # A common reward above 0 is a model that answers right but is cut before its end of turn (a converged run
    # with a short max_new_tokens, as the real-vLLM test's): nothing to learn, and nothing wrong either.
    stuck = len(scored) == 0 or (len(scored) == 1 and next(iter(scored)) <= 0)
    streak = streak + 1 if n and len(truncated) + failed == n and stuck else 0
    by = collections.Counter(_LIMIT_OF.get(s.metadata.get("truncated_by", "length"), "max_new_tokens")
                             for s in truncated)
    cut = f"truncated ({', '.join(f'{v} by {k}' for k, v in by.most_common()) or 0}) or failed ({failed})"
    if rollout.max_truncated_steps and streak >= rollout.max_truncated_steps:
        raise TruncatedRunError(
            f"step {step}: {streak} steps in a row had nothing to learn from: every sample was {cut} and the rewards "
            f"were all {next(iter(scored), None)}, so every advantage and the loss were 0. The model runs out of room "
            f"before it finishes: raise {_limits(rollout)} (a multi-turn config copied from configs/demo.toml keeps "
            f"its max_new_tokens = 6), or set [rl.rollout] max_truncated_steps = 0 to train on anyway")
    unfinished = len(truncated) + failed
    if n and unfinished / n > MOSTLY_UNFINISHED:
        return streak, (f"warning: step {step}: {unfinished} of {n} samples ({unfinished / n:.0%}) were {cut}; if "
                        f"the model needs more room, raise {_limits(rollout)}")
    return streak, None


def _batch_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The rollout's own batch statistics (trainer.rollout.samples.build_batch_metadata) under rollout/, plus the
    headline
    figures unprefixed (the progress bar, the plot and the tests read those)."""
    meta = batch.metadata if "reward_mean" in batch.metadata else build_batch_metadata(batch.samples)
    numeric = {k: float(v) for k, v in meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**{f"rollout/{k}": v for k, v in numeric.items()},
            **{k: numeric[k] for k in ("reward_mean", "response_length_mean", "num_samples")}}


def _trainable(batch: RolloutBatch, config: RLTrainingConfig) -> tuple[list[Sample], list[float], dict[str, float]]:
    """The samples the step trains on, their advantages ("gae": 0, the backend computes them per token from the
    critic) and the counts of the ones left out; an error when none is left or the correction lacks its inputs."""
    samples = list(batch.samples)
    keep, metrics = trained_samples(samples, config.advantage_estimator, mask_truncated=config.rollout.mask_truncated)
    if not keep:
        errors = [s.metadata.get("reward_error") or s.metadata["env_error"] for s in samples
                  if "reward_error" in s.metadata or "env_error" in s.metadata]
        masked = sum(s.status == Status.TRUNCATED for s in samples) if config.rollout.mask_truncated else 0
        raise RunStopped(f"no sample of this batch can be trained on ({len(samples)} samples, {masked} truncated and "
                         f"masked ([rl.rollout] mask_truncated), the others failed or in groups with fewer than two "
                         f"scored samples); first error: {errors[0] if errors else None}")
    # A per-token estimator ("gae"): 0 here, per token in the step once the critic's values are known.
    per_token = config.estimator.per_token
    advantages = [0.0] * len(samples) if per_token else compute_advantages(samples, config.advantage_estimator)
    samples, advantages = [samples[i] for i in keep], [advantages[i] for i in keep]
    correction = config.loss.rollout_correction
    if correction != "none" and any(s.rollout_logprobs is None for s in samples):
        raise ValueError(f"loss.rollout_correction={correction!r} needs the engine's log-probs on every sample, "
                         f"but the engine returned none for some; use an engine that returns them or set "
                         f"[rl.loss] rollout_correction = \"none\"")
    return samples, advantages, metrics


def train_on_batch(backend: TrainingBackend, state: TrainingState, batch: RolloutBatch,
                   config: RLTrainingConfig) -> tuple[dict, TrainingState]:
    """advantages -> datums -> ppo_epochs x (forward_backward -> optim_step) through `backend`; returns the metrics
    and the next state.

    The backend packs and trains (trainer.backend.local.LocalBackend: micro-batches, pi_old, the KL reference, the
    critic's GAE; trainer.backend.remote.TinkerPolicy: a Tinker-API server). The engine's log-probs ride along in
    the datums whenever the engine returned them: the loss then reports the engine-vs-trainer mismatch metrics, and
    applies the off-policy correction when one is configured.
    """
    samples, advantages, metrics = _trainable(batch, config)
    datums, extra = to_datums(samples, advantages)  # extra: prompt lengths, rewards ("gae": the critic's targets)
    futures = [(backend.forward_backward(datums, "policy", extra), backend.optim_step())
               for _ in range(config.ppo_epochs)]
    # Reading the futures is the step's only host sync; every epoch's are read so that a deferred input error of any
    # epoch is raised. The metrics are the last epoch's.
    for fb, opt in futures:
        metrics.update(fb.result().metrics)
        metrics.update(opt.result())
    num_tokens = sum(sum(s.effective_loss_mask) for s in samples)  # the loss tokens (every prompt_length >= 1)
    for _ in futures:
        state = advanced(state, num_tokens)
    return {k: float(v) for k, v in metrics.items()}, state


def batches_trained(step: int, config: RLTrainingConfig) -> int:
    """The rollout batches trained by optimizer step `step`: each batch is ppo_epochs optimizer steps (the steps
    num_steps, the LR schedule and checkpoints count). The rollout side and its resume points count batches."""
    return step // config.ppo_epochs


def local_backend(components: TrainingComponents, config: RLTrainingConfig, tcfg: TrainerConfig, *, pad_id: int,
                  ref: TrainingComponents | None = None, critic: TrainingComponents | None = None) -> LocalBackend:
    """The RL step's LocalBackend over `components`: the KL reference `ref` (kl_coef > 0: _reference_components),
    GAE's separate critic (trainer.backend.critic.build_critic for [rl.critic] kind = "model"; the policy's own head
    for kind = "head"), pi_old by a forward of its own when needs_old_logprobs."""
    needs_critic = config.estimator.needs_critic
    assert needs_critic or critic is None, f"advantage_estimator = {config.advantage_estimator!r} needs no critic"
    if needs_critic and (critic is None) != (config.critic.kind == "head"):
        need = ("the separate critic: pass critic=trainer.backend.critic.build_critic(components, tcfg)"
                if critic is None else "no separate critic (the value head is the policy's own)")
        raise ValueError(f"advantage_estimator = \"gae\" with [rl.critic] kind = {config.critic.kind!r} needs {need}")
    return LocalBackend(components, tcfg, pad_id=pad_id, ref=ref, critic=critic,
                        old_logprobs=needs_old_logprobs(config))


def describe_objective(config: RLTrainingConfig) -> str:
    """One line naming the objective a run trains with, and why its rollout correction is what it is (async
    rollouts turn TIS on by default: a user should see that, not find it in the code)."""
    lo = config.loss
    lag = ("async_rollout" if config.async_rollout else f"sync_every = {config.sync_every}") if config.off_policy \
        else None
    why = (f"off-policy rollouts ({lag}): the engines may sample with older weights" if lag else
           "synchronous on-policy rollouts")
    kl = f", kl {lo.kl_type} x {lo.kl_coef:g}" if lo.kl_coef > 0 else ""
    ent = f", entropy x {lo.entropy_coef:g}" if lo.entropy_coef > 0 else ""
    return (f"rl objective: {lo.objective}, {config.advantage_estimator} advantages, loss_agg {lo.loss_agg}, clip "
            f"[{1 - lo.clip_low:g}, {1 + lo.clip_high:g}]{kl}{ent}, ppo_epochs {config.ppo_epochs}; rollout_correction "
            f"{lo.rollout_correction!r} ({why}; [rl.loss] rollout_correction chooses)")


@dataclasses.dataclass(eq=False)
class _RLRun:
    """A built RL run (`_setup`): what the loop reads. Mutable state: `state`, the loop's current TrainingState (the
    checkpointer reads it at save time), and `history`, the metrics of the steps trained so far."""

    config: RLTrainingConfig
    tcfg: TrainerConfig
    backend: TrainingBackend
    components: TrainingComponents | None  # None: the optimisation runs on a Tinker-API server
    engines: Sequence[InferenceEngine]
    sender: WeightSync
    manager: AsyncRolloutManager
    rewards: RewardSources
    points: ResumePoints
    logger: MetricsLogger | None  # opened last by _setup
    pad_id: int
    state: TrainingState
    ckpt: Checkpointer | None = None
    probe_prompts: Sequence[Sequence[int]] | None = None
    on_step: Callable[[int, dict], None] | None = None
    evaluation: Evaluation | None = None
    dumps: RolloutDumps | None = None
    history: list[dict] = dataclasses.field(default_factory=list)

    @property
    def rank(self) -> int:
        return 0 if self.components is None else self.components.rank


def _setup(model: Any, data_buffer: Any, config: RLTrainingConfig, tcfg: TrainerConfig, *, tokenizer: Any,
           reward_fn: Any, reward_timeout_s: float | None, components: TrainingComponents | None,
           backend: TrainingBackend | None, logger: Any, resume: bool, **parts: Any) -> _RLRun:
    """Build the run: the backend (local: the components, the KL reference and the critic; or the remote one given),
    the reward sources, the rollout manager, the state (resumed), the checkpointer and the metrics logger."""
    from trainer.rewards.sources import as_reward_sources
    from trainer.rollout.manager import AsyncRolloutManager

    pad_id = pad_token_id(tokenizer)  # what packed rows pad with
    comp = critic = None
    if backend is None:
        comp = components or build_components(model, tcfg)
        ref = _reference_components(comp, tcfg) if config.loss.kl_coef > 0 else None  # frozen starting weights
        critic = build_critic(comp, tcfg)  # "gae" with a separate critic: from the starting weights; else None
        backend = local_backend(comp, config, tcfg, pad_id=pad_id, ref=ref, critic=critic)
    # Built once: per-sample sources score inside the rollout, per-batch ones (models, judges) after it.
    rewards = as_reward_sources(reward_fn, timeout_s=reward_timeout_s)
    manager = AsyncRolloutManager(parts["engines"], config.rollout, tokenizer=tokenizer,
                                  reward_fn=rewards.rollout_reward(), deterministic=config.deterministic)
    resumable = {"data_buffer": data_buffer, "rollout_manager": manager}  # restored with the weights on resume
    if comp is None:
        state = remote_resume(backend, tcfg.output_dir, resumable) if resume else TrainingState()
    else:
        state = _resume(comp, tcfg.output_dir, resumable, critic=critic) if resume else TrainingState()
    # A checkpoint of step n holds the data position and rollout state of when batch n was drawn, not the live
    # ones (batch n+1 may be drawn already): the resumed run draws exactly the batches an uninterrupted one would.
    points = ResumePoints(resumable, step=batches_trained(state.step, config), keep=config.generation_ahead + 2)
    run = _RLRun(config=config, tcfg=tcfg, backend=backend, components=comp, manager=manager, rewards=rewards,
                 points=points, logger=None, pad_id=pad_id, state=state, **parts)
    extra = lambda: points.at(batches_trained(run.state.step, config))  # noqa: E731 - read at save time
    run.ckpt = Checkpointer(comp, lambda: run.state, extra, save_every=tcfg.save_every, critic=critic) if comp \
        else RemoteCheckpointer(None, lambda: run.state, extra, save_every=tcfg.save_every, backend=backend,
                                output_dir=tcfg.output_dir)
    # last: the caller's `with` closes it, and with it what opening starts ([logging] profile_steps' profiler)
    run.logger = open_logger(logger, Path(tcfg.output_dir) / "metrics.jsonl", enabled=comp is None or comp.rank == 0,
                             keep_through=state.step)
    return run


def run_rl_training(model: Any, data_buffer: Any, config: RLTrainingConfig, *, engines: Sequence[InferenceEngine],
                    sender: WeightSync, tokenizer: Any, reward_fn: Any, trainer_config: TrainerConfig | None = None,
                    components: TrainingComponents | None = None, backend: TrainingBackend | None = None,
                    logger: MetricsLogger | Callable[[int], MetricsLogger] | None = None, resume: bool = False,
                    probe_prompts: Sequence[Sequence[int]] | None = None,
                    on_step: Callable[[int, dict], None] | None = None,
                    reward_timeout_s: float | None = DataConfig.reward_timeout_s,
                    evaluation: Evaluation | None = None, dumps: RolloutDumps | None = None,
                    ) -> tuple[TrainingComponents | None, TrainingState, list[dict]]:
    """Train with GRPO/PPO for config.num_steps steps; returns (components, final state, per-step metrics).

    model: a folder, an HF config or a built TrainModule (ignored when `components` or `backend` is given, e.g.
    after SFT). backend: where the optimisation runs instead of this process (trainer.backend.remote.TinkerPolicy: a
    Tinker-API server; the returned components are then None). data_buffer: trainer.data.buffer.DataBuffer of
    prompts (with answers in metadata for verifiable rewards).
    engines: InferenceEngine objects (built by engines.registry). Their weights are synced from the trainer at the
    start (so they serve the policy being trained) and every `sync_every` steps, through `sender`: a
    trainer.weight_sync sender (WeightSyncSender, or DiskWeightSync; trainer.backend.remote.TinkerSync with a
    remote backend) to those engines whose group is already up; the caller owns it (init_group before, close
    after). tokenizer: the model's (prompts, stop tokens, the pad id). reward_fn: the reward, as built RewardSources
    (trainer.rewards.sources.build_reward_sources: [rewards] sources, rules, reward models and judges, each
    source's metrics logged), or as a function of a Sample or a name trainer.rewards.rules.load_reward_fn resolves
    (the [data].reward shorthand: one rule), whose call longer than `reward_timeout_s` (None: no limit) marks its
    sample FAILED instead of stalling the step. None: the episodes' environment or rollout_fn gives each reward
    ([rl.rollout] env / rollout_fn); an episode given none is FAILED (trainer.rewards.rules.no_reward).
    Writes metrics.jsonl and checkpoints under config.output_dir (`logger`: where the metrics go instead, e.g.
    trainer.tracking.build_logger's); resume=True continues from the newest complete checkpoint there (data
    position and partial-rollout cache included). Ctrl-C writes a checkpoint first. `evaluation`
    (trainer.evaluation.Evaluation): held-out figures at the start, every N steps right after the weight sync, and
    at the last step, logged with the step. `dumps` (trainer.rollout.dumps.RolloutDumps): the samples of every
    N-th step written out (with the trainer's log-probs before the update) and a few shown as a table.
    """
    tcfg = trainer_config or trainer_config_from(config)
    run = _setup(model, data_buffer, config, tcfg, tokenizer=tokenizer, reward_fn=reward_fn,
                 reward_timeout_s=reward_timeout_s, components=components, backend=backend, logger=logger,
                 resume=resume, engines=engines, sender=sender, probe_prompts=probe_prompts, on_step=on_step,
                 evaluation=evaluation, dumps=dumps)
    if run.rank == 0:
        print(describe_objective(config), flush=True)
    with (contextlib.closing(run.logger), progress(config.num_steps, initial=run.state.step, desc="rl",
                                                   enabled=run.rank == 0) as bar,
          rollout_service(data_buffer, config, run.manager, sender, run.rank, on_failure=run.ckpt.save,
                          on_drawn=run.points.record, rewards=run.rewards, worker_cpus=tcfg.backend.rollout_cpus,
                          first_step=batches_trained(run.state.step, config) + 1) as source,
          run.ckpt, frozen_heap()):
        sync_s = _sync(sender, run.state.weight_version)  # engines serve exactly the weights being trained
        if run.rank == 0 and evaluation is not None and evaluation.at_start and run.state.step == 0:
            run.logger.log(0, evaluation.run(0))
        unfinished = 0  # steps in a row with nothing to learn from (check_finishing)
        while run.state.step < config.num_steps:
            sync_s, unfinished = _rl_step(run, source, bar, sync_s=sync_s, unfinished=unfinished)
    return run.components, run.state, run.history


def _rl_step(run: _RLRun, source: Any, bar: Any, *, sync_s: float, unfinished: int) -> tuple[float, int]:
    """One step: take a batch -> train on it -> (every sync_every steps) sync the engines, verify, evaluate -> log
    -> dump -> checkpoint. Returns the last sync's seconds and the steps in a row with nothing to learn from."""
    config, state = run.config, run.state
    t_step = time.perf_counter()  # time_step_s: the wall time of this step, waits included
    batch, gen_s = _timed("rl.generate", source.next, batches_trained(state.step, config) + 1)
    # Every rank gets the same batch, so every rank stops alike (a collective-safe error).
    unfinished, warning = check_finishing(batch.samples, unfinished, config.rollout, step=state.step + 1)
    if warning is not None:
        bar.warn(warning)
    trained_from = state.weight_version  # the batch's staleness is measured against these weights
    def requeue(groups: list[list[Sample]]) -> None:  # and into the resume points already recorded (checkpoints)
        source.requeue(groups)
        run.points.requeued(batches_trained(state.step, config) + 1,
                            [[sample_to_dict(s) for s in restart_group(g)] for g in groups])

    batch, stale = within_staleness(batch, trained_from, config.staleness, requeue=requeue)
    due = run.dumps is not None and run.dumps.due(state.step + 1)
    # A Ctrl-C / SIGTERM during the step waits for its end (trainer.stops.interrupts_held), then arrives inside
    # _reported: the checkpoint on the way out holds the whole step, and the log its row.
    with interrupts_held() as release:
        seen = _inspect(run.backend, batch) if due else None  # a forward too: held as the step's
        (metrics, run.state), train_s = _timed("rl.train", train_on_batch, run.backend, state, batch, config)
        metrics = step_metrics(metrics, batch, run.state, time_generate_s=gen_s, time_train_s=train_s,
                               time_sync_s=sync_s) | stale
        metrics.update(batch.metadata.get("reward_metrics", {}))  # [rewards] sources: reward/<label>_mean, judge/*
        # The step has trained (a checkpoint now holds it): its row is logged even when Ctrl-C stops the sync.
        with _reported(run.state.step, metrics, logger=run.logger, history=run.history, bar=bar,
                       on_step=run.on_step):
            release()
            metrics["time_step_s"] = time.perf_counter() - t_step
            if run.state.step % config.sync_every == 0 or run.state.step == config.num_steps:
                sync_s = _sync_engines(run, source, metrics, batch, t_step)
    if seen is not None and run.rank == 0:
        _write_rollouts(run.dumps, run.state.step, batch, seen, config, logger=run.logger,
                        tokenizer=run.manager.tokenizer)
    run.ckpt.maybe_save()
    return sync_s, unfinished


def _sync_engines(run: _RLRun, source: Any, metrics: dict[str, float], batch: RolloutBatch, t_step: float) -> float:
    """The trained weights to the engines, then verify_sync and the evaluation that is due; returns the sync's
    seconds. The engines pause for the load as the rollout service's policy says: between two batches (for the whole
    block), or ([rl] update_in_flight) in place mid-request (for the load only)."""
    config, state = run.config, run.state
    with source.paused(load=functools.partial(_sync, run.sender, state.weight_version,
                                              on_failure=run.ckpt.save)) as sync_s:
        metrics["time_sync_s"] = sync_s
        metrics["sync/bytes"] = float(run.sender.last_sync_bytes)  # a LoRA run: adapters' only
        # Up to the weights landing: with the sync, the wait for the batch being generated.
        metrics["time_step_s"] = time.perf_counter() - t_step
        if config.verify_sync and state.step % config.sync_every == 0:
            with interrupts_held():  # the trainer's forward on the probes: no interrupt inside FSDP's forward
                metrics["verify_sync_max_abs_diff"] = _verify_sync(
                    run.components, run.engines, run.sender, state.step, run.probe_prompts or _default_probes(batch))
        if run.rank == 0 and run.evaluation is not None and run.evaluation.due(state.step, config.num_steps):
            metrics.update(run.evaluation.run(state.step))  # the engines serve this step's weights
    return sync_s


def _inspect(backend: TrainingBackend, batch: RolloutBatch) -> list[list[float | None]]:
    """The trainer's per-token log-probs of the batch before the step's update (for the dump's mismatch column),
    None where the loss mask is 0."""
    datums, extra = to_datums(batch.samples, [0.0] * len(batch.samples))
    outputs = backend.forward(datums, "cross_entropy", {"prompt_lengths": extra["prompt_lengths"]}).result().outputs
    return [[float(out["logprobs"][s.prompt_length - 1 + r]) if m else None
             for r, m in enumerate(s.effective_loss_mask)] for s, out in zip(batch.samples, outputs)]


def _write_rollouts(dumps: RolloutDumps, step: int, batch: RolloutBatch, logprobs: list[list[float | None]],
                    config: RLTrainingConfig, *, logger: MetricsLogger, tokenizer: Any) -> None:
    """The step's samples to <rollouts>/step_N.jsonl, and a few (best, median, worst reward) as a table to the
    backends that show tables."""
    with warnings.catch_warnings():  # the step already warned about its failed samples
        warnings.simplefilter("ignore")
        keep, _ = trained_samples(batch.samples, config.advantage_estimator,
                                  mask_truncated=config.rollout.mask_truncated)
    keep_set = set(keep)
    rows = rollout_rows(batch, step=step, advantages=compute_advantages(batch.samples, config.advantage_estimator),
                        trained=[i in keep_set for i in range(len(batch))], trainer_logprobs=logprobs,
                        tokenizer=tokenizer)
    write_rollouts(dumps.path(step), rows)
    table = table_rows(rows, dumps.table_rows)
    if table and hasattr(logger, "log_table"):  # JSONL has no tables (the file above is its view)
        logger.log_table(step, "rollouts/samples", table)


@contextlib.contextmanager
def _reported(step: int, metrics: dict[str, float], *, logger: MetricsLogger, history: list[dict], bar: Any,
              on_step: Callable[[int, dict], None] | None) -> Iterator[None]:
    """Report a trained step's metrics after the block (which completes them: sync time, verify_sync), or, when the
    block raises (Ctrl-C or an engine failing the sync), log them as they are before the error goes on: the
    checkpoint written on the way out holds this step, so the log must too. The caller's on_step and the progress
    bar are left out then (the run is stopping)."""
    try:
        yield
    except BaseException:
        logger.log(step, metrics)
        raise
    _report(step, metrics, logger=logger, history=history, bar=bar, on_step=on_step)


def _report(step: int, metrics: dict[str, float], *, logger: MetricsLogger, history: list[dict], bar: Any,
            on_step: Callable[[int, dict], None] | None) -> None:
    """A step's metrics to the logger, the returned history, the caller's on_step and the progress line."""
    logger.log(step, metrics)
    history.append(metrics)
    if on_step is not None:
        on_step(step, metrics)
    bar.step(metrics)


def step_metrics(train: dict[str, float], batch: RolloutBatch, state: TrainingState, *,
                 time_generate_s: float, time_train_s: float, time_sync_s: float) -> dict[str, float]:
    """The metrics of one RL step, the names the JSONL log, the plot and the tests read: the training metrics
    (loss, grad_norm, ...), the rollout's batch statistics (`_batch_metrics`), the step and weight version after
    it, and the timings (a step without a sync reports the last sync's time). The batch's staleness is
    trainer.rollout.staleness's staleness/* family (within_staleness)."""
    tokens = sum(len(s.tokens) for s in batch.samples)
    return {**train, **_batch_metrics(batch),
            "step": state.step, "weight_version": state.weight_version, "time_generate_s": time_generate_s,
            "time_train_s": time_train_s, "time_sync_s": time_sync_s,
            "train_tokens_per_s": tokens / max(time_train_s, 1e-9)}


def _resume(components: TrainingComponents, output_dir: str, resumable: dict[str, Any], *,
            critic: TrainingComponents | None = None) -> TrainingState:
    """Load the newest checkpoint (if any) into the trainer (and its critic) and the objects that resume with it."""
    state, saved = load_latest(components, output_dir, critic=critic)
    if saved:
        for name, part in resumable.items():
            part.load_state_dict(saved[name])
    return state


def _timed(label: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[Any, float]:
    """(fn's result, its seconds), under a profiler range named `label` ([logging] profile_steps' traces)."""
    t0 = time.perf_counter()
    with torch.profiler.record_function(label):
        out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def _sync(sender: WeightSync, version: int, *, on_failure: Callable[[], None] | None = None) -> float:
    """Send the trainer's weights (version `version`) to the engines; returns the seconds it took.

    An engine that dies or fails during the sync is what a failed rollout is: the trained state is consistent, so
    every rank (the sender's error reaches them all) runs `on_failure` (the collective checkpoint) and raises an
    error that names the engine (the sender's) and the way on."""
    t0 = time.perf_counter()
    try:
        with torch.profiler.record_function("rl.sync"):
            sender.sync(weight_version=version)
    except WeightSyncError as e:
        if on_failure is None:
            raise
        on_failure()
        raise WeightSyncError(f"an engine failed the weight sync of version {version}; the trained steps are "
                              f"checkpointed: restart the engine, then continue with --resume (run_rl_training("
                              f"resume=True)). The sync's error: {e}") from e
    return time.perf_counter() - t0


def _verify_sync(components: TrainingComponents, engines: Sequence[InferenceEngine], sender: WeightSync, step: int,
                 probe_prompts: Sequence[Sequence[int]]) -> float:
    """The engines' log-probs of the probes against the trainer's (trainer.weight_sync.verify_sync): the largest
    difference, or an error naming the versions when they differ beyond the tolerance."""
    from trainer.weight_sync import verify_sync

    res = verify_sync(_ThroughRoot(components.root), engines, probe_prompts, expected_version=sender.weight_version)
    if not res.ok:
        raise RuntimeError(f"verify_sync failed after step {step}: engine log-probs differ from the trainer's by "
                           f"{res.max_abs_diff} (tol {res.tol}), versions {res.versions} vs {res.expected_version}")
    return max(res.max_abs_diff)


class _ThroughRoot(torch.nn.Module):
    """`model(**kw)` run through the FSDP root, so the root group's parameters (embeddings, lm_head) are
    unsharded: verify_sync's probe forward needs the whole model."""

    def __init__(self, root: torch.nn.Module) -> None:
        super().__init__()
        self.root = root

    def forward(self, **kw: Any) -> Any:
        return self.root(lambda lm: lm(**kw))


def _default_probes(batch: RolloutBatch) -> list[list[int]]:
    return [list(s.tokens[:s.prompt_length]) for s in batch.samples[:2]]


def _reference_components(components: TrainingComponents, tcfg: TrainerConfig) -> TrainingComponents:
    """A frozen copy of the current policy (the reference for the KL term), sharded like it, in the compute dtype
    (trainer.backend.steps.frozen_copy).

    LoRA ([rl.lora]): the policy itself, whose frozen base is the starting model; its log-probs are computed with
    the adapters off (`adapters_disabled`), so no second copy of the model exists. With train_unembed the lm_head
    itself trains, so the base is not the start any more: a copy is made as in a full run."""
    if is_lora(components.model) and not tcfg.lora.train_unembed:
        return components
    return frozen_copy(components, tcfg)

