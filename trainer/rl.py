"""GRPO/PPO training as one readable function: generate -> reward -> advantages -> pack -> forward_backward ->
optim_step -> sync -> log -> checkpoint.

    comp, state, history = run_rl_training(model, buffer, RLTrainingConfig(...), engine_urls=[...],
                                           reward_fn="trainer.rollout.rewards:arithmetic_reward")

Rollouts come from inference engines over HTTP (the embedded engine by default; SGLang / vLLM by URL) through
`trainer.rollout.manager.generate_rollout_batches`; the engines get the new weights every `sync_every` steps by
broadcast or shared memory (engines.weight_sync.wire); a disk sync happens only when the caller passes a
trainer.weight_sync.DiskWeightSync as `sender` (the CLI's opt-in [engines] sync = "disk"). In async mode the batch
of step n+1 is generated (in a worker thread, by the engine processes) while step n trains; the weights that
generated it lag by at most `rollout.max_staleness` versions. Whenever the engines may lag (async, or sync_every >
1) the trainer recomputes old log-probs (`compute_logprobs`) and the loss's off-policy correction ([rl.loss]
rollout_correction, "tis" by default there) weights each token by the engine-vs-trainer ratio. The engine-vs-trainer
mismatch metrics (mismatch/*) are logged on every step where the engine returned its log-probs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.backend.attention import supports_shared_prompts
from trainer.backend.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.backend.steps import (
    TrainerConfig,
    TrainingComponents,
    broadcast_from_rank0,
    build_components,
    compute_logprobs,
    forward_backward,
    optim_step,
    trainer_config_from,
)
from trainer.batching.micro_batches import attach_logprobs, build_micro_batches
from trainer.batching.shared_prompt import build_shared_micro_batches
from trainer.config import RLTrainingConfig
from trainer.metrics import JSONLLogger, MetricsLogger
from trainer.rollout.samples import build_batch_metadata
from trainer.types import RolloutBatch, Sample, Status, TrainingState

GROUP_ESTIMATORS = ("grpo", "rloo")  # estimators whose baseline is the sample's group


@dataclasses.dataclass(frozen=True)
class RolloutFailed:
    """What rank 0 broadcasts instead of a batch when its rollout raised: the error, as text."""

    error: str


def _group_ids(samples: Sequence[Sample]) -> list[Any]:
    return [s.metadata.get("group_uid", s.group_index) for s in samples]


def compute_advantages(samples: Sequence[Sample], estimator: str) -> list[float]:
    """One advantage per sample from its reward and its group (samples of one prompt share metadata group_uid).

    A FAILED sample has no reward: it gets advantage 0 and stays out of its group's mean and std.
    """
    from kernels.advantages import grpo_advantages, reinforce_advantages, rloo_advantages

    if estimator not in (*GROUP_ESTIMATORS, "reinforce"):
        raise ValueError(f"advantage_estimator={estimator!r}: choose grpo, rloo or reinforce")
    scored = [i for i, s in enumerate(samples) if s.status != Status.FAILED]
    out = [0.0] * len(samples)
    if not scored:
        return out
    rewards = torch.tensor([0.0 if samples[i].reward is None else samples[i].reward for i in scored],
                           dtype=torch.float64)
    all_uids = _group_ids(samples)
    uids = [all_uids[i] for i in scored]
    remap = {u: k for k, u in enumerate(dict.fromkeys(uids))}
    groups = torch.tensor([remap[u] for u in uids], dtype=torch.int64)
    if estimator == "grpo":
        adv = grpo_advantages(rewards, groups)
    elif estimator == "rloo":
        adv = rloo_advantages(rewards, groups)
    else:
        adv = reinforce_advantages(rewards, rewards.mean())
    for i, a in zip(scored, adv.tolist()):
        out[i] = a
    return out


def trained_samples(samples: Sequence[Sample], estimator: str) -> tuple[list[int], dict[str, float]]:
    """Indices of the samples the loss trains on, and counts of the ones it leaves out.

    Left out: FAILED samples (the reward function raised, or generation failed: there is no reward to learn
    from), and for group estimators every sample of a group left with fewer than two scored samples (no
    baseline). Left-out samples are not packed at all, so they count in neither the token nor the sequence
    normaliser of the loss. A warning names the first reward error.
    """
    failed = [s for s in samples if s.status == Status.FAILED]
    if failed:
        first = next((s.metadata["reward_error"] for s in failed if "reward_error" in s.metadata), "generation failed")
        warnings.warn(f"{len(failed)} of {len(samples)} samples FAILED and are left out of the loss; first error: "
                      f"{first}", stacklevel=2)
    uids = _group_ids(samples)
    scored_per_group = collections.Counter(u for u, s in zip(uids, samples) if s.status != Status.FAILED)
    keep = [i for i, (u, s) in enumerate(zip(uids, samples)) if s.status != Status.FAILED
            and (estimator not in GROUP_ESTIMATORS or scored_per_group[u] >= 2)]
    n = len(samples)
    return keep, {"rollout/failed_fraction": len(failed) / n, "train/excluded_fraction": (n - len(keep)) / n}


def needs_old_logprobs(config: RLTrainingConfig) -> bool:
    """Whether the trainer recomputes old log-probs before the update.

    With ppo_epochs > 1 the policy moves between the epochs, and when the engines lag (async rollouts,
    sync_every > 1) the samples come from older weights: the loss's ratio and the engine-vs-trainer metrics then
    take pi_old from the weights at the start of this step. Otherwise old = the current log-probs, detached,
    inside the loss (one forward fewer, the same numbers).
    """
    return config.ppo_epochs > 1 or config.off_policy


def _batch_metrics(batch: RolloutBatch) -> dict[str, float]:
    """The rollout's own batch statistics (trainer.rollout.samples.build_batch_metadata) under rollout/, plus the
    headline
    figures unprefixed (the progress bar, the plot and the tests read those)."""
    meta = batch.metadata if "reward_mean" in batch.metadata else build_batch_metadata(batch.samples)
    numeric = {k: float(v) for k, v in meta.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**{f"rollout/{k}": v for k, v in numeric.items()},
            **{k: numeric[k] for k in ("reward_mean", "response_length_mean", "num_samples")}}


def train_on_batch(components: TrainingComponents, state: TrainingState, batch: RolloutBatch,
                   config: RLTrainingConfig, tcfg: TrainerConfig, *,
                   ref_components: TrainingComponents | None = None) -> tuple[dict, TrainingState]:
    """advantages -> pack -> (old/ref log-probs) -> ppo_epochs x (forward_backward -> optim_step); returns metrics.

    The engine's log-probs ride along whenever the engine returned them: the loss then reports the
    engine-vs-trainer mismatch metrics, and applies the off-policy correction when one is configured.
    """
    samples = list(batch.samples)
    keep, metrics = trained_samples(samples, config.advantage_estimator)
    if not keep:
        errors = [s.metadata["reward_error"] for s in samples if "reward_error" in s.metadata]
        raise RuntimeError(f"no sample of this batch can be trained on ({len(samples)} samples, every group has "
                           f"fewer than two scored samples); first reward error: {errors[0] if errors else None}")
    advantages = compute_advantages(samples, config.advantage_estimator)
    samples, advantages = [samples[i] for i in keep], [advantages[i] for i in keep]
    correction = config.loss.rollout_correction
    if correction != "none" and any(s.rollout_logprobs is None for s in samples):
        raise ValueError(f"loss.rollout_correction={correction!r} needs the engine's log-probs on every sample, "
                         f"but the engine returned none for some; use an engine that returns them or set "
                         f"[rl.loss] rollout_correction = \"none\"")
    # The shared-prompt layout runs a group's prompt once (the same loss); plain where the attention has no tree mask.
    build = build_shared_micro_batches if tcfg.share_prompts and supports_shared_prompts(components.model) \
        else build_micro_batches
    mbs = build(samples, token_budget=tcfg.token_budget, bucket_size=tcfg.bucket_size, advantages=advantages,
                pad_id=0, num_ranks=components.world_size, rank=components.rank)
    if needs_old_logprobs(config):
        mbs = attach_logprobs(mbs, compute_logprobs(components, mbs), "old_logprobs")
    if ref_components is not None:
        mbs = attach_logprobs(mbs, compute_logprobs(ref_components, mbs), "ref_logprobs")
    futures = []
    for _ in range(config.ppo_epochs):
        fut = forward_backward(components, mbs, tcfg)
        opt_fut, state = optim_step(components, state, tcfg)
        futures.append((fut, opt_fut))
    # Reading the futures is the step's only host sync; every epoch's are read so that a deferred input error
    # of any epoch is raised. The metrics are the last epoch's.
    for fut, opt_fut in futures:
        metrics.update(fut.result())
        metrics.update(opt_fut.result())
    return {k: float(v) for k, v in metrics.items()}, state


class _Prefetcher:
    """Generates the next rollout batch in a worker thread while the trainer trains (async mode).

    Mutable state (the pending future) is why this is a class. The engines are separate processes, so the
    generation really runs in parallel with training; the thread only waits on HTTP.
    """

    def __init__(self, batches) -> None:
        self._batches = batches
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._pending: concurrent.futures.Future | None = None

    def start(self) -> None:
        assert self._pending is None, "one batch in flight at a time"
        self._pending = self._pool.submit(next, self._batches)

    def take(self) -> RolloutBatch:
        assert self._pending is not None, "start() first"
        fut, self._pending = self._pending, None
        return fut.result()

    def wait_idle(self) -> None:
        """Block until the in-flight batch is generated (it stays queued for `take`): engines are idle after."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_rl_training(model: Any, data_buffer: Any, config: RLTrainingConfig, *, engine_urls: Sequence[str] = (),
                    tokenizer: Any = None, reward_fn: Any = "trainer.rollout.rewards:arithmetic_reward",
                    trainer_config: TrainerConfig | None = None, components: TrainingComponents | None = None,
                    logger: MetricsLogger | None = None, resume: bool = False, api_key: str | None = None,
                    probe_prompts: Sequence[Sequence[int]] | None = None,
                    on_step: Callable[[int, dict], None] | None = None, sender: Any = None,
                    engines: Sequence[Any] | None = None,
                    ) -> tuple[TrainingComponents, TrainingState, list[dict]]:
    """Train with GRPO/PPO for config.num_steps steps; returns (components, final state, per-step metrics).

    model: a folder, an HF config or a built TrainModule (ignored when `components` is given, e.g. after SFT).
    data_buffer: trainer.rollout.data.DataBuffer of prompts (with answers in metadata for verifiable rewards).
    engine_urls: SGLang-protocol engines (the embedded engine or SGLang). Their weights are synced from the
    trainer at the start (so they serve the policy being trained) and every `sync_every` steps.
    engines: InferenceEngine objects (e.g. engines.vllm.VLLMEngine) to use instead of SGLang clients of engine_urls.
    sender: a trainer.weight_sync.WeightSyncSender whose group is already up (the caller owns it); by default
    one is built here, and closed at the end.
    Writes metrics.jsonl and checkpoints under config.output_dir; resume=True continues from the newest complete
    checkpoint there (data position and partial-rollout cache included). Ctrl-C writes a checkpoint first.
    """
    from tqdm import tqdm

    from engines.sglang import SGLangEngine
    from engines.tiny import build_tokenizer
    from trainer.rollout.manager import AsyncRolloutManager, generate_rollout_batches
    from trainer.weight_sync import WeightSyncSender, verify_sync

    if config.async_rollout and config.rollout.max_staleness < 1:
        raise ValueError("rollout.max_staleness: async_rollout trains on batches one version old; set it >= 1")
    tokenizer = tokenizer or build_tokenizer()
    tcfg = trainer_config or trainer_config_from(config)
    comp = components or build_components(model, tcfg)
    ref = _reference_components(comp, tcfg) if config.loss.kl_coef > 0 else None  # frozen starting weights
    out = Path(tcfg.output_dir)
    state = TrainingState()
    rc = config.rollout
    engines = list(engines) if engines is not None else [
        SGLangEngine(u, api_key=api_key, connect_timeout_s=rc.connect_timeout_s, max_connections=rc.max_concurrency)
        for u in engine_urls]
    manager = AsyncRolloutManager(engines, rc, tokenizer=tokenizer, reward_fn=reward_fn,
                                  deterministic=config.deterministic)
    if resume and latest_checkpoint(out) is not None:
        state, extra = load_checkpoint(comp, out)
        data_buffer.load_state_dict(extra["data_buffer"])
        manager.load_state_dict(extra["rollout_manager"])
    own_sender = sender is None
    if own_sender:
        sender = WeightSyncSender(comp.model, engines, weight_version=state.weight_version)
    logger = logger or JSONLLogger(out / "metrics.jsonl", enabled=comp.rank == 0)
    is_main = comp.rank == 0
    # Rank 0 drives the rollouts and hands every batch to the other ranks (they must pack the same samples).
    batches = generate_rollout_batches(data_buffer, config.rollout, manager=manager,
                                       weight_version=lambda: sender.weight_version) if is_main else None
    prefetch = _Prefetcher(batches) if config.async_rollout and is_main else None
    history: list[dict] = []
    bar = tqdm(total=config.num_steps, initial=state.step, disable=not is_main, desc="rl")

    def extra() -> dict:
        return {"data_buffer": data_buffer.state_dict(), "rollout_manager": manager.state_dict()}

    try:
        if own_sender:
            sender.init_group()
        sync_s = _sync(sender, state.weight_version)  # engines serve exactly the weights being trained
        if prefetch is not None:
            prefetch.start()
        while state.step < config.num_steps:
            t0 = time.perf_counter()
            failure: Exception | None = None
            try:
                batch = (prefetch.take() if prefetch is not None else next(batches)) if is_main else None
            except Exception as e:
                # Rollouts failed (engine gone, filters starving the batch, ...): the other ranks wait in the
                # broadcast below, so they get a marker instead of a batch.
                failure, batch = e, RolloutFailed(f"{type(e).__name__}: {e}")
            batch = broadcast_from_rank0(batch)
            if isinstance(batch, RolloutFailed):
                # The trainer state is consistent: every rank writes its shard (save_checkpoint is collective),
                # then every rank raises, rank 0 its own exception.
                save_checkpoint(comp, state, extra())
                if failure is not None:
                    raise failure
                raise RuntimeError(f"the rollout on rank 0 failed at step {state.step + 1}: {batch.error}")
            gen_s = time.perf_counter() - t0
            if prefetch is not None and state.step + 1 < config.num_steps:
                prefetch.start()  # step n+1 generates with the current engine weights while step n trains
            # Versions behind the weights being trained: 0 in synchronous mode, 1 in async mode.
            lag = [state.weight_version - s.weight_version for s in batch.samples]
            t1 = time.perf_counter()
            metrics, state = train_on_batch(comp, state, batch, config, tcfg, ref_components=ref)
            train_s = time.perf_counter() - t1
            if state.step % config.sync_every == 0 or state.step == config.num_steps:
                if prefetch is not None:
                    prefetch.wait_idle()  # the engine must not change weights mid-request
                sync_s = _sync(sender, state.weight_version)
            metrics.update(_batch_metrics(batch))
            metrics.update(train_staleness_max=float(max(lag)), train_staleness_min=float(min(lag)),
                           train_staleness_mean=sum(lag) / len(lag))
            tokens = sum(len(s.tokens) for s in batch.samples)
            metrics.update(step=state.step, weight_version=state.weight_version, time_generate_s=gen_s,
                           time_train_s=train_s, time_sync_s=sync_s, train_tokens_per_s=tokens / max(train_s, 1e-9))
            if config.verify_sync and state.step % config.sync_every == 0:
                res = verify_sync(_ThroughRoot(comp.module), engines, probe_prompts or _default_probes(batch),
                                  expected_version=sender.weight_version)
                metrics["verify_sync_max_abs_diff"] = max(res.max_abs_diff)
                if not res.ok:
                    raise RuntimeError(f"verify_sync failed after step {state.step}: engine log-probs differ from "
                                       f"the trainer's by {res.max_abs_diff} (tol {res.tol}), versions "
                                       f"{res.versions} vs {res.expected_version}")
            logger.log(state.step, metrics)
            history.append(metrics)
            if on_step is not None:
                on_step(state.step, metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.4f}")
            if tcfg.save_every and state.step % tcfg.save_every == 0:
                save_checkpoint(comp, state, extra())
        save_checkpoint(comp, state, extra())
    except BaseException as e:
        if not _is_interrupt(e):
            raise
        save_checkpoint(comp, state, extra())
        if isinstance(e, KeyboardInterrupt):
            raise
        raise KeyboardInterrupt from e  # Ctrl-C inside trio arrives wrapped in an exception group
    finally:
        bar.close()
        if prefetch is not None:
            prefetch.close()
        if batches is not None:
            batches.close()
        if own_sender:
            sender.close()
        logger.close()
    return comp, state, history


def _sync(sender: Any, version: int) -> float:
    t0 = time.perf_counter()
    sender.sync(weight_version=version)
    return time.perf_counter() - t0


class _ThroughRoot(torch.nn.Module):
    """`model(**kw)` run through the FSDP root, so the root group's parameters (embeddings, lm_head) are
    unsharded: verify_sync's probe forward needs the whole model."""

    def __init__(self, root: torch.nn.Module) -> None:
        super().__init__()
        self.root = root

    def forward(self, **kw: Any) -> Any:
        return self.root(lambda lm: lm(**kw))


def _is_interrupt(e: BaseException) -> bool:
    """Ctrl-C, bare or inside the exception group of a trio nursery that was generating when it arrived."""
    if isinstance(e, KeyboardInterrupt):
        return True
    return isinstance(e, BaseExceptionGroup) and e.subgroup(KeyboardInterrupt) is not None


def _default_probes(batch: RolloutBatch) -> list[list[int]]:
    return [list(s.tokens[:s.prompt_length]) for s in batch.samples[:2]]


def _reference_components(components: TrainingComponents, tcfg: TrainerConfig) -> TrainingComponents:
    """A frozen copy of the current policy (the reference for the KL term), sharded like it, built in memory."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ref = build_components(components.model.config, dataclasses.replace(tcfg, compile=False))
    set_model_state_dict(ref.module, get_model_state_dict(components.module))
    ref.module.requires_grad_(False)
    return ref

