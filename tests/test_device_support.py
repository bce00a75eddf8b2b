"""Tests on a CUDA machine as on this one (issue 42 item 4): a CPU test's child processes see no GPU and keep the
environment they need to start (tests/device_support.py), and what tests leave alive in the pytest process is
released when the run ends (the root conftest's pytest_sessionfinish)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
