"""OpenMP pools handed between the trainer's thread and an in-process engine's model thread (kernels.device
.release_host_threads, engines/local.py borrow_cores, [engines] lend_cores): each side's worker threads exist only
while it computes, so libgomp never holds two pools on the same cores (where it stops spinning at its barriers).

The children count the process's threads (/proc/self/task): an OpenMP pool of 2 is the calling thread plus one
worker, so a pool that exists shows as one more thread than before it."""

import json
import subprocess
import sys

import pytest
from device_support import cpu_child_env

from trainer.cli import load_run_config
from trainer.run import lends_cores

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task: Linux only")

_RELEASE_CHILD = r"""
import json, os, torch
from kernels.device import release_host_threads
torch.set_num_threads(2)
n = lambda: len(os.listdir("/proc/self/task"))
x = torch.randn(256, 256)
before = n()
y = x @ x                                    # a pool of 2: one worker thread
with_pool = n()
released = release_host_threads()
after = n()
z = x @ x                                    # the next parallel op starts it again, and computes the same
print(json.dumps({"before": before, "with_pool": with_pool, "released": released, "after": after,
                  "again": n(), "same": bool(torch.equal(y, z))}))
"""

_ENGINE_CHILD = r"""
import asyncio, json, os, sys, torch, trio
from engines.local import LocalEngine
from engines.protocol import SamplingParams
torch.set_num_threads(2)
borrow = sys.argv[1] == "1"
n = lambda: len(os.listdir("/proc/self/task"))
eng = LocalEngine("tiny", seed=3, threads=2, borrow_cores=borrow)
on_model_thread = lambda fn: asyncio.run_coroutine_threadsafe(eng.server.on_model_thread(fn), eng._loop).result(60)
params = SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=5)
trio.run(eng.generate, [[1, 20, 21, 22]] * 8, params)  # warm: the engine's one-time threads exist from here on
base = n()
x = torch.randn(256, 256); x @ x            # the caller's pool of 2 (a train step's)
caller_pool = n()
out = trio.run(eng.generate, [[1, 20, 21, 22]] * 8, params)
after_generate = n()
on_model_thread(lambda: x @ x)              # the model thread's work (a decode step's size) through the server's path
after_model_work = n()
eng.server.model_thread.submit(lambda: x @ x).result(60)  # the same op around that path: its pool stays
raw = n()
on_model_thread(lambda: None)               # the next piece of work on the idle engine ends it
released_again = n()
eng.close()
print(json.dumps({"base": base, "caller_pool": caller_pool, "after_generate": after_generate,
                  "after_model_work": after_model_work, "raw": raw, "released_again": released_again,
                  "tokens": sum(len(c.output_ids) for g in out for c in g)}))
"""


def _child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], env=cpu_child_env(), check=True, capture_output=True,
                         text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_host_threads_ends_the_calling_threads_pool_and_the_next_op_starts_it_again():
    got = _child(_RELEASE_CHILD)
    assert got["released"] is True
    assert got["with_pool"] == got["before"] + 1, got  # the worker a pool of 2 adds
    assert got["after"] == got["before"], got  # gone after the release
    assert got["again"] == got["before"] + 1 and got["same"], got


@pytest.mark.parametrize("borrow", [True, False])
def test_an_engine_borrowing_the_callers_cores_leaves_no_pool_behind(borrow):
    """With borrow_cores, a generate call releases the caller's pool; without it the caller's pool stays. Either
    way the model thread (2 threads) releases its own whenever its work leaves the engine idle (the server's rule),
    which the same op submitted around that path does not."""
    got = _child(_ENGINE_CHILD, "1" if borrow else "0")
    assert got["tokens"] == 8 * 4 * 8, got  # every sample ran to its limit (the tiny model never stops early here)
    assert got["caller_pool"] == got["base"] + 1, got
    caller = 0 if borrow else 1  # the caller's worker, where it was not released
    assert got["after_generate"] == got["base"] + caller, got
    assert got["after_model_work"] == got["base"] + caller, got
    assert got["raw"] == got["base"] + caller + 1, got
    assert got["released_again"] == got["base"] + caller, got


@pytest.mark.parametrize(("overrides", "device", "in_process", "processes", "want"), [
    ([], "cpu", 1, 0, True),  # the demo: one in-process engine, synchronous
    (["rl.async_rollout=true"], "cpu", 1, 0, False),  # async: engine and trainer compute at once
    (["engines.lend_cores=false"], "cpu", 1, 0, False),  # the user's choice
    ([], "cuda:0", 1, 0, False),  # a GPU engine computes on the GPU
    ([], "cpu", 2, 0, False),  # two in-process engines generate at once
    ([], "cpu", 1, 1, False),  # and so does an engine process beside it
])
def test_which_runs_lend_the_trainers_cores(overrides, device, in_process, processes, want):
    cfg = load_run_config("configs/demo.toml", overrides, mode="rl")
    assert lends_cores(cfg, device, in_process=in_process, processes=processes) is want


def test_lend_cores_must_be_a_bool():
    with pytest.raises(Exception, match="lend_cores"):
        load_run_config("configs/demo.toml", ['engines.lend_cores="yes"'], mode="rl")
