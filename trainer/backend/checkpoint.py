"""Checkpoints: sharded model + optimizer (torch.distributed.checkpoint), JSON state, RNG, config fingerprint.

Layout of `<output_dir>/checkpoints/step_00000012/`:
    *.distcp, .metadata     DCP shards of {"model": ..., "optim": ...} (each rank writes its own shards), and of
                            {"critic_model": ..., "critic_optim": ...} for a run with a separate critic (PPO's value
                            model, trainer.backend.critic): saved and resumed with the policy, in the same step
    rng_rank{r}.pt          torch / CUDA / python / numpy RNG states of rank r, as tensors, numbers and lists only:
                            read with torch.load(weights_only=True), so a crafted file cannot run code
    state.json              TrainingState, the caller's `extra` (data position, ...), scheduler state,
                            config fingerprint, world size, the sha256 of every other file; written LAST

Everything is written into `.tmp_step_00000012/` and renamed when complete, so a crash mid-save leaves only a
hidden temporary folder that no listing sees. A step folder is therefore claimed complete, and `verify_checkpoint`
is the one check of that claim before anything of it is loaded: state.json and .metadata present, state.json JSON,
every file against its recorded sha256, the DCP metadata readable (through trainer.backend.safe_dcp's allow-list:
a crafted pickle runs nothing) and every shard it names present. A resume (`load_latest`) sets a newest checkpoint
that fails it aside (renamed `step_00000012.corrupt`), whatever the damage, with a warning naming the folder and
the bad file, and resumes from the previous intact one; a load of an output_dir (`pick_checkpoint`: export, replay,
`[model] checkpoint`) skips it with the same warning but leaves it in place (a reader does not rename a run's
files). Every load prints the folder and step it loaded. `export_hf` writes a consolidated Hugging Face folder
(config.json + model.safetensors [+ tokenizer]) that `load_hf_model` and the inference engines read.
`Checkpointer` is the schedule both training loops (RL, SFT) save on: every save_every steps, at the end, on Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from trainer.backend.parallel import ROOT_PREFIX
from trainer.backend.safe_dcp import CorruptCheckpointError, load_dcp, read_dcp_metadata, shard_names
from trainer.backend.steps import TrainingComponents, broadcast_from_rank0
from trainer.stops import RunStopped
from trainer.types import TrainingState

FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


# The files every save writes; state.json last, so a folder without it was never completely written.
_REQUIRED = (".metadata", "state.json")


def _first_missing(path: Path) -> str | None:
    return next((name for name in _REQUIRED if not (path / name).is_file()), None)


def is_complete(path: str | os.PathLike) -> bool:
    """A renamed step folder holding the files every save writes: the quick test a listing uses (no file is read);
    verify_checkpoint checks the same and the files' contents before anything is loaded."""
    p = Path(path)
    return bool(_STEP_RE.match(p.name)) and _first_missing(p) is None


def step_folders(output_dir: str | os.PathLike) -> list[Path]:
    """Every step_NNNNNNNN folder under output_dir, complete or not, oldest first: the folders a save renamed into
    place, each claimed complete (a damaged one is found by verify_checkpoint, not by leaving it out)."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under output_dir (is_complete), oldest first: what keep_last counts."""
    return [p for p in step_folders(output_dir) if is_complete(p)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint, or None (not verified: to load one, use pick_checkpoint or load_latest, which
    verify it and say which newer one they skipped)."""
    ckpts = list_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def _rng_state() -> dict[str, Any]:
    """This process's RNG states in types `torch.load(weights_only=True)` reads (tensors, numbers, strings, lists):
    no numpy array or tuple that would need a pickle to come back."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": [version, list(mt), gauss],
           "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def read_rng_file(path: Path) -> dict[str, Any]:
    """The RNG states of `path`, read without running any of its code: weights_only=True refuses every pickled
    object but tensors and plain containers (a crafted file, or one written by a version that pickled numpy
    arrays)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}: refused to load: it holds objects other than tensors and plain data (a crafted "
                         f"file, or an RNG file from an older version); delete it to resume without restoring the "
                         f"RNG states ({str(e).splitlines()[0]})") from e


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_own_checksums(folder: Path, rank: int) -> None:
    """The sha256 of the files this rank wrote (its DCP shards, named `__<rank>_<n>.distcp` by DCP's file system
    writer, and its RNG file) to `sha256_rank<rank>.json`: each rank hashes its own, in parallel."""
    own = [*folder.glob(f"__{rank}_*.distcp"), folder / f"rng_rank{rank}.pt"]
    (folder / f"sha256_rank{rank}.json").write_text(json.dumps({f.name: _sha256(f) for f in own}))


def _collect_checksums(folder: Path) -> dict[str, str]:
    """Rank 0, once every rank wrote its files and checksums: {file name: sha256} of every file of the checkpoint
    but state.json (the ranks' lists merged and removed; a file no rank claimed, .metadata included, hashed here)."""
    sums: dict[str, str] = {}
    for part in sorted(folder.glob("sha256_rank*.json")):
        sums.update(json.loads(part.read_text()))
        part.unlink()
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name != "state.json" and f.name not in sums:
            sums[f.name] = _sha256(f)
    return sums


def _sd_options(components: TrainingComponents) -> StateDictOptions:
    """A LoRA run ([sft.lora] / [rl.lora]) saves and loads only what trains (the adapters, a value head, the lm_head
    with train_unembed) and its optimizer state: the frozen base is the model folder's, rebuilt by every start. Its
    load is not strict (the frozen names are absent by design); the DCP load still fails on any trained tensor the
    checkpoint lacks."""
    lora = components.config.lora is not None
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _state_dicts(components: TrainingComponents, critic: TrainingComponents | None) -> dict[str, Any]:
    """The DCP state of a checkpoint: the model and optimizer of the policy, and of the critic when there is one."""
    model_sd, optim_sd = get_state_dict(components.root, components.optimizer, options=_sd_options(components))
    out = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        out["critic_model"], out["critic_optim"] = get_state_dict(critic.root, critic.optimizer,
                                                                  options=_sd_options(critic))
    return out


def save_checkpoint(components: TrainingComponents, state: TrainingState,
                    extra: dict[str, Any] | None = None, *, critic: TrainingComponents | None = None) -> TrainingState:
    """Write a complete checkpoint of step `state.step` (collective: every rank calls it); returns `state`.

    `extra` is JSON data the caller needs to resume (e.g. {"data_position": 96}). `critic`: a separate value
    model (trainer.backend.critic.build_critic), saved in the same step folder (its model, optimizer and
    schedule). Keeps the newest `config.keep_last` complete checkpoints.
    """
    cfg = components.config
    root = checkpoints_root(cfg.output_dir)
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp_step_{state.step:08d}"
    extra = dict(extra or {})
    json.dumps(extra)  # fail before writing anything when `extra` is not JSON data
    if _holds(final, state):  # this very step is saved already (Ctrl-C right after a periodic save, a finished
        return state          # phase resumed): rewriting it would only open a window without a complete copy
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_state_dicts(components, critic), checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _write_own_checksums(tmp, _rank())
    _barrier()
    if _rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "state": dataclasses.asdict(state),
            "extra": extra,
            "scheduler": components.scheduler.state_dict(),
            "fingerprint": cfg.fingerprint(),
            "fingerprint_fields": cfg.fingerprint_fields(),
            "world_size": components.world_size,
            "sha256": _collect_checksums(tmp),  # what a resume verifies before it loads anything
        }
        if critic is not None:
            meta["critic_scheduler"] = critic.scheduler.state_dict()
        (tmp / "state.json").write_text(json.dumps(meta, indent=1, default=repr))
        aside = final.with_name(f".old_{final.name}")
        if final.exists():  # another save of this step number (a run that went on differently): the old copy goes
            shutil.rmtree(aside, ignore_errors=True)  # only once the new one is in place
            os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        for old in list_checkpoints(cfg.output_dir)[:-cfg.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return state


def _follow_schedule(scheduler: Any) -> None:
    """The learning rates of this run's schedule at the restored step. The checkpoint holds the ones its run's
    schedule gave; a resume that extends num_steps has another schedule, which the optimizer would otherwise follow
    only from the next step on (the same schedule gives the same rates: nothing changes)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        lrs = [base * lam(scheduler.last_epoch) for base, lam in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs


def _holds(final: Path, state: TrainingState) -> bool:
    """Whether `final` is a complete checkpoint of exactly `state` (read on every rank: the same answer)."""
    try:
        meta = json.loads((final / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("state") == json.loads(json.dumps(dataclasses.asdict(state), default=repr))


# Fingerprinted settings a resume may change: a longer num_steps extends the run (the LR schedule then decays to
# the new end; the step the checkpoint stopped at is kept).
RESUMABLE_CHANGES = ("num_steps",)
# Fingerprinted since 2026-11-29: a checkpoint written before has no record of them, so they are compared only when
# it has one (any other field missing on one side is a difference: e.g. a LoRA run resumed without LoRA).
RECORDED_LATER = ("rl.advantage_estimator", "rl.ppo_epochs", "rl.n_samples_per_prompt")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}: the names a user sets them by."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (checkpoint's value, this run's value)} for the fingerprinted settings that differ, RESUMABLE_CHANGES
    left out."""
    a, b = _flat(saved), _flat(current)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in RESUMABLE_CHANGES and (k in a or k not in RECORDED_LATER)}


class CheckpointMismatch(RunStopped, ValueError):
    """A checkpoint this run cannot continue from as configured: a fingerprinted setting differs, num_steps is below
    its step, a critic on one side only, shards that do not fit this model. The message names the field and the fix;
    a ValueError as well, for callers that catch bad values."""


def _check_resumable(path: Path, meta: dict[str, Any], config: Any) -> None:
    """Refuse a resume that would silently change the run's math, naming each field that differs."""
    saved = meta.get("fingerprint_fields")
    if saved is None:  # written before the fields were stored: only the hash can be compared
        if meta["fingerprint"] != config.fingerprint():
            raise CheckpointMismatch(f"{path}: config fingerprint {meta['fingerprint']} differs from this run's "
                                     f"{config.fingerprint()} (the checkpoint predates per-field records, so the "
                                     f"field cannot be named); resume with the same TrainerConfig")
        return
    diff = config_differences(saved, config.fingerprint_fields())
    if diff:
        fields = "; ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in diff.items())
        raise CheckpointMismatch(f"{path}: this run's config differs from the checkpoint's in {', '.join(diff)} "
                                 f"({fields}); resume with the checkpoint's values (num_steps may change to extend a "
                                 f"run, and output_dir/keep_last/save_every/compile may change) or start a new run")
    step = meta["state"]["step"]
    if config.num_steps < step:
        raise CheckpointMismatch(f"{path}: num_steps = {config.num_steps} is below the checkpoint's step {step}; a "
                                 f"resume may extend a run, not shorten it: set num_steps >= {step}")


def _check_lora(path: Path, meta: dict[str, Any], config: Any) -> None:
    """A LoRA checkpoint (adapters only) resumed by a full run, or the reverse: named by the phase's LoRA table
    before the per-field comparison (which would list every LoRA key)."""
    saved = "lora" in (meta.get("fingerprint_fields") or {})
    if saved != (config.lora is not None):
        has, wants = ("LoRA adapters", "full fine-tuning") if saved else ("a full model", "LoRA")
        raise CheckpointMismatch(f"{path}: the checkpoint holds {has} but this run trains with {wants}; resume with "
                                 f"the checkpoint's [{config.lora_table}] table ({'set' if saved else 'remove'} it) "
                                 f"or start a new run")


def _read_meta(path: Path) -> dict[str, Any]:
    f = path / "state.json"
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{f}: unreadable ({type(e).__name__}: {e}); the checkpoint is damaged: "
                                     f"resume from an earlier one (pass the output_dir: the newest intact one is "
                                     f"used)") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict) \
            or not isinstance(meta["state"].get("step"), int):
        raise CorruptCheckpointError(f"{f}: no state.step in it; the checkpoint is damaged: resume from an earlier "
                                     f"one (pass the output_dir: the newest intact one is used)")
    named = _STEP_RE.match(path.name)  # state.json holds the checksums, so nothing else covers its own step
    if named and int(named.group(1)) != meta["state"]["step"]:
        raise CorruptCheckpointError(f"{f}: state.step = {meta['state']['step']} in the folder of step "
                                     f"{int(named.group(1))}; the checkpoint is damaged: resume from an earlier one "
                                     f"(pass the output_dir: the newest intact one is used)")
    return meta


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The one check of a checkpoint before anything of it is loaded; returns its state.json. Raises
    CorruptCheckpointError naming the first problem: state.json or .metadata missing (an interrupted save, or
    damage), state.json not JSON, a file missing or differing from the sha256 recorded when it was written, the DCP
    metadata unreadable or naming code to run (read through safe_dcp's allow-list, so nothing of it runs), or a shard
    it names missing (a checkpoint written before checksums were recorded is checked by this last test alone)."""
    p = Path(path)
    missing = _first_missing(p)
    if missing is not None:
        raise CorruptCheckpointError(f"{p}: not a complete checkpoint: {missing} is missing (an interrupted save, or "
                                     f"damage)")
    meta = _read_meta(p)
    sums = meta.get("sha256", {})  # none in a checkpoint written before checksums were recorded
    if not isinstance(sums, dict):
        raise CorruptCheckpointError(f"{p / 'state.json'}: its sha256 entry is not a table; the checkpoint is damaged")
    for name, want in sorted(sums.items()):
        f = p / name
        try:
            got = _sha256(f)
        except OSError as e:
            raise CorruptCheckpointError(f"{f}: unreadable ({type(e).__name__}: {e}); the checkpoint is "
                                         f"incomplete or damaged") from e
        if got != want:
            raise CorruptCheckpointError(f"{f}: sha256 {got[:16]}... differs from {want[:16]}..., recorded when the "
                                         f"checkpoint was written: the file changed or is damaged")
    absent = sorted(n for n in shard_names(read_dcp_metadata(p / ".metadata")) if not (p / n).is_file())
    if absent:
        raise CorruptCheckpointError(f"{p / absent[0]}: missing (named by {p / '.metadata'}); the checkpoint is "
                                     f"incomplete or damaged")
    return meta


def _agreed(pick: Callable[[], Path | None]) -> Path | None:
    """Rank 0 runs `pick` (it reads and verifies files, may set a checkpoint aside); every rank returns its choice
    or raises its error, of the same type (collective)."""
    found, error, corrupt = None, None, False
    if _rank() == 0:
        try:
            found = pick()
        except ValueError as e:  # CorruptCheckpointError included
            error, corrupt = str(e), isinstance(e, CorruptCheckpointError)
    found, error, corrupt = broadcast_from_rank0((None if found is None else str(found), error, corrupt))
    if error is not None:
        raise CorruptCheckpointError(error) if corrupt else ValueError(error)
    return None if found is None else Path(found)


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the step_NNNNNNNN namespace (kept for inspection, never loaded, never
    counted by keep_last, never overwritten by a later save of the same step)."""
    dest, k = path.with_name(f"{path.name}.corrupt"), 1
    while dest.exists():  # set aside before: keep both
        dest, k = path.with_name(f"{path.name}.corrupt{k}"), k + 1
    os.replace(path, dest)
    return dest


def _newest_intact(output_dir: str | os.PathLike, *, set_aside: bool) -> tuple[Path | None, str | None]:
    """(the newest step folder that passes verify_checkpoint, None), after a warning naming each newer one and
    what is wrong with it; `set_aside`: a resume, which owns the run's folder, also renames each one *.corrupt (a
    reader such as an export leaves it in place). (None, an error) when there are step folders but none verifies;
    (None, None) when there are none."""
    bad: list[str] = []
    for p in reversed(step_folders(output_dir)):
        try:
            verify_checkpoint(p)
            return p, None
        except CorruptCheckpointError as e:
            bad.append(str(e))
            if set_aside:
                print(f"warning: resume: checkpoint {p} is damaged ({e}); set aside as {_set_aside(p)}, resuming "
                      f"from the previous complete checkpoint", file=sys.stderr, flush=True)
            else:
                print(f"warning: checkpoint {p} is damaged ({e}); skipped (left in place), loading the previous "
                      f"complete checkpoint", file=sys.stderr, flush=True)
    if not bad:
        return None, None
    fix = ("each was set aside as *.corrupt; start a new run without --resume" if set_aside
           else "name an intact step folder, or start from another run")
    return None, f"no intact checkpoint under {checkpoints_root(output_dir)} ({fix}): {'; '.join(bad)}"


def pick_checkpoint(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The checkpoint `path` names, verified, with its state.json: a step folder itself (CorruptCheckpointError
    naming the problem when it fails verify_checkpoint), or the newest intact one of an output_dir or of its
    checkpoints folder, each damaged newer one skipped with a warning and left in place. Reads files only (rank 0's
    part of a load)."""
    p = Path(path)
    if _STEP_RE.match(p.name):
        return p, verify_checkpoint(p)
    output_dir = p.parent if p.name == "checkpoints" else p
    found, error = _newest_intact(output_dir, set_aside=False)
    if error is not None:
        raise CorruptCheckpointError(f"{p}: {error}")
    if found is None:
        raise ValueError(f"{p}: no complete checkpoint (step_NNNNNNNN with state.json) under "
                         f"{checkpoints_root(output_dir)}")
    return found, _read_meta(found)


def load_checkpoint(components: TrainingComponents, path: str | os.PathLike, *,
                    critic: TrainingComponents | None = None) -> tuple[TrainingState, dict]:
    """Restore model, optimizer, scheduler and RNG from `path` (a step folder, or an output_dir: its newest intact
    one, see pick_checkpoint); prints the folder and step it loaded.

    Returns (TrainingState, extra). Raises CorruptCheckpointError (a ValueError) naming the file when `path` is a
    step folder that fails verify_checkpoint (`load_latest` falls back to an earlier checkpoint instead), and
    ValueError when there is no checkpoint or when it was written with other settings of the run's math (a resume
    must not silently change the run), naming the fields; a larger num_steps is allowed (it extends the run).
    `critic`: the run's separate critic, restored from the same checkpoint (which must hold one). Collective.
    """
    p = _agreed(lambda: pick_checkpoint(path)[0])
    return _load_verified(components, p, critic, told="loading checkpoint")


def _load_verified(components: TrainingComponents, p: Path, critic: TrainingComponents | None = None, *,
                   told: str) -> tuple[TrainingState, dict]:
    """Load the checkpoint `p` (verify_checkpoint passed); rank 0 prints `told`, the folder and the step."""
    meta = _read_meta(p)
    if (critic is not None) != ("critic_scheduler" in meta):  # before the fingerprint: the one difference to name
        raise CheckpointMismatch(f"{p}: {'holds no critic' if critic is not None else 'holds a critic'} but this run "
                                 f"{'has one' if critic is not None else 'has none'}; resume with the checkpoint's "
                                 f"[rl] advantage_estimator and [rl.critic]")
    _check_lora(p, meta, components.config)
    _check_resumable(p, meta, components.config)
    sds = _state_dicts(components, critic)
    try:
        load_dcp(sds, p)
    except CorruptCheckpointError:
        raise
    except (CheckpointException, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        # Shards of another model (or damaged ones no checksum covers): say which folder.
        raise CheckpointMismatch(f"{p}: its model/optimizer shards did not load into this model "
                                 f"({type(e).__name__}: {e}); the files are damaged or the checkpoint is of another "
                                 f"model") from e
    set_state_dict(components.root, components.optimizer, model_state_dict=sds["model"], optim_state_dict=sds["optim"],
                   options=_sd_options(components))
    components.scheduler.load_state_dict(meta["scheduler"])
    _follow_schedule(components.scheduler)
    if critic is not None:
        set_state_dict(critic.root, critic.optimizer, model_state_dict=sds["critic_model"],
                       optim_state_dict=sds["critic_optim"], options=_sd_options(critic))
        critic.scheduler.load_state_dict(meta["critic_scheduler"])
        _follow_schedule(critic.scheduler)
    rng_file = p / f"rng_rank{_rank()}.pt"
    if meta["world_size"] == components.world_size and rng_file.is_file():
        _set_rng_state(read_rng_file(rng_file))
    state = TrainingState(**meta["state"])
    if _rank() == 0:
        print(f"{told} {p} (step {state.step})", flush=True)
    return state, meta["extra"]


def load_latest(components: TrainingComponents, output_dir: str | os.PathLike, *,
                critic: TrainingComponents | None = None) -> tuple[TrainingState, dict]:
    """Resume: the newest intact checkpoint under output_dir loaded into `components`, as (state, extra), printing
    the folder and step. A newer one that fails verify_checkpoint (a file missing, changed or unreadable, whatever
    it is) is set aside (renamed *.corrupt) with a warning naming the folder and the problem, and the previous
    complete one is loaded; an error when every checkpoint is damaged. A fresh (TrainingState(), {}) when there is
    none yet (the first run of a resumable job), with a warning: a user who asked to resume must see that nothing
    was resumed. Collective: rank 0 verifies, every rank loads its choice. `critic`: the run's separate critic,
    loaded from the same checkpoint."""
    def newest() -> Path | None:
        found, error = _newest_intact(output_dir, set_aside=True)
        if error is not None:
            raise CorruptCheckpointError(f"resume: {error}")
        return found

    found = _agreed(newest)
    if found is None:
        if _rank() == 0:
            print(f"warning: resume: no complete checkpoint under {checkpoints_root(output_dir)}; starting from "
                  f"step 0", file=sys.stderr, flush=True)
        return TrainingState(), {}
    return _load_verified(components, found, critic, told="resume: resuming from")


def is_interrupt(e: BaseException) -> bool:
    """Ctrl-C, bare or inside the exception group of a trio nursery that was running when it arrived."""
    if isinstance(e, KeyboardInterrupt):
        return True
    return isinstance(e, BaseExceptionGroup) and e.subgroup(KeyboardInterrupt) is not None


@dataclasses.dataclass(frozen=True)
class Checkpointer:
    """The checkpoint schedule of a training loop: `with Checkpointer(...) as ckpt:` around the loop, then
    `ckpt.maybe_save()` at the end of each step.

    Saves every `save_every` steps (`maybe_save`; 0: never on a schedule), when the loop ends, and on Ctrl-C (bare or
    wrapped in a trio exception group, which leaves as a plain KeyboardInterrupt), so that nothing is lost. Any
    other exception passes through unsaved: the caller decides (`save` writes one now). `state` and `extra` are
    read at save time: the loop's current TrainingState and the JSON data the rest of the run resumes from
    (data position, rollout state). Every rank must use it alike (saving is collective).
    """

    components: TrainingComponents
    state: Callable[[], TrainingState]
    extra: Callable[[], dict[str, Any]] = dict
    save_every: int = 0
    critic: TrainingComponents | None = None  # a separate critic, saved in the same checkpoints

    def save(self) -> None:
        save_checkpoint(self.components, self.state(), self.extra(), critic=self.critic)

    def maybe_save(self) -> None:
        if self.save_every and self.state().step % self.save_every == 0:
            self.save()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: Any) -> None:
        if error is None:
            self.save()
        elif is_interrupt(error):
            self.save()
            if not isinstance(error, KeyboardInterrupt):
                raise KeyboardInterrupt from error  # Ctrl-C inside trio arrives wrapped in an exception group


def export_hf(components: TrainingComponents, path: str | os.PathLike, *, tokenizer: Any = None,
              dtype: torch.dtype | None = None) -> Path | None:
    """Consolidated Hugging Face folder (config.json, model.safetensors, tokenizer if given) at `path`.

    Collective (every rank gathers its shards); rank 0 writes to `<path>.tmp` and renames. Returns the path on
    rank 0, None elsewhere.
    """
    from trainer.backend.lora import is_lora, merged_state_dict

    if is_lora(components.model):  # the merged weights under the plain names: a stock model folder

        full = {ROOT_PREFIX + k: v.cpu() for k, v in merged_state_dict(components.model)}
    else:
        full = get_model_state_dict(components.root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() != 0:
        _barrier()
        return None
    from trainer.backend.models import is_value_head

    lm = components.model
    # A value head (a policy with [rl.critic] kind = "head") is the trainer's: the exported LM is the stock model.
    sd = {k.removeprefix(ROOT_PREFIX): v for k, v in full.items() if not is_value_head(k)}
    if getattr(lm.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight; loaders re-tie
    sd = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in sd.items()}

    def fill(tmp: Path) -> None:
        lm.config.save_pretrained(tmp)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    return write_folder(path, fill, tokenizer=tokenizer)


def write_folder(path: str | os.PathLike, fill: Callable[[Path], None], *, tokenizer: Any = None) -> Path:
    """Rank 0 writes the folder `path` whole or not at all: `fill(tmp)` (and the tokenizer, if given) write into
    `<path>.tmp`, which then replaces `path`; every rank waits for it (its callers are collectives)."""
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    _barrier()
    return out


def checkpoint_note(output_dirs: Sequence[tuple[str, str | os.PathLike]], *, since: float) -> str:
    """What a stopped run tells its user about its checkpoints. output_dirs: (phase, output_dir) of the phases the
    run trains ("sft", "rl"); since: when it started (time.time()). Names the checkpoint written since then (the
    newest, when the run wrote several), else the newest from before (a resumed run stopped before its first
    checkpoint), else says there is none."""
    if not output_dirs:
        return "this mode keeps no checkpoint; run it again"
    found = []
    for phase, out in output_dirs:
        ckpt = latest_checkpoint(out)
        if ckpt is not None:
            found.append(((ckpt / "state.json").stat().st_mtime, phase, ckpt))  # state.json: written last
    if not found:
        return "no step had trained, so there is no checkpoint; start the run again"
    written, phase, ckpt = max(found)
    step = int(ckpt.name.removeprefix("step_"))
    if written >= since:
        return f"a checkpoint was written at {phase} step {step} ({ckpt}); continue with --resume"
    return (f"no checkpoint was written in this session; the newest is {phase} step {step} ({ckpt}): continue "
            f"from it with --resume")


def stop_note(output_dirs: Sequence[tuple[str, str | os.PathLike]], *, since: float, terminated: bool) -> str:
    """The line a run stopped by a signal prints: which signal, and its checkpoint (checkpoint_note)."""
    how = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
    return f"{how}: {checkpoint_note(output_dirs, since=since)}"
