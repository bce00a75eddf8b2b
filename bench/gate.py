"""Kernel regression gate over pytest-benchmark runs: our op's time relative to the in-run torch reference.

    python bench/gate.py save       run bench/regression and store pytest-benchmark's JSON as this device's
                                    baseline: bench/results/baselines/<device>.json
    python bench/gate.py check      run it again; pytest-benchmark prints its own table of the raw medians against
                                    the baseline (--benchmark-compare), then this gate compares normalised times
    python bench/gate.py compare BASELINE.json CURRENT.json     the normalised comparison of two saved runs
    python bench/gate.py device     the device name that names the baseline file

Normalised time of a case = median(ours) / median(torch reference), both measured in the same run. On a machine
shared with other jobs both medians move together with the load, so their ratio moves much less than either
raw median. A case regresses when its ratio is more than its limit above the baseline's ratio: THRESHOLD (15 %),
or, for a case whose blocks disagree, SPREAD_K (3) times the two runs' spreads combined (`CaseResult.limit`):
on a loaded machine one case's block ratios moved by 20 % between checks of the same tree, and a fixed 15 % then
fails an unchanged tree, while a real 2x slowdown (+100 %) stays far above any spread the gate accepts.
Exit codes: 0 no regression, 1 regression (each regressed case named), 2 no baseline for this device,
3 the benchmark run itself failed.

A benchmark takes part when its `extra_info` has `case` (the name compared across runs) and `impl`
("ours" or "torch"); see bench/regression/test_kernels_regress.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "bench" / "regression"
BASELINES = ROOT / "bench" / "results" / "baselines"
THRESHOLD = 0.15
# A case's limit grows with the spread of its block ratios (relative median absolute deviation, in both runs):
# SPREAD_K x that is about 3.6 standard deviations of the change of the median over BLOCKS = 5 blocks.
SPREAD_K = 3.0
IMPLS = ("ours", "torch")


# ---------------------------------------------------------------------------------------------------------
# Device name (the baseline's file name)
# ---------------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def device_name() -> str:
    """The GPU's name when CUDA is present (what the set times), else the CPU model and the usable core count."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{_cpu_model()} {len(os.sched_getaffinity(0))}core"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def baseline_path(baselines: Path = BASELINES) -> Path:
    return Path(baselines) / f"{slug(device_name())}.json"


# ---------------------------------------------------------------------------------------------------------
# Normalisation and comparison (pure functions over pytest-benchmark's JSON)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    """One case of one run: our median and the torch reference's (seconds), and the normalised time."""

    ours: float
    torch: float
    value: float  # median over blocks of median(ours) / median(torch); ours / torch with a single block
    spread: float = 0.0  # median |block ratio - value| / value: how much the blocks disagree (0 with one block)


@dataclass(frozen=True)
class CaseResult:
    case: str
    baseline: Ratio | None  # None: the case is new in this run
    current: Ratio | None  # None: the case is in the baseline but did not run
    threshold: float = THRESHOLD

    @property
    def change(self) -> float | None:
        """Relative change of the normalised time (+0.20 = 20 % slower relative to the reference)."""
        if self.baseline is None or self.current is None:
            return None
        return self.current.value / self.baseline.value - 1.0

    @property
    def limit(self) -> float:
        """The change this case may show before it counts as a regression: the threshold, or SPREAD_K times the
        combined spread of the two runs' block ratios where that is larger (a noisy case needs a larger change)."""
        if self.baseline is None or self.current is None:
            return self.threshold
        return max(self.threshold, SPREAD_K * math.hypot(self.baseline.spread, self.current.spread))

    @property
    def regressed(self) -> bool:
        return self.change is not None and self.change > self.limit


def normalised(run: dict) -> dict[str, Ratio]:
    """{case: Ratio} from one pytest-benchmark JSON document.

    A case may be measured in several blocks (extra_info `block`, default 0) alternating torch and ours; each
    block's ratio compares two windows close in time, and the median over blocks drops a block that a burst of
    load hit on one side only.
    """
    medians: dict[str, dict[int, dict[str, float]]] = {}
    for bench in run["benchmarks"]:
        info = bench.get("extra_info") or {}
        case, impl, block = info.get("case"), info.get("impl"), info.get("block", 0)
        if case is None or impl is None:
            continue  # not part of the regression set
        if impl not in IMPLS:
            raise ValueError(f"benchmark {bench['fullname']}: extra_info impl={impl!r}, expected one of {IMPLS}")
        sides = medians.setdefault(case, {}).setdefault(block, {})
        if impl in sides:
            raise ValueError(f"case {case!r} block {block} has two {impl!r} benchmarks ({bench['fullname']}); "
                             "give each benchmark its own case or block")
        sides[impl] = float(bench["stats"]["median"])
    out = {}
    for case, blocks in medians.items():
        for block, sides in blocks.items():
            missing = [i for i in IMPLS if i not in sides]
            if missing:
                raise ValueError(f"case {case!r} block {block} has no {missing[0]!r} benchmark in this run; "
                                 f"each block needs both {IMPLS}")
        ratios = [s["ours"] / s["torch"] for s in blocks.values()]
        value = statistics.median(ratios)
        out[case] = Ratio(
            ours=statistics.median(s["ours"] for s in blocks.values()),
            torch=statistics.median(s["torch"] for s in blocks.values()),
            value=value,
            spread=statistics.median(abs(r - value) for r in ratios) / value,
        )
    return out


def compare(baseline: dict, current: dict, threshold: float = THRESHOLD) -> list[CaseResult]:
    """One CaseResult per case of either run, in the baseline's order (new cases last)."""
    timers = {_timer(baseline), _timer(current)}
    if len(timers) > 1:
        raise ValueError(f"the baseline and this run were timed by different clocks {sorted(timers)}; "
                         "re-save the baseline on this machine kind (make bench-save)")
    base, cur = normalised(baseline), normalised(current)
    if not base:
        raise ValueError("the baseline holds no regression case (no benchmark with extra_info case/impl)")
    names = list(base) + [c for c in cur if c not in base]
    return [CaseResult(c, base.get(c), cur.get(c), threshold) for c in names]


def _timer(run: dict) -> str | None:
    timers = {b.get("options", {}).get("timer") for b in run["benchmarks"]}
    return timers.pop() if len(timers) == 1 else None


def regressions(results: list[CaseResult]) -> list[str]:
    return [r.case for r in results if r.regressed]


def format_report(results: list[CaseResult]) -> str:
    width = max(len(r.case) for r in results)
    lines = [f"{'case':<{width}}  {'baseline ours/torch':>20}  {'now ours/torch':>15}  {'change':>8}  verdict"]
    for r in results:
        base = f"{r.baseline.value:.3f}" if r.baseline else "-"
        now = f"{r.current.value:.3f}" if r.current else "-"
        if r.current is None:
            change, verdict = "-", "did not run (not compared)"
        elif r.baseline is None:
            change, verdict = "-", "new (no baseline; re-save to track it)"
        else:
            change = f"{100 * r.change:+.1f}%"
            verdict = f"REGRESSED (> +{100 * r.limit:.0f}%)" if r.regressed else f"ok (limit +{100 * r.limit:.0f}%)"
        lines.append(f"{r.case:<{width}}  {base:>20}  {now:>15}  {change:>8}  {verdict}")
    return "\n".join(lines)


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------


def timer() -> str:
    """pytest-benchmark's clock: CUDA work is timed by wall clock (the set synchronises the device each round);
    CPU work by the process's CPU time, which the set keeps single-threaded: the time a kernel computes, not the
    share of a core a shared machine happened to give it."""
    import torch

    return "time.perf_counter" if torch.cuda.is_available() else "time.process_time"


def _run_suite(suite: Path, json_out: Path, *extra: str) -> int:
    """Run the regression set with pytest-benchmark, writing its JSON (all rounds' timings) to json_out."""
    cmd = [
        sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "--benchmark-only",
        f"--benchmark-json={json_out}", "--benchmark-columns=median,iqr,min,max,rounds",
        "--benchmark-group-by=group", "--benchmark-sort=name", f"--benchmark-timer={timer()}", *extra,
    ]
    # The root conftest turns the Triton interpreter on for tests; timings must never measure the interpreter
    # (on CPU the set times the torch path, on CUDA the compiled kernels). glibc's malloc serves large buffers by
    # fresh mmaps, with a threshold that moves with the process's allocation history: whether a [T, V] buffer
    # costs page faults then depends on what ran before. A fixed threshold above every buffer of the set and no
    # trimming keep host allocations out of the timings.
    env = {**os.environ, "TRITON_INTERPRET": "0", "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
           "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def cmd_save(suite: Path, baselines: Path) -> int:
    path = baseline_path(baselines)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        rc = _run_suite(suite, out)
        if rc != 0:
            print(f"bench-save: the regression set failed (pytest exit {rc}); baseline {path} left unchanged")
            return 3
        run = load(out)
        shutil.move(out, path)  # tmp may be another file system
    print(f"bench-save: baseline for {device_name()!r} written to {path}")
    for case, r in normalised(run).items():
        print(f"  {case}: ours {1e3 * r.ours:.2f} ms / torch {1e3 * r.torch:.2f} ms = {r.value:.3f}")
    return 0


def cmd_check(suite: Path, baselines: Path, current_out: Path | None, threshold: float) -> int:
    path = baseline_path(baselines)
    if not path.exists():
        print(f"bench-check: no baseline for this machine ({device_name()!r}): {path} does not exist; "
              "run `make bench-save` on this machine kind first")
        return 2
    current_out = current_out or ROOT / ".benchmarks" / f"regression-{path.stem}.json"
    current_out.parent.mkdir(parents=True, exist_ok=True)
    # --benchmark-compare makes pytest-benchmark print the raw medians of the baseline next to this run's.
    rc = _run_suite(suite, current_out, f"--benchmark-compare={path}")
    if rc != 0:
        print(f"bench-check: the regression set failed (pytest exit {rc}); nothing compared")
        return 3
    return cmd_compare(path, current_out, threshold)


def cmd_compare(baseline: Path, current: Path, threshold: float) -> int:
    results = compare(load(baseline), load(current), threshold)
    print(f"\nNormalised times (median ours / median torch reference, same run): {current} vs baseline {baseline}")
    print(format_report(results))
    bad = regressions(results)
    if bad:
        print(f"\nbench-check FAILED: {len(bad)} case(s) slower relative to the torch reference than in the baseline "
              f"by more than their limit ({100 * threshold:.0f}%, or more for a case whose blocks disagree): "
              f"{', '.join(bad)}")
        return 1
    print(f"\nbench-check passed: no case slower relative to the torch reference by more than its limit "
          f"({100 * threshold:.0f}%, or more for a case whose blocks disagree)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("save", "check"):
        s = sub.add_parser(name)
        s.add_argument("--suite", type=Path, default=SUITE, help="pytest path of the regression set")
        s.add_argument("--baselines", type=Path, default=BASELINES, help="folder of the per-device baselines")
        if name == "check":
            s.add_argument("--current", type=Path, default=None, help="where to write this run's JSON")
            s.add_argument("--threshold", type=float, default=THRESHOLD)
    c = sub.add_parser("compare")
    c.add_argument("baseline", type=Path)
    c.add_argument("current", type=Path)
    c.add_argument("--threshold", type=float, default=THRESHOLD)
    sub.add_parser("device")
    a = p.parse_args(argv)
    if a.command == "save":
        return cmd_save(a.suite, a.baselines)
    if a.command == "check":
        return cmd_check(a.suite, a.baselines, a.current, a.threshold)
    if a.command == "compare":
        return cmd_compare(a.baseline, a.current, a.threshold)
    print(slug(device_name()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
