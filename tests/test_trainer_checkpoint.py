"""Checkpoints: kill-and-resume reproduces later steps exactly in a fresh process; incomplete checkpoints are
never picked; a changed config is refused; keep_last prunes."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.tiny import tiny_model_config
from kernels import use_backend
from trainer.backend.checkpoint import (
    Checkpointer,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from trainer.backend.steps import build_components, init_distributed
from trainer.types import TrainingState

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "trainer_worker.py"
sys.path.insert(0, str(WORKER.parent))
import trainer_worker as w  # noqa: E402
from device_support import cpu_child_env  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_path():
    """In-process training runs on the production CPU path (torch), not the Triton interpreter."""
    from kernels import use_backend

    with use_backend("torch"):
        yield


def test_kill_and_resume_reproduces_steps_exactly(tmp_path):
    out = tmp_path / "run"
    with use_backend("torch"):  # on the CPU, as the resuming process below is on every machine
        comp = build_components(tiny_model_config(), w.config(str(out), compile=False), mesh=init_distributed("cpu"))
        state, first = w.train_steps(comp, TrainingState(), range(2))
        save_checkpoint(comp, state, {"next_step": state.step})
        state, rest = w.train_steps(comp, state, range(2, 4))
    assert state.step == 4 and state.tokens_seen > 0
    # A fresh process resumes from the step-2 checkpoint and runs steps 3-4.
    subprocess.run([sys.executable, str(WORKER), "train", str(tmp_path / "r.pt"), str(out), "4", "2", "resume"],
                   check=True, timeout=240, env=cpu_child_env(), cwd=ROOT)
    resumed = torch.load(tmp_path / "r.pt")
    assert resumed["first_step"] == 2
    assert resumed["losses"] == rest, (resumed["losses"], rest)  # bit-exact
    assert rest[0] != first[1]


def test_incomplete_checkpoints_and_fingerprint(tmp_path):
    out = tmp_path / "run"
    cfg = w.config(str(out), compile=False)
    cfg = cfg.replace(keep_last=2)
    with use_backend("torch"):
        comp = build_components(tiny_model_config(), cfg)
        state = TrainingState()
        for _ in range(3):
            state, _ = w.train_steps(comp, state, range(state.step, state.step + 1))
            save_checkpoint(comp, state, {"next_step": state.step})
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002", "step_00000003"]  # keep_last=2
    newest = latest_checkpoint(out)
    # A crash mid-save: a later step folder without state.json and a leftover temporary folder.
    shutil.copytree(newest, newest.parent / "step_00000009")
    (newest.parent / "step_00000009" / "state.json").unlink()
    (newest.parent / ".tmp_step_00000010").mkdir()
    assert latest_checkpoint(out) == newest
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(comp, newest.parent / "step_00000009")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        load_checkpoint(comp, tmp_path / "elsewhere")
    state2, extra = load_checkpoint(comp, out)
    assert state2 == state and extra == {"next_step": 3}
    faster = dataclasses.replace(cfg.optim, lr=cfg.optim.lr * 2)
    other = dataclasses.replace(comp, config=cfg.replace(optim=faster))
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in optim\.lr \(optim\.lr was 0\.003, now "
                                         r"0\.006\)"):
        load_checkpoint(other, out)
    # output_dir / keep_last may change on resume
    same = dataclasses.replace(comp, config=cfg.replace(keep_last=5, output_dir=str(tmp_path / "x")))
    assert load_checkpoint(same, newest)[0] == state
    with pytest.raises(TypeError):
        save_checkpoint(comp, state, {"bad": object()})


def test_checkpointer_saves_on_schedule_at_the_end_and_on_ctrl_c(tmp_path):
    """The checkpointer both loops use: every save_every steps, when the loop ends, on Ctrl-C (bare, or wrapped in
    the exception group of a trio nursery, which leaves as a KeyboardInterrupt); never on another error."""
    out = tmp_path / "run"
    comp = build_components(tiny_model_config(), w.config(str(out), compile=False).replace(keep_last=9))
    assert load_latest(comp, out) == (TrainingState(), {})  # nothing to resume yet: a fresh start
    state, position = TrainingState(), 0
    ckpt = Checkpointer(comp, lambda: state, lambda: {"position": position}, save_every=2)
    with ckpt:
        for _ in range(3):
            state, _ = w.train_steps(comp, state, range(state.step, state.step + 1))
            position += 10
            ckpt.maybe_save()
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002", "step_00000003"]
    assert load_latest(comp, out) == (state, {"position": 30})
    for interrupt in (KeyboardInterrupt(), BaseExceptionGroup("nursery", [KeyboardInterrupt(), ValueError()])):
        with pytest.raises(KeyboardInterrupt), ckpt:
            state = dataclasses.replace(state, step=state.step + 1)
            raise interrupt
        assert latest_checkpoint(out).name == f"step_{state.step:08d}"
    with pytest.raises(ValueError), ckpt:
        state = dataclasses.replace(state, step=state.step + 1)
        raise ValueError("not an interrupt")
    assert latest_checkpoint(out).name == f"step_{state.step - 1:08d}"


class _RunsCode:
    """A pickled object whose loading runs code (here: creates a file), as a crafted rng_rank0.pt would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), float(np.random.rand()), float(np.random.standard_normal()), float(torch.rand(()))


def test_rng_states_resume_exactly_and_load_without_pickle(tmp_path):
    import random

    import numpy as np

    out = tmp_path / "run"
    comp = build_components(tiny_model_config(), w.config(str(out), compile=False))
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # numpy keeps a cached gaussian in its state: it must come back too
    state = save_checkpoint(comp, TrainingState(step=1), {})
    expected = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(comp, out)
    assert _draws() == expected
    rng_file = latest_checkpoint(out) / "rng_rank0.pt"
    assert set(torch.load(rng_file, weights_only=True)) >= {"torch", "python", "numpy"}  # no pickle needed
    # A crafted file is refused, naming it, and its code never runs.
    marker = tmp_path / "pwned"
    torch.save({"torch": _RunsCode(marker)}, rng_file)
    with pytest.raises(ValueError, match=f"{rng_file}: sha256 .* differs"):  # the checksum catches a plain swap
        load_checkpoint(comp, out)
    # A crafter who also rewrites the checksum in state.json: the file still never runs code.
    import hashlib
    import json

    meta_file = rng_file.parent / "state.json"
    meta = json.loads(meta_file.read_text())
    meta["sha256"]["rng_rank0.pt"] = hashlib.sha256(rng_file.read_bytes()).hexdigest()
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"{rng_file}: refused to load"):
        load_checkpoint(comp, out)
    assert not marker.exists()
    assert state.step == 1


def test_saving_a_step_again_never_leaves_it_without_a_complete_copy(tmp_path, monkeypatch):
    """Was: a second save of a step (Ctrl-C right after a periodic save, a finished phase resumed) removed the step's
    folder before it renamed the new one into place: a kill in between left no complete checkpoint, and the next
    --resume started from step 0. The same state is now not written again; another state of the same step number
    replaces the old copy only once it is in place."""
    import os

    out = tmp_path / "run"
    comp = build_components(tiny_model_config(), w.config(str(out), compile=False))
    state, _ = w.train_steps(comp, TrainingState(), range(2))
    save_checkpoint(comp, state, {"at": 1})
    folder = latest_checkpoint(out)
    written = (folder / "state.json").stat().st_mtime_ns
    replace = os.replace

    def killed(src, dst):  # what a kill between the removal and the rename would leave
        raise RuntimeError("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    save_checkpoint(comp, state, {"at": 2})  # the same step and state: nothing is rewritten
    assert (folder / "state.json").stat().st_mtime_ns == written and latest_checkpoint(out) == folder
    other = dataclasses.replace(state, tokens_seen=state.tokens_seen + 1)
    calls = []
    monkeypatch.setattr(os, "replace", lambda src, dst: (calls.append((Path(src).name, Path(dst).name)),
                                                         replace(src, dst))[1])
    save_checkpoint(comp, other, {"at": 3})
    assert calls[:2] == [(folder.name, f".old_{folder.name}"), (f".tmp_{folder.name}", folder.name)]
    assert load_checkpoint(comp, out)[0] == other and not list(out.glob("**/.old_*"))


def test_resume_may_extend_num_steps_and_names_any_other_difference(tmp_path):
    out = tmp_path / "run"
    cfg = w.config(str(out), compile=False)  # num_steps 6
    comp = build_components(tiny_model_config(), cfg)
    state, _ = w.train_steps(comp, TrainingState(), range(3))
    save_checkpoint(comp, state, {})
    longer = dataclasses.replace(comp, config=cfg.replace(num_steps=20))
    assert load_checkpoint(longer, out)[0] == state  # extending a run is allowed
    # The resumed step's learning rate is the longer schedule's (was: the old schedule's, for one step)
    from trainer.backend.steps import warmup_cosine

    extended = build_components(tiny_model_config(), cfg.replace(num_steps=20))
    load_checkpoint(extended, out)
    opt = cfg.optim
    want = opt.lr * warmup_cosine(3, warmup_steps=opt.warmup_steps, num_steps=20, min_lr_ratio=opt.min_lr_ratio)
    old = opt.lr * warmup_cosine(3, warmup_steps=opt.warmup_steps, num_steps=6, min_lr_ratio=opt.min_lr_ratio)
    assert abs(want - old) > 1e-4 * opt.lr
    assert extended.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
    assert extended.scheduler.get_last_lr()[0] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match=r"num_steps = 2 is below the checkpoint's step 3"):
        load_checkpoint(dataclasses.replace(comp, config=cfg.replace(num_steps=2)), out)
    other = dataclasses.replace(comp, config=cfg.replace(num_steps=20, token_budget=cfg.token_budget * 2))
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in token_budget \(token_budget was"):
        load_checkpoint(other, out)


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(tmp_path, capsys):
    """Bytes flipped in a shard of the newest checkpoint: its checksum (recorded at save time) fails; an explicit
    load names the file; a resume warns naming it, sets the checkpoint aside and resumes from the previous step
    with exactly the weights saved there."""
    import json
    import re

    from trainer.backend.checkpoint import CorruptCheckpointError

    out = tmp_path / "run"
    comp = build_components(tiny_model_config(), w.config(str(out), compile=False))
    state, saved = TrainingState(), {}
    for _ in range(2):
        state, _ = w.train_steps(comp, state, range(state.step, state.step + 1))
        save_checkpoint(comp, state, {"next_step": state.step})
        saved[state.step] = {k: v.clone() for k, v in w.full_params(comp).items()}  # not views of the live ones
    newest = out / "checkpoints" / "step_00000002"
    sums = json.loads((newest / "state.json").read_text())["sha256"]
    assert {".metadata", "__0_0.distcp", "rng_rank0.pt"} <= set(sums) and not list(newest.glob("sha256_rank*"))
    shard = newest / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])  # same size, other bytes
    shard.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpointError, match=re.escape(str(shard)) + ": sha256 .* differs"):
        load_checkpoint(comp, newest)  # a step named explicitly is verified, not replaced
    capsys.readouterr()
    fresh = build_components(tiny_model_config(), w.config(str(out), compile=False))
    resumed, extra = load_latest(fresh, out)
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged ({shard}: sha256" in err, err
    assert resumed.step == 1 and extra == {"next_step": 1}
    params = w.full_params(fresh)
    assert all(torch.equal(params[k], saved[1][k]) for k in saved[1])
    assert not all(torch.equal(params[k], saved[2][k]) for k in saved[2])
    # Set aside, not deleted: never picked again, never counted by keep_last.
    assert [p.name for p in list_checkpoints(out)] == ["step_00000001"]
    assert (out / "checkpoints" / "step_00000002.corrupt" / "__0_0.distcp").is_file()
    # An export of the damaged checkpoint is refused too, naming the file.
    from trainer.backend.export import load_checkpoint_weights

    aside = out / "checkpoints" / "step_00000002.corrupt"
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(aside / "__0_0.distcp"))):
        load_checkpoint_weights(fresh.model, aside)  # the checksums are checked before any tensor is read


def test_every_checkpoint_damaged_is_an_error_naming_them(tmp_path):
    from trainer.backend.checkpoint import CorruptCheckpointError

    out = tmp_path / "run"
    comp = build_components(tiny_model_config(), w.config(str(out), compile=False))
    state, _ = w.train_steps(comp, TrainingState(), range(1))
    save_checkpoint(comp, state, {})
    meta = out / "checkpoints" / "step_00000001" / "state.json"
    meta.write_text(meta.read_text()[:-20])  # cut short: not JSON any more
    with pytest.raises(CorruptCheckpointError, match=f"no intact checkpoint.*{meta}: unreadable"):
        load_latest(comp, out)
