"""Damaged and crafted checkpoints (issue 44, items 5 and 8): every kind of damage of the newest checkpoint is set
aside with a warning naming the folder and the problem, and the resume loads the previous one, saying which; a
reader (export, `[model] checkpoint`) skips it the same way but leaves it in place; a crafted `.metadata` pickle
or optimizer entry runs nothing on export, resume or replay; a real checkpoint still round-trips through the
allow-list unpickler."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from transformers import AutoModelForCausalLM

from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.backend.checkpoint import (
    CorruptCheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from trainer.backend.export import export_checkpoint, export_run, start_folder
from trainer.backend.parallel import ROOT_PREFIX
from trainer.backend.safe_dcp import load_dcp, read_dcp_metadata
from trainer.backend.steps import build_components
from trainer.config import ModelConfig, RunConfig
from trainer.types import TrainingState

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_worker as w  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_path():
    """In-process training runs on the production CPU path (torch), not the Triton interpreter."""
    with use_backend("torch"):
        yield


class _RunsCode:
    """A pickled object whose loading runs code (here: creates `marker`), as a crafted checkpoint file would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _optim_state(comp) -> dict[str, torch.Tensor]:
    """{"<param>.<exp_avg|exp_avg_sq|step>": full tensor} of the optimizer, cloned (not views of the live state)."""
    sd = get_optimizer_state_dict(comp.root, comp.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {f"{p}.{k}": v.clone() for p, state in sd["state"].items() for k, v in state.items()}


@dataclasses.dataclass(frozen=True)
class _Template:
    folder: Path  # an HF folder of the tiny model (config.json + weights): the architecture export reads
    run: Path  # an output_dir with checkpoints of step 1 and step 2
    params: dict[int, dict[str, torch.Tensor]]  # step -> full parameters saved there
    optim: dict[int, dict[str, torch.Tensor]]  # step -> optimizer state saved there


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> _Template:
    """Built once: each test copies `run` and damages its copy."""
    root = tmp_path_factory.mktemp("template")
    folder = root / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_model_config()).save_pretrained(folder)
    run = root / "run"
    params, optim = {}, {}
    with use_backend("torch"):
        comp = build_components(str(folder), w.config(str(run), compile=False))
        state = TrainingState()
        for _ in range(2):
            state, _ = w.train_steps(comp, state, range(state.step, state.step + 1))
            save_checkpoint(comp, state, {"next_step": state.step})
            params[state.step] = {k: v.clone() for k, v in w.full_params(comp).items()}
            optim[state.step] = _optim_state(comp)
    return _Template(folder=folder, run=run, params=params, optim=optim)


def _copy_run(template: _Template, out: Path) -> Path:
    shutil.copytree(template.run, out)
    return out


def _fresh(template: _Template, out: Path):
    return build_components(str(template.folder), w.config(str(out), compile=False))


def _rewrite_checksum(ckpt: Path, name: str) -> None:
    """What a crafter does after changing `name`: record its new sha256, so the integrity check passes."""
    meta = json.loads((ckpt / "state.json").read_text())
    meta["sha256"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "state.json").write_text(json.dumps(meta))


def _flip_bytes(f: Path) -> None:
    data = bytearray(f.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # same size, other bytes
    f.write_bytes(bytes(data))


def _no_checksums_and_no_shard(ckpt: Path) -> None:
    """A checkpoint written before checksums were recorded, missing its shard: only the metadata can tell."""
    meta = json.loads((ckpt / "state.json").read_text())
    del meta["sha256"]
    (ckpt / "state.json").write_text(json.dumps(meta))
    (ckpt / "__0_0.distcp").unlink()


# kind of damage -> (how to do it to the newest checkpoint, the problem the warning must name)
def _set_step(ckpt: Path, step: int) -> None:
    """state.json naming another step than its folder's (the probe: step 7 inside step_00000003 went unnoticed)."""
    meta = json.loads((ckpt / "state.json").read_text())
    meta["state"]["step"] = step
    (ckpt / "state.json").write_text(json.dumps(meta))


DAMAGE = {
    "state.json missing": (lambda c: (c / "state.json").unlink(),
                           lambda c: f"{c}: not a complete checkpoint: state.json is missing"),
    ".metadata missing": (lambda c: (c / ".metadata").unlink(),
                          lambda c: f"{c}: not a complete checkpoint: .metadata is missing"),
    "shard missing": (lambda c: (c / "__0_0.distcp").unlink(),
                      lambda c: f"{c / '__0_0.distcp'}: unreadable (FileNotFoundError"),
    "shard changed": (lambda c: _flip_bytes(c / "__0_0.distcp"),
                      lambda c: f"{c / '__0_0.distcp'}: sha256 "),
    "state.json not JSON": (lambda c: (c / "state.json").write_text((c / "state.json").read_text()[:-20]),
                            lambda c: f"{c / 'state.json'}: unreadable (JSONDecodeError"),
    "state.json without a step": (lambda c: (c / "state.json").write_text("{}"),
                                  lambda c: f"{c / 'state.json'}: no state.step in it"),
    "state.json of another step": (lambda c: _set_step(c, 7),
                                   lambda c: f"{c / 'state.json'}: state.step = 7 in the folder of step 2"),
    "no checksums, shard missing": (_no_checksums_and_no_shard,
                                    lambda c: f"{c / '__0_0.distcp'}: missing (named by {c / '.metadata'})"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_every_kind_of_damage_is_set_aside_and_the_resume_loads_the_previous_one(template, tmp_path, capsys, kind):
    out = _copy_run(template, tmp_path / "run")
    newest, previous = out / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000001"
    damage, problem = DAMAGE[kind]
    damage(newest)
    comp = _fresh(template, out)
    capsys.readouterr()

    state, extra = load_latest(comp, out)

    printed = capsys.readouterr()
    assert f"warning: resume: checkpoint {newest} is damaged ({problem(newest)}" in printed.err, printed.err
    assert f"set aside as {newest}.corrupt, resuming from the previous complete checkpoint" in printed.err
    assert f"resume: resuming from {previous} (step 1)\n" in printed.out, printed.out
    assert state.step == 1 and extra == {"next_step": 1}
    params = w.full_params(comp)
    assert all(torch.equal(params[k], v) for k, v in template.params[1].items())
    assert [p.name for p in list_checkpoints(out)] == ["step_00000001"]
    aside = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert aside == ["step_00000001", "step_00000002.corrupt"]
    # The run goes on and saves step 2 again: the damaged one is kept for inspection, never overwritten.
    files = sorted(p.name for p in (out / "checkpoints" / "step_00000002.corrupt").iterdir())
    save_checkpoint(comp, dataclasses.replace(state, step=2), {"next_step": 2})
    assert sorted(p.name for p in (out / "checkpoints" / "step_00000002.corrupt").iterdir()) == files
    assert [p.name for p in list_checkpoints(out)] == ["step_00000001", "step_00000002"]


def test_readers_skip_a_damaged_newest_with_a_warning_leave_it_in_place_and_say_what_they_loaded(template, tmp_path,
                                                                                                 capsys):
    """`[model] checkpoint` and export of an output_dir whose newest checkpoint lost its state.json (once passed over
    without a word): a warning naming it, the folder and step loaded printed, the damaged folder left where it is
    (a reader does not rename a run's files); naming the damaged step folder itself is an error naming the file."""
    out = _copy_run(template, tmp_path / "sft")
    newest, previous = out / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000001"
    (newest / "state.json").unlink()
    capsys.readouterr()

    cfg = RunConfig(output_dir=str(tmp_path / "rl"), model=ModelConfig(path=str(template.folder), checkpoint=str(out)))
    start = start_folder(cfg, template.folder)

    printed = capsys.readouterr()
    assert (f"warning: checkpoint {newest} is damaged ({newest}: not a complete checkpoint: state.json is missing "
            f"(an interrupted save, or damage)); skipped (left in place), loading the previous complete checkpoint"
            ) in printed.err, printed.err
    assert f"loading [model] checkpoint {previous} (step 1)\n" in printed.out, printed.out
    assert start == tmp_path / "rl" / "start_model"
    exported = load_file(start / "model.safetensors")
    assert exported and all(torch.equal(v, template.params[1][ROOT_PREFIX + k]) for k, v in exported.items())
    assert newest.is_dir() and not (out / "checkpoints" / "step_00000002.corrupt").exists()

    # `python -m trainer export` of the run: the same warning, and what it exported.
    run_cfg = RunConfig(output_dir=str(tmp_path), model=ModelConfig(path=str(template.folder)))
    export_run(run_cfg, template.folder, out=str(tmp_path / "export"))
    printed = capsys.readouterr()
    assert f"warning: checkpoint {newest} is damaged" in printed.err
    assert f"exporting checkpoint {previous} (step 1)\n" in printed.out, printed.out
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{newest}: not a complete checkpoint: state.json "
                                                               f"is missing")):
        export_checkpoint(newest, template.folder, tmp_path / "x")


def _crafted_metadata(ckpt: Path, marker: Path) -> Path:
    """The checkpoint's real DCP metadata with a payload that runs code when unpickled (in a field DCP never
    checks), its checksum in state.json rewritten to match."""
    meta_file = ckpt / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())  # our own file, written by this test's fixture
    metadata.storage_meta.modules = [_RunsCode(marker)]
    meta_file.write_bytes(pickle.dumps(metadata))
    _rewrite_checksum(ckpt, ".metadata")
    return meta_file


def test_a_crafted_metadata_runs_nothing_on_export_replay_or_resume(template, tmp_path):
    from trainer.replay import replay

    out = _copy_run(template, tmp_path / "run")
    shutil.rmtree(out / "checkpoints" / "step_00000002")
    ckpt = out / "checkpoints" / "step_00000001"
    marker = tmp_path / "pwned"
    meta_file = _crafted_metadata(ckpt, marker)
    refused = re.escape(f"{meta_file}: refused to unpickle builtins.exec") + ".*nothing of it was run"

    with pytest.raises(CorruptCheckpointError, match=refused):  # python -m trainer export --checkpoint
        export_checkpoint(ckpt, template.folder, tmp_path / "export")
    assert not marker.exists() and not (tmp_path / "export").exists()

    cfg = RunConfig(output_dir=str(tmp_path / "replay_run"), model=ModelConfig(path=str(template.folder)))
    with pytest.raises(CorruptCheckpointError, match=refused):  # python -m trainer replay --checkpoint
        replay(cfg, template.folder, tmp_path / "rollouts", checkpoint=str(ckpt), tokenizer=build_tokenizer())
    assert not marker.exists()

    with pytest.raises(CorruptCheckpointError, match="resume: no intact checkpoint under .*" + refused):
        load_latest(_fresh(template, out), out)  # --resume
    assert not marker.exists()

    # The payload is real: DCP's own reader runs it.
    dcp.FileSystemReader(str(out / "checkpoints" / "step_00000001.corrupt")).read_metadata()
    assert marker.exists()


def test_a_crafted_optimizer_entry_in_a_shard_runs_nothing(tmp_path):
    """DCP stores non-tensor entries (an optimizer's param_groups) as pickles and reads them with
    torch.load(weights_only=False); load_dcp reads them with weights_only=True."""
    folder, marker = tmp_path / "ckpt", tmp_path / "pwned"
    dcp.save({"w": torch.arange(3.0), "lr": _RunsCode(marker), "betas": (0.9, 0.95)}, checkpoint_id=str(folder),
             no_dist=True)
    assert not marker.exists()

    target = {"w": torch.zeros(3), "lr": 0.0, "betas": None}
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{folder}: the entry lr holds objects other than "
                                                               f"tensors and plain data, refused and not run")):
        load_dcp(target, folder, no_dist=True)
    assert not marker.exists()

    dcp.load(target, checkpoint_id=str(folder), no_dist=True)  # the payload is real: DCP's own planner runs it
    assert marker.exists()


def test_a_real_checkpoint_round_trips_through_the_allow_list(template, tmp_path, capsys, monkeypatch):
    """Weights, optimizer state and step come back exactly, and the export holds the same weights, with DCP's own
    pickle.load of `.metadata` made to fail: the allow-list unpickler is what reads it."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    def no_pickle_load(*args, **kwargs):
        raise AssertionError("a checkpoint's .metadata was read with pickle.load")

    monkeypatch.setattr(dcp_filesystem.pickle, "load", no_pickle_load)
    out = _copy_run(template, tmp_path / "run")
    newest = out / "checkpoints" / "step_00000002"
    metadata = read_dcp_metadata(newest / ".metadata")
    assert set(template.params[2]) <= {k.removeprefix("model.") for k in metadata.state_dict_metadata}

    comp = _fresh(template, out)
    capsys.readouterr()
    state, extra = load_checkpoint(comp, newest)
    assert capsys.readouterr().out == f"loading checkpoint {newest} (step 2)\n"
    assert state.step == 2 and extra == {"next_step": 2}
    params = w.full_params(comp)
    assert params.keys() == template.params[2].keys()
    assert all(torch.equal(params[k], v) for k, v in template.params[2].items())
    optim = _optim_state(comp)
    assert optim.keys() == template.optim[2].keys() and len(optim) > 0
    assert all(torch.equal(optim[k], v) for k, v in template.optim[2].items())
    assert comp.optimizer.param_groups[0]["betas"] == w.config().optim.betas  # a non-tensor entry, read back

    exported = load_file(export_checkpoint(newest, template.folder, tmp_path / "export") / "model.safetensors")
    assert exported and all(torch.equal(v, template.params[2][ROOT_PREFIX + k]) for k, v in exported.items())
