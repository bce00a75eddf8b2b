"""Memory plan: the bytes per rank of each part of a training run, before anything is allocated.

    plan = memory_plan(model_config, world_size=1, device_bytes=80e9, trainer=BackendConfig(...),
                       micro_batch_tokens=8192, lora=LoRAConfig(rank=16), engine=EngineMemory(rows=32, context=4096))
    plan.fits, plan.headroom, plan.verdict          # the verdict names every part that does not fit and its fix
    plan = resolve_plan(...)                        # the same, with the trainer's automatic decisions applied

Parts (bytes on one rank; P = parameters of the model, T = the trained ones: all of them, or LoRA's adapters;
W = world size; e = bytes of an element in the compute dtype):

    masters             T x 4 / W       fp32 master weights, sharded by FSDP2 (build_components loads them in fp32)
    frozen_base         P x b / W       LoRA only: the frozen base, in its own dtype b (fp32: 4, bf16: 2)
    optimizer           T x 8 / W       AdamW's exp_avg and exp_avg_sq in fp32
    gradients           T x 4 / W       the sharded fp32 gradients FSDP2 reduce-scatters into
    unsharded_gradient  T x 4           defer_grad_sync with >= 2 micro-batches: FSDP2 accumulates the *unsharded*
                                        gradient in reduce_dtype (fp32) until the last micro-batch, on every rank
    gathered_params     e x (root + 2 blocks)  FSDP2's all-gathered copies: the root group (embeddings, lm_head,
                                        final norm) stays gathered for the whole forward (its forward wraps the
                                        model), blocks one at a time plus one prefetched
    reference           P x b / W       the KL reference, sharded like the policy (none for LoRA: adapters off)
    activations         see `activation_bytes`
    logprob_chunk       the fused log-prob kernel's [rows, V] logit buffer (e), its dh [N, H] (e) and, when the
                        lm_head trains, its dW [V, H] accumulated in fp32
    runtime             CUDA context, cuBLAS / NCCL workspaces: a fixed estimate
    engine_weights      colocated engine: P x e_engine, the whole model (the engine is not sharded)
    engine_kv_cache     colocated engine: rows x context x layers x 2 (K, V) x kv_heads x head_dim x e_engine,
                        x 2: growing a cache (engines/embedded/kv_cache.py `rebuilt`) holds the old and the new

A plan fits when its total leaves `HEADROOM_FRACTION` of the device free (the caching allocator's fragmentation
and whatever the estimate misses). Pure functions over a transformers config; `measured_plan` is the one reader
of a live run (the step's defer_grad_sync decision).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from kernels.linear_policy_loss import _default_chunk_tokens  # the kernel's own chunk rule, not a copy of it

GB = 1e9
HEADROOM_FRACTION = 0.10  # a plan fits when this much of the device stays free
AC_AUTO_PARAMS = 1_000_000_000  # activation_checkpointing = None (auto): on above this many parameters
RUNTIME_BYTES = int(1.5e9)  # CUDA context (~0.5 GB) + cuBLAS workspaces + NCCL buffers, per rank
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SUPPORTED = ("qwen2", "qwen3", "llama", "mistral")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a Llama-family causal LM, from its config (no model built)."""

    hidden: int
    intermediate: int
    layers: int
    q_out: int  # heads x head_dim
    kv_out: int  # kv_heads x head_dim
    vocab: int
    embed: int  # V x H
    lm_head: int  # V x H, 0 when tied to the embeddings
    final_norm: int  # H
    block: int  # parameters of one decoder block
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out) of each Linear of a block: LoRA's targets

    @property
    def params(self) -> int:
        return self.embed + self.lm_head + self.final_norm + self.layers * self.block

    @property
    def root_group(self) -> int:
        """What FSDP2's root group holds: embeddings, lm_head, final norm."""
        return self.embed + self.lm_head + self.final_norm


def model_shape(config: Any) -> ModelShape:
    """The parameter counts of a transformers config of a Llama-family model (qwen2, qwen3, llama, mistral).

    Per block: q [H -> heads*hd], k, v [H -> kv_heads*hd], o [heads*hd -> H] (biases: q, k, v on Qwen2; all four
    with attention_bias), gate, up [H -> I], down [I -> H] (biases with mlp_bias), two RMSNorms [H], and on Qwen3
    q_norm / k_norm [hd]."""
    kind = getattr(config, "model_type", None)
    if kind not in _SUPPORTED:
        raise ValueError(f"memory plan: model_type {kind!r} is not planned; the plan counts {_SUPPORTED} "
                         f"(Llama-family blocks); add its block's parameters to trainer.backend.memory.model_shape")
    h, i, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    q_out, kv_out = heads * hd, kv_heads * hd
    attn_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = kind == "qwen2" or attn_bias
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    linears = (("q_proj", h, q_out), ("k_proj", h, kv_out), ("v_proj", h, kv_out), ("o_proj", q_out, h),
               ("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))
    weights = sum(a * b for _, a, b in linears)
    biases = (q_out + 2 * kv_out if qkv_bias else 0) + (h if attn_bias else 0) + (2 * i + h if mlp_bias else 0)
    norms = 2 * h + (2 * hd if kind == "qwen3" else 0)
    vocab = config.vocab_size
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return ModelShape(hidden=h, intermediate=i, layers=config.num_hidden_layers, q_out=q_out, kv_out=kv_out,
                      vocab=vocab, embed=vocab * h, lm_head=0 if tied else vocab * h, final_norm=h,
                      block=weights + biases + norms, linears=linears)


def lora_targets(shape: ModelShape, lora: Any) -> tuple[tuple[str, int, int], ...]:
    """The (name, in, out) of the block Linears LoRA adapts: all of them for "all-linear", else those named."""
    if lora.target_modules == "all-linear":
        return shape.linears
    have = {name for name, _, _ in shape.linears}
    missing = [m for m in lora.target_modules if m not in have]
    if missing:
        raise ValueError(f"memory plan: LoRA target_modules {missing} are not Linears of the blocks; the plan knows "
                         f"{sorted(have)} (or \"all-linear\")")
    return tuple(t for t in shape.linears if t[0] in lora.target_modules)


def lora_params(shape: ModelShape, lora: Any) -> int:
    """Adapter parameters: A [r, in] + B [out, r] per targeted Linear per block."""
    return shape.layers * sum(lora.rank * (a + b) for _, a, b in lora_targets(shape, lora))


def auto_activation_checkpointing(setting: bool | None, num_params: int) -> bool:
    """[trainer] activation_checkpointing: the setting when given; None (auto) = on above AC_AUTO_PARAMS
    parameters, where a micro-batch's saved activations (~L x 0.27 MB a token at 7B) outgrow the weights' shards."""
    return setting if setting is not None else num_params > AC_AUTO_PARAMS


def activation_bytes(shape: ModelShape, tokens: int, elsize: int, *, checkpointing: bool,
                     lora_rank_targets: int = 0) -> int:
    """Saved activations of one micro-batch of `tokens` packed tokens (flash / flex attention: nothing of size N^2).

    Per token and block, what autograd keeps for the backward (e = compute dtype bytes):
        e x (6H + 2 q_out + 2 kv_out + 4I)    2 residual inputs + 2 norm outputs + attention output + o_proj output
                                              (6H); q and attention output (2 q_out); k, v (2 kv_out); gate, up,
                                              silu(gate), silu(gate)*up (4I)
      + 4 x 4H                                the RMSNorms' fp32 upcast input and normalised value, twice
      + e x (r x LoRA targets)                each adapter's A output [N, r]
    Without checkpointing: every block's, + one block's worth of gradients in flight in the backward.
    With checkpointing: each block's input [N, H] (e), + one block recomputed and its gradients in flight (2x)."""
    per_block = (elsize * (6 * shape.hidden + 2 * shape.q_out + 2 * shape.kv_out + 4 * shape.intermediate)
                 + 16 * shape.hidden + elsize * lora_rank_targets)
    if checkpointing:
        return tokens * (shape.layers * shape.hidden * elsize + 2 * per_block)
    return tokens * (shape.layers + 1) * per_block


def logprob_chunk_bytes(shape: ModelShape, tokens: int, elsize: int, *, chunk_tokens: int | None,
                        lm_head_trains: bool) -> int:
    """The fused log-prob kernel's buffers on CUDA (kernels.linear_policy_loss._ChunkLoop): logits of one chunk
    [rows, V] in the compute dtype, dh [N, H] in it, and dW [V, H] in fp32 when the lm_head trains."""
    rows = min(tokens, chunk_tokens or _default_chunk_tokens(shape.vocab, torch.device("cuda")))
    return rows * shape.vocab * elsize + tokens * shape.hidden * elsize + (
        shape.vocab * shape.hidden * 4 if lm_head_trains else 0)


def kv_cache_bytes(shape: ModelShape, rows: int, context: int, elsize: int) -> int:
    """One KV cache of `rows` x `context` tokens: layers x 2 (K and V) x kv_heads x head_dim x elsize a token."""
    return rows * context * shape.layers * 2 * shape.kv_out * elsize


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """The inference engine's share of this GPU: colocated = on the trainer's GPU (in process or beside it);
    `rows` x `context` tokens of KV cache at most, in `dtype`."""

    colocated: bool = True
    rows: int = 32
    context: int = 4096
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank of each part (`parts`, name -> bytes, in the order of the module docstring), against
    `device_bytes`. `unsharded_gradient_bytes`: the gradient defer_grad_sync would hold, planned or not (the
    decision reads it); `decisions`: what resolve_plan changed and why."""

    parts: tuple[tuple[str, int], ...]
    device_bytes: float
    world_size: int
    settings: tuple[tuple[str, Any], ...]  # what the parts were computed under (dtypes, AC, defer_grad_sync, ...)
    unsharded_gradient_bytes: int
    fixes: tuple[tuple[str, str], ...] = ()  # (part, the change that shrinks it) for parts that have one
    decisions: tuple[str, ...] = ()

    def part(self, name: str) -> int:
        return dict(self.parts).get(name, 0)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    @property
    def headroom(self) -> float:
        return self.device_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= HEADROOM_FRACTION * self.device_bytes

    @property
    def verdict(self) -> str:
        gb = lambda b: f"{b / GB:.1f} GB"  # noqa: E731
        if self.fits:
            return (f"fits: {gb(self.total)} of {gb(self.device_bytes)} per rank, {gb(self.headroom)} free "
                    f"(>= {HEADROOM_FRACTION:.0%} kept for fragmentation)")
        limit = (1 - HEADROOM_FRACTION) * self.device_bytes
        over = [f"{name} {gb(self.part(name))} ({fix})" for name, fix in self.fixes if self.part(name)]
        return (f"does not fit: {gb(self.total)} per rank > {gb(limit)} ({1 - HEADROOM_FRACTION:.0%} of "
                f"{gb(self.device_bytes)}); shrink " + "; ".join(over or ["nothing planned shrinks: more GPUs"]))

    def as_dict(self) -> dict[str, Any]:
        """Each part, the total and the headroom in GB (2 decimals), the verdict, the settings and decisions."""
        r2 = lambda b: round(b / GB, 2)  # noqa: E731
        return {"parts_gb": {n: r2(b) for n, b in self.parts}, "total_gb": r2(self.total),
                "device_gb": r2(self.device_bytes), "headroom_gb": r2(self.headroom), "fits": self.fits,
                "verdict": self.verdict, "settings": dict(self.settings), "decisions": list(self.decisions)}


def _bytes(dtype: str, what: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"memory plan: {what} = {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def memory_plan(model_config: Any, *, world_size: int, device_bytes: float, trainer: Any, micro_batch_tokens: int,
                micro_batches: int = 2, reference_dtype: str | None = None, lora: Any = None,
                frozen_dtype: str | None = None, engine: EngineMemory | None = None) -> MemoryPlan:
    """The plan of one CUDA rank (module docstring) for `trainer` (the [trainer] table: param_dtype,
    activation_checkpointing (None: auto), defer_grad_sync, logprob_chunk_tokens) as given, no decision applied.

    reference_dtype: the KL reference's storage dtype, None = no reference. lora: a trainer.config.LoRAConfig
    (rank, target_modules, train_unembed) or None = full fine-tuning; frozen_dtype: its frozen base's storage
    (None: the compute dtype). engine: what an engine holds on this GPU (None or colocated=False: nothing)."""
    shape = model_shape(model_config)
    w = world_size
    compute = trainer.param_dtype or "bfloat16"  # the CUDA default (trainer.backend.parallel.compute_dtype)
    e = _bytes(compute, "[trainer] param_dtype")
    p = shape.params
    lm_head_trains = lora is None or bool(getattr(lora, "train_unembed", False))
    if lora is None:
        trained, frozen, rank_targets = p, 0, 0
    else:
        adapters = lora_params(shape, lora)
        head = (shape.lm_head or shape.embed) if lm_head_trains else 0
        trained, frozen = adapters + head, p - head
        rank_targets = lora.rank * len(lora_targets(shape, lora))
        frozen_dtype = frozen_dtype or compute
    ac = auto_activation_checkpointing(trainer.activation_checkpointing, p)
    defers = bool(trainer.defer_grad_sync) and micro_batches >= 2
    unsharded = trained * 4
    # LoRA's reference is the policy with its adapters off (trainer.rl), unless the lm_head itself trains.
    has_ref = reference_dtype is not None and (lora is None or lm_head_trains)
    colocated = engine is not None and engine.colocated
    ee = _bytes(engine.dtype, "engine dtype") if colocated else 0
    gathered_extra = 2 * (lora_params(shape, lora) // shape.layers if lora is not None else 0)
    parts = (
        ("masters", trained * 4 // w),
        ("frozen_base", frozen * _bytes(frozen_dtype, "frozen base dtype") // w if frozen else 0),
        ("optimizer", trained * 8 // w),
        ("gradients", trained * 4 // w),
        ("unsharded_gradient", unsharded if defers else 0),
        ("gathered_params", e * (shape.root_group + 2 * shape.block + gathered_extra)),
        ("reference", p * _bytes(reference_dtype, "reference dtype") // w if has_ref else 0),
        ("activations", activation_bytes(shape, micro_batch_tokens, e, checkpointing=ac,
                                         lora_rank_targets=rank_targets)),
        ("logprob_chunk", logprob_chunk_bytes(shape, micro_batch_tokens, e, chunk_tokens=trainer.logprob_chunk_tokens,
                                              lm_head_trains=lm_head_trains)),
        ("runtime", RUNTIME_BYTES),
        ("engine_weights", p * ee),
        ("engine_kv_cache", 2 * kv_cache_bytes(shape, engine.rows, engine.context, ee) if colocated else 0),
    )
    with_ac = activation_bytes(shape, micro_batch_tokens, e, checkpointing=True, lora_rank_targets=rank_targets)
    fixes = []
    if has_ref and reference_dtype != compute:
        fixes.append(("reference", f"hold it in {compute}: {p * e / w / GB:.1f} GB"))
    if frozen and frozen_dtype != compute:
        fixes.append(("frozen_base", f"hold it in {compute}: {frozen * e / w / GB:.1f} GB"))
    if defers:
        fixes.append(("unsharded_gradient", "[trainer] defer_grad_sync = false: reduce-scatter every micro-batch"))
    if not ac:
        fixes.append(("activations", f"[trainer] activation_checkpointing = true: {with_ac / GB:.1f} GB"))
    if lora is None:
        fixes += [(name, "16 bytes a trained parameter: train LoRA adapters ([rl.lora] / [sft.lora]) or shard over "
                         "more GPUs") for name in ("optimizer", "masters")]
    if colocated:
        fixes.append(("engine_kv_cache", "fewer engine rows or a shorter context"))
    settings = (("compute_dtype", compute), ("activation_checkpointing", ac), ("defer_grad_sync", defers),
                ("micro_batches", micro_batches), ("micro_batch_tokens", micro_batch_tokens),
                ("reference_dtype", reference_dtype if has_ref else None), ("params", p), ("trained_params", trained),
                ("lora_rank", None if lora is None else lora.rank),
                ("frozen_dtype", frozen_dtype if frozen else None),
                ("engine", None if not colocated else f"colocated, {engine.rows} rows x {engine.context} tokens"))
    return MemoryPlan(parts=parts, device_bytes=device_bytes, world_size=w, settings=settings,
                      unsharded_gradient_bytes=unsharded, fixes=tuple(fixes))


def defer_grad_sync_fits(plan: MemoryPlan) -> bool:
    """Whether the plan fits while holding defer_grad_sync's unsharded gradient (planned in it or not)."""
    without = plan.total - plan.part("unsharded_gradient")
    return plan.device_bytes - without - plan.unsharded_gradient_bytes >= HEADROOM_FRACTION * plan.device_bytes


def resolve_plan(model_config: Any, *, trainer: Any, **kwargs: Any) -> MemoryPlan:
    """memory_plan with the trainer's automatic decisions applied and named in `decisions`: activation
    checkpointing when None (auto_activation_checkpointing), defer_grad_sync off when its unsharded gradient does
    not fit (defer_grad_sync_fits). `trainer` is not changed (a dataclasses.replace of it is planned)."""
    notes = []
    p = model_shape(model_config).params
    if trainer.activation_checkpointing is None:
        ac = auto_activation_checkpointing(None, p)
        notes.append(f"activation_checkpointing auto: {'on' if ac else 'off'} ({p / 1e9:.2f}B parameters, "
                     f"{'>' if ac else '<='} {AC_AUTO_PARAMS / 1e9:.0f}B)")
        trainer = dataclasses.replace(trainer, activation_checkpointing=ac)
    plan = memory_plan(model_config, trainer=trainer, **kwargs)
    if plan.part("unsharded_gradient") and not defer_grad_sync_fits(plan):
        notes.append(f"defer_grad_sync off: its unsharded gradient ({plan.unsharded_gradient_bytes / GB:.1f} GB) "
                     f"does not fit beside the rest ({(plan.total - plan.part('unsharded_gradient')) / GB:.1f} GB)")
        plan = memory_plan(model_config, trainer=dataclasses.replace(trainer, defer_grad_sync=False), **kwargs)
    return dataclasses.replace(plan, decisions=tuple(notes))


# ---------------------------------------------------------------------------------------------------------
# A live run: the step's defer_grad_sync decision (reads the device once per set of components)
# ---------------------------------------------------------------------------------------------------------


def measured_plan(components: Any) -> MemoryPlan:
    """The plan of a built run on its CUDA device, its own parts measured: masters / frozen base from the
    parameters' local shards, optimizer = 2 x masters (AdamW allocates its state at the first step), gradients =
    masters; "other" = what the device holds besides this run's parameters, gradients and optimizer state (the
    reference, an engine, other processes, the CUDA context) minus the allocator's free cached blocks.
    Activations, gathered parameters and the log-prob chunk are planned from the model config as in memory_plan."""
    dev, config = components.device, components.config
    free, total = torch.cuda.mem_get_info(dev)
    nbytes = lambda t: (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()  # noqa: E731
    params = list(components.root.parameters())
    trained = [p for p in params if p.requires_grad]
    masters = sum(nbytes(p) for p in trained)
    frozen = sum(nbytes(p) for p in params if not p.requires_grad)
    own = (masters + frozen + sum(nbytes(p.grad) for p in params if p.grad is not None)
           + sum(nbytes(v) for s in components.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)))
    cached_free = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    shape = model_shape(components.model.config)
    e = _bytes(config.param_dtype or "bfloat16", "[trainer] param_dtype")
    ac = auto_activation_checkpointing(config.activation_checkpointing, sum(p.numel() for p in params))  # parallelize's
    tokens = config.token_budget
    parts = (("masters", masters), ("frozen_base", frozen), ("optimizer", 2 * masters), ("gradients", masters),
             ("unsharded_gradient", 0), ("gathered_params", e * (shape.root_group + 2 * shape.block)),
             ("activations", activation_bytes(shape, tokens, e, checkpointing=ac)),
             ("logprob_chunk", logprob_chunk_bytes(shape, tokens, e, chunk_tokens=config.logprob_chunk_tokens,
                                                   lm_head_trains=any(p is components.model.get_output_embeddings()
                                                                      .weight for p in trained))),
             ("other", max(0, total - free - cached_free - own)))
    return MemoryPlan(parts=parts, device_bytes=total, world_size=components.world_size,
                      settings=(("activation_checkpointing", ac), ("micro_batch_tokens", tokens)),
                      unsharded_gradient_bytes=4 * sum(p.numel() for p in trained))


_DEFER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # components -> whether the step may defer


def step_defers_grad_sync(components: Any, requested: bool, micro_batches: int) -> bool:
    """Whether this step's micro-batches accumulate unsharded gradients: `requested` ([trainer] defer_grad_sync)
    with >= 2 micro-batches, and on CUDA only while the unsharded gradient fits (`defer_grad_sync_fits` of the
    run's `measured_plan`, decided once per set of components, with one warning). On the CPU as requested."""
    if not requested or micro_batches < 2:
        return False
    if components.device.type != "cuda":
        return True
    if components not in _DEFER:
        plan = measured_plan(components)
        _DEFER[components] = defer_grad_sync_fits(plan)
        if not _DEFER[components]:
            warnings.warn(f"[trainer] defer_grad_sync: turned off for this run: its unsharded fp32 gradient "
                          f"({plan.unsharded_gradient_bytes / GB:.1f} GB on every rank) does not fit beside the rest "
                          f"({plan.total / GB:.1f} GB of {plan.device_bytes / GB:.1f} GB); the gradients are "
                          f"reduce-scattered after every micro-batch. Set defer_grad_sync = false to silence this.",
                          stacklevel=3)
    return _DEFER[components]


def release_phase_memory(components: Any) -> None:
    """At a phase boundary (SFT -> RL): drop the finished phase's AdamW state (8 bytes a trained parameter; the
    next phase builds its own optimizer) and gradients, then on CUDA hand the allocator's cached blocks back to
    the device (`torch.cuda.empty_cache`), so that the next phase's optimizer, a reference or an engine's KV cache
    allocate from them instead of beside them. The parameters stay: the next phase trains them."""
    components.optimizer.zero_grad(set_to_none=True)
    components.optimizer.state.clear()
    if components.device.type == "cuda":
        torch.cuda.empty_cache()
