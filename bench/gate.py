"""Kernel regression gate over pytest-benchmark runs: our op's time relative to the in-run torch reference.

    python bench/gate.py save [--force]  run bench/regression and store pytest-benchmark's JSON, with the gate's
                                    per-case block ratios, spreads, limits and the versions it ran with, as this
                                    device's baseline: bench/results/baselines/<device>.json. Refuses (exit 4) to
                                    overwrite a baseline another device name made, unless --force
    python bench/gate.py check      run it again; pytest-benchmark prints its own table of the raw medians against
                                    the baseline (--benchmark-compare), then this gate compares normalised times
                                    and warns where the versions differ from the baseline's
    python bench/gate.py compare BASELINE.json CURRENT.json     the normalised comparison of two saved runs
    python bench/gate.py device     the device name that names the baseline file

Normalised time of a case = median over its blocks of median(ours) / median(torch reference), each block's two
medians measured back to back in the same run. On a machine shared with other jobs both medians move together
with the load, so their ratio moves much less than either raw median. A case regresses when its ratio is more
than its limit above the baseline's ratio; the limit is learned from how much the case's blocks disagree
(`case_limit`). Exit codes: 0 no regression, 1 regression (each regressed case named), 2 no baseline for this
device, 3 the benchmark run itself failed, 4 save refused (the baseline belongs to another device name).

A benchmark takes part when its `extra_info` has `case` (the name compared across runs) and `impl`
("ours" or "torch"), optionally `block`; see bench/regression/test_kernels_regress.py.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
# A case's limit (`case_limit`): min(CEILING, max(FLOOR, SPREAD_K x spread)), spread = the robust standard
# deviation of the log of its block ratios (1.4826 x their median absolute deviation; `block_spread`).
# - SPREAD_K = 3 spreads: a whole run moved by the noise of one block rarely gets that far (3 standard
#   deviations), and a single block hit by a burst does not move the median at all. The spread of one block, not
#   of the median over n blocks (sqrt(n) times smaller), on purpose: the blocks of one process share some of their
#   noise, so the spread within a run understates how far two runs move apart.
# - FLOOR = 15 %: that shared part has no block spread to learn from: a case whose blocks agreed within 0.3 %
#   (policy-loss-logits-full, CPU) moved by +12 % between processes of the same tree, in steps (memory placement
#   of its buffers, not noise that more blocks average out).
# - CEILING = 20 %: a 25 % slowdown of any one kernel must fail (issue 45), so no limit may reach it; 5 points are
#   left for the noise of the slowed run itself. A case whose spread asks for more than the ceiling is flagged as
#   noisy in the table: expect false alarms on it until it is measured better (more rounds, a quieter machine).
FLOOR = 0.15
SPREAD_K = 3.0
CEILING = 0.20
MAD_TO_SD = 1.4826  # the median absolute deviation of normal noise x this = its standard deviation
GATE_FORMAT = 2  # the baseline's "gate" section (per-case block ratios, spread, limit; versions); 1: none
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
    spread: float = 0.0  # `block_spread` of the block ratios: how much the blocks disagree (0 with one block)
    blocks: tuple[float, ...] = ()  # each block's ratio, in block order


def block_spread(ratios: list[float]) -> float:
    """Robust relative standard deviation of a case's block ratios: 1.4826 x median |ln r_b - median ln r|.

    Logs, because a ratio's noise is multiplicative (0.9x and 1.1x are the same size of excursion); the median
    absolute deviation, because a block that a burst of load hit on one side must not widen the limit."""
    if len(ratios) < 2:
        return 0.0
    logs = [math.log(r) for r in ratios]
    centre = statistics.median(logs)
    return MAD_TO_SD * statistics.median(abs(x - centre) for x in logs)


def case_limit(base_spread: float, current_spread: float = 0.0, floor: float = FLOOR,
               ceiling: float = CEILING) -> float:
    """The change a case may show before it counts as a regression: SPREAD_K x the larger of the baseline's spread
    (learned when it was saved) and this run's (a run noisier than its baseline widens its own limit), never below
    the floor nor above the ceiling (the constants above say why)."""
    ceiling = max(ceiling, floor)
    return min(ceiling, max(floor, SPREAD_K * max(base_spread, current_spread)))


@dataclass(frozen=True)
class CaseResult:
    case: str
    baseline: Ratio | None  # None: the case is new in this run
    current: Ratio | None  # None: the case is in the baseline but did not run
    floor: float = FLOOR
    ceiling: float = CEILING

    @property
    def change(self) -> float | None:
        """Relative change of the normalised time (+0.20 = 20 % slower relative to the reference)."""
        if self.baseline is None or self.current is None:
            return None
        return self.current.value / self.baseline.value - 1.0

    @property
    def limit(self) -> float:
        base = self.baseline.spread if self.baseline else 0.0
        cur = self.current.spread if self.current else 0.0
        return case_limit(base, cur, self.floor, self.ceiling)

    @property
    def noisy(self) -> bool:
        """The spreads ask for a limit above the ceiling: the case cannot both pass its noise and catch 25 %."""
        base = self.baseline.spread if self.baseline else 0.0
        cur = self.current.spread if self.current else 0.0
        return SPREAD_K * max(base, cur) > max(self.ceiling, self.floor)

    @property
    def regressed(self) -> bool:
        return self.change is not None and self.change > self.limit


def normalised(run: dict) -> dict[str, Ratio]:
    """{case: Ratio} from the timings of one pytest-benchmark JSON document.

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
        ratios = [blocks[b]["ours"] / blocks[b]["torch"] for b in sorted(blocks)]
        out[case] = Ratio(
            ours=statistics.median(s["ours"] for s in blocks.values()),
            torch=statistics.median(s["torch"] for s in blocks.values()),
            value=statistics.median(ratios),
            spread=block_spread(ratios),
            blocks=tuple(ratios),
        )
    return out


def baseline_ratios(baseline: dict) -> dict[str, Ratio]:
    """The baseline's cases: the ratios and spreads saved in its "gate" section (format 2), else (a baseline saved
    before that section existed) computed from its own blocks' timings, as `normalised` does for any run."""
    computed = normalised(baseline)
    saved = (baseline.get("gate") or {}).get("cases")
    if not saved:
        return computed
    out = {}
    for case, r in computed.items():
        entry = saved.get(case)
        if entry is None:
            out[case] = r
            continue
        out[case] = Ratio(ours=r.ours, torch=r.torch, value=float(entry["ratio"]), spread=float(entry["spread"]),
                          blocks=tuple(float(x) for x in entry["block_ratios"]))
    return out


def gate_section(run: dict, device: str, versions: dict[str, str | None]) -> dict:
    """What a baseline saves beside pytest-benchmark's timings: each case's block ratios, their median, spread and
    the limit they set (before a check's own spread), the rule's constants, the device and the versions."""
    cases = {}
    for case, r in normalised(run).items():
        cases[case] = {"block_ratios": list(r.blocks), "ratio": r.value, "spread": r.spread,
                       "limit": case_limit(r.spread)}
    return {"format": GATE_FORMAT, "device": device, "versions": versions,
            "rule": {"floor": FLOOR, "spread_k": SPREAD_K, "ceiling": CEILING}, "cases": cases}


def compare(baseline: dict, current: dict, floor: float = FLOOR, ceiling: float = CEILING) -> list[CaseResult]:
    """One CaseResult per case of either run, in the baseline's order (new cases last)."""
    timers = {_timer(baseline), _timer(current)}
    if len(timers) > 1:
        raise ValueError(f"the baseline and this run were timed by different clocks {sorted(timers)}; "
                         "re-save the baseline on this machine kind (make bench-save)")
    base, cur = baseline_ratios(baseline), normalised(current)
    if not base:
        raise ValueError("the baseline holds no regression case (no benchmark with extra_info case/impl)")
    names = list(base) + [c for c in cur if c not in base]
    return [CaseResult(c, base.get(c), cur.get(c), floor, ceiling) for c in names]


def _timer(run: dict) -> str | None:
    timers = {b.get("options", {}).get("timer") for b in run["benchmarks"]}
    return timers.pop() if len(timers) == 1 else None


def regressions(results: list[CaseResult]) -> list[str]:
    return [r.case for r in results if r.regressed]


def format_report(results: list[CaseResult]) -> str:
    """The gate's table: each case's normalised times, change, limit, the two runs' block spreads and verdict."""
    width = max(len(r.case) for r in results)
    head = (f"{'case':<{width}}  {'baseline':>8}  {'now':>6}  {'change':>7}  {'limit':>6}  "
            f"{'spread base/now':>15}  verdict")
    lines = [head]
    for r in results:
        base = f"{r.baseline.value:.3f}" if r.baseline else "-"
        now = f"{r.current.value:.3f}" if r.current else "-"
        spread = "/".join(f"{100 * x.spread:.1f}%" if x else "-" for x in (r.baseline, r.current))
        if r.current is None:
            change, limit, verdict = "-", "-", "did not run (not compared)"
        elif r.baseline is None:
            change, limit, verdict = "-", "-", "new (no baseline; re-save to track it)"
        else:
            change, limit = f"{100 * r.change:+.1f}%", f"+{100 * r.limit:.0f}%"
            verdict = "REGRESSED" if r.regressed else "ok"
            if r.noisy:
                verdict += " (noisy: blocks disagree past the ceiling; a false alarm is possible)"
        lines.append(f"{r.case:<{width}}  {base:>8}  {now:>6}  {change:>7}  {limit:>6}  {spread:>15}  {verdict}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Versions and device names recorded with a baseline
# ---------------------------------------------------------------------------------------------------------


def _package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    """What the timings depend on besides our code: the libraries, the interpreter and the hardware."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "triton": _package_version("triton", "pytorch-triton"),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
    }


def recorded_versions(run: dict) -> dict[str, str | None]:
    """The versions a saved run recorded: its "gate" section, else what pytest-benchmark's machine_info holds
    (a baseline saved before the section existed: torch, python and the CPU; the rest unknown, not compared)."""
    saved = (run.get("gate") or {}).get("versions")
    if saved:
        return dict(saved)
    info = run.get("machine_info") or {}
    return {k: v for k, v in {"torch": info.get("torch"), "python": info.get("python_version"),
                              "cpu": (info.get("cpu") or {}).get("brand_raw")}.items() if v}


def recorded_device(run: dict) -> str | None:
    return (run.get("gate") or {}).get("device") or (run.get("machine_info") or {}).get("device")


def version_warnings(baseline: dict[str, str | None], now: dict[str, str | None]) -> list[str]:
    """One line for each version both sides recorded and that differs."""
    return [f"{key}: baseline {baseline[key]}, now {now[key]}"
            for key in baseline if key in now and baseline[key] != now[key]]


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


def _write_json(doc: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def cmd_save(suite: Path, baselines: Path, force: bool = False) -> int:
    path = baseline_path(baselines)
    device = device_name()
    if path.exists() and not force:
        other = recorded_device(load(path))
        if other is not None and other != device:
            print(f"bench-save: refused: {path} is the baseline of {other!r}, and this machine is {device!r} "
                  f"(the two names share a file name). Overwriting it would compare {other!r}'s checks against "
                  f"this machine's figures. Run with --force (make bench-save GATE_ARGS=--force) to replace it.")
            return 4
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        rc = _run_suite(suite, out)
        if rc != 0:
            print(f"bench-save: the regression set failed (pytest exit {rc}); baseline {path} left unchanged")
            return 3
        run = load(out)
        run["gate"] = gate_section(run, device, versions())
        _write_json(run, out)
        shutil.move(out, path)  # tmp may be another file system
    print(f"bench-save: baseline for {device!r} written to {path}")
    for case, entry in run["gate"]["cases"].items():
        r = normalised(run)[case]
        note = ""
        if SPREAD_K * entry["spread"] > CEILING:
            note = (f"  noisy: its blocks ask for +{100 * SPREAD_K * entry['spread']:.0f}%, above the ceiling; "
                    "re-save on a quieter machine or give the case more rounds")
        print(f"  {case}: ours {1e3 * r.ours:.2f} ms / torch {1e3 * r.torch:.2f} ms = {entry['ratio']:.3f}, "
              f"spread {100 * entry['spread']:.1f}%, limit +{100 * entry['limit']:.0f}%{note}")
    return 0


def cmd_check(suite: Path, baselines: Path, current_out: Path | None, floor: float, ceiling: float) -> int:
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
    run = load(current_out)
    run["gate"] = gate_section(run, device_name(), versions())
    _write_json(run, current_out)
    return cmd_compare(path, current_out, floor, ceiling)


def cmd_compare(baseline: Path, current: Path, floor: float, ceiling: float) -> int:
    base_doc, cur_doc = load(baseline), load(current)
    results = compare(base_doc, cur_doc, floor, ceiling)
    print(f"\nNormalised times (median over blocks of median ours / median torch reference, same run): "
          f"{current} vs baseline {baseline}")
    print(format_report(results))
    differ = version_warnings(recorded_versions(base_doc), recorded_versions(cur_doc))
    if differ:
        print(f"\nwarning: this run's versions differ from the baseline's ({'; '.join(differ)}): a change in the "
              "table may come from them, not from the kernels. Once these versions are the ones to hold to, "
              "re-save the baseline (make bench-save) and commit it.")
    rule = (f"limit per case: {SPREAD_K:g} x the larger block spread, at least {100 * floor:.0f}%, "
            f"at most {100 * max(ceiling, floor):.0f}%")
    bad = regressions(results)
    if bad:
        print(f"\nbench-check FAILED: {len(bad)} case(s) slower relative to the torch reference than in the baseline "
              f"by more than their limit ({rule}): {', '.join(bad)}")
        return 1
    print(f"\nbench-check passed: no case slower relative to the torch reference by more than its limit ({rule})")
    return 0


def parse_slow_case(value: str | None) -> tuple[str, float] | None:
    """GATE_SLOW_CASE: '<case>' (our side of that case 2x slower) or '<case>:<factor>' (e.g. 'unpack-fwd:1.25');
    None when unset or empty."""
    if not value:
        return None
    case, _, factor = value.partition(":")
    try:
        slow = float(factor) if factor else 2.0
    except ValueError:
        slow = float("nan")
    if not case or not slow >= 1.0:
        raise ValueError(f"GATE_SLOW_CASE={value!r}: expected '<case>' or '<case>:<factor>' with a factor >= 1, "
                         "e.g. 'unpack-fwd:1.25'")
    return case, slow


def settled(ratios: list[float], window: int, tolerance: float) -> bool:
    """The warm-up's stop rule: the median of the last `window` ours/torch ratios of single rounds is within
    `tolerance` of the median of the `window` before them. Until then a cache, an allocator or a lazily compiled
    kernel is still warming one side more than the other (the ratio drifts), and a block timed then would not
    measure the steady ratio. Medians of windows, not single rounds: one round of a short op on a shared machine
    varies by more than any drift worth waiting for."""
    if len(ratios) < 2 * window:
        return False
    last = statistics.median(ratios[-window:])
    before = statistics.median(ratios[-2 * window:-window])
    return abs(last / before - 1.0) <= tolerance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def limits(s):
        s.add_argument("--floor", "--threshold", dest="floor", type=float, default=FLOOR,
                       help="the smallest limit of a case (relative change, 0.15 = 15 %%)")
        s.add_argument("--ceiling", type=float, default=CEILING, help="the largest limit of a case")

    for name in ("save", "check"):
        s = sub.add_parser(name)
        s.add_argument("--suite", type=Path, default=SUITE, help="pytest path of the regression set")
        s.add_argument("--baselines", type=Path, default=BASELINES, help="folder of the per-device baselines")
        if name == "save":
            s.add_argument("--force", action="store_true",
                           help="overwrite a baseline that another device name made (same file name)")
        else:
            s.add_argument("--current", type=Path, default=None, help="where to write this run's JSON")
            limits(s)
    c = sub.add_parser("compare")
    c.add_argument("baseline", type=Path)
    c.add_argument("current", type=Path)
    limits(c)
    sub.add_parser("device")
    a = p.parse_args(argv)
    if a.command == "save":
        return cmd_save(a.suite, a.baselines, a.force)
    if a.command == "check":
        return cmd_check(a.suite, a.baselines, a.current, a.floor, a.ceiling)
    if a.command == "compare":
        return cmd_compare(a.baseline, a.current, a.floor, a.ceiling)
    print(slug(device_name()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
