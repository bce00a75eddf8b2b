"""SFT -> RL through files: a training checkpoint becomes a Hugging Face folder any loader (and our engines) reads.

    python -m trainer export --config configs/x.toml [--checkpoint runs/x/sft] [--out runs/x/export]

A checkpoint (trainer.backend.checkpoint: DCP shards of model + optimizer) holds weights but no architecture,
tokenizer or
chat template; those come from the run's model folder (`[model].path`, or the preset folder the run wrote). The
export loads only the model entries of the checkpoint into a plain CPU model of that architecture (no optimizer
state, no process group) and writes it with `trainer.backend.checkpoint.export_hf`: config.json, model.safetensors (a
tied
lm_head is stored once, as HF does), the tokenizer files with their chat template and special tokens, and the
generation config (its eos ids are the stop tokens of the next phase).

A LoRA checkpoint ([sft.lora] / [rl.lora]) holds the adapters only (and a trained lm_head). Its base is what the
phase recorded in <phase dir>/lora_base.json when it started (`record_lora_base`): a model folder (the run's start
folder), or the run's SFT phase (sft+rl and demo: RL's adapters sit on the SFT result, itself a full checkpoint
or SFT adapters merged into their base). The export builds that base, injects the adapters (trainer.backend.lora)
and loads them, then writes the merged model (a stock folder), or with `adapter=True` (`--adapter`) a PEFT adapter
folder at --out whose base_model_name_or_path is the base, exported beside it as `<out>-base`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from engines.tokenizer import load_tokenizer
from trainer.backend.checkpoint import pick_checkpoint, step_folders, verify_checkpoint
from trainer.backend.parallel import ROOT_PREFIX, TrainModule
from trainer.backend.safe_dcp import load_dcp, read_dcp_metadata
from trainer.config import LoRAConfig, RunConfig

_MODEL = "model."  # the checkpoint's top-level key of the model entries ({"model": ..., "optim": ...})


@dataclasses.dataclass(frozen=True)
class _Exportable:
    """What export_hf reads of a TrainingComponents: the root whose state dict it gathers and the HF model."""

    root: nn.Module
    model: nn.Module


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A verified step folder, given itself or as an output_dir / checkpoints folder (its newest intact one: each
    damaged newer one is skipped with a warning naming it, see trainer.backend.checkpoint.pick_checkpoint)."""
    return _resolve(path)[0]


def check_checkpoint_exists(path: str | os.PathLike) -> Path:
    """`path` as a Path when it exists; the error naming it and what to give otherwise. The CLI's preflight checks
    [model] checkpoint with this before any work: verifying a checkpoint reads every shard, which the load does."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p}: does not exist (give a step_NNNNNNNN folder or a phase's "
                                f"output_dir such as runs/<name>/sft)")
    return p


def _resolve(path: str | os.PathLike) -> tuple[Path, dict]:
    return pick_checkpoint(check_checkpoint_exists(path))


def _plain_model(model_folder: Path) -> nn.Module:
    """The folder's architecture on the CPU in float32, weights uninitialised (the checkpoint fills them)."""
    config = AutoConfig.from_pretrained(model_folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu").float()
    model.tie_weights()  # to_empty gives tied parameters separate storage; one Parameter again
    _rebuild_rotary(model)
    return model


def load_checkpoint_weights(model: nn.Module, checkpoint: Path) -> None:
    """Fill `model` (a plain HF model) from the model entries of a DCP checkpoint, after checking its files against
    the checksums recorded when it was written (a damaged shard is an error naming it, never a silently wrong
    export); names every missing tensor."""
    verify_checkpoint(checkpoint)
    _fill(model, checkpoint)


def _fill(model: nn.Module, checkpoint: Path) -> None:
    """load_checkpoint_weights of a checkpoint verify_checkpoint passed. Its metadata and entries are read through
    trainer.backend.safe_dcp: a crafted pickle runs nothing."""
    saved = read_dcp_metadata(checkpoint / ".metadata").state_dict_metadata
    names = {k.removeprefix(_MODEL + ROOT_PREFIX) for k in saved if k.startswith(_MODEL + ROOT_PREFIX)}
    params = dict(model.named_parameters())  # a tied lm_head appears once, under its embedding's name
    missing = sorted(set(params) - names)
    if missing:
        raise ValueError(f"checkpoint {checkpoint}: no weights for {missing[:5]}{'...' if len(missing) > 5 else ''}"
                         f" of the {model.config.model_type} model; export with the run config the checkpoint was "
                         f"trained with ([model] must be the same architecture)")
    target = {_MODEL[:-1]: {ROOT_PREFIX + n: p.data for n, p in params.items()}}
    with warnings.catch_warnings():  # no_dist: this read is one process's, whatever the process group says
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_dcp(target, checkpoint, no_dist=True)
    _rebuild_rotary(model)


def _rebuild_rotary(model: nn.Module) -> None:
    """RoPE tables are buffers, in no checkpoint and garbage after to_empty: rebuilt from the config."""
    for buf_owner in model.modules():
        if "Rotary" in type(buf_owner).__name__ and hasattr(buf_owner, "config"):
            fresh = type(buf_owner)(buf_owner.config)
            for name, buf in fresh.named_buffers(recurse=False):
                buf_owner._buffers[name] = buf


def export_checkpoint(checkpoint: str | os.PathLike, model_folder: str | os.PathLike, out: str | os.PathLike, *,
                      dtype: torch.dtype | None = None, told: str = "exporting checkpoint") -> Path:
    """Write the HF folder `out` from `checkpoint` (see resolve_checkpoint) with the architecture, tokenizer and
    generation config of `model_folder`, printing `told`, the checkpoint's folder and its step. dtype None keeps the
    training (float32) weights."""
    folder = Path(model_folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a Hugging Face model folder (no config.json); it gives the "
                                f"checkpoint's architecture and tokenizer")
    ckpt, meta = _resolve(checkpoint)
    model = checkpoint_model(ckpt, meta, folder)
    print(f"{told} {ckpt} (step {meta['state']['step']})", flush=True)
    return _write_hf(model, folder, out, dtype)


def _write_hf(model: nn.Module, folder: Path, out: str | os.PathLike, dtype: torch.dtype | None) -> Path:
    """`model` (plain, or with LoRA adapters: merged) as an HF folder at `out`, with `folder`'s tokenizer and
    generation config."""
    from trainer.backend.checkpoint import export_hf

    tokenizer = load_tokenizer(folder) if (folder / "tokenizer_config.json").is_file() else None
    path = export_hf(_Exportable(root=TrainModule(model), model=model), out, tokenizer=tokenizer, dtype=dtype)
    if (folder / "generation_config.json").is_file():
        shutil.copy(folder / "generation_config.json", Path(out) / "generation_config.json")
    return path


def checkpoint_lora(meta: dict) -> LoRAConfig | None:
    """The LoRA settings a checkpoint was trained with (its fingerprint's), None for a full checkpoint."""
    fields = (meta.get("fingerprint_fields") or {}).get("lora")
    return LoRAConfig(**fields) if fields else None


def checkpoint_model(ckpt: Path, meta: dict, model_folder: Path) -> nn.Module:
    """The CPU float32 model a verified checkpoint holds, with `model_folder`'s architecture: its weights, or for a
    LoRA checkpoint its base (`lora_base_model`) with the adapters injected and loaded (export_hf merges them)."""
    lora = checkpoint_lora(meta)
    if lora is None:
        model = _plain_model(model_folder)
        _fill(model, ckpt)
        return model
    from trainer.backend.lora import inject, is_adapter

    model = lora_base_model(ckpt, model_folder)
    inject(model, lora)
    saved = read_dcp_metadata(ckpt / ".metadata").state_dict_metadata
    names = {k.removeprefix(_MODEL + ROOT_PREFIX) for k in saved if k.startswith(_MODEL + ROOT_PREFIX)}
    params = {n: p for n, p in model.named_parameters() if n in names}
    missing = sorted(n for n, _ in model.named_parameters() if is_adapter(n) and n not in names)
    if missing:
        raise ValueError(f"checkpoint {ckpt}: no adapter weights for {missing[:3]}; its [lora] settings name "
                         f"modules the checkpoint lacks (export with the run config it was trained with)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_dcp({_MODEL[:-1]: {ROOT_PREFIX + n: p.data for n, p in params.items()}}, ckpt, no_dist=True)
    return model


# <phase dir>/LORA_BASE: {"base": "folder", "path": the HF folder} or {"base": "sft", "path": the SFT phase's dir}
LORA_BASE = "lora_base.json"


def record_lora_base(phase_dir: str | os.PathLike, *, folder: str | os.PathLike | None = None,
                     sft_dir: str | os.PathLike | None = None) -> None:
    """What a LoRA phase's adapters sit on, written when it starts (rank 0): a model folder, or the run's SFT phase
    (its newest checkpoint, when RL continues from SFT in memory). The export reads it (`lora_base_model`)."""
    assert (folder is None) != (sft_dir is None), "give the base folder or the SFT phase's dir"
    record = {"base": "folder", "path": str(Path(folder).resolve())} if folder is not None else \
        {"base": "sft", "path": str(Path(sft_dir).resolve())}
    Path(phase_dir).mkdir(parents=True, exist_ok=True)
    (Path(phase_dir) / LORA_BASE).write_text(json.dumps(record) + "\n")


def lora_base_model(ckpt: Path, model_folder: Path) -> nn.Module:
    """The base a LoRA checkpoint's adapters were trained on, as a plain CPU float32 model: the folder its phase
    recorded, or the newest checkpoint of the SFT phase it continued from (itself exported as checkpoint_model)."""
    record_path = ckpt.parent.parent / LORA_BASE  # <phase dir>/checkpoints/step_N
    if not record_path.is_file():
        raise FileNotFoundError(f"{record_path}: missing; a LoRA phase records there, when it starts through the "
                                f"CLI, the base its adapters sit on (a checkpoint saved from Python, or by an older "
                                f"tree, has none): write it with trainer.backend.export.record_lora_base(phase_dir, "
                                f"folder=<the base's HF folder>), or export the trained components in Python "
                                f"(export_hf, export_adapter)")
    record = json.loads(record_path.read_text())
    if record.get("base") == "sft":
        sft, sft_meta = _resolve(record["path"])
        return _merged(checkpoint_model(sft, sft_meta, model_folder), model_folder)
    return AutoModelForCausalLM.from_pretrained(record["path"], dtype=torch.float32).eval()


def _merged(model: nn.Module, model_folder: Path) -> nn.Module:
    """A plain model of the weights `model` stands for: its LoRA adapters merged in (as RL's base was built from
    SFT's components in memory); `model` itself when it has none."""
    from trainer.backend.lora import is_lora, merged_state_dict

    if not is_lora(model):
        return model
    plain = _plain_model(model_folder)
    merged = dict(merged_state_dict(model))
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(merged[name])
    return plain


# ----------------------------------------------------------------------------------------------- run config
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_run(cfg: RunConfig, model_folder: str | os.PathLike, *, checkpoint: str | None = None,
               out: str | None = None, dtype: str | None = None, adapter: bool = False) -> Path:
    """`python -m trainer export`: the run's newest checkpoint (RL if it has one, else SFT) or `checkpoint`, written
    to `out` (default <output_dir>/export) with the architecture and tokenizer of the run's model folder; a LoRA
    checkpoint with `adapter` (--adapter) as a PEFT adapter folder (`export_adapter_run`)."""
    run_dir = Path(cfg.output_dir)
    if checkpoint is None:  # the last phase that saved anything: a damaged RL checkpoint never passes over to SFT's
        found = [run_dir / phase for phase in ("rl", "sft") if step_folders(run_dir / phase)]
        if not found:
            raise FileNotFoundError(f"{run_dir}: no checkpoint under rl/ or sft/ (run a phase first, or pass "
                                    f"--checkpoint)")
        checkpoint = str(found[0])
    if adapter:
        return export_adapter_run(checkpoint, Path(model_folder), Path(out or run_dir / "export"),
                                  dtype=_DTYPES[dtype] if dtype else None)
    return export_checkpoint(checkpoint, model_folder, Path(out or run_dir / "export"),
                             dtype=_DTYPES[dtype] if dtype else None)


@dataclasses.dataclass(frozen=True)
class _AdapterSource:
    """What export_adapter reads of a TrainingComponents: the LoRA settings (config.lora) and the model."""

    config: Any
    model: nn.Module


def export_adapter_run(checkpoint: str | os.PathLike, model_folder: Path, out: Path, *,
                       dtype: torch.dtype | None = None) -> Path:
    """A LoRA checkpoint as a PEFT adapter folder at `out` (export_adapter, float32 adapters) on its base, written
    beside it as `<out>-base` (a stock HF folder in `dtype`, with the tokenizer; base_model_name_or_path names
    it), so PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out) loads it unchanged."""
    ckpt, meta = _resolve(checkpoint)
    lora = checkpoint_lora(meta)
    if lora is None:
        raise ValueError(f"--adapter: checkpoint {ckpt} trains no LoRA adapters (no [sft.lora] / [rl.lora]); export "
                         f"it without --adapter (the full model)")
    model = checkpoint_model(ckpt, meta, model_folder)
    print(f"exporting the adapters of {ckpt} (step {meta['state']['step']})", flush=True)
    from trainer.backend.lora import sync_weights

    base_dir = out.with_name(out.name + "-base")
    base = _plain_model(model_folder)
    with torch.no_grad():  # the base weights under their plain names: each adapted Linear's base_layer, unmerged
        held = {n: p for n, p, _ in sync_weights(model)}
        for name, p in base.named_parameters():
            p.copy_(held[name])
    _write_hf(base, model_folder, base_dir, dtype)
    tokenizer = load_tokenizer(model_folder) if (model_folder / "tokenizer_config.json").is_file() else None
    return export_adapter(_AdapterSource(config=_LoRAOnly(lora), model=model), out, base=str(base_dir.resolve()),
                          tokenizer=tokenizer)


@dataclasses.dataclass(frozen=True)
class _LoRAOnly:
    lora: LoRAConfig


def start_folder(cfg: RunConfig, model_folder: Path) -> Path:
    """The HF folder a run starts from: `model_folder`, or with [model].checkpoint set, that checkpoint exported
    once into <output_dir>/start_model (so the trainer and the engines load the same weights from one folder)."""
    ckpt = cfg.model.checkpoint
    if not ckpt:
        return model_folder
    return export_checkpoint(ckpt, model_folder, Path(cfg.output_dir) / "start_model",
                             told="loading [model] checkpoint")


# ----------------------------------------------------------------------------------------------- LoRA adapters
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def export_adapter(components: Any, out: str | os.PathLike, *, base: str, tokenizer: Any = None) -> Path | None:
    """A LoRA run's adapters as a PEFT adapter folder at `out` (adapter_config.json, adapter_model.safetensors, the
    tokenizer files when given), which `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)`
    loads unchanged: `base` is the folder of the weights the adapters were trained on (base_model_name_or_path).

    Tensor names are PEFT's saved ones: "base_model.model.<module>.lora_A.weight" (the adapter's name dropped);
    with train_unembed the trained lm_head weight goes in as PEFT's `modules_to_save` ("base_model.model.lm_head.
    weight"). Collective (every rank gathers its shards); rank 0 writes `<out>.tmp` and renames. Returns the path on
    rank 0, None elsewhere."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    from trainer.backend.checkpoint import _barrier, _rank, write_folder
    from trainer.backend.lora import is_adapter, peft_config, resolve_targets

    lora, lm = components.config.lora, components.model
    if lora is None:
        raise ValueError("export_adapter: this run trains no LoRA adapters (no [sft.lora] / [rl.lora]); export the "
                         "model with export_hf")
    tied = bool(getattr(lm.config, "tie_word_embeddings", False))
    if lora.train_unembed and tied:
        raise ValueError("export_adapter: train_unembed on a model with tied embeddings trained the input embedding "
                         "too, which a PEFT adapter folder cannot carry; export the merged model with export_hf")
    tensors = {}
    for name, p in lm.named_parameters():  # every rank, in the same order: full_tensor is a collective
        if is_adapter(name) or (lora.train_unembed and p is lm.get_output_embeddings().weight):
            full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
            key = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
            tensors["base_model.model." + key] = full.float().cpu().contiguous()
    if _rank() != 0:
        _barrier()
        return None
    config = peft_config(lora, resolve_targets(lm, lora))
    config.base_model_name_or_path = str(base)
    config.task_type = "CAUSAL_LM"
    if lora.train_unembed:
        config.modules_to_save = ["lm_head"]

    def fill(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / ADAPTER_FILES[1]), metadata={"format": "pt"})

    return write_folder(out, fill, tokenizer=tokenizer)
