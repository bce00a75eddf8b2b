"""Rewards for the runs of tests/test_signals.py, loaded by name in a `python -m trainer` process (and its rollout
process) with tests/ on PYTHONPATH: `[data].reward = "signal_support:reward"`."""

from __future__ import annotations

import itertools
import os
import signal

# The reward call (1-based, counted in the process that scores) that sends SIGTERM; unset or 0: none.
SIGTERM_AT_ENV = "RLKERNELS_TEST_SIGTERM_AT"

_calls = itertools.count(1)


def reward(sample) -> float:
    """A dense reward (the fraction of response tokens with an odd id: a group's samples rarely all score the same,
    so every step trains). The call SIGTERM_AT_ENV names first sends SIGTERM to this process's whole process group,
    as Slurm's scancel and a Kubernetes pod deletion stop a job: the trainer, its rollout process and the engines it
    started. The test starts the run in a session of its own, so that the group is the run's alone."""
    if next(_calls) == int(os.environ.get(SIGTERM_AT_ENV, "0")):
        os.killpg(os.getpgid(0), signal.SIGTERM)
    response = sample.tokens[sample.prompt_length:]
    return sum(t % 2 for t in response) / max(len(response), 1)


def failing(sample) -> float:
    """A reward that fails on every sample: the first batch has nothing to train on (a run-time stop)."""
    raise ValueError("this reward fails on purpose")
