"""FSDP2 + torch.compile: free functions applied to a (meta-device) Hugging Face causal LM in a fixed order.

    apply_liger            CUDA only: Liger's RMSNorm / SwiGLU on this model's modules, where Liger supports it
                           (eager blocks only: uses_liger)
    apply_ac               activation checkpointing of every decoder block (HF's non-reentrant path): as set, or
                           by default above 1B parameters
    fully_shard            each block, one MixedPrecisionPolicy
    compile_blocks         per-decoder-block torch.compile (small graphs, one per block class; fast to build), of
                           the forward fully_shard's class gives each block
    fully_shard            the root (a TrainModule wrapping the LM)

The root is a thin `TrainModule` and not the HF model because the training loss reads the lm_head *weight*
directly (kernels.linear_policy_loss fuses lm_head + log-softmax so full logits never exist). FSDP2 all-gathers
a group's parameters in the group's forward pre-hook; making the wrapper the root puts embed/norm/lm_head in a
group whose forward is exactly the code that uses them, so the weight is unsharded there and its gradient is
reduce-scattered by the root's backward hook. State-dict keys of the root carry the prefix "lm.".
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.weak import WeakIdKeyDictionary

from kernels.device import without_duck_sizing
from trainer.backend.memory import auto_activation_checkpointing

ROOT_PREFIX = "lm."
# [trainer] attention: "auto" or an attn_implementation with a packed path (trainer.backend.attention)
ATTENTION_CHOICES = ("auto", "packed_sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "sdpa", "eager")
VALUE_HEAD = "value_head"  # the attribute of the causal LM that holds a value model's head


def is_value_head(name: str) -> bool:
    """Whether a parameter / state-dict name (of the LM, or of the FSDP root: "lm." first) is the value head's."""
    return name.removeprefix(ROOT_PREFIX).startswith(VALUE_HEAD + ".")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is parallelised. param_dtype None = bfloat16 on CUDA, float32 on CPU."""

    compile: bool = True  # torch.compile each decoder block
    compile_backend: str = "inductor"  # tests on CPU use "aot_eager" (same graphs and recompiles, no C++ build)
    # None: the packed row's sizes dynamic from the first call (one graph for every packed length: compile_blocks);
    # True: every size and module constant a symbol (torch.compile's dynamic=True); False: static, one graph per
    # bucketed length
    compile_dynamic: bool | None = None
    # Recompute each block's activations in the backward (less memory, one more forward of each block). Unset
    # (auto): on for models above 1B parameters, whose saved activations outgrow the rest (trainer.backend.memory).
    activation_checkpointing: bool | None = None
    param_dtype: str | None = None  # "float32" | "bfloat16" | None
    liger: bool = True  # Liger's RMSNorm / SwiGLU: CUDA only, in eager blocks only (compile = false)
    # The packed training attention (trainer.backend.attention): "auto" picks per device (packed_sdpa on the CPU;
    # flash-attn's varlen kernel on CUDA where it is installed and the compute dtype is half, FlexAttention
    # otherwise), or by name: packed_sdpa, flex_attention, flash_attention_2 / _3 (CUDA, flash-attn), sdpa or eager
    # (a dense mask: references, debugging)
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.param_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"param_dtype: expected None, 'float32' or 'bfloat16', got {self.param_dtype!r}")
        if self.activation_checkpointing not in (None, True, False):
            raise ValueError(f"activation_checkpointing: expected true, false or unset (auto: on above 1B "
                             f"parameters), got {self.activation_checkpointing!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention: expected one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}")
        if self.compile_backend not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"compile_backend: expected inductor, aot_eager or eager, got {self.compile_backend!r}")


class TrainModule(nn.Module):
    """FSDP root: runs `fn(lm)` inside the root's forward so the root group's parameters are unsharded there."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, fn: Callable[[nn.Module], Any]) -> Any:
        return fn(self.lm)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF causal LM (`model.model.layers`); a clear error for other layouts."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        arch = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"unsupported architecture {arch!r}: expected a decoder-only HF causal LM with its blocks "
                         f"at model.model.layers (Llama, Qwen2, Mistral, ... layouts)")
    return layers


def _module_globals(package: str) -> dict[str, dict[str, Any]]:
    """{module name: a copy of its globals} for `package` and its loaded submodules."""
    return {name: dict(vars(m)) for name, m in list(sys.modules.items())
            if m is not None and (name == package or name.startswith(package + "."))}


def _restore_globals(saved: dict[str, dict[str, Any]]) -> None:
    """Rebind every global that changed in the modules `saved` copied (names added since, such as a submodule
    imported meanwhile, stay: they replaced nothing)."""
    for name, before in saved.items():
        now = vars(sys.modules[name])
        for key, value in before.items():
            if now.get(key) is not value:
                now[key] = value


def apply_liger(model: nn.Module) -> bool:
    """Liger's RMSNorm / SwiGLU kernels on this instance's modules only (CUDA only). Returns whether applied.

    Liger's apply functions also rebind names in the architecture's transformers module (its RoPE function, its
    RMSNorm and MLP classes), which changes every model of that architecture in the process: the in-process
    engine's model (built before, possibly on the CPU) would run Triton RoPE on its tensors, and a model built
    after would get Liger's classes. So the module's globals are put back after the call: the instance keeps its
    norms and MLPs (Liger binds their forward per module), the rest of the process keeps transformers' code.
    RoPE stays transformers': it is a module-level function with no per-instance form, and the per-block compile
    fuses its elementwise ops anyway.
    """
    model_type = getattr(model.config, "model_type", None)
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        warnings.warn("liger-kernel is not installed: model kernels (RMSNorm/SwiGLU) stay eager", stacklevel=2)
        return False
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        warnings.warn(f"liger-kernel has no kernels for model_type={model_type!r}; using the HF modules",
                      stacklevel=2)
        return False
    # e.g. transformers.models.qwen2 for transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM
    saved = _module_globals(type(model).__module__.rpartition(".")[0])
    try:
        # The loss is ours (fused lm_head + policy loss), so Liger's cross-entropy patches stay off.
        fn(rope=False, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False,
           model=model)
    finally:
        _restore_globals(saved)
    return True


def uses_liger(device_type: str, config: ParallelConfig) -> bool:
    """Whether `parallelize` swaps in Liger's RMSNorm / SwiGLU: on CUDA, with [trainer] liger, in eager blocks only.

    Compiled blocks keep transformers' modules: inside an inductor-compiled block, torch 2.11 / triton 3.6 cannot
    trace Liger's RMSNorm kernel (identify_mutated_tensors fails on its `offset.to`), assumes every input mutated,
    and the H100 run's compiled SFT step died with an illegal memory access; with Liger off the same compiled step
    ran (bench/results/nvidia-h100.md). Inductor fuses the norms and SwiGLU itself there."""
    return device_type == "cuda" and config.liger and not config.compile


def apply_ac(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder block (keeps parameter names unchanged)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_blocks(model: nn.Module, config: ParallelConfig) -> None:
    """torch.compile each decoder block's forward in place (an attribute of the instance: state-dict keys do not
    change, and FSDP2's hooks run around it, uncompiled, as they would graph-break anyway); the blocks of a class
    share its graphs.

    compile_dynamic None (the default): the packed row's sizes are dynamic from the first call, duck sizing off.
    dynamo's own default compiles the first row length static, then again dynamic: two inductor compiles of the
    block's forward and backward, per grad mode and attention layout, where the static one serves only rows of
    that length (every later step runs the dynamic one). `dynamic=True` instead makes everything a symbol, module
    constants and FSDP's buffers included (4x the trace time on the CPU test). So each call marks the sizes of its
    tensor arguments dynamic (`_mark_dynamic`): the hidden states, position embeddings and packing indices, and a
    FlexAttention BlockMask's tables and the tensors its mask_mod reads; the ones that are really constant (the
    hidden size, the head dim) are specialised by the first op against a weight. Duck sizing would tie sizes that
    coincide at that call (a row of 2048 tokens and a hidden size of 2048, then traced as a constant).
    Left: a size of 1 specialises (a packed_sdpa row of one sequence is a batch of 1: it compiles once more).
    Marking that size dynamic under torch's backed_size_oblivious gave one graph under aot_eager, but inductor's
    compiled backward failed its stride check (bench/results/compile_counts-cpu-2core.json, tried_and_dropped).
    """
    for block in decoder_layers(model):
        compiled = torch.compile(block.forward, backend=config.compile_backend, dynamic=config.compile_dynamic)
        if config.compile_dynamic is None:
            compiled = _marking_dynamic(without_duck_sizing(compiled))
        compiled.compiled_block = True  # blocks_compiled
        block.forward = compiled


def blocks_compiled(model: nn.Module) -> bool:
    """Whether compile_blocks compiled any block of `model` (the packed attention inputs differ: see
    trainer.backend.attention.packed_attention_kwargs)."""
    return any(getattr(m.__dict__.get("forward"), "compiled_block", False) for m in model.modules())


def _marking_dynamic(compiled: Callable) -> Callable:
    def call(*args, **kwargs):
        for t in _tensors((args, kwargs)):
            _mark_dynamic(t)
        return compiled(*args, **kwargs)

    return call


# Tensors and BlockMasks already marked: a forward passes the same position embeddings, packing indices and mask to
# every block, so only the first block's call walks them (the marking is ~30 us a call otherwise)
_MARKED = WeakIdKeyDictionary()


def _mark_dynamic(t: torch.Tensor) -> None:
    """Every size > 1 of `t` (and of the tensor it views) dynamic at dynamo's next trace of it: a mark on the tensor,
    no trace, no copy."""
    if t in _MARKED:
        return
    for d, n in enumerate(t.shape):
        if n > 1:
            torch._dynamo.maybe_mark_dynamic(t, d)
    _MARKED[t] = True
    if t._base is not None:  # a view is traced as its base viewed
        _mark_dynamic(t._base)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """The tensors a block call receives: in tuples, lists, dicts, and a BlockMask (its tables and what its mask_mod
    closes over: the row's sequence ids or tree ends)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        yield from _tensors(tuple(x.values()))
    elif isinstance(x, BlockMask) and x not in _MARKED:
        _MARKED[x] = True
        yield from _tensors(tuple(vars(x).values()))
        yield from _tensors(tuple(c.cell_contents for c in getattr(x.mask_mod, "__closure__", None) or ()))


def compute_dtype(device_type: str, config: ParallelConfig) -> torch.dtype:
    """The dtype the blocks compute in: [trainer] param_dtype, default bfloat16 on CUDA and float32 on CPU."""
    return getattr(torch, config.param_dtype or ("bfloat16" if device_type == "cuda" else "float32"))


def mixed_precision(device_type: str, config: ParallelConfig) -> MixedPrecisionPolicy:
    """bf16 compute + fp32 gradient reduction on CUDA by default; plain fp32 on CPU."""
    if compute_dtype(device_type, config) == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(model: nn.Module, mesh: DeviceMesh, config: ParallelConfig) -> TrainModule:
    """Apply Liger (CUDA), AC, fully_shard per block, per-block compile, then fully_shard on the root; returns it.

    Works on a meta-device model (call `root.to_empty(device=...)` and load weights afterwards).
    """
    layers = decoder_layers(model)
    if uses_liger(mesh.device_type, config):
        apply_liger(model)
    if auto_activation_checkpointing(config.activation_checkpointing, sum(p.numel() for p in model.parameters())):
        apply_ac(model)
    mp = mixed_precision(mesh.device_type, config)
    n = len(layers)
    for i, block in enumerate(layers):
        # The last block's parameters are needed again at once by the backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    if config.compile:
        # After fully_shard, which gives each block a class of its own: transformers' activation checkpointing
        # wraps every subclass's forward and checkpoints only in the outermost wrapper, so a forward bound before
        # would run unchecked.
        compile_blocks(model, config)
    root = TrainModule(model)
    fully_shard(root, mesh=mesh, mp_policy=mp)
    return root
