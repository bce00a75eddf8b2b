"""LocalBackend: the TrainingBackend surface (trainer/backend/protocol.py) over this process's TrainingComponents, the
backend the SFT and RL loops train through unless `[trainer] backend = "tinker"` sends the optimisation elsewhere.

    backend = LocalBackend(components, tcfg, pad_id=pad_id, ref=ref, critic=critic)
    fb = backend.forward_backward(datums, "policy", {"prompt_lengths": [...]})   # -> Future[ForwardOutput]
    opt = backend.optim_step()                                                   # -> Future[dict]
    fb.result().metrics, opt.result()                                            # the step's one host sync

A batch is a list of `Datum` in Tinker's shape (`to_datums`: input tokens [T], and per target token
`target_tokens`, `weights` (the loss mask, 0 on prompt targets), `advantages`, and `logprobs`, the engine's, where
the engine returned them). The backend turns them back into Samples and packs them exactly as the loops did before
it existed (build_micro_batches, or build_shared_micro_batches where the attention has the tree mask), then runs
trainer.backend.steps' forward_backward / optim_step: full or LoRA, FSDP2, compile and the fused kernels, the same
numbers. What a Datum does not carry travels in `loss_fn_config` (RL_CONFIG_KEYS): each datum's prompt length (the
shared-prompt layout groups samples by identical prompt tokens) and, for "gae", each sample's reward. The objective
itself is the TrainerConfig's ([rl.loss]): `loss_fn` names it ("policy", or "nll" for SFT) and must match.

The KL reference and the critic (GAE's value model) are components the backend owns: forward_backward computes the
reference log-probs, pi_old (ppo_epochs > 1) and the GAE advantages once per batch (the first call with that list
of datums: the weights before the update), trains the critic beside the policy, and optim_step steps both.
Futures are lazy: the device work is queued, and reading a future is the host sync (trainer.backend.futures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainer.backend.attention import supports_shared_prompts
from trainer.backend.critic import attach_gae, sum_across_ranks, token_rewards
from trainer.backend.futures import TrainFuture
from trainer.backend.lora import adapters_disabled
from trainer.backend.protocol import AdamParams, BackendFuture, Datum, ForwardOutput
from trainer.backend.steps import (
    TrainerConfig,
    TrainingComponents,
    compute_logprobs,
    compute_values,
    forward_backward,
    optim_step,
)
from trainer.batching.micro_batches import MicroBatch, attach_logprobs, build_micro_batches
from trainer.batching.shared_prompt import build_shared_micro_batches
from trainer.types import Sample, TrainingState

# loss_fn_config keys of this backend: per datum, its prompt length in tokens (required: >= 1) and its reward
# (advantage_estimator "gae" only: the critic's targets).
RL_CONFIG_KEYS = ("prompt_lengths", "rewards")


def to_datums(samples: Sequence[Sample], advantages: Sequence[float]) -> tuple[list[Datum], dict[str, list]]:
    """Samples (and one advantage each) in Tinker's Datum shape, and the loss_fn_config entries they need here.

    Position t of a datum scores target_tokens[t] = tokens[t + 1]: weights[t] is the sample's loss mask on response
    targets and 0 on prompt targets; advantages[t] the sample's advantage on every response target (0 on prompt
    targets); logprobs[t] the engine's log-prob of a response target (0 on prompt targets), only where the engine
    returned them. Each field of the batch is built as one tensor from one flat list and split into the datums'
    views (a few ops a batch instead of ~10 a sample: 17 -> ~3 ms for the single-turn step's 512 samples)."""
    pl, lengths, token_ids, weights, advs = [], [], [], [], []
    lp_values, lp_lengths = [], []
    for s, adv in zip(samples, advantages):
        # An empty prompt: no position predicts the first token, so it is the prompt (the same labels and mask).
        p, n = max(s.prompt_length, 1), len(s.tokens) - 1  # n targets; the response's start at target p - 1
        cut = p - s.prompt_length
        pl.append(p)
        lengths.append(n + 1)
        token_ids.extend(s.tokens)
        weights.extend([0.0] * (p - 1))
        weights.extend(s.effective_loss_mask[cut:])
        advs.extend([0.0] * (p - 1))
        advs.extend([float(adv)] * (n + 1 - p))
        if s.rollout_logprobs is not None:
            lp_values.extend([0.0] * (p - 1))
            lp_values.extend(s.rollout_logprobs[cut:])
            lp_lengths.append(n)
    targets = [n - 1 for n in lengths]
    tokens = torch.tensor(token_ids, dtype=torch.int64).split(lengths)
    weight_views = torch.tensor(weights, dtype=torch.float32).split(targets)
    adv_views = torch.tensor(advs, dtype=torch.float32).split(targets)
    lp_views = iter(torch.tensor(lp_values, dtype=torch.float32).split(lp_lengths))
    datums = []
    for s, t, w, a in zip(samples, tokens, weight_views, adv_views):
        inputs = {"target_tokens": t[1:], "weights": w, "advantages": a}
        if s.rollout_logprobs is not None:
            inputs["logprobs"] = next(lp_views)
        datums.append(Datum(tokens=t[:-1], loss_inputs=inputs))
    return datums, {"prompt_lengths": pl,
                    "rewards": [0.0 if s.reward is None else float(s.reward) for s in samples]}


def from_datums(batch: Sequence[Datum], prompt_lengths: Sequence[int]) -> tuple[list[Sample], list[float]]:
    """`to_datums` inverted: the Samples the micro-batch builders pack, and their advantages (float32 values: the
    packed rows hold float32 anyway, so the numbers are those of packing the samples directly). Each tensor is read
    to the host once (`tolist`) and checked there."""
    if len(prompt_lengths) != len(batch):
        raise ValueError(f"loss_fn_config['prompt_lengths'] has {len(prompt_lengths)} entries for {len(batch)} "
                         f"datums: give one prompt length per datum (trainer.backend.local.to_datums)")
    samples, advantages = [], []
    for i, (d, p) in enumerate(zip(batch, prompt_lengths)):
        inputs = d.loss_inputs
        tokens, target = d.tokens.tolist(), inputs["target_tokens"].tolist()
        if not 1 <= p <= len(tokens) or tokens[1:] != target[:-1]:
            raise ValueError(f"datum {i}: not a next-token datum of one sequence with a {p}-token prompt "
                             f"(target_tokens must be tokens shifted by one): build it with "
                             f"trainer.backend.local.to_datums")
        mask = [int(w) for w in inputs["weights"].tolist()[p - 1:]]  # int(): truncation, as .to(int64)
        lp = inputs.get("logprobs")
        samples.append(Sample(prompt="", tokens=(*tokens, target[-1]), response_length=len(mask),
                              loss_mask=None if all(mask) else tuple(mask),
                              rollout_logprobs=None if lp is None else tuple(lp.tolist()[p - 1:])))
        advantages.append(inputs["advantages"].tolist()[p - 1] if mask else 0.0)
    return samples, advantages


class DeviceFuture(BackendFuture):
    """A BackendFuture of device work already queued: `read()` builds the result from TrainFutures (reading them
    is the host sync); `await` polls their CUDA events from trio first."""

    def __init__(self, read: Callable[[], Any], *pending: TrainFuture) -> None:
        self._read, self._pending = read, pending

    def done(self) -> bool:
        return all(f.done() for f in self._pending)

    def result(self, timeout: float | None = None) -> Any:
        return self._read()

    async def aresult(self) -> Any:
        for f in self._pending:
            await f.aresult()
        return self._read()


def _critic_names(metrics: Mapping[str, float]) -> dict[str, float]:
    """A separate critic's metrics under critic/ names: its loss is critic/value_loss, its grad_norm and lr
    critic/grad_norm and critic/lr (its own metrics are critic/* already; num_tokens is the policy's)."""
    out = {}
    for k, v in metrics.items():
        if k == "loss":
            out["critic/value_loss"] = v
        elif k != "num_tokens":
            out[k if k.startswith("critic/") else f"critic/{k}"] = v
    return out


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """One batch packed for the step: the micro-batches (with pi_old / reference log-probs / GAE targets attached)
    and the GAE statistics' future."""

    batch: Sequence[Datum]
    mbs: list[MicroBatch]
    gae_stats: TrainFuture | None


class LocalBackend:
    """TrainingBackend over TrainingComponents (and the reference / critic components it owns). Mutable state: the
    components, the batch being trained (packed once for all its epochs) and the loss tokens since optim_step."""

    def __init__(self, components: TrainingComponents, tcfg: TrainerConfig, *, pad_id: int,
                 ref: TrainingComponents | None = None, critic: TrainingComponents | None = None,
                 old_logprobs: bool = False) -> None:
        """ref: the KL reference (the policy itself for LoRA: its adapters off). critic: GAE's separate value model
        ([rl.critic] kind = "model"). old_logprobs: pi_old by a forward of its own (ppo_epochs > 1)."""
        self.components, self.tcfg, self.pad_id = components, tcfg, pad_id
        self.ref, self.critic, self.old_logprobs = ref, critic, old_logprobs
        self._prepared: _Prepared | None = None
        self._num_tokens = 0

    @property
    def gae(self) -> bool:
        return self.tcfg.critic is not None

    # -- surface ---------------------------------------------------------------------------------------
    def forward(self, batch: Sequence[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, Any] | None = None) -> BackendFuture:
        """Per datum its target log-probs [T] under the current weights (ForwardOutput.outputs[i]["logprobs"]; 0
        where the datum's weights are 0, and on the prompt targets of loss_fn_config's prompt_lengths); every rank
        computes every datum (the same micro-batches everywhere, so the FSDP collectives match)."""
        samples, _ = from_datums(batch, (loss_fn_config or {}).get("prompt_lengths") or [1] * len(batch))
        mbs = build_micro_batches(samples, token_budget=self.tcfg.token_budget,
                                  bucket_size=self.tcfg.micro_batch_buckets, advantages=[0.0] * len(samples),
                                  pad_id=self.pad_id, num_ranks=1, rank=0)
        logps = compute_logprobs(self.components, mbs)

        def read() -> ForwardOutput:
            out: list[dict[str, torch.Tensor]] = [{} for _ in batch]
            for mb, lp in zip(mbs, logps):
                lp = lp.detach().float().cpu()  # host read: the future is being read
                starts = mb.row.cu_seqlens.tolist()
                for j, idx in enumerate(mb.sample_index):
                    n = batch[idx].tokens.numel()
                    out[idx] = {"logprobs": lp[starts[j]: starts[j] + n].clone()}
            return ForwardOutput(outputs=out, metrics={})
        return DeviceFuture(read)

    def forward_backward(self, batch: Sequence[Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, Any] | None = None) -> BackendFuture:
        """Gradients of the TrainerConfig's loss over the batch (accumulated until optim_step). The future's
        ForwardOutput carries the step's metrics (loss, num_tokens, the objective's, critic/*); its per-datum
        outputs are left empty (the packed rows are not unpacked: `forward` gives log-probs)."""
        if loss_fn != self.tcfg.loss:
            raise ValueError(f"loss_fn {loss_fn!r}: this backend trains the loss of its TrainerConfig, "
                             f"{self.tcfg.loss!r} ([rl.loss] for RL, the NLL for SFT)")
        prep = self._prepare(batch, dict(loss_fn_config or {}))
        fut = forward_backward(self.components, prep.mbs, self.tcfg)
        self._num_tokens += fut.num_tokens
        c_fut = forward_backward(self.critic, prep.mbs) if self.critic is not None else None

        def read() -> ForwardOutput:
            metrics = dict(fut.result())
            if c_fut is not None:
                metrics.update(_critic_names(c_fut.result()))
            if prep.gae_stats is not None:
                metrics.update(prep.gae_stats.result())
            return ForwardOutput(outputs=[], metrics=metrics)
        return DeviceFuture(read, *(f for f in (fut, c_fut, prep.gae_stats) if f is not None))

    def optim_step(self, adam_params: AdamParams | None = None) -> BackendFuture:
        """AdamW, clipping and the schedule of the components' own optimiser ([rl.optim] / [sft.optim]); a local
        run's hyper-parameters live there, so `adam_params` must be None. The future's dict: grad_norm, lr (and the
        critic's under critic/)."""
        if adam_params is not None:
            raise ValueError("LocalBackend.optim_step: the optimiser and its schedule are the components' own "
                             "([rl.optim] / [sft.optim]); pass adam_params=None")
        # The new TrainingState is the loop's (trainer.backend.steps.advanced); the backend's is not kept.
        opt, _ = optim_step(self.components, TrainingState(), self.tcfg, num_tokens=self._num_tokens)
        c_opt = optim_step(self.critic, TrainingState(), num_tokens=self._num_tokens)[0] \
            if self.critic is not None else None
        self._num_tokens = 0

        def read() -> dict:
            return {**opt.result(), **(_critic_names(c_opt.result()) if c_opt is not None else {})}
        return DeviceFuture(read, *(f for f in (opt, c_opt) if f is not None))

    def save_state(self, name: str) -> BackendFuture:
        raise NotImplementedError("a local run checkpoints through trainer.backend.checkpoint.Checkpointer "
                                  "(the loops' [rl] / [sft] save_every)")

    def load_state(self, path: str, optimizer: bool = True) -> BackendFuture:
        raise NotImplementedError("a local run resumes through trainer.backend.checkpoint.load_latest (--resume)")

    def get_weights(self) -> BackendFuture:
        """The weights an engine serves: {plain HF name: full tensor}, LoRA adapters merged (a stock model's state
        dict, trainer.backend.lora.merged_state_dict; collective under FSDP2: every rank calls it)."""
        from trainer.backend.lora import merged_state_dict

        weights = dict(merged_state_dict(self.components.model))
        return DeviceFuture(lambda: weights)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> BackendFuture:
        raise NotImplementedError("a local run loads weights when it is built (build_components from a folder)")

    # -- one batch, packed ------------------------------------------------------------------------------
    def _prepare(self, batch: Sequence[Datum], config: dict) -> _Prepared:
        """The batch packed into this rank's micro-batches, with pi_old, the reference log-probs and the GAE
        targets attached: once per batch (the list object), before its first update; later epochs reuse it."""
        if self._prepared is not None and self._prepared.batch is batch:
            return self._prepared
        unknown = sorted(set(config) - set(RL_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"loss_fn_config keys {unknown}: this backend's objective is its TrainerConfig's; it "
                             f"takes only {RL_CONFIG_KEYS}")
        if "prompt_lengths" not in config:
            raise ValueError("loss_fn_config lacks 'prompt_lengths' (one per datum: trainer.backend.local.to_datums)")
        samples, advantages = from_datums(batch, config["prompt_lengths"])
        comp, tcfg = self.components, self.tcfg
        # The shared-prompt layout runs a group's prompt once (the same loss): RL, where the attention has the tree
        # mask; SFT's one-token "prompts" pack plain.
        shared = tcfg.loss == "policy" and tcfg.share_prompts and supports_shared_prompts(comp.model)
        build = build_shared_micro_batches if shared else build_micro_batches
        mbs = build(samples, token_budget=tcfg.token_budget, bucket_size=tcfg.micro_batch_buckets,
                    advantages=advantages, pad_id=self.pad_id, num_ranks=comp.world_size, rank=comp.rank)
        rewards = [token_rewards(mb, config["rewards"]) for mb in mbs] if self.gae else None  # host, [L] per mb
        if self.old_logprobs:
            mbs = attach_logprobs(mbs, compute_logprobs(comp, mbs), "old_logprobs")
        if self.ref is not None:  # LoRA: the policy itself, its adapters off (trainer.backend.lora)
            with adapters_disabled(self.ref.model):
                mbs = attach_logprobs(mbs, compute_logprobs(self.ref, mbs), "ref_logprobs")
        gae_stats = None
        if self.gae:  # the values before the update -> per-token advantages and returns
            cfg = self.tcfg.phase
            mbs, stats = attach_gae(mbs, compute_values(self.critic or comp, mbs), rewards, gamma=cfg.gamma,
                                    lam=cfg.lam, whiten_advantages=cfg.whiten_advantages,
                                    sum_across=sum_across_ranks(comp), estimator=cfg.estimator.fn)
            gae_stats = TrainFuture.record(stats, comp.device)
        self._prepared = _Prepared(batch=batch, mbs=list(mbs), gae_stats=gae_stats)
        return self._prepared
