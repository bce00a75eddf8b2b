"""Rewards for the runs of tests/test_signals.py, loaded by name in a `python -m trainer` process (and its rollout
process) with tests/ on PYTHONPATH: `[data].reward = "signal_support:reward"`."""

from __future__ import annotations

import itertools
import os
import signal

# The reward call (1-based, counted in the process that scores) that sends SIGTERM; unset or 0: none.
SIGTERM_AT_ENV = "RLKERNELS_TEST_SIGTERM_AT"
# The training forward (1-based: decoder-layer calls with grad enabled on the main thread) that sends SIGTERM from
# inside the layer, between FSDP's unshard and reshard of it; unset or 0: none.
SIGTERM_IN_FORWARD_ENV = "RLKERNELS_TEST_SIGTERM_IN_FORWARD"

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


def _sigterm_inside_a_training_forward(nth: int) -> None:
    """Patch the tiny model's decoder layer (Llama) so that its `nth` training call sends SIGTERM to this process
    before computing: the signal lands in the middle of a step, where FSDP has swapped the block's parameters."""
    import threading

    import torch
    from transformers.models.llama import modeling_llama

    layer_forward, calls = modeling_llama.LlamaDecoderLayer.forward, itertools.count(1)

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and threading.current_thread() is threading.main_thread() and next(calls) == nth:
            os.kill(os.getpid(), signal.SIGTERM)
        return layer_forward(self, *args, **kwargs)

    modeling_llama.LlamaDecoderLayer.forward = forward


if int(os.environ.get(SIGTERM_IN_FORWARD_ENV, "0")):  # this module is imported where the run loads its reward
    _sigterm_inside_a_training_forward(int(os.environ[SIGTERM_IN_FORWARD_ENV]))

