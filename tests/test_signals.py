"""How a run stops (issue 44, items 6, 9 and 10): SIGTERM, the signal Slurm, Kubernetes and torchrun stop a job
with, checkpoints like Ctrl-C and the resumed run equals an uninterrupted one; a run-time stop is one `error:` line
(its traceback only with RLKERNELS_DEBUG=1); the reward server caps request bodies and warns about samples past its
model's context; the one-process trainer's gloo port takes no connection.

The signal runs are real `python -m trainer rl` processes on a tiny preset (4 steps of 2 prompts x 2 samples), each
in a session of its own: the SIGTERM comes from the reward function at a chosen call and goes to the run's whole
process group (trainer, rollout process, engine), as a scheduler's does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import httpx
import pytest
from device_support import cpu_child_env
from signal_support import SIGTERM_AT_ENV, SIGTERM_IN_FORWARD_ENV
from test_nothing_lost import _logged_steps

from engines.protocol import EngineError, EngineUnavailableError
from engines.weight_sync.wire import WeightSyncError
from trainer.backend.checkpoint import CheckpointMismatch, CorruptCheckpointError
from trainer.cli import main, run_stop
from trainer.stops import DEBUG_ENV, RunStopped, Terminated, interrupts_held, sigterm_as_interrupt

ROOT = Path(__file__).resolve().parents[1]
NUM_STEPS = 4
SAMPLES_PER_STEP = 4  # rollout_batch_size 2 x n_samples_per_prompt 2

TINY = f"""
seed = 0
[model]
preset = "tiny"
arch = "llama"
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
[data]
train = "{ROOT}/data/arithmetic_train.jsonl"
reward = "signal_support:reward"
format = "plain"
[engines]
in_process = true
[rl]
num_steps = {NUM_STEPS}
token_budget = 256
micro_batch_buckets = 32
deterministic = true
[rl.optim]
lr = 1e-2
warmup_steps = 0
min_lr_ratio = 1.0
[rl.rollout]
rollout_batch_size = 2
n_samples_per_prompt = 2
max_new_tokens = 4
[trainer]
compile = false
[logging]
rollouts_every = 1
"""

# async: generation one step ahead, in a rollout process, from an embedded engine started as a server.
MODES = {"sync": (), "async": ("rl.async_rollout=true", "engines.in_process=false", "rl.rollout_worker=\"process\"")}


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def _cli(config: Path, out: Path, mode: str, *, sigterm_at: int = 0, sigterm_in_forward: int = 0,
         resume: bool = False) -> subprocess.CompletedProcess:
    """`python -m trainer rl` on the tiny config into `out`, in a session of its own (its process group is the
    run's alone, which the reward's SIGTERM goes to)."""
    sets = [f"output_dir=\"{out}\"", *MODES[mode]]
    cmd = [sys.executable, "-m", "trainer", "rl", "--config", str(config), *(a for s in sets for a in ("--set", s)),
           *(["--resume"] if resume else [])]
    env = cpu_child_env([str(ROOT / "tests")], **{SIGTERM_AT_ENV: str(sigterm_at),
                                                  SIGTERM_IN_FORWARD_ENV: str(sigterm_in_forward)})
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          start_new_session=True)


def _dumped(out: Path, step: int) -> list[tuple[str, float]]:
    """(prompt, reward) of each sample step `step` trained on, from its rollouts dump ([logging] rollouts_every)."""
    rows = [json.loads(line) for line in (out / "rl" / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    return [(r["prompt"], r["reward"]) for r in rows]


def _without_warning_reports(lines: list[str]) -> list[str]:
    """stderr lines without Python's warning reports: a "path:line: SomeWarning: message" line and the indented
    source line warnings prints under it."""
    out, skip = [], False
    for line in lines:
        if re.match(r"^\S.*:\d+: \w*Warning: ", line):
            skip = True
            continue
        if skip and line.startswith("  "):
            skip = False
            continue
        skip = False
        out.append(line)
    return out


def _metrics(out: Path) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, (out / "rl" / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_sigterm_mid_step_checkpoints_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, mode):
    """SIGTERM to the whole process group while the batch of step 3 is scored (the first reward call of step 3):
    exit 143 and one line naming the checkpoint, no traceback; `--resume` then trains the remaining steps on the
    uninterrupted run's prompts. Synchronous: the checkpoint is of step 2, and the rewards and the metrics of steps 3
    and 4 are the uninterrupted run's. Async (one step ahead, from a rollout process): batch 3 is generated while step
    2 trains, so the checkpoint is of step 1 or 2, and a resumed batch comes from other weights than the
    uninterrupted run's did: only the prompts can agree."""
    config = _config(tmp_path)
    full, cut = tmp_path / "full", tmp_path / "cut"
    ref = _cli(config, full, mode)
    assert ref.returncode == 0, ref.stderr[-3000:]

    stopped = _cli(config, cut, mode, sigterm_at=2 * SAMPLES_PER_STEP + 1)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    saved = sorted((cut / "rl" / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "state.json").is_file()
    done = int(saved[-1].name.removeprefix("step_"))
    assert done == 2 if mode == "sync" else done in (1, 2)
    # The line's end: a child's exit (the rollout process's) may print triton's nanobind leak report just before it,
    # and a Python warning report (its "file:line: ...Warning: ..." line and the source line under it) after it.
    lines = _without_warning_reports(stopped.stderr.splitlines())
    assert lines[-1].endswith(f"terminated (SIGTERM): a checkpoint was written at rl step {done} "
                              f"({saved[-1]}); continue with --resume"), stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert _logged_steps(cut / "rl") == list(range(1, done + 1))

    resumed = _cli(config, cut, mode, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _logged_steps(cut / "rl") == list(range(1, NUM_STEPS + 1))
    want, got = _metrics(full), _metrics(cut)
    for step in range(done + 1, NUM_STEPS + 1):
        ours, theirs = _dumped(cut, step), _dumped(full, step)
        assert [p for p, _ in ours] == [p for p, _ in theirs], f"step {step} trained on other prompts"
        if mode == "sync":
            assert ours == theirs
            assert got[step]["reward_mean"] == want[step]["reward_mean"]
            assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5)


def test_sigterm_inside_a_training_forward_waits_for_the_step_and_checkpoints_it_whole(tmp_path):
    """SIGTERM from inside step 2's training forward, where FSDP has the block's parameters swapped in (an interrupt
    there once made the CLI's Ctrl-C test of an async run die with a KeyError in torch's get_state_dict instead of
    writing its checkpoint): the step finishes, its row is logged, the checkpoint holds it (without the hold: step
    1's), exit 143 with no traceback; `--resume` then trains steps 3-4 as the uninterrupted run did."""
    config = _config(tmp_path)
    full, cut = tmp_path / "full", tmp_path / "cut"
    ref = _cli(config, full, "sync")
    assert ref.returncode == 0, ref.stderr[-3000:]
    stopped = _cli(config, cut, "sync", sigterm_in_forward=2)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    saved = sorted((cut / "rl" / "checkpoints").glob("step_*"))
    assert [p.name for p in saved][-1:] == ["step_00000002"]
    assert _logged_steps(cut / "rl") == [1, 2]
    resumed = _cli(config, cut, "sync", resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _metrics(full), _metrics(cut)
    for step in range(1, NUM_STEPS + 1):
        assert got[step]["reward_mean"] == want[step]["reward_mean"], step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5), step


def test_interrupts_held_arrive_when_the_block_ends_and_a_second_one_at_once():
    """Ctrl-C inside the block: the block runs to its end, then KeyboardInterrupt; SIGTERM under sigterm_as_interrupt
    likewise arrives as Terminated; `release` delivers earlier; a second signal while held stops the block at once.
    The handlers are restored in every case."""
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    finished = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        signal.raise_signal(signal.SIGINT)  # to this (the main) thread: held
        threading.Event().wait(0.05)
        finished.append("block")
    assert finished == ["block"]
    with pytest.raises(Terminated), sigterm_as_interrupt(), interrupts_held() as release:
        signal.raise_signal(signal.SIGTERM)
        finished.append("before release")
        release()
        finished.append("after release")  # not reached: release delivered it
    assert finished[-1] == "before release"
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the second: at once
        finished.append("not reached")
    assert finished[-1] == "before release"
    with interrupts_held():  # nothing held: nothing raised
        finished.append("quiet")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_an_engine_a_run_started_leaves_sigterm_and_ctrl_c_to_the_run(engine):
    """A scheduler's SIGTERM and a terminal's Ctrl-C reach the whole process group: an engine the trainer started
    (EngineProcess, as engines_for starts them) keeps serving through both (uvicorn would shut down within its 1 s
    grace), so the trainer checkpoints first and stops it after."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        engine.proc.send_signal(sig)
    with pytest.raises(subprocess.TimeoutExpired):
        engine.proc.wait(timeout=3)
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200


def test_only_the_first_sigterm_interrupts_and_the_handler_is_restored():
    """The second SIGTERM arrives while the first one's checkpoint is written: it must not break that off."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_as_interrupt() as terminated:
        try:
            signal.raise_signal(signal.SIGTERM)  # to this (the main) thread: its handler runs at once
            threading.Event().wait(10)
        finally:
            assert terminated.is_set()
            signal.raise_signal(signal.SIGTERM)  # ignored: no second Terminated from this finally
            threading.Event().wait(0.2)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_stop_line_names_the_checkpoint_written_else_the_newest_else_none(tmp_path):
    """A run stopped before its first checkpoint must not claim one: the line names a checkpoint written during the
    run (the newest, over the phases), else the newest from before (a resumed run), else says there is none."""
    from trainer.backend.checkpoint import stop_note

    def checkpoint(phase: str, step: int, mtime: float) -> Path:
        folder = tmp_path / phase / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        for name in (".metadata", "state.json"):  # what a complete checkpoint holds (is_complete)
            (folder / name).write_text("{}")
        os.utime(folder / "state.json", (mtime, mtime))
        return folder

    phases = [("sft", tmp_path / "sft"), ("rl", tmp_path / "rl")]
    assert stop_note(phases, since=100.0, terminated=True) == (
        "terminated (SIGTERM): no step had trained, so there is no checkpoint; start the run again")
    old = checkpoint("rl", 3, mtime=50.0)
    assert stop_note(phases, since=100.0, terminated=False) == (
        f"interrupted (Ctrl-C): no checkpoint was written in this session; the newest is rl step 3 ({old}): continue "
        f"from it with --resume")
    checkpoint("sft", 7, mtime=150.0)
    new = checkpoint("rl", 5, mtime=160.0)
    assert stop_note(phases, since=100.0, terminated=True) == (
        f"terminated (SIGTERM): a checkpoint was written at rl step 5 ({new}); continue with --resume")
    assert stop_note([], since=100.0, terminated=True) == (
        "terminated (SIGTERM): this mode keeps no checkpoint; run it again")


def test_a_run_time_stop_is_one_error_line_and_exit_1_with_its_traceback_under_the_debug_flag(tmp_path, capsys,
                                                                                              monkeypatch):
    """A resume whose config differs from the checkpoint's (one of the run-time stops): `error: <its message>` on
    one line, no traceback, exit status 1; with RLKERNELS_DEBUG=1 the exception itself propagates (Python prints its
    traceback)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # signal_support, the reward
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    out = tmp_path / "out"
    args = ["rl", "--config", str(_config(tmp_path)), "--set", f"output_dir=\"{out}\"", "--set", "rl.num_steps=1",
            "--set", "logging.rollouts_every=0"]
    assert main(args) == 0
    capsys.readouterr()
    ran = (out / "config.toml").read_bytes()
    changed = [*args, "--resume", "--set", "rl.optim.lr=0.5"]
    assert main(changed) == 1
    assert (out / "config.toml").read_bytes() == ran  # the refused config is not recorded as the run's (the probe)
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"error: {out}/rl/checkpoints/step_00000001: this run's config differs from the "
                                    f"checkpoint's in optim.lr (optim.lr was 0.01, now 0.5); resume with the "
                                    f"checkpoint's values (num_steps may change to extend a run, and output_dir/"
                                    f"keep_last/save_every/compile may change) or start a new run")
    assert "Traceback" not in err
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(CheckpointMismatch, match="differs from the checkpoint's in optim.lr"):
        main(changed)


def test_which_errors_are_run_time_stops():
    """Stops: the trainer's RunStopped (a changed config on resume among them), an engine's error, a failed weight
    sync, a damaged checkpoint, and an exception group holding only stops (trio's nurseries); not a bug."""
    stops = [RunStopped("x"), CheckpointMismatch("lr differs"), EngineUnavailableError("http://e: gone"),
             EngineError("http://e: 400", status=400), WeightSyncError("sync failed"), CorruptCheckpointError("bad")]
    for e in stops:
        assert run_stop(e) is e
    first = EngineUnavailableError("first")
    assert run_stop(BaseExceptionGroup("nursery", [BaseExceptionGroup("inner", [first]), WeightSyncError("b")])) \
        is first
    assert run_stop(ExceptionGroup("nursery", [first, KeyError("a bug")])) is None
    assert run_stop(KeyError("a bug")) is None and run_stop(ValueError("a bug")) is None


# ----------------------------------------------------------------------------------------------- reward server
def _app(score, **kw):
    from starlette.testclient import TestClient

    from trainer.rewards.server import build_app

    return TestClient(build_app(score, **kw))


def test_reward_server_refuses_a_body_over_its_limit_naming_it():
    """A declared Content-Length over the limit is refused before the body is read; a streamed body (no length) as
    soon as it passes the limit. Neither reaches the scoring, and a body within the limit is scored."""
    calls = []

    def score(prompts, completions, systems):
        calls.append(len(prompts))
        return [1.0] * len(prompts)

    with _app(score, max_body_bytes=1000) as client:
        big = json.dumps({"prompts": ["x" * 600], "completions": ["y" * 600]}).encode()
        resp = client.post("/score", content=big, headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        assert resp.json()["error"] == (f"a body of {len(big)} bytes is over this server's limit of 1000 bytes "
                                        f"(0.000953674 MiB, --max-body-mb); send fewer samples per request")
        streamed = client.post("/score", content=iter([big[:700], big[700:]]))  # chunked: no Content-Length
        assert streamed.status_code == 413
        assert streamed.json()["error"].startswith("a body of more than 1000 bytes is over this server's limit")
        assert calls == []
        ok = client.post("/score", json={"prompts": ["a"], "completions": ["b"]})
        assert ok.status_code == 200 and ok.json() == {"scores": [1.0]} and calls == [1]


def test_the_reward_client_cuts_a_batch_into_requests_under_the_limit():
    from trainer.rewards.server import request_bodies

    prompts, completions = [f"p{i}" * 50 for i in range(10)], [f"c{i}" * 50 for i in range(10)]
    bodies = request_bodies(prompts, completions, [None] * 10, limit=700)
    assert [len(b["prompts"]) for b in bodies] == [3, 3, 3, 1]  # a sample is 214 bytes of JSON: 3 fit in 700
    assert [p for b in bodies for p in b["prompts"]] == prompts
    assert [c for b in bodies for c in b["completions"]] == completions
    assert all(len(json.dumps(b)) <= 700 + 100 for b in bodies)
    assert request_bodies(["a"], ["b", "c"], [None], limit=700) == [
        {"prompts": ["a"], "completions": ["b", "c"], "systems": [None]}]  # the server says what is wrong


def test_reward_server_warns_once_about_samples_past_its_models_context():
    from engines.tiny import build_tokenizer
    from trainer.rewards.server import warn_past_context

    tok = build_tokenizer()
    scored = []
    score = warn_past_context(lambda p, c, s: scored.append(p) or [0.0] * len(p), tok, context=16, chat=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        score(["1+1="], ["2"], [None])  # within the context: no warning
        assert caught == []
        score(["1+1=", "9" * 40], ["2", "3"], [None, None])
        score(["9" * 40], ["3"], [None])  # warned once: not checked again
    assert len(caught) == 1
    assert str(caught[0].message).startswith("reward server: 1 of 2 samples of a request render to more tokens than "
                                             "the reward model's context (")
    assert "> 16, its max_position_embeddings)" in str(caught[0].message) and "--max-length 16" in str(
        caught[0].message)
    assert scored == [["1+1="], ["1+1=", "9" * 40], ["9" * 40]]  # every request is still scored


# ----------------------------------------------------------------------------------------------- the extra port
def test_the_one_process_trainers_gloo_port_takes_no_connection():
    """A one-process trainer's default group (gloo, world size 1) listens for peers that never come: nothing can
    connect (a connect times out, no descriptor is spent in the trainer), and the group still works."""
    script = """
import json, os, sys, torch, torch.distributed as dist
from trainer.backend.listeners import listening_sockets
from trainer.backend.steps import init_distributed
init_distributed("cpu")
import socket
ports = []
for inode, fd in listening_sockets().items():
    with socket.socket(fileno=os.dup(fd)) as s:
        ports.append(s.getsockname()[1])
print(json.dumps([ports, len(os.listdir("/proc/self/fd"))]), flush=True)
sys.stdin.readline()  # the test connects meanwhile
t = torch.ones(3); dist.all_reduce(t)
print(t.tolist(), len(os.listdir("/proc/self/fd")), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        ports, fds = json.loads(proc.stdout.readline())
        assert len(ports) == 1, ports  # gloo's, and nothing else
        for _ in range(3):
            with pytest.raises(TimeoutError):
                socket.create_connection(("127.0.0.1", ports[0]), timeout=1.0)
        with pytest.raises(httpx.ConnectTimeout):
            httpx.get(f"http://127.0.0.1:{ports[0]}/", timeout=1.0)
        out, err = proc.communicate("\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == f"[1.0, 1.0, 1.0] {fds}"
