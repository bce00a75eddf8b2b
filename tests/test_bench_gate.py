"""The kernel regression gate (bench/gate.py) fails on a case made slower, names it, and only it.

Real pytest-benchmark runs, in subprocesses started by the gate's own `save` and `check` commands, of a tiny
suite written here: two cases, each with an "ours" and a "torch" side that burn a fixed amount of CPU time (CPU
work, not a sleep: on a CPU machine the gate times by process CPU time). The slowed run adds a deliberate delay
to one case's "ours" side, chosen by an environment variable that only this tiny suite reads.
"""

from __future__ import annotations

import importlib.util
import json
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
def suite(tmp_path):
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
    assert results["beta"].change > gate.THRESHOLD >= results["alpha"].change
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


def test_the_limit_grows_with_the_spread_of_a_cases_blocks():
    """A case whose blocks disagree by ~20 % (a loaded machine) may move by more than 15 % between checks of the
    same tree without failing; a quiet case may not; a 2x slowdown fails either way."""
    noisy = [1.0, 1.2, 0.8, 1.25, 0.78]  # median 1.0, relative MAD 0.2
    quiet = [1.0, 1.01, 0.99, 1.0, 1.005]
    base = gate.normalised(_blocked_run({"noisy": noisy, "quiet": quiet}))
    assert base["noisy"].value == 1.0 and base["noisy"].spread == pytest.approx(0.2)
    assert base["quiet"].spread == pytest.approx(0.005)
    shifted = _blocked_run({"noisy": [r * 1.2 for r in noisy], "quiet": [r * 1.2 for r in quiet]})
    results = {r.case: r for r in gate.compare(_blocked_run({"noisy": noisy, "quiet": quiet}), shifted)}
    assert results["noisy"].change == pytest.approx(0.2) and results["quiet"].change == pytest.approx(0.2)
    assert results["noisy"].limit == pytest.approx(3 * (0.2 ** 2 + 0.2 ** 2) ** 0.5)  # ~0.85: within the noise
    assert results["quiet"].limit == gate.THRESHOLD  # the spread is below the floor
    assert gate.regressions(list(results.values())) == ["quiet"]
    doubled = _blocked_run({"noisy": [r * 2 for r in noisy], "quiet": quiet})
    assert gate.regressions(gate.compare(_blocked_run({"noisy": noisy, "quiet": quiet}), doubled)) == ["noisy"]
    report = gate.format_report(gate.compare(_blocked_run({"noisy": noisy, "quiet": quiet}), doubled))
    assert "REGRESSED (> +85%)" in report and "ok (limit +15%)" in report
