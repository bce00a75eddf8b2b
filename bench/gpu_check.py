"""`make gpu-check`: one command that validates a CUDA machine and records what it measured.

In one run: versions and a compiled-kernel preflight (a Triton kernel must run as a compiled `JITFunction`, not
the interpreter, and match torch), then the stages, in this order:

    gpu_tests    every `gpu`-marked test
    demo         `python -m trainer demo` on the GPU, under a timeout: job time and accuracies from summary.json
    distributed  the `distributed`-marked tests (torchrun / spawned ranks, NCCL on the GPUs present); skipped with
                 the reason on one GPU (NCCL cannot put two ranks on one device)
    benchmarks   every bench/bench_*.py suite at its CUDA sizes, one process each (kernel GB/s against a copy, Liger
                 side by side where it is importable, the train step, the engine's generation on the GPU)
    weight_sync  a Qwen2.5-0.5B-shaped model, colocated and broadcast (bench/bench_weight_sync.py --json)
    kernel_configs  the from-logits kernels' launch-config sweep (bench/tune_logits.py): each candidate checked
                 against fp32 log_softmax, then timed against a copy and Liger; the report names the best config
                 per size and mode (issue 42 item 9: the configs the kernels should ship)

Writes bench/results/<gpu-name>.json and .md after every stage. `--dry-run` prints the plan (every stage, its
commands, timeout, or why it is skipped; every benchmark case with its planned peak device bytes, marked where it
would not fit `--memory-gb`, 80 by default, as the run skips it; the memory plans of Qwen2.5-7B RL on 1 x 80 GB
with LoRA and on 8 x 80 GB in full: each part per rank, the total, the headroom and the verdict) and runs nothing,
on any machine; `--gpus N` plans for N GPUs.

A stage is judged by what it produced, not by its exit status alone: a pytest stage by its JUnit XML (tests ran, none
failed or errored), the weight sync by the JSON figures it printed. A process that crashes after that (a segfault at
interpreter exit, as CUDA processes sometimes do) keeps its pass, with its exit status recorded as `exit_after_pass`.

Exit status: 0 all passed, 1 something failed (the report says what), 2 no CUDA device (nothing is run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = ("gpu-check needs a CUDA device and a CUDA build of torch; this machine has none "
           "(torch.cuda.is_available() is False). Run it on the GPU machine; CPU checks are `make test`.")


def compiled_binaries(kernel) -> int:
    """How many compiled binaries a `@triton.jit` kernel holds, over all devices (0 for an interpreted one)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        return 0
    return sum(len(entry[0]) for entry in caches.values())  # entry[0]: the kernel cache, in triton 3.x


def check_compiled_run(kernel, run):
    """Run `run()` and assert that `kernel` ran compiled on the GPU: a `triton.runtime.jit.JITFunction` (not the
    interpreter's InterpretedFunction) holding a compiled binary afterwards. Returns run()'s result."""
    import torch
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise AssertionError("TRITON_INTERPRET is set: GPU checks must run compiled kernels; unset it")
    if not isinstance(kernel, JITFunction):
        raise AssertionError(f"{getattr(kernel, '__name__', kernel)!r} is a {type(kernel).__name__}, not a compiled "
                             f"triton JITFunction (was TRITON_INTERPRET set when triton was imported?)")
    out = run()
    torch.cuda.synchronize()
    if compiled_binaries(kernel) == 0:
        raise AssertionError(f"{kernel.__name__}: no compiled binary after the run; the call took another path "
                             f"(the torch fallback?) instead of launching the kernel")
    return out


def versions() -> dict:
    import torch
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
           "capability": ".".join(map(str, torch.cuda.get_device_capability(0)))}
    for mod in ("transformers", "liger_kernel"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out[mod] = f"not importable ({type(e).__name__})"
    return out


def preflight() -> dict:
    """A real kernel of ours, compiled and compared with torch."""
    import torch

    from kernels import use_backend
    from kernels.scale import _masked_scale_kernel, masked_scale

    x = torch.randn(4099, device="cuda")
    mask = torch.rand(4099, device="cuda") > 0.3
    with use_backend("triton"):
        y = check_compiled_run(_masked_scale_kernel, lambda: masked_scale(x, mask, 0.37))
    err = (y - torch.where(mask, 0.37 * x, 0.0)).abs().max().item()
    if err > 1e-6:
        raise AssertionError(f"masked_scale compiled kernel differs from torch by {err}")
    return {"ok": True, "kernel": "_masked_scale_kernel", "max_abs_err": err}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels only
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


# Each stage's commands come from these builders, for the run and for the --dry-run plan alike.
DEMO_TIMEOUT_S = 1800  # the demo's job is ~80 s on a 2-core CPU; a GPU run far past this is a failure
ONE_GPU = ("one GPU: the distributed tests start two ranks and NCCL cannot put two ranks on one device; run "
           "gpu-check on a machine with two or more GPUs")


def pytest_marker_cmd(marker: str, xml: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "tests", "-m", marker, "-q", "-p", "no:cacheprovider",
            "--benchmark-disable", f"--junitxml={xml}"]


def benchmark_files() -> list[str]:
    """The pytest-benchmark suites (the weight sync runs as its own stage); a script without a test function
    (bench_rl_vs_trl.py) is not one: pytest would collect nothing and exit 5, a failure of the stage's making."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").glob("bench_*.py")
                  if p.name != "bench_weight_sync.py" and re.search(r"^def test_", p.read_text(), re.M))


UNSIZED = {"bench/bench_real_shape.py": "runs the CLI (sft, export, rl) in its own processes on the Qwen2.5-0.5B "
                                        "shape: its memory follows configs/qwen05b_shape.toml, not a per-case plan"}


def benchmark_memory_plan(memory_bytes: float) -> dict[str, list[dict] | str]:
    """Suite -> every case it launches at its CUDA sizes with its planned peak device bytes (the suite's own
    planned_cases, from the sizing function its run skips by), marked "skipped" with the reason where it would not
    fit `memory_bytes`; or why the suite is not sized. Imports each suite (bench/ on the path, as under pytest)."""
    import importlib

    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    out: dict[str, list[dict] | str] = {}
    for f in benchmark_files():
        module = importlib.import_module(Path(f).stem)
        sized = getattr(module, "planned_cases", None)
        out[f] = sized(memory_bytes) if sized else "not sized: " + UNSIZED.get(f, "the suite has no planned_cases")
    return out


def qwen25_7b_config():
    """Qwen2.5-7B's transformers config from its published numbers (no download): 7.62B parameters."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def memory_plans() -> dict[str, dict]:
    """The memory plans (trainer.backend.memory.resolve_plan, the trainer's defaults and decisions) of the 7B
    targets of issue 42: Qwen2.5-7B RL on 1 x 80 GB with LoRA r=16 on every block Linear and the engine colocated,
    and on 8 x 80 GB in full with the engine colocated on each GPU; both with a bf16 KL reference where one
    exists, 2 micro-batches of 8192 tokens a step, an engine KV cache of 32 rows x 4096 tokens. Per rank, in GB."""
    from trainer.backend.memory import EngineMemory, resolve_plan
    from trainer.config import BackendConfig, LoRAConfig

    common = dict(trainer=BackendConfig(), device_bytes=80e9, micro_batch_tokens=8192, micro_batches=2,
                  reference_dtype="bfloat16", engine=EngineMemory(colocated=True, rows=32, context=4096))
    cases = {"qwen2.5-7b 1x80GB lora r16 all-linear, colocated engine": dict(world_size=1, lora=LoRAConfig(rank=16)),
             "qwen2.5-7b 8x80GB full, colocated engine": dict(world_size=8, lora=None)}
    return {name: resolve_plan(qwen25_7b_config(), **common, **case).as_dict() for name, case in cases.items()}


def benchmark_cmd(file: str, js: Path) -> list[str]:
    """One suite at its CUDA sizes: figures to `js`, the verdict to the JUnit XML beside it (benchmark_xml)."""
    return [sys.executable, "-m", "pytest", file, "-q", "-p", "no:cacheprovider", "--benchmark-only",
            f"--benchmark-json={js}", f"--junitxml={benchmark_xml(js)}"]


def benchmark_xml(js: Path) -> Path:
    return js.with_suffix(".xml")


def weight_sync_cmd() -> list[str]:
    return [sys.executable, "bench/bench_weight_sync.py", "--json", "--device", "cuda"]


def kernel_configs_cmd(js: Path) -> list[str]:
    return [sys.executable, "bench/tune_logits.py", "--json", str(js)]


def demo_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "trainer", "demo", "--set", f"output_dir={out}"]


def stage_commands(work: Path) -> dict[str, list[list[str]]]:
    """Stage -> the commands it runs, in run order."""
    return {"gpu_tests": [pytest_marker_cmd("gpu", work / "gpu_tests.xml")],
            "demo": [demo_cmd(work / "demo")],
            "distributed": [pytest_marker_cmd("distributed", work / "distributed.xml")],
            "benchmarks": [benchmark_cmd(f, work / f"benchmarks-{Path(f).stem}.json") for f in benchmark_files()],
            "weight_sync": [weight_sync_cmd()],
            "kernel_configs": [kernel_configs_cmd(work / "tune_logits.json")]}


def stage_skip_reason(stage: str, gpus: int) -> str | None:
    return ONE_GPU if stage == "distributed" and gpus < 2 else None


def stage_timeout(stage: str, timeout_s: float) -> float:
    return min(timeout_s, DEMO_TIMEOUT_S) if stage == "demo" else timeout_s


def plan(work: Path, gpus: int, timeout_s: float, memory_gb: float = 80.0) -> dict[str, dict]:
    """What a run does, without running it: for each stage its commands (shell-quoted), its timeout, and why it is
    skipped where it is; for the benchmarks, every case with its planned device bytes against `memory_gb`
    ("cases"), and the cases that would not fit and are skipped with the reason ("does_not_fit")."""
    out = {}
    for stage, cmds in stage_commands(work).items():
        entry: dict = {"commands": [shlex.join(c) for c in cmds], "timeout_s": stage_timeout(stage, timeout_s)}
        if (why := stage_skip_reason(stage, gpus)) is not None:
            entry["skipped"] = why
        out[stage] = entry
    cases = benchmark_memory_plan(memory_gb * 1e9)
    out["benchmarks"].update(memory_gb=memory_gb, cases=cases, does_not_fit=[
        f"{f}::{c['case']}" for f, rows in cases.items() if isinstance(rows, list) for c in rows if "skipped" in c])
    return out


def junit_counts(xml: Path) -> dict | None:
    """tests, failures, errors, skipped and the failed test ids from a pytest JUnit XML file; None when there is no
    readable one (pytest died or was killed before its session finished, or the file is cut short)."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    out: dict = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                     if c.find("failure") is not None or c.find("error") is not None]
    return out


def judge(rc: int, produced: bool, missing: str) -> dict:
    """A stage's verdict from its exit status and whether it produced its results (`produced`): returncode 0 when it
    did, whatever the exit status, which is kept as exit_after_pass when it is not 0 (a crash at exit after the
    results were written); otherwise the exit status (1 for an exit 0), with `missing` as the error."""
    if produced:
        return {"returncode": 0, **({"exit_after_pass": rc} if rc != 0 else {})}
    return {"returncode": rc or 1, "error": missing}


def _pytest_stage(cmd: list[str], xml: Path, log: Path, timeout_s: float) -> dict:
    """Run a pytest command; judged by its JUnit XML: passed when tests ran and none failed or errored."""
    xml.unlink(missing_ok=True)  # a previous run's results must not pass for this one's
    rc, secs = _run(cmd, log, timeout_s)
    counts = junit_counts(xml)
    clean = counts is not None and counts["tests"] > 0 and counts["failures"] + counts["errors"] == 0
    missing = ("wrote no JUnit XML" if counts is None else "no test ran" if counts["tests"] == 0 else
               f"{counts['failures']} failed, {counts['errors']} errors")
    return {**judge(rc, clean, missing), "seconds": round(secs, 1), "log": str(log), **(counts or {})}


def gpu_tests(work: Path, timeout_s: float) -> dict:
    """Every gpu-marked test, compiled kernels; counts from the JUnit XML."""
    (cmd,) = stage_commands(work)["gpu_tests"]
    return _pytest_stage(cmd, work / "gpu_tests.xml", work / "gpu_tests.log", timeout_s)


def distributed(work: Path, timeout_s: float, gpus: int) -> dict:
    """The distributed-marked tests with the machine's GPUs visible (their ranks take one GPU each); on one GPU
    skipped with the reason (a skip, not a failure: the stage cannot run here)."""
    if (why := stage_skip_reason("distributed", gpus)) is not None:
        return {"returncode": 0, "skipped": why, "seconds": 0}
    (cmd,) = stage_commands(work)["distributed"]
    return {**_pytest_stage(cmd, work / "distributed.xml", work / "distributed.log", timeout_s), "gpus": gpus}


def demo(work: Path, timeout_s: float) -> dict:
    """`python -m trainer demo` on the GPU (the trainer and the in-process engine on the rank's device), under
    the demo's timeout: the job time and the accuracies before/after SFT and RL from its summary.json."""
    (cmd,) = stage_commands(work)["demo"]
    summary = work / "demo" / "summary.json"
    summary.unlink(missing_ok=True)  # a previous run's figures must not pass for this one's
    rc, secs = _run(cmd, work / "demo.log", stage_timeout("demo", timeout_s))
    out: dict = {"returncode": rc, "seconds": round(secs, 1), "log": str(work / "demo.log")}
    if summary.exists():
        got = json.loads(summary.read_text())
        out.update({k: v for k, v in got.items() if k == "wall_seconds" or k.startswith(("accuracy_", "sft_",
                                                                                          "rl_"))})
    elif rc == 0:
        out.update(returncode=1, error=f"the demo exited 0 but wrote no {summary}")
    return out


def _benchmark_results(js: Path) -> list[dict]:
    """The rows of one pytest-benchmark JSON file (none when the suite wrote none: it failed or timed out)."""
    if not js.exists():
        return []
    return [{"name": b["fullname"], "median_ms": 1e3 * b["stats"]["median"],
             **{k: v for k, v in b.get("extra_info", {}).items() if isinstance(v, int | float | str)}}
            for b in json.loads(js.read_text()).get("benchmarks", [])]


def benchmarks(work: Path, timeout_s: float, progress: Callable[[dict], None] = lambda out: None) -> dict:
    """The pytest-benchmark suites at their CUDA sizes (weight sync separately, below), each in its own pytest
    process with its own JSON, `timeout_s` for the whole stage: a suite that fails or runs out of time loses only
    its own figures, and `progress(out)` after each suite lets the caller write what finished. Each suite is judged
    by its JUnit XML, as the test stages are."""
    files = benchmark_files()
    deadline = time.monotonic() + timeout_s
    out: dict = {"returncode": 0, "seconds": 0.0, "files": files, "suites": {}, "results": []}
    for f in files:
        left = deadline - time.monotonic()
        if left <= 0:
            out["suites"][f] = {"returncode": 124, "skipped": f"the stage's {timeout_s:.0f} s were spent"}
            out["returncode"] = out["returncode"] or 124
            continue
        stem = Path(f).stem
        js = work / f"benchmarks-{stem}.json"
        js.unlink(missing_ok=True)  # a previous run's figures must not pass for this one's
        suite = _pytest_stage(benchmark_cmd(f, js), benchmark_xml(js), work / f"benchmarks-{stem}.log", left)
        out["suites"][f] = {k: v for k, v in suite.items() if k != "log"}
        out["results"] += _benchmark_results(js)
        out["seconds"] = round(out["seconds"] + suite["seconds"], 1)
        out["returncode"] = out["returncode"] or suite["returncode"]
        progress(out)
    return out


WEIGHT_SYNC_FIGURE = "colocated_ms"  # printed by every run of bench_weight_sync.py --json (broadcast may be skipped)


def weight_sync_figures(log: Path) -> dict | None:
    """The JSON object bench_weight_sync.py --json printed (its last line that is one), None when it printed none
    with its figures."""
    for line in reversed(log.read_text(errors="replace").splitlines() if log.exists() else []):
        if line.startswith("{"):
            try:
                got = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(got, dict) and WEIGHT_SYNC_FIGURE in got:
                return got
    return None


def weight_sync(work: Path, timeout_s: float) -> dict:
    """bench_weight_sync.py --json; judged by the figures it printed, not by its exit status alone."""
    log = work / "weight_sync.log"
    rc, secs = _run(weight_sync_cmd(), log, timeout_s)
    figures = weight_sync_figures(log)
    return {**(figures or {}), **judge(rc, figures is not None, f"printed no JSON with {WEIGHT_SYNC_FIGURE}"),
            "seconds": round(secs, 1), "log": str(log)}


def best_configs(sweep: list[dict]) -> list[dict]:
    """Per size of a tune_logits.py sweep: the fastest correct forward (with and without entropy) and backward
    variant, its GB/s and its fraction of a copy's, beside Liger's forward. Raises on a variant marked wrong."""
    rows = []
    for size in sweep:
        wrong = [k for part in ("fwd", "bwd") for k, v in size[part].items() if v.get("wrong")]
        if wrong:
            raise AssertionError(f"T{size['T']}-V{size['V']}: variants {wrong} disagree with fp32 log_softmax")
        copy = size.get("copy_GBps")
        for part, ent in (("fwd", False), ("fwd", True), ("bwd", True)):
            timed = {k: v for k, v in size[part].items() if "ms" in v and k.endswith("-ent") == ent}
            if not timed:
                continue
            key = min(timed, key=lambda k: timed[k]["ms"])
            row = {"size": f"T{size['T']}-V{size['V']}", "mode": part + ("-ent" if ent else ""), "best": key,
                   "ms": timed[key]["ms"], "GBps": timed[key]["GBps"]}
            shipped = size["shipped"] + ("-ent" if ent else "")  # the config kernels.logprobs launches
            if shipped in timed:
                row["shipped_ms"] = timed[shipped]["ms"]
            if copy:
                row["vs_copy"] = timed[key]["GBps"] / copy
            if part == "fwd" and "GBps" in size.get("liger_fwd", {}):
                row["liger_GBps"] = size["liger_fwd"]["GBps"]
            rows.append(row)
    return rows


def kernel_configs(work: Path, timeout_s: float) -> dict:
    """bench/tune_logits.py; judged by the JSON it wrote (every variant right), not by its exit status alone."""
    js, log = work / "tune_logits.json", work / "tune_logits.log"
    js.unlink(missing_ok=True)
    rc, secs = _run(kernel_configs_cmd(js), log, timeout_s)
    try:
        best = best_configs(json.loads(js.read_text())) if js.exists() else None
        missing = "wrote no tune_logits.json"
    except AssertionError as e:
        best, missing = None, str(e)
    return {**({"best": best} if best is not None else {}), **judge(rc, best is not None, missing),
            "seconds": round(secs, 1), "log": str(log)}


def _verdict_note(stage: dict) -> str:
    """What the Markdown adds to a stage's line: a crash after it passed, or why it failed."""
    notes = [f"passed, then its process exited {stage['exit_after_pass']}"] if "exit_after_pass" in stage else []
    notes += [stage["error"]] if "error" in stage else []
    return f" ({'; '.join(notes)})" if notes else ""


def markdown(report: dict) -> str:
    """The report as Markdown; a partial one (stages not run yet) shows what it has."""
    v, t, ws = report["versions"], report.get("gpu_tests", {}), report.get("weight_sync", {})
    lines = [f"# gpu-check on {v['gpu']}", "", f"{report['date']} · status **{report['status']}**", "",
             "| component | version |", "|---|---|", *[f"| {k} | {val} |" for k, val in v.items()], "",
             f"Preflight (compiled Triton kernel vs torch): {report.get('preflight', 'not run')}", "",
             f"GPU tests: {t.get('tests', '?')} run, {t.get('failures', '?')} failed, {t.get('errors', '?')} errors, "
             f"{t.get('skipped', '?')} skipped ({t.get('seconds', '?')} s){_verdict_note(t)}.",
             *[f"- failed: `{n}`" for n in t.get("failed", [])]]
    d, dm = report.get("distributed", {}), report.get("demo", {})
    lines += ["", "Distributed tests: " + (d["skipped"] if "skipped" in d else
                                           f"{d.get('tests', '?')} run, {d.get('failures', '?')} failed, "
                                           f"{d.get('errors', '?')} errors ({d.get('seconds', '?')} s)"
                                           f"{_verdict_note(d)}"),
              *[f"- failed: `{n}`" for n in d.get("failed", [])],
              "", f"Demo: exit {dm.get('returncode', '?')}, job {dm.get('wall_seconds', '?')} s, " + ", ".join(
                  f"{k} {v}" for k, v in dm.items() if k.startswith("accuracy_")),
              "", "## Weight sync (Qwen2.5-0.5B-shaped, fp32)", "",
              *([f"- exit {ws['returncode']}{_verdict_note(ws)}"] if "returncode" in ws else [])]
    for key in ("colocated_ms", "colocated_gbps", "broadcast_ms", "broadcast_gbps", "broadcast_skipped",
                "memcpy_gbps"):
        if key in ws:
            lines.append(f"- {key}: {ws[key]:.3f}" if isinstance(ws[key], float) else f"- {key}: {ws[key]}")
    kc = report.get("kernel_configs", {})
    if kc.get("best"):
        lines += ["", "## From-logits kernel configs (bench/tune_logits.py, bf16, median)", "",
                  "| size | mode | best | ms | GB/s | vs copy | shipped ms | Liger GB/s |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['size']} | {r['mode']} | {r['best']} | {r['ms']:.3f} | {r['GBps']:.0f} | "
                  f"{r.get('vs_copy', float('nan')):.2f} | {r.get('shipped_ms', float('nan')):.3f} | "
                  f"{r.get('liger_GBps', float('nan')):.0f} |" for r in kc["best"]]
    lines += ["", "## Benchmarks (median)", ""]
    bench = report.get("benchmarks", {})
    lines += [f"- `{f}`: exit {r['returncode']}" + (f" ({r['skipped']})" if "skipped" in r else "")
              for f, r in bench.get("suites", {}).items() if r["returncode"] != 0]
    lines += ["", "| benchmark | ms | figures |", "|---|---|---|"]
    for r in bench.get("results", []):
        extra = ", ".join(f"{k}={val:.3g}" if isinstance(val, float) else f"{k}={val}" for k, val in r.items()
                          if k not in ("name", "median_ms"))
        lines.append(f"| `{r['name']}` | {r['median_ms']:.3f} | {extra} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path, name: str) -> None:
    """<out_dir>/<name>.json and .md as they stand; written after every stage (and every benchmark suite), so a
    stage that times out, or a run that is killed, keeps what finished. Status "running: ..." until the end."""
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(report))


def run_stages(report: dict, stages: dict[str, Callable[[], dict]], write: Callable[[dict], None]) -> list[str]:
    """Run each stage in order, recording its result in `report` and writing the report after each one; a stage
    that raises is recorded as failed and the rest still run. Returns the stages that failed."""
    failed = []
    for key, stage in stages.items():
        report["status"] = f"running: {key}"
        write(report)
        try:
            report[key] = stage()
        except Exception as e:  # noqa: BLE001 - recorded; the rest still runs
            report[key] = {"returncode": 1, "error": f"{type(e).__name__}: {e}"}
        print(f"{key}:", {k: v for k, v in report[key].items() if k not in ("failed", "results", "suites")},
              flush=True)
        if report[key].get("returncode", 0) != 0:
            failed.append(key)
    return failed


SKIP_NAMES = {"tests": "gpu_tests", "demo": "demo", "distributed": "distributed", "benchmarks": "benchmarks",
              "weight_sync": "weight_sync", "tune": "kernel_configs"}  # --skip -> stage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the .json and .md go")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per stage (tests, benchmarks, sync)")
    ap.add_argument("--skip", default="", help=f"comma list of stages to skip: {','.join(SKIP_NAMES)}")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (stages, commands, timeouts, skips) "
                                                            "as JSON and run nothing; works without CUDA")
    ap.add_argument("--gpus", type=int, default=None, help="plan for this many GPUs (default: the machine's)")
    ap.add_argument("--memory-gb", type=float, default=80.0, help="plan the benchmark cases against this much "
                                                                     "device memory (GB, 1e9 bytes; default 80)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled kernels only
    sys.path.insert(0, str(ROOT))
    import torch

    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    skip = set(filter(None, args.skip.split(",")))
    if skip - SKIP_NAMES.keys():
        ap.error(f"--skip {args.skip}: unknown stage(s) {sorted(skip - SKIP_NAMES.keys())}; "
                 f"choose from {','.join(SKIP_NAMES)}")
    if args.dry_run:
        stages = plan(Path(args.out) / "<gpu-name>-logs", gpus, args.timeout, args.memory_gb)
        for s in skip:
            stages[SKIP_NAMES[s]]["skipped"] = "--skip"
        print(json.dumps({"gpus": gpus, "stages": stages, "memory_plans": memory_plans()}, indent=2))
        return 0
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    work = out_dir / f"{name}-logs"
    work.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "versions": versions()}
    print(json.dumps(report["versions"]), flush=True)
    try:
        report["preflight"] = preflight()
    except Exception as e:  # noqa: BLE001 - recorded; the rest still runs
        report["preflight"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print("preflight:", report["preflight"], flush=True)

    def write(r: dict) -> None:
        write_report(r, out_dir, name)

    def bench_progress(partial: dict) -> None:  # each finished suite reaches the files at once
        write({**report, "benchmarks": partial})

    run = {"gpu_tests": lambda: gpu_tests(work, args.timeout),
           "demo": lambda: demo(work, args.timeout),
           "distributed": lambda: distributed(work, args.timeout, gpus),
           "benchmarks": lambda: benchmarks(work, args.timeout, bench_progress),
           "weight_sync": lambda: weight_sync(work, args.timeout),
           "kernel_configs": lambda: kernel_configs(work, args.timeout)}
    assert list(run) == list(stage_commands(work)), "a stage without a plan (or a plan without a stage)"
    for s in skip:
        report[SKIP_NAMES[s]] = {"skipped": "--skip", "seconds": 0}
    failed = run_stages(report, {k: f for k, f in run.items() if k not in report}, write)
    if not report["preflight"].get("ok"):
        failed.insert(0, "preflight")
    report["status"] = "failed: " + ", ".join(failed) if failed else "passed"
    write(report)
    print(f"{report['status']}; wrote {out_dir / name}.json and .md", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
