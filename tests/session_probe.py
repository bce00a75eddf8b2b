"""Not collected by a normal run (no test_ prefix): tests/test_device_support.py runs it in a pytest of its own.

Its one test leaves behind what tests can leave in the pytest process: the default torch.distributed group
(init_distributed, as build_components does) and an in-process engine (the tiny preset's LocalEngine, kept alive
past the test as a module-scoped fixture's would be). An atexit handler, which runs after pytest has returned,
writes to $SESSION_PROBE_OUT whether the group is still initialised and which engine threads still run.
"""

import atexit
import json
import os
import threading

import torch.distributed as dist

LEFT = []


def _report() -> None:
    threads = sorted(t.name for t in threading.enumerate() if t.name == "local-engine")
    with open(os.environ["SESSION_PROBE_OUT"], "w") as f:
        json.dump({"process_group": dist.is_initialized(), "engine_threads": threads}, f)


def test_leaves_a_process_group_and_an_in_process_engine():
    from engines.local import LocalEngine
    from trainer.backend.steps import init_distributed

    init_distributed("cpu")
    LEFT.append(LocalEngine("tiny", threads=1))
    assert dist.is_initialized() and [t.name for t in threading.enumerate()].count("local-engine") == 1
    atexit.register(_report)
