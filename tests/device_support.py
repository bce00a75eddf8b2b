"""The environment of a CPU test's child process (imported as a plain module: pytest puts tests/ on sys.path).

A CPU test that starts a process (a CLI run, torchrun and its ranks, a worker script) pins it to the CPU here, so it
computes what the test's tolerances assume (float32 on the CPU) on a CUDA machine as on a CPU one: the CLI, its
engines and torchrun's ranks all choose CUDA when they see a GPU (`engine_devices` then needs a GPU the ranks leave
free, and bf16 replaces float32). The child gets this process's own environment otherwise, because it needs it to
start: PATH with the venv, PYTHONPATH with the packages carried to a GPU machine, LD_LIBRARY_PATH, HOME; all but
the rank variables of a torchrun this process may run under (the child is a launch of its own).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

CPU_CHILD = {
    "CUDA_VISIBLE_DEVICES": "",  # no GPU for the child and for everything it starts (engines, ranks)
    "TRITON_INTERPRET": "0",  # the root conftest sets 1 for this process's kernel tests; a CPU run takes torch's path
    "OMP_NUM_THREADS": "1",  # the child and its engines share the machine's cores with the tests
}

# torchrun's (torch.distributed's env://) rank variables, which trainer.cli reads to know its place in a job
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cpu_child_env(pythonpath: Sequence[str] = (), **overrides: str) -> dict[str, str]:
    """This process's environment without RANK_VARS, with CPU_CHILD set, `pythonpath` put first on PYTHONPATH, then
    `overrides`."""
    env = {**{k: v for k, v in os.environ.items() if k not in RANK_VARS}, **CPU_CHILD}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, **overrides}
