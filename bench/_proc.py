"""Run a benchmark's worker process and sample the peak resident memory of its whole process tree.

Shared by bench_rl_vs_trl.py (each side in its own process) and bench_real_shape.py (each CLI phase): a trainer's
memory includes the engine processes it starts, so the tree is summed, from /proc (Linux), every 0.2 s.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_with_peak_rss(cmd: Sequence[str], *, log: Path, timeout_s: float, cwd: Path, env: dict) -> tuple[int, int]:
    """Run `cmd` with stdout and stderr to `log`; (exit code, peak tree RSS in bytes). Killed past `timeout_s`
    (subprocess.TimeoutExpired is raised)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        peak, done = [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], tree_rss(proc.pid))
                done.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        finally:
            done.set()
            sampler.join()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return rc, peak[0]
