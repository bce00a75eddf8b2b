"""`make gpu-check`: one command that validates a CUDA machine and records what it measured.

In one run: versions and a compiled-kernel preflight (a Triton kernel must run as a compiled `JITFunction`, not
the interpreter, and match torch); every `gpu`-marked test; the benchmarks at their CUDA sizes (kernel GB/s
against a copy, Liger side by side where it is importable, the train step; pytest-benchmark JSON); the weight sync
of a Qwen2.5-0.5B-shaped model, colocated and broadcast (bench/bench_weight_sync.py --json). Writes
bench/results/<gpu-name>.json and bench/results/<gpu-name>.md.

Exit status: 0 all passed, 1 something failed (the report says what), 2 no CUDA device (nothing is run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
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


def gpu_tests(work: Path, timeout_s: float) -> dict:
    """Every gpu-marked test, compiled kernels; counts from the JUnit XML."""
    xml = work / "gpu_tests.xml"
    rc, secs = _run([sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                     "--benchmark-disable", f"--junitxml={xml}"], work / "gpu_tests.log", timeout_s)
    out = {"returncode": rc, "seconds": round(secs, 1), "log": str(work / "gpu_tests.log")}
    if xml.exists():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        out.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
    return out


def benchmarks(work: Path, timeout_s: float) -> dict:
    """The pytest-benchmark suites at their CUDA sizes (weight sync separately, below)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").glob("bench_*.py")
                   if p.name != "bench_weight_sync.py")
    js = work / "benchmarks.json"
    rc, secs = _run([sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "--benchmark-only",
                     f"--benchmark-json={js}"], work / "benchmarks.log", timeout_s)
    out = {"returncode": rc, "seconds": round(secs, 1), "files": files, "results": []}
    if js.exists():
        for b in json.loads(js.read_text()).get("benchmarks", []):
            out["results"].append({"name": b["fullname"], "median_ms": 1e3 * b["stats"]["median"],
                                   **{k: v for k, v in b.get("extra_info", {}).items()
                                      if isinstance(v, int | float | str)}})
    return out


def weight_sync(work: Path, timeout_s: float) -> dict:
    log = work / "weight_sync.log"
    rc, secs = _run([sys.executable, "bench/bench_weight_sync.py", "--json", "--device", "cuda"], log, timeout_s)
    out = {"returncode": rc, "seconds": round(secs, 1)}
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        out.update(json.loads(lines[-1]))
    return out


def markdown(report: dict) -> str:
    v, t, ws = report["versions"], report["gpu_tests"], report["weight_sync"]
    lines = [f"# gpu-check on {v['gpu']}", "", f"{report['date']} · status **{report['status']}**", "",
             "| component | version |", "|---|---|", *[f"| {k} | {val} |" for k, val in v.items()], "",
             f"Preflight (compiled Triton kernel vs torch): {report['preflight']}", "",
             f"GPU tests: {t.get('tests', '?')} run, {t.get('failures', '?')} failed, {t.get('errors', '?')} errors, "
             f"{t.get('skipped', '?')} skipped ({t['seconds']} s).", *[f"- failed: `{n}`" for n in t.get("failed", [])],
             "", "## Weight sync (Qwen2.5-0.5B-shaped, fp32)", ""]
    for key in ("colocated_ms", "colocated_gbps", "broadcast_ms", "broadcast_gbps", "broadcast_skipped",
                "memcpy_gbps"):
        if key in ws:
            lines.append(f"- {key}: {ws[key]:.3f}" if isinstance(ws[key], float) else f"- {key}: {ws[key]}")
    lines += ["", "## Benchmarks (median)", "", "| benchmark | ms | figures |", "|---|---|---|"]
    for r in report["benchmarks"].get("results", []):
        extra = ", ".join(f"{k}={val:.3g}" if isinstance(val, float) else f"{k}={val}" for k, val in r.items()
                          if k not in ("name", "median_ms"))
        lines.append(f"| `{r['name']}` | {r['median_ms']:.3f} | {extra} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the .json and .md go")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per stage (tests, benchmarks, sync)")
    ap.add_argument("--skip", default="", help="comma list of stages to skip: tests,benchmarks,weight_sync")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled kernels only
    sys.path.insert(0, str(ROOT))
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
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
    report["gpu_tests"] = gpu_tests(work, args.timeout) if "tests" not in skip else {"skipped": "--skip", "seconds": 0}
    print("gpu tests:", {k: v for k, v in report["gpu_tests"].items() if k != "failed"}, flush=True)
    report["benchmarks"] = benchmarks(work, args.timeout) if "benchmarks" not in skip else {"skipped": "--skip"}
    print("benchmarks:", report["benchmarks"].get("returncode"), flush=True)
    report["weight_sync"] = weight_sync(work, args.timeout) if "weight_sync" not in skip else {"skipped": "--skip"}
    print("weight sync:", report["weight_sync"], flush=True)
    failed = [k for k in ("gpu_tests", "benchmarks", "weight_sync") if report[k].get("returncode", 0) != 0]
    if not report["preflight"].get("ok"):
        failed.insert(0, "preflight")
    report["status"] = "failed: " + ", ".join(failed) if failed else "passed"
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown(report))
    print(f"{report['status']}; wrote {out_dir / name}.json and .md", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
