"""Tests on a CUDA machine as on this one (issue 42 item 4): a CPU test's child processes see no GPU and keep the
environment they need to start (tests/device_support.py), and what tests leave alive in the pytest process is
released when the run ends (the root conftest's pytest_sessionfinish)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from device_support import cpu_child_env

ROOT = Path(__file__).resolve().parents[1]
CHILD = "import os, torch, carried; print(repr(os.environ['CUDA_VISIBLE_DEVICES']), torch.cuda.is_available())"


def test_a_cpu_tests_child_sees_no_gpu_and_keeps_what_it_needs_to_start(tmp_path, monkeypatch):
    """A GPU machine's environment: GPUs visible, packages carried on PYTHONPATH, CUDA's libraries on
    LD_LIBRARY_PATH. The child of a CPU test sees no GPU and still imports what was carried; this process's own
    environment is left as it was."""
    (tmp_path / "carried.py").write_text("")  # a package the GPU machine has on PYTHONPATH only
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/cuda/lib64")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under a torchrun: not the child's (trainer.cli would count it)
    env = cpu_child_env([str(ROOT)], HOME=str(tmp_path))
    assert "WORLD_SIZE" not in env
    assert (env["CUDA_VISIBLE_DEVICES"], env["TRITON_INTERPRET"], env["OMP_NUM_THREADS"]) == ("", "0", "1")
    assert env["PYTHONPATH"] == f"{ROOT}{os.pathsep}{tmp_path}" and env["HOME"] == str(tmp_path)
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64" and env["PATH"] == os.environ["PATH"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # only the child's copy changed

    child = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["''", "False"]
    # The environment these tests used to give their children: the carried package is gone.
    path_only = {"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", CHILD], env=path_only, capture_output=True, text=True, timeout=300)
    assert "No module named 'carried'" in child.stderr


def test_no_test_gives_a_child_an_environment_built_from_path_alone():
    """What test_cli, test_rank_failure and others did: a child given {"PATH": ...} loses PYTHONPATH (packages
    carried to a GPU machine), LD_LIBRARY_PATH and HOME, and still sees the GPUs. Children of CPU tests get
    device_support.cpu_child_env instead."""
    files = [p for p in sorted((ROOT / "tests").glob("*.py")) if p.name != Path(__file__).name]  # not the example
    offenders = [f"{p.name}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"\{\s*\"PATH\":", line)]
    assert not offenders, f"build these children's environments with device_support.cpu_child_env: {offenders}"


def test_the_end_of_the_run_releases_the_process_group_and_engine_threads(tmp_path):
    """A pytest run whose test leaves the default group and an in-process engine: by the time the interpreter
    exits (an atexit handler, after pytest returned), the group is destroyed and the engine's thread has stopped."""
    out = tmp_path / "left.json"
    env = {**os.environ, "SESSION_PROBE_OUT": str(out), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                           "tests/session_probe.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in proc.stdout and "releasing what the tests left" not in proc.stderr
    assert json.loads(out.read_text()) == {"process_group": False, "engine_threads": []}


def test_every_engine_a_cpu_test_starts_names_its_device():
    """An EngineProcess without a device runs on the GPU where there is one, in bf16: outside gpu-marked tests each
    names its device (the CPU, where the CPU tests' trainers and tolerances are)."""
    import ast

    unplaced = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for fn in [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]:
            if any("mark.gpu" in ast.unparse(d) for d in fn.decorator_list):
                continue
            for call in [c for c in ast.walk(fn) if isinstance(c, ast.Call)]:
                named = getattr(call.func, "id", getattr(call.func, "attr", None)) == "EngineProcess"
                placed = any(k.arg == "device" for k in call.keywords) or "--device" in [
                    c.value for c in ast.walk(call) if isinstance(c, ast.Constant)]
                if named and not placed:
                    unplaced.append(f"{path.name}:{call.lineno}")
    assert not unplaced, f"give these engines device=\"cpu\": {unplaced}"
