"""bench/tune_logits.py (the from-logits kernels' launch-config sweep for a GPU call) stays runnable and right.

Its correctness half, through the Triton interpreter at odd sizes: every forward variant it would time (the shipped
tile kernel at each candidate config, and the per-lane-accumulator variant) gives the float64 reference's log-prob
and entropy, and every backward config gives the reference gradient.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kernels.reference import token_logprobs_ref

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_tune_logits", ROOT / "bench" / "tune_logits.py")
tune = importlib.util.module_from_spec(_spec)
sys.modules["bench_tune_logits"] = tune
_spec.loader.exec_module(tune)


@pytest.mark.parametrize("T,V", [(5, 300), (4, 1271)])
@pytest.mark.parametrize("variant", ["tiles", "lanes"])
def test_every_forward_variant_matches_the_float64_reference(T, V, variant):
    kernel, configs = ((tune._token_logprobs_fwd_kernel, tune.FWD_CONFIGS) if variant == "tiles"
                       else (tune._fwd_lanes_kernel, tune.VEC_CONFIGS))
    g = torch.Generator().manual_seed(T * V)
    x = (3 * torch.randn(T, V, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, V, (T,), generator=g)
    keep = torch.rand(T, generator=g) < 0.7
    keep[0], keep[1] = True, False
    ref_logp, ref_ent = token_logprobs_ref(x.double(), labels, mask=keep, return_entropy=True, dtype=torch.float64)
    for block, warps in configs[:2]:  # the interpreter is slow: two configs a variant (the GPU sweep runs all)
        logp, ent, _ = tune._launch_fwd(kernel, x, labels, keep, True, block, warps)
        torch.testing.assert_close(logp.double(), torch.where(keep, ref_logp, 0.0), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), torch.where(keep, ref_ent, 0.0), atol=1e-5, rtol=0)


def test_backward_configs_give_the_reference_gradient():
    T, V = 5, 1271
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(T, V, generator=g)).to(torch.float32)
    labels = torch.randint(0, V, (T,), generator=g)
    keep = torch.tensor([True, False, True, True, False])
    gl, ge = torch.randn(T, generator=g), torch.randn(T, generator=g)
    xr = x.double().requires_grad_(True)
    lp, en = token_logprobs_ref(xr, labels, mask=keep, return_entropy=True, dtype=torch.float64)
    ((lp * gl.double()).sum() + (en * ge.double()).sum()).backward()
    _, ent, lse = tune._launch_fwd(tune._token_logprobs_fwd_kernel, x, labels, keep, True, 4096, 8)
    for block, warps in tune.BWD_CONFIGS[:2]:
        dx = torch.full_like(x, float("nan"))  # poisoned: every element must be written
        tune._launch_bwd(x, dx, labels, keep, lse, ent, gl, ge, True, block, warps)
        rel = ((dx.double() - xr.grad).norm() / xr.grad.norm()).item()
        assert rel < 1e-4, (block, warps, rel)


def test_the_sweep_starts_from_the_shipped_config_and_marks_no_variant_wrong():
    from kernels.logprobs import _block_v

    out = tune.run_size(5, 300, torch.bfloat16, "cpu", timed=False)
    block, warps = _block_v(300, torch.bfloat16, torch.device("cpu"))
    assert out["shipped"] == f"tiles-{block}-{warps}"
    assert next(iter(out["fwd"])) == out["shipped"] and next(iter(out["bwd"])) == out["shipped"] + "-ent"
    assert not [k for part in ("fwd", "bwd") for k, v in out[part].items() if v.get("wrong")]
    assert all(v["max_abs_err"] < 1e-5 for v in out["fwd"].values())
    assert all(v["max_abs_diff_vs_first"] == 0.0 for v in out["bwd"].values())  # every config, the same gradient
