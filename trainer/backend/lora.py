"""LoRA ([sft.lora] / [rl.lora]): PEFT's adapters injected into the Hugging Face model in place, a frozen base.

Why `peft.inject_adapter_in_model` and not `get_peft_model` / `LoraModel`: it replaces each targeted nn.Linear by
PEFT's `lora.Linear` (the original as `.base_layer`, the adapters as `.lora_A.default` [r, in] and
`.lora_B.default` [out, r]) and returns the same HF model object. So the blocks stay at `model.model.layers`
(trainer.backend.parallel.decoder_layers), per-block compile and FSDP2's per-block `fully_shard` apply unchanged,
`get_output_embeddings()` is still the lm_head, and the parameter names are PEFT's own (an adapter folder written
from them is what `PeftModel.from_pretrained` loads). A PeftModel/LoraModel wrapper would add two module levels
above the HF model that every one of those paths would have to look through.

    build:  meta model -> `inject` (+ freeze the base) -> parallelize -> to_empty -> `with_adapters(full sd)`
    train:  the fused kernels read the lm_head weight as before (never an adapter target: `train_unembed` makes
            the weight itself trainable instead, so the kernels see the trained matrix with no extra term)
    sync:   `merged_weight`: W + (alpha / r) B @ A under the plain HF name (engines and exports see a stock model)
    KL ref: `adapters_disabled`: the policy's own frozen base, no second copy of the model

FSDP2: the adapters live in their block's module tree, so `fully_shard(block)` shards them with the block (Shard(0)
like every parameter): the block's one all-gather brings base and adapters together and their gradients are
reduce-scattered with it. There is no separate replicated group to keep in sync, and frozen parameters (no .grad)
cost no reduce-scatter. The lm_head and embeddings stay in the root's group as in a full run.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from trainer.backend.parallel import decoder_layers, is_value_head

ADAPTER = "default"  # PEFT's adapter name: one adapter per trained model
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")
_BASE = ".base_layer."


def is_adapter(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's (A or B)."""
    return any(part in name for part in _ADAPTER_PARTS)


def hf_name(name: str) -> str:
    """The plain Hugging Face name of a base parameter: "...q_proj.base_layer.weight" -> "...q_proj.weight"."""
    return name.replace(_BASE, ".")


def block_linear_names(model: nn.Module) -> list[str]:
    """The names (last component) of the nn.Linear modules inside the decoder blocks: what target_modules may
    name. The lm_head, embeddings and a value head are outside the blocks and never adapter targets."""
    from peft.tuners.lora import LoraLayer

    inner = {"base_layer", "lora_A", "lora_B", "lora_dropout"}  # the parts of an injected layer, not targets
    names = set()
    for block in decoder_layers(model):
        names.update(n.rsplit(".", 1)[-1] for n, m in block.named_modules()
                     if isinstance(m, nn.Linear | LoraLayer) and not inner & set(n.split(".")))
    return sorted(names)


def resolve_targets(model: nn.Module, lora: Any, table: str = "lora") -> tuple[str, ...]:
    """The module names the adapters go on: every Linear of the blocks for "all-linear", else the list given,
    checked against the model (an error names the bad key and the modules the model has)."""
    have = block_linear_names(model)
    if lora.target_modules == "all-linear":
        return tuple(have)
    missing = [m for m in lora.target_modules if m not in have]
    if missing:
        hint = " (the lm_head is trained in full with train_unembed = true)" if "lm_head" in missing else ""
        raise ValueError(f"[{table}] target_modules: {missing} are not Linear modules of this model's decoder "
                         f"blocks; it has {have}, or use \"all-linear\"{hint}")
    return tuple(lora.target_modules)


def peft_config(lora: Any, targets: Iterable[str]) -> Any:
    """PEFT's LoraConfig: a regex on the blocks' module paths, so a name that also exists outside the blocks (a
    value head, the lm_head) never gets an adapter. PEFT's default init (A Kaiming-uniform, B zero) is
    reproduced from the run's seed by `adapter_init`."""
    import peft

    pattern = r"model\.layers\.\d+\.(?:.*\.)?(?:" + "|".join(re.escape(t) for t in targets) + ")"
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=pattern,
                           bias="none", init_lora_weights=True)


def inject(model: nn.Module, lora: Any, table: str = "lora") -> None:
    """Adapters into `model` in place (a meta-device model before parallelize, or a materialised one), then the
    base frozen (`freeze_base`)."""
    import peft

    config = peft_config(lora, resolve_targets(model, lora, table))
    meta = next(model.parameters()).device.type == "meta"
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    freeze_base(model, lora)


def freeze_base(model: nn.Module, lora: Any) -> None:
    """requires_grad only on the adapters, a value head (fresh: it must learn) and, with train_unembed, the lm_head
    weight (tied models: that is also the input embedding). FSDP2 keeps each flag when it shards the parameter."""
    unembed = model.get_output_embeddings().weight if lora.train_unembed else None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or is_value_head(name) or p is unembed)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module path: PEFT LoRA layer} of the model (paths of the HF model, no root prefix)."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_init(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh adapters (state-dict names of the HF model), float32: A [r, in] ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    kaiming_uniform_(a=sqrt(5))), B [out, r] = 0, so the first forward is the base model's.

    Each A draws from its own generator seeded by (seed, module path), so the values do not depend on the order of
    the modules, the world size or the device."""
    out = {}
    for path, layer in lora_layers(model).items():
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        out[f"{path}.lora_A.{ADAPTER}.weight"] = seeded_lora_a(a.shape, seed, path)
        out[f"{path}.lora_B.{ADAPTER}.weight"] = torch.zeros(b.shape)
    return out


def seeded_lora_a(shape: torch.Size, seed: int, path: str) -> torch.Tensor:
    """A fresh A [r, in] for the module at `path`, float32 U(-1/sqrt(in), 1/sqrt(in)), from a generator of its own
    seeded by (seed, path)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def with_adapters(sd: dict[str, torch.Tensor], model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A plain HF state dict (what a folder or a random init holds) under the injected model's names: the base
    tensors of adapted modules moved to ".base_layer.", the seeded adapters added (`adapter_init`)."""
    names = {hf_name(k): k for k in model.state_dict() if not is_adapter(k)}
    renamed = {names.get(k, k): v for k, v in sd.items()}
    dtype = next(iter(sd.values())).dtype
    return {**renamed, **{k: v.to(dtype) for k, v in adapter_init(model, seed).items()}}


# ---------------------------------------------------------------------------------------------------------
# Merged weights (weight sync, exports) and the adapter-free forward (the KL reference)
# ---------------------------------------------------------------------------------------------------------


def sync_weights(model: nn.Module) -> list[tuple[str, torch.Tensor, nn.Module | None]]:
    """(plain HF name, parameter, its LoRA layer or None) for every parameter an engine holds, in a fixed order:
    adapters left out, each adapted base weight paired with its layer (`merged_weight` folds the adapters in)."""
    named = list(model.named_parameters())
    layers = lora_layers(model) if any(is_adapter(n) for n, _ in named) else {}  # a full run never imports peft
    out = []
    for name, p in named:
        name = name.replace("_orig_mod.", "")
        if is_adapter(name):
            continue
        path, _, leaf = name.rpartition(".")
        layer = layers.get(path.removesuffix(".base_layer")) if path.endswith(".base_layer") and leaf == "weight" \
            else None
        out.append((hf_name(name), p, layer))
    return out


@torch.no_grad()
def merged_weight(weight: torch.Tensor, layer: nn.Module | None, dtype: torch.dtype) -> torch.Tensor:
    """The full [out, in] tensor an engine gets, in `dtype`: W + (alpha / r) B @ A for an adapted weight, W else.

    FSDP2 (DTensors): W [out, in] and B [out, r] are both Shard(0) over the same out dimension, so their local rows
    line up; only A [r, in] (small) is gathered, the merge runs on the local shard in float32, and the one full
    all-gather is of the merged shard in the sent dtype (the same bytes as a full run's sync). A collective: every
    rank calls it for the same weights in the same order."""
    from torch.distributed.tensor import DTensor

    def full_tensor(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    if layer is None:
        return full_tensor(weight.detach().to(dtype))
    a, b = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
    scale = float(layer.scaling[ADAPTER])
    if not isinstance(weight, DTensor):
        return (weight.float() + scale * (b.float() @ a.float())).to(dtype)
    assert weight.placements == b.placements, f"W {weight.placements} and B {b.placements}: not sharded alike"
    local = weight.to_local().float() + scale * (b.to_local().float() @ full_tensor(a).float())
    merged = DTensor.from_local(local.to(dtype), weight.device_mesh, weight.placements, shape=weight.shape,
                                stride=weight.stride(), run_check=False)
    return merged.full_tensor()


def merged_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain HF name, full merged tensor) for every engine-held weight: a stock model's state dict. Collective."""
    for name, p, layer in sync_weights(model):
        yield name, merged_weight(p, layer, dtype or p.dtype)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Forward passes of the base model alone (the KL reference): every LoRA layer returns base_layer(x).

    Sets PEFT's `_disable_adapters` flag directly: its public `enable_adapters(False)` also flips requires_grad of
    the adapters, which FSDP2 fixed when it built the unsharded parameters. A compiled block guards on the flag, so
    it compiles a second graph once (the adapter-free one) and reuses both after that. No-op on a model without
    adapters (a full run's reference copy)."""
    layers = list(lora_layers(model).values()) if is_lora(model) else []
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def is_lora(model: nn.Module) -> bool:
    """Whether the model carries LoRA adapters (any parameter named like one)."""
    return any(is_adapter(n) for n, _ in model.named_parameters())
