"""Are two CPU cores independent for compute? (the disaggregated stand-in assumes so; docs/results.md)

Times 3000 fp32 256x256 matmuls (one torch thread) on core 1 alone, then while core 0 runs another matmul loop,
then while core 0 runs a pure-Python loop. Independent cores give the same time in all three; SMT siblings, or
cores sharing their vector units or memory bandwidth, slow the first loop down while the other core multiplies.

    python bench/cores_coupled.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

BUSY = {"matmul": "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nwhile True: a @ a",
        "python": "x = 0\nwhile True: x += 1"}


def matmuls(n: int = 3000) -> float:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(n):
        a @ b
    return time.perf_counter() - t0


def main() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores")
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    times = {"alone": matmuls()}
    for name, code in BUSY.items():
        busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{0}})\n{code}"])
        try:
            time.sleep(1.0)
            times[f"core0_{name}"] = matmuls()
        finally:
            busy.kill()
            busy.wait()
    print({k: round(v, 2) for k, v in times.items()},
          f"slowdown while core 0 multiplies: {times['core0_matmul'] / times['alone']:.2f}x")


if __name__ == "__main__":
    main()
