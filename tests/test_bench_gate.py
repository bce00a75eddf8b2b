"""The kernel regression gate (bench/gate.py) fails on a case made slower, names it, and only it.

Real pytest-benchmark runs, in subprocesses started by the gate's own `save` and `check` commands, of a tiny
suite written here: two cases, each with an "ours" and a "torch" side that burn a fixed amount of CPU time (CPU
work, not a sleep: on a CPU machine the gate times by process CPU time). The slowed run adds a deliberate delay
to one case's "ours" side, chosen by an environment variable that only this tiny suite reads.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_gate", ROOT / "bench" / "gate.py")
gate = importlib.util.module_from_spec(_spec)
sys.modules["bench_gate"] = gate  # dataclasses look their module up while the file executes
_spec.loader.exec_module(gate)

TINY_SUITE = '''
import os
import time

import pytest

SLOW_CASE = os.environ.get("GATE_TEST_SLOW_CASE", "")


def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.parametrize("case", ["alpha", "beta"])
@pytest.mark.parametrize("impl", ["torch", "ours"])
def test_case(benchmark, case, impl):
    benchmark.group = case
    benchmark.extra_info.update(case=case, impl=impl)
    seconds = 0.004 if impl == "torch" else 0.002
    if impl == "ours" and case == SLOW_CASE:
        seconds += 0.004  # the deliberate delay: ours goes from half the reference's time to 1.5 times it
    benchmark.pedantic(burn, args=(seconds,), rounds=9, iterations=1, warmup_rounds=1)
'''


@pytest.fixture
def suite(tmp_path, monkeypatch):
    # The gate measures the suite in a child pytest, which inherits the environment: under `make test`'s xdist it
    # would take this worker's variables for its own, and pytest-benchmark refuses --benchmark-only under xdist.
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "suite" / "test_tiny_bench.py"
    path.parent.mkdir()
    path.write_text(TINY_SUITE)
    return path


def _medians(run: dict) -> dict[tuple[str, str], float]:
    return {(b["extra_info"]["case"], b["extra_info"]["impl"]): b["stats"]["median"] for b in run["benchmarks"]}


def _check(suite, baselines, current, capfd):
    rc = gate.main(["check", "--suite", str(suite), "--baselines", str(baselines), "--current", str(current)])
    return rc, capfd.readouterr().out


def test_gate_names_the_slowed_case_and_only_it(suite, tmp_path, monkeypatch, capfd):
    baselines = tmp_path / "baselines"
    monkeypatch.delenv("GATE_TEST_SLOW_CASE", raising=False)
    assert gate.main(["save", "--suite", str(suite), "--baselines", str(baselines)]) == 0
    baseline_file = gate.baseline_path(baselines)
    assert baseline_file.parent == baselines and baseline_file.name == f"{gate.slug(gate.device_name())}.json"
    base = json.loads(baseline_file.read_text())
    assert {c for c, _ in _medians(base)} == {"alpha", "beta"}

    # A run without the delay passes.
    rc, out = _check(suite, baselines, tmp_path / "clean.json", capfd)
    clean_results = gate.compare(base, json.loads((tmp_path / "clean.json").read_text()))
    assert rc == 0, out
    assert gate.regressions(clean_results) == [] and "bench-check passed" in out

    # The same check with beta's "ours" side slowed on purpose fails and names beta alone.
    monkeypatch.setenv("GATE_TEST_SLOW_CASE", "beta")
    rc, out = _check(suite, baselines, tmp_path / "slow.json", capfd)
    slow = json.loads((tmp_path / "slow.json").read_text())
    assert rc == 1, out
    results = {r.case: r for r in gate.compare(base, slow)}
    assert gate.regressions(list(results.values())) == ["beta"]
    failed_line = next(line for line in out.splitlines() if line.startswith("bench-check FAILED"))
    assert failed_line.endswith(": beta")
    assert [line.split()[0] for line in out.splitlines() if "REGRESSED" in line] == ["beta"]

    # The verdict rests on the runs' own medians: normalised time = median(ours) / median(torch), both runs.
    m_base, m_slow = _medians(base), _medians(slow)
    for case in ("alpha", "beta"):
        want_base = m_base[case, "ours"] / m_base[case, "torch"]
        want_now = m_slow[case, "ours"] / m_slow[case, "torch"]
        assert results[case].baseline.value == pytest.approx(want_base, rel=1e-12)
        assert results[case].current.value == pytest.approx(want_now, rel=1e-12)
        assert results[case].change == pytest.approx(want_now / want_base - 1, rel=1e-9)
    assert results["beta"].change > gate.CEILING and results["alpha"].change <= gate.FLOOR
    # pytest-benchmark's own table of raw medians (--benchmark-compare against the baseline) is in the output.
    assert "(NOW)" in out and baseline_file.stem in out


def test_missing_baseline_exits_2_before_running_anything(suite, tmp_path, capfd):
    current = tmp_path / "current.json"
    rc, out = _check(suite, tmp_path / "no-baselines-here", current, capfd)
    assert rc == 2
    assert "no baseline for this machine" in out and str(gate.baseline_path(tmp_path / "no-baselines-here")) in out
    assert not current.exists()


def test_a_case_without_its_reference_is_an_error():
    run = {"benchmarks": [
        {"fullname": "t[a-ours]", "extra_info": {"case": "a", "impl": "ours"}, "stats": {"median": 2.0}},
        {"fullname": "t[b-ours]", "extra_info": {"case": "b", "impl": "ours"}, "stats": {"median": 3.0}},
        {"fullname": "t[b-torch]", "extra_info": {"case": "b", "impl": "torch"}, "stats": {"median": 4.0}},
    ]}
    with pytest.raises(ValueError, match="case 'a' block 0 has no 'torch' benchmark"):
        gate.normalised(run)
    run["benchmarks"].pop(0)
    assert gate.normalised(run)["b"].value == statistics.median([3.0 / 4.0])


def _blocked_run(ratios_by_case: dict[str, list[float]]) -> dict:
    """A pytest-benchmark document whose case c has block b with torch median 1.0 and ours median ratios[b]."""
    benches = []
    for case, ratios in ratios_by_case.items():
        for b, r in enumerate(ratios):
            for impl, median in (("torch", 1.0), ("ours", r)):
                benches.append({"fullname": f"t[{case}-b{b}-{impl}]", "stats": {"median": median},
                                "extra_info": {"case": case, "impl": impl, "block": b}})
    return {"benchmarks": benches}


BASELINE_FILES = sorted((ROOT / "bench" / "results" / "baselines").glob("*.json"))


def _scaled(run: dict, factors: dict[str, float]) -> dict:
    """A copy of a pytest-benchmark document with case c's "ours" medians times factors[c]: synthetic timings of a
    run whose every block ratio of c moved by that factor (the clock and the torch medians unchanged)."""
    out = copy.deepcopy(run)
    out.pop("gate", None)
    for b in out["benchmarks"]:
        info = b.get("extra_info") or {}
        if info.get("impl") == "ours" and info.get("case") in factors:
            b["stats"]["median"] *= factors[info["case"]]
    return out


def test_the_limit_is_learned_from_the_baselines_own_blocks():
    """spread = 1.4826 x the median absolute deviation of the log block ratios; limit = 3 x spread, within
    [15 %, 20 %]; saved per case with the baseline and read back from there."""
    quiet = [1.0, 1.01, 0.99, 1.0, 1.005]
    middle = [1.0, 1.04, 0.96, 1.0, 1.04, 0.96, 1.0]  # |log deviations| median 0.039: limit +17.4 %
    noisy = [1.0, 1.2, 0.8, 1.25, 0.78]
    for ratios in (quiet, middle, noisy):
        logs = [math.log(r) for r in ratios]
        mad = statistics.median(abs(x - statistics.median(logs)) for x in logs)
        assert gate.block_spread(ratios) == pytest.approx(1.4826 * mad)
    assert gate.block_spread([1.3]) == 0.0
    # A block that a burst hit on one side does not widen the limit.
    calm = [1.0, 1.02, 0.98, 1.01, 0.99, 1.015, 0.985]
    assert gate.block_spread(calm[:-1] + [3.0]) <= gate.block_spread(calm)

    run = _blocked_run({"quiet": quiet, "middle": middle, "noisy": noisy})
    section = gate.gate_section(run, "test device", {"torch": "1"})
    cases = section["cases"]
    assert cases["middle"]["block_ratios"] == middle and cases["middle"]["ratio"] == 1.0
    assert cases["quiet"]["limit"] == gate.FLOOR  # 3 x 1.5 % is below the floor
    middle_limit = 3 * gate.block_spread(middle)
    assert gate.FLOOR < middle_limit < gate.CEILING and cases["middle"]["limit"] == pytest.approx(middle_limit)
    assert cases["noisy"]["limit"] == gate.CEILING  # 3 x ~30 % would not catch a 25 % slowdown
    assert section["rule"] == {"floor": gate.FLOOR, "spread_k": gate.SPREAD_K, "ceiling": gate.CEILING}

    # The check takes the baseline's saved spread, and its own where that is larger.
    base = {**run, "gate": section}
    steady = gate.compare(base, _blocked_run({"quiet": quiet, "middle": [r * 1.16 for r in middle],
                                              "noisy": noisy}))
    assert {r.case: r.limit for r in steady} == pytest.approx({"quiet": 0.15, "middle": middle_limit, "noisy": 0.2})
    assert gate.regressions(steady) == []  # +16 % is within middle's learned +17.4 %
    assert gate.regressions(gate.compare(base, _blocked_run(
        {"quiet": quiet, "middle": [r * 1.2 for r in middle], "noisy": noisy}))) == ["middle"]
    loaded = gate.compare(base, _blocked_run({"quiet": middle}))
    assert loaded[0].limit == pytest.approx(middle_limit)  # a noisier check widens its own limit
    saved = copy.deepcopy(base)
    saved["gate"]["cases"]["quiet"]["spread"] = 0.06
    assert gate.compare(saved, run)[0].limit == pytest.approx(0.18)  # the saved spread is the one used

    report = gate.format_report(steady)
    assert report.splitlines()[0].split()[:6] == ["case", "baseline", "now", "change", "limit", "spread"]
    middle_line = next(line for line in report.splitlines() if line.startswith("middle"))
    assert f"+{100 * middle_limit:.0f}%" in middle_line and f"{100 * gate.block_spread(middle):.1f}%/" in middle_line
    assert "noisy:" in next(line for line in report.splitlines() if line.startswith("noisy"))


@pytest.mark.parametrize("path", BASELINE_FILES, ids=[p.stem for p in BASELINE_FILES])
@pytest.mark.parametrize("saved_section", [False, True], ids=["as-committed", "with-gate-section"])
def test_a_quarter_slowdown_of_one_case_is_flagged_and_the_baselines_own_spread_is_not(path, saved_section):
    """On synthetic timings built from a committed baseline's per-block ratios, in both formats: without the gate
    section (a baseline saved before it existed, as the H100's: limits computed from its own blocks) and with it."""
    base = {k: v for k, v in gate.load(path).items() if k != "gate"}
    if saved_section:
        base = {**base, "gate": gate.gate_section(base, gate.recorded_device(base), gate.recorded_versions(base))}
    ratios = gate.baseline_ratios(base)
    assert len(ratios) == 8
    for r in ratios.values():
        assert r.spread == pytest.approx(gate.block_spread(list(r.blocks)))
    # Unchanged code, the whole run one spread slower (a typical excursion of its blocks): no case fails.
    moved = _scaled(base, {c: math.exp(r.spread) for c, r in ratios.items()})
    assert gate.regressions(gate.compare(base, moved)) == []
    assert gate.regressions(gate.compare(base, _scaled(base, {}))) == []
    # Any one case 1.25x slower: that case fails, and only it.
    for case in ratios:
        results = gate.compare(base, _scaled(base, {case: 1.25}))
        assert gate.regressions(results) == [case]
        assert next(r for r in results if r.case == case).change == pytest.approx(0.25)


def test_slow_case_injection_and_the_warm_up_rule():
    assert gate.parse_slow_case(None) is None and gate.parse_slow_case("") is None
    assert gate.parse_slow_case("unpack-fwd") == ("unpack-fwd", 2.0)
    assert gate.parse_slow_case("unpack-fwd:1.25") == ("unpack-fwd", 1.25)
    for bad in ("unpack-fwd:fast", "unpack-fwd:0.5", ":1.25"):
        with pytest.raises(ValueError, match="GATE_SLOW_CASE"):
            gate.parse_slow_case(bad)
    assert not gate.settled([1.0] * 5, window=3, tolerance=0.05)  # two windows needed
    # Drifting down (a side still warming): not settled; noisy round to round but steady: settled.
    assert not gate.settled([1.5, 1.4, 1.3, 1.2, 1.1, 1.0], window=3, tolerance=0.05)
    assert gate.settled([1.5, 1.2, 1.0, 1.1, 0.92, 1.02, 1.08, 0.95, 1.01], window=3, tolerance=0.05)


def _fake_suite(run: dict):
    """Stands in for gate._run_suite: writes `run` as the pytest-benchmark JSON, times nothing."""

    def run_suite(suite, json_out, *extra):
        Path(json_out).write_text(json.dumps(run))
        return 0

    return run_suite


def _timed_run(ratios: dict[str, list[float]]) -> dict:
    run = _blocked_run(ratios)
    for b in run["benchmarks"]:
        b["options"] = {"timer": "process_time"}
    run["machine_info"] = {"device": "Test CPU 2core", "torch": "0"}
    return run


def test_save_refuses_another_devices_baseline_and_records_versions(tmp_path, monkeypatch, capfd):
    baselines = tmp_path / "baselines"
    run = _timed_run({"alpha": [1.0, 1.02, 0.98], "beta": [0.5, 0.51, 0.5]})
    monkeypatch.setattr(gate, "_run_suite", _fake_suite(run))
    monkeypatch.setattr(gate, "device_name", lambda: "Test CPU 2core")
    monkeypatch.setattr(gate, "versions", lambda: {"torch": "2.13.0", "triton": "3.9.0", "python": "3.11.7",
                                                   "cpu": "Test CPU", "gpu": None, "cuda": None})
    assert gate.main(["save", "--suite", "unused", "--baselines", str(baselines)]) == 0
    path = gate.baseline_path(baselines)
    saved = json.loads(path.read_text())
    assert saved["gate"]["device"] == "Test CPU 2core" and saved["gate"]["format"] == gate.GATE_FORMAT
    assert saved["gate"]["versions"] == {"torch": "2.13.0", "triton": "3.9.0", "python": "3.11.7",
                                         "cpu": "Test CPU", "gpu": None, "cuda": None}
    assert saved["gate"]["cases"]["beta"]["block_ratios"] == [0.5, 0.51, 0.5]
    out = capfd.readouterr().out
    assert "spread" in out and "limit +15%" in out

    # Another device whose name slugs to the same file: refused before anything runs, naming both and --force.
    monkeypatch.setattr(gate, "device_name", lambda: "Test  CPU 2core")
    assert gate.baseline_path(baselines) == path
    before = path.read_text()

    def must_not_run(*args):
        raise AssertionError("the suite ran although the save is refused")

    monkeypatch.setattr(gate, "_run_suite", must_not_run)
    assert gate.main(["save", "--suite", "unused", "--baselines", str(baselines)]) == 4
    out = capfd.readouterr().out
    assert "refused" in out and "'Test CPU 2core'" in out and "'Test  CPU 2core'" in out and "--force" in out
    assert path.read_text() == before
    # A baseline saved before the gate section existed names its device in machine_info: refused as well.
    path.write_text(json.dumps(run))
    assert gate.main(["save", "--suite", "unused", "--baselines", str(baselines)]) == 4
    # --force replaces it.
    monkeypatch.setattr(gate, "_run_suite", _fake_suite(run))
    assert gate.main(["save", "--force", "--suite", "unused", "--baselines", str(baselines)]) == 0
    assert json.loads(path.read_text())["gate"]["device"] == "Test  CPU 2core"


def test_check_warns_when_the_versions_differ_from_the_baselines(tmp_path, monkeypatch, capfd):
    baselines = tmp_path / "baselines"
    run = _timed_run({"alpha": [1.0, 1.02, 0.98]})
    monkeypatch.setattr(gate, "_run_suite", _fake_suite(run))
    monkeypatch.setattr(gate, "device_name", lambda: "Test CPU 2core")
    now = {"torch": "2.13.0", "triton": "3.9.0", "python": "3.11.7", "cpu": "Test CPU", "gpu": None, "cuda": None}
    monkeypatch.setattr(gate, "versions", lambda: dict(now))
    assert gate.main(["save", "--suite", "unused", "--baselines", str(baselines)]) == 0
    capfd.readouterr()
    current = tmp_path / "current.json"
    assert gate.main(["check", "--suite", "unused", "--baselines", str(baselines), "--current", str(current)]) == 0
    out = capfd.readouterr().out
    assert "bench-check passed" in out and "warning" not in out
    assert json.loads(current.read_text())["gate"]["versions"] == now  # the check's run records its versions too

    monkeypatch.setattr(gate, "versions", lambda: {**now, "torch": "2.14.0", "triton": "3.10.0"})
    assert gate.main(["check", "--suite", "unused", "--baselines", str(baselines), "--current", str(current)]) == 0
    out = capfd.readouterr().out
    warning = next(line for line in out.splitlines() if line.startswith("warning:"))
    assert "torch: baseline 2.13.0, now 2.14.0" in warning and "triton: baseline 3.9.0, now 3.10.0" in warning
    assert "python" not in warning and "make bench-save" in warning
    # An old-format baseline: the versions its machine_info holds are compared, the unknown ones are not.
    assert gate.version_warnings(gate.recorded_versions(run), {"torch": "0", "triton": "3.9.0"}) == []
    assert gate.version_warnings(gate.recorded_versions(run), {"torch": "1"}) == ["torch: baseline 0, now 1"]
