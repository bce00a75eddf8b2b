"""The Python API examples run as a user runs them (a fresh process each, two steps), and do what they print."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path, *extra: str) -> str:
    # TRITON_INTERPRET=0: a user's environment, the production CPU path (the root conftest sets 1 for this process's
    # kernel tests, and a child would inherit it: the Triton interpreter, several times slower)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--steps", "2", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_custom_loop_trains_and_syncs_each_step(tmp_path):
    out = _run("custom_loop.py", tmp_path / "custom")
    steps = re.findall(r"step (\d+) reward=(\S+) loss=(\S+) grad_norm=(\S+) engine_weight_version=(\d+)", out)
    assert [int(s[0]) for s in steps] == [1, 2]
    assert [int(s[4]) for s in steps] == [1, 2]  # the engine serves the weights of the step just taken
    assert all(0.0 <= float(s[1]) <= 1.0 and math.isfinite(float(s[2])) and float(s[3]) >= 0 for s in steps)


def test_run_rl_example_writes_metrics_and_a_checkpoint(tmp_path):
    out = _run("run_rl.py", tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run/rl/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["weight_version"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and 0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert (tmp_path / "run/rl/checkpoints/step_00000002/state.json").is_file()
    assert "step 2 reward=" in out


def test_run_rl_example_with_an_environment_object_runs_episodes(tmp_path):
    """The Python API takes an environment object as the CLI takes a "module:factory" name."""
    out = _run("run_rl.py", tmp_path / "retry", "--episodes")
    rows = [json.loads(line) for line in (tmp_path / "retry/rl/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # A random model almost never answers right on the first try: most episodes take their second turn (a first
    # turn cut at max_new_tokens ends its episode, truncated, after one).
    assert all(1.0 <= r["rollout/turns_mean"] <= 2.0 and r["rollout/env_errors"] == 0 for r in rows)
    assert all(set(r) >= {"rollout/tool_calls_mean", "rollout/tool_errors", "rollout/env_time_s"} for r in rows)
    assert "turns=" in out
