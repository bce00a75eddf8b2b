"""Model construction: `load_hf_model` (meta build -> FSDP2 -> weights). The tiny preset lives in engines/tiny.py.

A value model (PPO's critic, trainer.backend.critic) is the same causal LM with one more module, `value_head`: a
Linear(H, 1) on the last hidden state (after the final norm), the one a sequence/token classifier puts there.
`load_hf_model(value_head=True)` adds it before sharding, so it lives in the FSDP root's group with the
embeddings and the lm_head (unsharded inside the root's forward, where the loss reads it), and gives it a fresh
seeded init whatever the folder holds. It is the trainer's only: weight sync and exports leave it out
(`is_value_head`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from trainer.backend.attention import default_attn_implementation
from trainer.backend.parallel import (  # noqa: F401  (is_value_head: where callers import it)
    ROOT_PREFIX,
    VALUE_HEAD,
    ParallelConfig,
    compute_dtype,
    decoder_layers,
    is_value_head,
    parallelize,
)


def has_value_head(model: nn.Module) -> bool:
    return isinstance(getattr(model, VALUE_HEAD, None), nn.Linear)


def _add_value_head(model: nn.Module) -> None:
    """A Linear(H, 1) with bias as `model.value_head`, on the device the model is on (meta while building)."""
    hidden = model.config.hidden_size
    device = next(model.parameters()).device
    setattr(model, VALUE_HEAD, nn.Linear(hidden, 1, bias=True, device=device))


def value_head_init(config: PretrainedConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A fresh value head's weights (state-dict names of the LM): weight ~ N(0, initializer_range²), bias 0.

    Small weights make the first values ~0 (the first advantages are then about the returns themselves) while
    the gradient w.r.t. the weight, Σ (V − R) h, is not 0: the head learns from step one. The initializer range is
    the architecture's (0.02 by default), what its sequence classifiers' heads get; seeded, so every rank and every
    world size builds the same head.
    """
    g = torch.Generator().manual_seed(seed + 7919)  # not the trunk's stream: adding a head changes no other weight
    std = float(getattr(config, "initializer_range", 0.02))
    weight = torch.randn(1, config.hidden_size, generator=g, dtype=torch.float64) * std
    return {f"{VALUE_HEAD}.weight": weight.to(dtype), f"{VALUE_HEAD}.bias": torch.zeros(1, dtype=dtype)}


def token_values(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[n] float32 values of hidden states [n, H] through the model's value head (read inside the FSDP root's
    forward, where its weights are unsharded). The head runs in float32 whatever the compute dtype: it is one dot
    product per token, and the regression target's scale is the reward's."""
    head = getattr(model, VALUE_HEAD)
    return torch.nn.functional.linear(hidden.float(), head.weight.float(), head.bias.float()).squeeze(-1)

# ---------------------------------------------------------------------------------------------------------
# Loading: meta-device build -> parallelise -> materialise -> load safetensors into the (sharded) model
# ---------------------------------------------------------------------------------------------------------


def _read_config(path_or_config: str | os.PathLike | PretrainedConfig) -> tuple[PretrainedConfig, Path | None]:
    if isinstance(path_or_config, PretrainedConfig):
        return path_or_config, None
    folder = Path(path_or_config)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a Hugging Face model folder (no config.json)")
    return AutoConfig.from_pretrained(folder), folder


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in folder.iterdir())
        raise FileNotFoundError(f"{folder}: no weights (*.safetensors) in the model folder; found {found}. Export "
                                f"one with trainer.backend.checkpoint.export_hf or "
                                 f"save_pretrained(safe_serialization=True)")
    return files


def _build_meta(config: PretrainedConfig, attn_implementation: str) -> nn.Module:
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    except (ValueError, KeyError) as e:
        raise ValueError(f"unsupported architecture {getattr(config, 'model_type', '?')!r} "
                         f"(architectures={getattr(config, 'architectures', None)}): AutoModelForCausalLM cannot "
                         f"build it: {e}") from e


def _full_state_dict(config: PretrainedConfig, folder: Path | None, model: nn.Module, seed: int,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The complete (unsharded) weights on the CPU: from the folder's safetensors, or a seeded random init; a
    value head (when the model has one) freshly initialised either way."""
    head = value_head_init(config, seed, dtype) if has_value_head(model) else {}
    if folder is None:
        # Random init, identical on every rank and every world size (built in full, then sharded).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            ref = AutoModelForCausalLM.from_config(config)
        return {**{k: v.to(dtype) for k, v in ref.state_dict().items()}, **head}
    sd: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(folder):
        sd.update({k: v.to(dtype) for k, v in load_file(str(f)).items()})
    sd.update(head)
    # A LoRA model (trainer.backend.lora) holds the folder's tensors under ".base_layer." names: compare plain ones.
    from trainer.backend.lora import hf_name, is_adapter

    expected = {hf_name(k) for k in model.state_dict() if not is_adapter(k)}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and "lm_head.weight" in expected and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd.get("model.embed_tokens.weight")
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not match the {config.model_type} architecture: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}")
    return sd


def check_model_folder(path: str | os.PathLike) -> None:
    """What load_hf_model refuses of a folder, found without reading a weight (the CLI's preflight, before a run
    removes or writes anything): no config.json, an architecture AutoModelForCausalLM cannot build on the meta
    device or whose blocks we cannot parallelise, no *.safetensors. The attention implementation is left at
    "eager": which one a run picks depends on its device, and every architecture builds with eager."""
    config, folder = _read_config(path)
    decoder_layers(_build_meta(config, "eager"))
    _safetensors_files(folder)


def _frozen_in_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """A LoRA model's frozen base held in the compute dtype (bf16 on CUDA) instead of fp32 masters: half the bytes
    of the largest part of a LoRA run (issue 38). Nothing changes numerically: mixed precision already casts every
    parameter to the compute dtype at all-gather, and a frozen weight has no optimizer update to lose precision in.
    The trained parameters (adapters, a value head, the lm_head with train_unembed) keep their fp32 masters."""
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)


def load_hf_model(path_or_config: str | os.PathLike | PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", mesh: DeviceMesh | None = None,
                  parallel: ParallelConfig | None = None, seed: int = 0, value_head: bool = False,
                  lora: Any = None, lora_table: str = "lora", trunk: bool = True) -> nn.Module:
    """Any HF causal LM from a local folder (safetensors) or from a config (seeded random weights).

    Without `mesh`: the plain HF model on `device` in `dtype` (for engines, exports and references).
    With `mesh`: built on the meta device, parallelised (`trainer.backend.parallel.parallelize`: Liger on CUDA, AC,
    per-block compile, FSDP2), materialised on `device`, and the full weights loaded into the shards; returns the
    FSDP root (`TrainModule`, the HF model is `.lm`). `dtype` is the storage (master) dtype of the parameters;
    compute may be bf16 through the mixed-precision policy. `value_head`: add a fresh value head (a critic's).
    `lora` (a trainer.config.LoRAConfig; `lora_table` names its table in errors): PEFT adapters injected before
    sharding, initialised from `seed`, the base frozen (trainer.backend.lora).
    `trunk=False`: the caller loads the model's weights itself (a copy of a model in memory: the KL reference, a
    critic from the policy); only what such a copy starts fresh (a value head, LoRA adapters) is initialised here,
    and the model is never built and random-initialised in full on the host (30 GB and minutes for a 7B, on every
    rank). The other tensors hold whatever memory they were given until the caller loads them.
    """
    config, folder = _read_config(path_or_config)
    device = torch.device(device)
    parallel = parallel or ParallelConfig()
    # The attention sees the compute dtype: `dtype` itself, or under a mesh the mixed-precision policy's (flash-attn
    # rejects fp32 inputs, so an fp32 run takes another path).
    impl = default_attn_implementation(device, dtype if mesh is None else compute_dtype(device.type, parallel),
                                       parallel.attention)
    model = _build_meta(config, impl)
    if value_head:
        _add_value_head(model)
    decoder_layers(model)  # fail early, with a clear message, on a layout we cannot parallelise
    if lora is not None:  # before parallelize: the adapters are sharded and compiled with their block
        from trainer.backend.lora import inject

        inject(model, lora, lora_table)
    if folder is not None:
        _safetensors_files(folder)  # a folder without weights fails before any work
    if mesh is None:
        model = model.to_empty(device=device).to(dtype)
        model.tie_weights()  # to_empty gives tied parameters separate storage; one Parameter again
        sd = (_lora_names(_full_state_dict(config, folder, model, seed, dtype), model, seed, lora) if trunk
              else _fresh_parts(config, model, seed, dtype))
        model.load_state_dict(sd, strict=trunk)
        _init_buffers(model, device)
        return model.eval()
    model.to(dtype)  # on the meta device: the shards materialise in the storage dtype (a bf16 frozen copy)
    if lora is not None:
        _frozen_in_compute_dtype(model, compute_dtype(device.type, parallel))
    root = parallelize(model, mesh, parallel)
    root.to_empty(device=device)
    sd = (_lora_names(_full_state_dict(config, folder, model, seed, dtype), model, seed, lora) if trunk
          else _fresh_parts(config, model, seed, dtype))
    # Each rank holds the full tensors on the CPU and keeps its own shard (distribute_tensor slices locally).
    if sd:
        set_model_state_dict(root, {ROOT_PREFIX + k: v for k, v in sd.items()},
                             options=StateDictOptions(full_state_dict=True, strict=trunk))
    _init_buffers(model, device)
    return root


def _fresh_parts(config: PretrainedConfig, model: nn.Module, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a copy of another model starts fresh (`load_hf_model(trunk=False)`): a value head and LoRA adapters,
    when the model has them, initialised as `_full_state_dict` and `with_adapters` would."""
    out = value_head_init(config, seed, dtype) if has_value_head(model) else {}
    from trainer.backend.lora import adapter_init, is_adapter

    if any(is_adapter(k) for k in model.state_dict()):
        out.update({k: v.to(dtype) for k, v in adapter_init(model, seed).items()})
    return out


def _lora_names(sd: dict[str, torch.Tensor], model: nn.Module, seed: int, lora: Any) -> dict[str, torch.Tensor]:
    """The plain weights under a LoRA model's names, with its seeded adapters (unchanged without LoRA)."""
    if lora is None:
        return sd
    from trainer.backend.lora import with_adapters

    return with_adapters(sd, model, seed)


def _init_buffers(model: nn.Module, device: torch.device) -> None:
    """to_empty leaves non-persistent buffers (RoPE inv_freq) uninitialised: rebuild the rotary modules' buffers.

    Rebuilding the module from its config (instead of calling a rope init function) stays correct across
    transformers versions, whose rope helpers change signature.
    """
    for module in model.modules():
        if "Rotary" in type(module).__name__ and hasattr(module, "config"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                module._buffers[name] = buf
            if hasattr(fresh, "attention_scaling"):
                module.attention_scaling = fresh.attention_scaling


def check_lora_targets(config: PretrainedConfig, lora: Any, table: str) -> None:
    """The preflight's check of [<table>] target_modules against a model config, on a meta-device build (no
    weights): the names trainer.backend.lora.resolve_targets would refuse at load time, refused before any work."""
    from trainer.backend.lora import resolve_targets

    resolve_targets(_build_meta(config, "eager"), lora, table)
