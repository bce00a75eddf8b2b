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
"""

from __future__ import annotations

import dataclasses
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
from trainer.config import RunConfig

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
    for buf_owner in model.modules():  # RoPE tables are buffers, not in the checkpoint: rebuild them
        if "Rotary" in type(buf_owner).__name__ and hasattr(buf_owner, "config"):
            fresh = type(buf_owner)(buf_owner.config)
            for name, buf in fresh.named_buffers(recurse=False):
                buf_owner._buffers[name] = buf


def export_checkpoint(checkpoint: str | os.PathLike, model_folder: str | os.PathLike, out: str | os.PathLike, *,
                      dtype: torch.dtype | None = None, told: str = "exporting checkpoint") -> Path:
    """Write the HF folder `out` from `checkpoint` (see resolve_checkpoint) with the architecture, tokenizer and
    generation config of `model_folder`, printing `told`, the checkpoint's folder and its step. dtype None keeps the
    training (float32) weights."""
    from trainer.backend.checkpoint import export_hf

    folder = Path(model_folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not a Hugging Face model folder (no config.json); it gives the "
                                f"checkpoint's architecture and tokenizer")
    ckpt, meta = _resolve(checkpoint)
    if "lora" in (meta.get("fingerprint_fields") or {}):
        raise ValueError(f"{ckpt}: a LoRA checkpoint ([sft.lora] / [rl.lora]) holds the adapters only, not a model; "
                         f"exporting one (merged into its base, or as a PEFT adapter folder) is not supported yet "
                         f"(issue 38, item 5): export the run's last full checkpoint, or use export_hf on the "
                         f"trained components in Python")
    model = _plain_model(folder)
    _fill(model, ckpt)
    print(f"{told} {ckpt} (step {meta['state']['step']})", flush=True)
    tokenizer = load_tokenizer(folder) if (folder / "tokenizer_config.json").is_file() else None
    root = TrainModule(model)
    path = export_hf(_Exportable(root=root, model=model), out, tokenizer=tokenizer, dtype=dtype)
    if (folder / "generation_config.json").is_file():
        shutil.copy(folder / "generation_config.json", Path(out) / "generation_config.json")
    return path


# ----------------------------------------------------------------------------------------------- run config
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_run(cfg: RunConfig, model_folder: str | os.PathLike, *, checkpoint: str | None = None,
               out: str | None = None, dtype: str | None = None) -> Path:
    """`python -m trainer export`: the run's newest checkpoint (RL if it has one, else SFT) or `checkpoint`, written
    to `out` (default <output_dir>/export) with the architecture and tokenizer of the run's model folder."""
    run_dir = Path(cfg.output_dir)
    if checkpoint is None:  # the last phase that saved anything: a damaged RL checkpoint never passes over to SFT's
        found = [run_dir / phase for phase in ("rl", "sft") if step_folders(run_dir / phase)]
        if not found:
            raise FileNotFoundError(f"{run_dir}: no checkpoint under rl/ or sft/ (run a phase first, or pass "
                                    f"--checkpoint)")
        checkpoint = str(found[0])
    return export_checkpoint(checkpoint, model_folder, Path(out or run_dir / "export"),
                             dtype=_DTYPES[dtype] if dtype else None)


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
