"""The functional training core: build once, then thread state through pure-looking step functions.

    components = build_components(model_or_path, TrainerConfig(...))
    fut = forward_backward(components, micro_batches, config)      # returns at once (queued on CUDA)
    opt_fut, state = optim_step(components, state, config,        # no host sync between the two
                                num_tokens=fut.num_tokens)         # (a host int: the step's loss tokens)
    metrics = fut.result() | opt_fut.result()                      # the step's only sync, when read

Loss path: the backbone gives hidden states [N, H] of a packed row (trainer.backend.attention.packed_hidden_states,
no cross-sequence attention) and the fused kernels take them with the lm_head weight [V, H], so the [N, V]
logits never exist. Every micro-batch's loss is already divided by the GLOBAL token / sequence counts
(trainer.batching.micro_batches), so gradient accumulation is a plain sum over micro-batches; FSDP's reduce-scatter
averages over ranks, so each rank scales its backward by the world size to turn that average into the global sum.

Streams (CUDA): every step function queues its work on the compute stream between two event hand-offs with the
caller's stream (`_on_compute_stream`), and micro-batches arrive through a copy stream; log-probs computed by
another model (the reference) reach the policy's stream through those hand-offs. Metrics stay device tensors
until the future is read, which is also where the kernels' deferred input errors are raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from kernels import PolicyLossConfig, linear_policy_loss, linear_token_logprobs, raise_on_input_errors
from kernels.gae import value_loss
from kernels.objective import merge_metrics
from trainer.backend.attention import packed_hidden_states
from trainer.backend.futures import DeviceStreams, TrainFuture
from trainer.backend.listeners import sealed_new_listeners
from trainer.backend.memory import step_defers_grad_sync
from trainer.backend.parallel import ParallelConfig, TrainModule
from trainer.batching.micro_batches import MicroBatch
from trainer.config import BackendConfig, CriticConfig, RLTrainingConfig, SFTTrainingConfig
from trainer.types import TrainingState

# The loss each phase trains: its config's class -> the loss function's name in _LOSS_FNS.
LOSSES = {SFTTrainingConfig: "nll", RLTrainingConfig: "policy"}
ROLES = ("policy", "critic")  # what a TrainerConfig's model is: the trained LM, or PPO's separate value model


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Everything the step functions need: a phase config and the backend settings, held by reference.

    phase: an SFTTrainingConfig (loss "nll", token-level NLL) or an RLTrainingConfig (loss "policy",
    kernels.linear_policy_loss with the phase's resolved `loss`, every trainer log-prob at the rollout's
    temperature). backend: the [trainer] table (trainer.config.BackendConfig; also the ParallelConfig of the model).
    The attributes below read the phase's or the backend's own fields, so there is no copy to drift; build one
    with `trainer_config_from(phase, compile=False, ...)`.

    role "critic" (`for_critic()`): the separate value model of an RL phase with [rl.critic] kind = "model": the
    loss "value" (kernels.gae.value_loss), the optimiser [rl.critic.optim]; everything else is the phase's and
    the backend's, so the critic is sharded, compiled and scheduled like the policy.
    """

    phase: Any = dataclasses.field(default_factory=RLTrainingConfig)  # SFTTrainingConfig | RLTrainingConfig
    backend: BackendConfig = dataclasses.field(default_factory=BackendConfig)  # [trainer]
    role: str = "policy"  # "policy" or "critic"

    def __post_init__(self) -> None:
        if type(self.phase) not in LOSSES:
            raise ValueError(f"TrainerConfig.phase: expected one of {[c.__name__ for c in LOSSES]} (it decides the "
                             f"loss: SFT trains the NLL, RL the policy loss), got {type(self.phase).__name__}")
        if self.role not in ROLES:
            raise ValueError(f"TrainerConfig.role: expected one of {ROLES}, got {self.role!r}")
        if self.role == "critic" and (self.critic is None or self.critic.kind != "model"):
            raise ValueError("TrainerConfig.role = \"critic\" is the separate value model of an RL phase with "
                             "advantage_estimator = \"gae\" and [rl.critic] kind = \"model\"; this phase has "
                             f"{'no critic' if self.critic is None else 'kind = ' + repr(self.critic.kind)}")
        if not isinstance(self.backend, BackendConfig):
            raise ValueError(f"TrainerConfig.backend: expected a trainer.config.BackendConfig (the [trainer] table), "
                             f"got {type(self.backend).__name__}")

    # The phase's fields (the critic's own optimiser).
    optim = property(lambda self: self.critic.optim if self.role == "critic" else self.phase.optim)
    num_steps = property(lambda self: self.phase.num_steps)  # also the length of the LR schedule
    token_budget = property(lambda self: self.phase.token_budget)
    micro_batch_buckets = property(lambda self: self.phase.micro_batch_buckets)
    seed = property(lambda self: self.phase.seed)
    output_dir = property(lambda self: self.phase.output_dir)
    keep_last = property(lambda self: self.phase.keep_last)
    save_every = property(lambda self: self.phase.save_every)
    # The backend's fields.
    logprob_chunk_tokens = property(lambda self: self.backend.logprob_chunk_tokens)
    share_prompts = property(lambda self: self.backend.share_prompts)
    defer_grad_sync = property(lambda self: self.backend.defer_grad_sync)
    compile = property(lambda self: self.backend.compile)
    compile_backend = property(lambda self: self.backend.compile_backend)
    activation_checkpointing = property(lambda self: self.backend.activation_checkpointing)
    param_dtype = property(lambda self: self.backend.param_dtype)

    @property
    def lora(self) -> Any:
        """The phase's [<phase>.lora] (a trainer.config.LoRAConfig) for the policy; None: full fine-tuning. A
        separate critic is trained in full."""
        return None if self.role == "critic" else self.phase.lora

    @property
    def lora_table(self) -> str:
        """The phase's LoRA table in a run file, for messages: "sft.lora" or "rl.lora"."""
        return f"{self.phase.TABLE}.lora"

    @property
    def loss(self) -> str:
        """"policy" (RL), "nll" (SFT) or "value" (the critic)."""
        return "value" if self.role == "critic" else LOSSES[type(self.phase)]

    @property
    def critic(self) -> CriticConfig | None:
        """RL with advantage_estimator = "gae": its [rl.critic]; otherwise None."""
        return getattr(self.phase, "critic", None)

    @property
    def value_head(self) -> bool:
        """Whether this model carries a value head: the critic, or a policy with [rl.critic] kind = "head"."""
        return self.role == "critic" or (self.critic is not None and self.critic.kind == "head")

    def for_critic(self) -> TrainerConfig:
        """The separate critic's config (role "critic") of this RL phase."""
        return dataclasses.replace(self, role="critic")

    @property
    def policy_loss(self) -> PolicyLossConfig:
        """RL: the phase's resolved kernels.PolicyLossConfig; SFT: unused (its defaults)."""
        return self.phase.loss if isinstance(self.phase, RLTrainingConfig) else PolicyLossConfig()

    @property
    def temperature(self) -> float:
        """RL: the rollout's temperature (the run has one); SFT: 1.0."""
        return self.phase.rollout.temperature if isinstance(self.phase, RLTrainingConfig) else 1.0

    def parallel(self) -> ParallelConfig:
        return self.backend

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with each change made where the field lives: the phase's (optim, keep_last, ...) or the
        backend's (compile, ...). `cfg.replace(compile=False)`."""
        phase = {f.name for f in dataclasses.fields(self.phase)}
        backend = {f.name for f in dataclasses.fields(self.backend)}
        unknown = sorted(set(changes) - phase - backend)
        if unknown:
            raise ValueError(f"TrainerConfig.replace: {unknown} are fields of neither the phase "
                             f"({type(self.phase).__name__}) nor the backend (BackendConfig)")
        return TrainerConfig(
            phase=dataclasses.replace(self.phase, **{k: v for k, v in changes.items() if k in phase}),
            backend=dataclasses.replace(self.backend, **{k: v for k, v in changes.items() if k in backend}),
            role=self.role)

    def fingerprint_fields(self) -> dict[str, Any]:
        """The settings that change the math of a run, as JSON data (a checkpoint stores them, so that a resume
        with other values can name the field that differs).

        The keys are those of the flat TrainerConfig that earlier checkpoints were fingerprinted with (its
        `bucket_size` is micro_batch_buckets): the same run gives the same fingerprint, so they still resume."""
        d = {"optim": dataclasses.asdict(self.optim), "num_steps": self.num_steps, "loss": self.loss,
             "policy_loss": dataclasses.asdict(self.policy_loss), "temperature": self.temperature,
             "logprob_chunk_tokens": self.logprob_chunk_tokens,
             # unset (auto) as false: the fingerprints of runs from before the auto default stay what they were
             "activation_checkpointing": self.backend.activation_checkpointing or False,
             "param_dtype": self.backend.param_dtype, "token_budget": self.token_budget,
             "bucket_size": self.micro_batch_buckets, "seed": self.seed}
        if self.lora is not None:  # LoRA runs only, so that the full runs' fingerprints stay what they were
            d["lora"] = dataclasses.asdict(self.lora)
        if hasattr(self.phase, "advantage_estimator"):  # RL: the estimator and the group its baseline is taken from
            d["rl"] = {"advantage_estimator": self.phase.advantage_estimator, "ppo_epochs": self.phase.ppo_epochs,
                       "n_samples_per_prompt": self.phase.rollout.n_samples_per_prompt}
        if self.critic is not None:  # "gae" only, so that the other runs' fingerprints stay what they were
            d["gae"] = {"gamma": self.phase.gamma, "lam": self.phase.lam,
                        "whiten_advantages": self.phase.whiten_advantages, "critic": dataclasses.asdict(self.critic)}
        return json.loads(json.dumps(d, sort_keys=True, default=repr))

    def fingerprint(self) -> str:
        """sha256 over `fingerprint_fields` (checkpoints refuse to resume on a mismatch, num_steps aside). The "rl"
        fields, recorded since checkpoints store the fields (and compared field by field), stay out of the hash: the
        checkpoints from before the fields were stored, compared by hash alone, still resume."""
        fields = {k: v for k, v in self.fingerprint_fields().items() if k != "rl"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, eq=False)
class TrainingComponents:
    """The long-lived objects of a run (the objects are mutable; the bundle is not)."""

    model: nn.Module  # the Hugging Face causal LM (parameters are DTensor shards)
    root: TrainModule  # the FSDP root wrapping `model`; every forward, state dict and optimizer step goes through it
    optimizer: torch.optim.Optimizer | None  # None: a frozen copy (frozen_copy: the KL reference)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    mesh: DeviceMesh
    device: torch.device
    config: TrainerConfig
    streams: Any = None  # trainer.backend.futures.DeviceStreams on CUDA, None on CPU (everything runs in order)

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


# ---------------------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------------------


def init_distributed(device_type: str | None = None) -> DeviceMesh:
    """A 1-D mesh over all ranks; a single-process group (in-memory store) when not launched by torchrun."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    # CUDA: the rank's device is current before the group exists, and device_id binds NCCL's communicator to it
    # (created eagerly: no lazy init on the first collective, no guess of the device from the rank).
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device_type == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        bind = {"device_id": device} if device is not None else {}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, **bind)
        else:
            # One process: gloo's listener for peers that never come is closed to everyone (trainer.backend.
            # listeners). Not on CUDA, where NCCL's own sockets open alongside and may still be needed.
            sealed = sealed_new_listeners() if device_type == "cpu" else contextlib.nullcontext()
            with sealed:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
    return init_device_mesh(device_type, (dist.get_world_size(),))


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's picklable `obj` on every rank of the default group (a no-op in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def warmup_cosine(step: int, *, warmup_steps: int, num_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over warmup_steps, then cosine decay to min_lr_ratio at num_steps."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, num_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def mesh_device(device_type: str) -> torch.device:
    """This rank's device for a mesh of `device_type`: the current CUDA device (init_distributed made it this
    rank's) or the CPU. The trainer and an in-process engine both live there."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def build_components(model: str | os.PathLike | Any, config: TrainerConfig, *,
                     mesh: DeviceMesh | None = None) -> TrainingComponents:
    """Load + parallelise the model (a folder, an HF config, or a TrainModule already built) and its optimizer.

    AdamW is fused on every device (one kernel, and no host read of its step count); the schedule is
    warmup + cosine (`warmup_cosine`). A value model (`config.value_head`: the critic, or a policy with a value
    head) gets a fresh value head (trainer.backend.models). A TrainModule is used as it is, except where it would
    be shared or lacks the head: a critic built from the policy's root, or a policy with a head from a root without
    one, gets its own parameters with the root's weights copied in (`_copy_of`). So does a LoRA phase, or any
    phase after a LoRA one: the copy holds the root's merged weights (as its frozen base, with fresh adapters, when
    this phase has [<phase>.lora]).
    """
    from trainer.backend.lora import is_lora
    from trainer.backend.models import has_value_head, load_hf_model

    mesh = mesh if mesh is not None else init_distributed()
    device = mesh_device(mesh.device_type)
    torch.manual_seed(config.seed)
    # A LoRA phase after another phase in memory (SFT -> RL with [rl.lora]) starts fresh adapters on a base that
    # holds the previous phase's weights, its own adapters merged in: the KL reference (the base) is then the model
    # RL started from.
    if isinstance(model, TrainModule) and (config.role == "critic" or has_value_head(model.lm) != config.value_head
                                           or is_lora(model.lm) or config.lora is not None):
        root = _copy_of(model, config, mesh, device)
    elif isinstance(model, TrainModule):
        root = model
    else:
        root = load_hf_model(model, dtype=torch.float32, device=device, mesh=mesh, parallel=config.parallel(),
                             seed=config.seed, value_head=config.value_head, lora=config.lora,
                             lora_table=config.lora_table)
    root.train()
    cuda = device.type == "cuda"
    opt = config.optim
    # Only what trains has gradients and AdamW state: with LoRA the adapters (+ a value head, + the lm_head with
    # train_unembed); the frozen base costs no optimizer memory.
    trainable = [p for p in root.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay, fused=True)
    lam = lambda s: warmup_cosine(s, warmup_steps=opt.warmup_steps, num_steps=config.num_steps,
                                  min_lr_ratio=opt.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
    return TrainingComponents(model=root.lm, root=root, optimizer=optimizer, scheduler=scheduler, mesh=mesh,
                              device=device, config=config, streams=DeviceStreams(device) if cuda else None)


def _copy_of(source: TrainModule, config: TrainerConfig, mesh: DeviceMesh, device: torch.device) -> TrainModule:
    """A new root built like `config` says (value head or not, LoRA or not) holding `source`'s weights: every
    tensor of the trunk copied shard by shard, the value head fresh when the source has none (and dropped when the
    new model has none). A LoRA source gives its merged weights (W + (alpha / r) B @ A, gathered in full); a LoRA
    copy takes the trunk into its frozen base and starts its adapters fresh (B = 0: the same function as the
    source), e.g. RL with [rl.lora] from the SFT phase's model in memory."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from trainer.backend.lora import hf_name, is_adapter, is_lora, merged_state_dict
    from trainer.backend.models import is_value_head, load_hf_model
    from trainer.backend.parallel import ROOT_PREFIX

    root = load_hf_model(source.lm.config, dtype=torch.float32, device=device, mesh=mesh, parallel=config.parallel(),
                         seed=config.seed, value_head=config.value_head, lora=config.lora,
                         lora_table=config.lora_table, trunk=False)  # the trunk is the source's, loaded below
    own = get_model_state_dict(root)
    merged = is_lora(source.lm)
    src = ({ROOT_PREFIX + k: v for k, v in merged_state_dict(source.lm)} if merged
           else get_model_state_dict(source))
    plain_to_own = {hf_name(k): k for k in own if not is_adapter(k)}  # ".base_layer." names of a LoRA copy
    given = {plain_to_own[k]: v for k, v in src.items() if k in plain_to_own}
    missing = sorted(k for k in own if k not in given and not is_value_head(k) and not is_adapter(k))
    assert not missing, f"the source model lacks {missing[:3]}: not the same architecture"
    set_model_state_dict(root, given, options=StateDictOptions(strict=False, full_state_dict=merged))
    return root


def frozen_copy(source: TrainingComponents, config: TrainerConfig) -> TrainingComponents:
    """A no-grad copy of `source`'s current weights, sharded like it, stored in the compute dtype: the KL
    reference of a full run (issue 42: an fp32 copy of a 7B model was 30 GB more than its bf16 one).

    No numerics change: under FSDP2's mixed precision the blocks already compute with the fp32 masters cast to the
    compute dtype at all-gather, which is what this copy stores (fp32 on the CPU: a plain copy). It has no
    optimizer and is never compiled (it runs once per step, without grad)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from trainer.backend.models import load_hf_model
    from trainer.backend.parallel import compute_dtype

    config = config.replace(compile=False)
    dtype = compute_dtype(source.device.type, config.parallel())
    root = load_hf_model(source.model.config, dtype=dtype, device=source.device, mesh=source.mesh,
                         parallel=config.parallel(), seed=config.seed, value_head=config.value_head,
                         lora=config.lora, lora_table=config.lora_table,
                         trunk=False)  # every tensor is the source's (LoRA: the same names, adapters copied too)
    set_model_state_dict(root, get_model_state_dict(source.root))  # copy_ into each shard casts to `dtype`
    root.requires_grad_(False)
    root.train()  # as the policy's forward: the same modules in the same mode
    return dataclasses.replace(source, model=root.lm, root=root, optimizer=None, scheduler=None, config=config)


# ---------------------------------------------------------------------------------------------------------
# Losses on one packed micro-batch (run inside the FSDP root's forward)
# ---------------------------------------------------------------------------------------------------------


def _loss_hidden_states(lm: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Hidden states of the micro-batch's loss rows: [N, H] (plain layout) or [M, H] gathered (shared prompts)."""
    hidden = packed_hidden_states(lm, mb.row, mb.trees)  # [N, H]
    return hidden if mb.trees is None else hidden.index_select(0, mb.trees.hidden_index)


def _policy_loss(lm: nn.Module, mb: MicroBatch, config: TrainerConfig) -> tuple[torch.Tensor, dict]:
    """The policy loss; with a value head on the policy ([rl.critic] kind = "head") plus value_loss_coef x the
    value loss on the same hidden states (one forward, one backward for both)."""
    hidden = _loss_hidden_states(lm, mb)
    weight = lm.get_output_embeddings().weight  # [V, H], unsharded inside the root's forward
    loss, metrics = linear_policy_loss(hidden, weight, mb.loss_inputs(), config=config.policy_loss,
                                       temperature=config.temperature, chunk_tokens=config.logprob_chunk_tokens)
    if not config.value_head:
        return loss, metrics
    v_loss, v_metrics = _value_terms(lm, hidden, mb, config)
    return loss + config.critic.value_loss_coef * v_loss, {**metrics, **v_metrics}


def _value_terms(lm: nn.Module, hidden: torch.Tensor, mb: MicroBatch,
                 config: TrainerConfig) -> tuple[torch.Tensor, dict]:
    """PPO's clipped value loss of the value head on hidden [L, H] against the micro-batch's returns, a token mean
    over the step's global loss tokens (so micro-batches and ranks sum to the step's mean, as the policy loss).

    Metrics: critic/value_loss, critic/value_clip_frac and critic/value_mean (each a share of the global token
    mean: they sum like the policy's). The explained variance needs the whole step's tokens at once:
    trainer.backend.critic computes it from the values before the update."""
    from trainer.backend.models import token_values

    assert mb.returns is not None and mb.old_values is not None, \
        "a value loss needs the micro-batch's returns and old values (trainer.backend.critic.attach_gae)"
    values = token_values(lm, hidden)  # [L] float32
    loss, metrics = value_loss(values, mb.old_values, mb.returns, mb.loss_mask, clip=config.critic.clip,
                               num_tokens=max(mb.num_tokens, 1))
    metrics.pop("critic/explained_variance")  # one micro-batch's: not a share of the step's
    return loss, {**metrics, "critic/value_loss": loss.detach()}


def _value_loss(lm: nn.Module, mb: MicroBatch, config: TrainerConfig) -> tuple[torch.Tensor, dict]:
    return _value_terms(lm, _loss_hidden_states(lm, mb), mb, config)


def _nll_loss(lm: nn.Module, mb: MicroBatch, config: TrainerConfig) -> tuple[torch.Tensor, dict]:
    hidden = _loss_hidden_states(lm, mb)
    weight = lm.get_output_embeddings().weight
    logp = linear_token_logprobs(hidden, weight, mb.labels, temperature=1.0, mask=mb.loss_mask,
                                 chunk_tokens=config.logprob_chunk_tokens)  # [N], 0 off the mask
    loss = -(logp * mb.loss_mask).sum() / max(mb.num_tokens, 1)
    return loss, {}


_LOSS_FNS: dict[str, Callable[[nn.Module, MicroBatch, TrainerConfig], tuple[torch.Tensor, dict]]] = {
    "policy": _policy_loss, "nll": _nll_loss, "value": _value_loss}


# ---------------------------------------------------------------------------------------------------------
# Step functions
# ---------------------------------------------------------------------------------------------------------


def _device_batches(components: TrainingComponents, micro_batches: Sequence[MicroBatch]):
    """Yield micro-batches on the device, for the compute stream (the current stream while this runs).

    With streams, the copy of batch i+1 (pinned host memory, copy stream) overlaps the compute of batch i; the
    compute stream waits on the copy's event before it reads the batch.
    """
    st, dev = components.streams, components.device
    if st is None:
        yield from (mb.to(dev) for mb in micro_batches)
        return

    def start(mb: MicroBatch) -> tuple[MicroBatch, Any]:
        with st.use(st.copy):
            out = mb.pin_memory().to(dev, non_blocking=True)
            return out, st.record(st.copy)

    nxt = start(micro_batches[0]) if micro_batches else None
    for i in range(len(micro_batches)):
        cur, ev = nxt
        nxt = start(micro_batches[i + 1]) if i + 1 < len(micro_batches) else None
        st.wait(st.compute, ev)
        # The copy stream allocated the copies, and old/ref log-probs may come from another model's compute
        # stream: tell the caching allocator the compute stream reads them all.
        for t in _tensors(cur):
            st.keep_alive(t, st.compute)
        yield cur


def _tensors(mb: MicroBatch) -> list[torch.Tensor]:
    out = [getattr(mb, f.name) for f in dataclasses.fields(mb)]
    out += [getattr(mb.row, f.name) for f in dataclasses.fields(mb.row)]
    return [t for t in out if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def _on_compute_stream(components: TrainingComponents):
    """Queue the enclosed work on the compute stream, ordered after and before the caller's stream.

    Entry: the compute stream waits on the caller's stream (weights loaded, inputs written there, e.g. log-probs
    of another model whose own exit handed them to the default stream). Exit: the caller's stream waits on the
    compute stream, so a checkpoint or a weight sync queued there after this step reads finished parameters.
    Both are device-side waits: the host does not block.
    """
    st = components.streams
    if st is None:
        yield
        return
    caller = st.current()
    st.wait(st.compute, st.record(caller))
    with st.use(st.compute):
        yield
    st.wait(caller, st.record(st.compute))


ERRORS_KEY = "input_errors"  # the loss kernels' device bitmask of data-dependent input errors


def _all_reduce(components: TrainingComponents, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Combine the step's metrics over the ranks with kernels.objective.merge_metrics' rules (`_max` by max,
    `input_errors` by or, the rest by sum): two collectives, no host sync."""
    if components.world_size == 1 or not values:
        return values
    group = components.mesh.get_group()
    out = dict(values)
    maxed = sorted(k for k in values if k.endswith("_max"))
    summed = sorted(k for k in values if k not in maxed and k != ERRORS_KEY)
    if summed:
        flat = torch.stack([values[k] for k in summed])
        dist.all_reduce(flat, group=group)
        out.update(zip(summed, flat.unbind(0)))
    # Maxima and the error bitmask (as 32 bits of 0/1, so max = or) in one MAX collective.
    bits = torch.arange(32, device=components.device, dtype=torch.int32)
    parts = [torch.stack([values[k] for k in maxed])] if maxed else []
    if ERRORS_KEY in values:
        parts.append(((values[ERRORS_KEY] >> bits) & 1).float())
    if parts:
        flat = torch.cat(parts)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        out.update(zip(maxed, flat[:len(maxed)].unbind(0)))
        if ERRORS_KEY in values:
            out[ERRORS_KEY] = (flat[len(maxed):].to(torch.int32) << bits).sum().to(torch.int32)
    return out


def _finalize_metrics(host: dict) -> dict:
    """Runs when the future is read: raise the kernels' deferred input errors, drop the bitmask."""
    raise_on_input_errors(host.pop(ERRORS_KEY, 0))
    return host


class GradFuture(TrainFuture[dict]):
    """forward_backward's future of the step's metrics. Also carries `num_tokens`, the global loss-token count of
    its micro-batches: a host int known when the work is queued, which `optim_step` takes to grow
    TrainingState.tokens_seen without reading the future."""

    def __init__(self, value: Any, event: Any = None, finalize: Callable[[Any], dict] | None = None, *,
                 num_tokens: int) -> None:
        super().__init__(value, event, finalize)
        self.num_tokens = num_tokens


def forward_backward(components: TrainingComponents, micro_batches: Sequence[MicroBatch],
                     config: TrainerConfig | None = None) -> GradFuture:
    """Accumulate gradients of the loss over this rank's packed micro-batches; returns a future of the metrics.

    micro_batches: from trainer.batching.micro_batches.build_micro_batches (same count on every rank; each already
    normalised by
    the global token / sequence counts). The future's dict has "loss" (the exact global loss, summed over
    micro-batches and ranks), the loss kernel's metrics combined the same way (a `_max` metric by max) and
    "num_tokens" (also `fut.num_tokens`, readable at once). Data-dependent input errors found by the kernels (NaN,
    label out of range) are raised when the future is read. Gradients stay in the parameters' .grad until
    `optim_step`.
    """
    config = config or components.config
    if not micro_batches:
        raise ValueError("micro_batches: empty; build them with trainer.batching.micro_batches.build_micro_batches")
    loss_fn = _LOSS_FNS[config.loss]
    world = components.world_size
    dev = components.device
    with _on_compute_stream(components):
        total_loss = torch.zeros((), device=dev, dtype=torch.float32)
        merged = None
        last = len(micro_batches) - 1
        # defer_grad_sync, unless the unsharded fp32 gradient it holds does not fit this device (decided once a run)
        defer = step_defers_grad_sync(components, config.defer_grad_sync, len(micro_batches))
        for i, mb in enumerate(_device_batches(components, micro_batches)):
            # FSDP2 reduce-scatters in this micro-batch's backward only when it is the last one (defer_grad_sync):
            # the earlier ones accumulate unsharded gradients, so a step costs one collective per block, not one
            # per micro-batch. The last micro-batch always syncs, so the flag is True again when the step ends.
            components.root.set_requires_gradient_sync(i == last or not defer)
            loss, metrics = components.root(lambda lm, mb=mb: loss_fn(lm, mb, config))
            (loss * world).backward()
            total_loss += loss.detach().float()
            merged = merge_metrics(merged, {k: v.detach().reshape(()) for k, v in metrics.items()})
        totals = _all_reduce(components, {"loss": total_loss, **(merged or {})})
        num_tokens = micro_batches[0].num_tokens  # global count: identical on every rank
        totals["num_tokens"] = float(num_tokens)
        return GradFuture.record(totals, dev, _finalize_metrics, num_tokens=num_tokens)


@torch.no_grad()
def compute_logprobs(components: TrainingComponents, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
    """No-grad log pi(label) [N] per micro-batch (0 off the loss mask), on the device: old / ref log-probs.

    [M] (one per loss row) for micro-batches in the shared-prompt layout: the shape of their labels.

    Computed at the run's one temperature (the rollout's). Attach them with
    trainer.batching.micro_batches.attach_logprobs(micro_batches, logps, "old_logprobs").
    """
    temp = components.config.temperature
    chunk = components.config.logprob_chunk_tokens
    out = []

    def fn(lm: nn.Module, mb: MicroBatch) -> torch.Tensor:
        hidden = _loss_hidden_states(lm, mb)
        weight = lm.get_output_embeddings().weight
        return linear_token_logprobs(hidden, weight, mb.labels, temperature=temp, mask=mb.loss_mask,
                                             chunk_tokens=chunk)

    with _on_compute_stream(components):
        for mb in _device_batches(components, micro_batches):
            out.append(components.root(lambda lm, mb=mb: fn(lm, mb)).float())
    return out


@torch.no_grad()
def compute_values(components: TrainingComponents, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
    """No-grad values [L] float32 per micro-batch, on the device: a value model's (the critic, or a policy with a
    value head) prediction for each label, read from the hidden state that predicts it, so values line up with
    labels, loss_mask and the log-probs ([N] in the plain layout, [M] loss rows in the shared-prompt layout).
    Off the loss mask they are whatever the head says there; kernels.gae never reads them."""
    from trainer.backend.models import token_values

    if not components.config.value_head:
        raise ValueError("compute_values: this model has no value head; build the critic with "
                         "trainer.backend.critic.build_critic, or the policy with [rl.critic] kind = \"head\"")
    out = []
    with _on_compute_stream(components):
        for mb in _device_batches(components, micro_batches):
            out.append(components.root(lambda lm, mb=mb: token_values(lm, _loss_hidden_states(lm, mb))))
    return out


@torch.no_grad()
def clip_grad_norm(parameters: Sequence[nn.Parameter], max_norm: float, mesh: DeviceMesh,
                   foreach: bool | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients of DTensor shards (device scalar) and in-place clipping to max_norm.

    FSDP2 shards every gradient as Shard(0) over the mesh, so the squared norm is the sum of the local squared
    norms over the ranks: one all-reduce of a scalar. max_norm = 0 only measures. foreach (default: on CUDA)
    norms and scales all local shards with multi-tensor kernels (a few launches instead of ~4 per parameter);
    the per-tensor loop is the CPU path.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    dev = grads[0].device if grads else torch.device("cpu")
    foreach = dev.type == "cuda" if foreach is None else foreach
    local, sharded = [], False
    for g in grads:
        if isinstance(g, DTensor):
            if not all(isinstance(pl, Shard) for pl in g.placements):
                raise ValueError(f"clip_grad_norm: expected Shard placements (FSDP2), got {g.placements}")
            sharded = True
            g = g.to_local()
        local.append(g)
    if foreach and local:
        sq = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32)).square().sum()
    else:
        sq = torch.zeros((), device=dev, dtype=torch.float32)
        for g in local:
            sq += g.float().pow(2).sum()
    if sharded and mesh.size() > 1:
        dist.all_reduce(sq, group=mesh.get_group())
    norm = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # stays on the device: no host sync
        if foreach:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in local:
                by_dtype.setdefault(g.dtype, []).append(g)
            for dtype, group in by_dtype.items():
                torch._foreach_mul_(group, coef.to(dtype))
        else:
            for g in local:
                g.mul_(coef.to(g.dtype))
    return norm


def optim_step(components: TrainingComponents, state: TrainingState, config: TrainerConfig | None = None, *,
               num_tokens: int) -> tuple[TrainFuture[dict], TrainingState]:
    """Clip, AdamW step, schedule step, zero grads; returns (future of {"grad_norm", "lr"}, the next state).

    num_tokens: the loss tokens of the gradients this step applies, the `num_tokens` of the forward_backward
    futures since the last step summed (global counts). The new state has step + 1, weight_version + 1 and
    tokens_seen + num_tokens.
    """
    config = config or components.config
    params = [p for p in components.root.parameters() if p.requires_grad]
    with _on_compute_stream(components):
        lr = components.scheduler.get_last_lr()[0]  # host float: the schedule lives on the host
        norm = clip_grad_norm(params, config.optim.max_grad_norm, components.mesh)
        components.optimizer.step()
        components.scheduler.step()
        components.optimizer.zero_grad(set_to_none=True)
        fut = TrainFuture.record({"grad_norm": norm, "lr": lr}, components.device)
    return fut, advanced(state, num_tokens)


def advanced(state: TrainingState, num_tokens: int) -> TrainingState:
    """The state after one optimizer step that applied `num_tokens` loss tokens (global counts): step + 1,
    weight_version + 1, tokens_seen + num_tokens. A loop that steps through a TrainingBackend threads it itself."""
    return dataclasses.replace(state, step=state.step + 1, weight_version=state.weight_version + 1,
                               tokens_seen=state.tokens_seen + num_tokens)


def trainer_config_from(phase: Any, backend: BackendConfig | None = None, **overrides: Any) -> TrainerConfig:
    """The TrainerConfig of a phase (SFTTrainingConfig or RLTrainingConfig) with `backend` ([trainer]; default
    BackendConfig()) and `overrides` of its fields (compile, logprob_chunk_tokens, ...) replaced."""
    backend = backend or BackendConfig()
    return TrainerConfig(phase=phase, backend=dataclasses.replace(backend, **overrides) if overrides else backend)
