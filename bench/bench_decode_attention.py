"""The engine's decode attention: one token a row against a left-padded KV cache, bf16, GQA.

    .venv/bin/python -m pytest bench/bench_decode_attention.py --benchmark-only

Providers
    repeat_kv     what transformers' sdpa path (sdpa_attention_forward) runs under torch.compile (the CUDA engine's
                  decode) and, before its pack_gqa (transformers 5.2x; the GPU machine has 5.17), always: each KV
                  head copied per query head (repeat_kv), then SDPA
    transformers  sdpa_attention_forward as installed (5.24 here: the queries packed as the engine's)
    engine        engines/embedded/attention.py: SDPA on the queries folded as [B, Hkv, n_rep, D], each KV head read
                  once, compiled or not
Both on the cache's strided views [B, Hkv, L, D] of a buffer twice as wide, under a [B, 1, 1, L] bool mask: what a
decode step of the embedded engine calls once a layer. The derived figure is GB/s of the cache (K and V:
2·B·Hkv·L·D·2 bytes read once); the ratio of the two providers in one run is what to compare. Shapes: Qwen2.5-0.5B's
heads (14 query over 2 KV heads, head dim 64).
"""

from __future__ import annotations

import pytest
import torch
from _bench_utils import _device, _shape, _sync, plan_entry, skip_unless_fits
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from engines.embedded.attention import engine_attention

PROVIDERS = ("repeat_kv", "transformers", "engine")
# name -> (device, (rows B, query heads H, KV heads Hkv, cached columns L, head dim D))
SIZES = {"cpu-B64-L512": ("cpu", (64, 14, 2, 512, 64)),
         "cuda-B256-L2048": ("cuda", (256, 14, 2, 2048, 64)),
         "cuda-B64-L8192": ("cuda", (64, 14, 2, 8192, 64))}
SMALL = (4, 4, 2, 33, 16)


class _Attn(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def case_bytes(provider: str, shape: tuple) -> int:
    """Planned peak device bytes (bf16): the cache buffer 2·(B·Hkv·2L·D)·2, queries and outputs 2·B·H·D·2, the mask;
    repeat_kv and transformers (which copies as repeat_kv does in 5.17) add the per-query-head copy of the keys and
    values, 2·B·H·L·D·2."""
    b, h, hkv, length, d = shape
    nbytes = 2 * b * hkv * 2 * length * d * 2 + 2 * b * h * d * 2 + b * length
    return nbytes + (2 * b * h * length * d * 2 if provider != "engine" else 0)


def planned_cases(memory_bytes: float) -> list[dict]:
    """Every CUDA case this file runs, with its planned bytes against `memory_bytes`."""
    return [plan_entry(f"test_decode_attention[{p}-{size}]", case_bytes(p, shape), memory_bytes)
            for size, (device, shape) in SIZES.items() if device == "cuda" for p in PROVIDERS]


def make_inputs(shape: tuple, device: str, seed: int = 0):
    """q [B, H, 1, D] (q_proj's view), key/value views [B, Hkv, L, D] of [B, Hkv, 2L, D] buffers, mask [B, 1, 1, L]
    keeping each row's last 1..L columns."""
    b, h, hkv, length, d = shape
    g = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: ~0.3 G values at the CUDA sizes
    rand = dict(generator=g, device=device, dtype=torch.bfloat16)
    q = torch.randn(b, 1, h, d, **rand).transpose(1, 2)
    k, v = (torch.randn(b, hkv, 2 * length, d, **rand)[:, :, :length] for _ in range(2))
    real = torch.randint(1, length + 1, (b,), generator=g, device=device)
    mask = torch.arange(length, device=device)[None, :] >= (length - real)[:, None]
    return q, k, v, mask[:, None, None, :]


def _repeat_kv_attention(module, q, k, v, mask):
    """transformers' copying path: [B, H, 1, D] queries against keys/values repeated to H heads -> [B, 1, H, D]."""
    n_rep = module.num_key_value_groups
    out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_decode_attention(benchmark, request, provider, size):
    device = _device()
    small = request.config.getoption("benchmark_disable")
    shape = _shape(SIZES, size, SMALL, device, small)
    if device == "cuda":
        skip_unless_fits(case_bytes(provider, shape))
    q, k, v, mask = make_inputs(shape, device)
    module = _Attn(shape[1] // shape[2])
    fn = dict(repeat_kv=_repeat_kv_attention, transformers=sdpa_attention_forward, engine=engine_attention)[provider]

    def run():
        out, _ = fn(module, q, k, v, mask)
        _sync()
        return out

    with torch.inference_mode():
        out = benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
        # Both providers compute the same attention: the engine's equals transformers' (bit for bit on the CPU)
        want, _ = sdpa_attention_forward(module, q, k, v, mask)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=0)
    if benchmark.stats is not None:
        b, _, hkv, length, d = shape
        benchmark.extra_info["cache_GB_per_s"] = 2 * b * hkv * length * d * 2 / benchmark.stats.stats.median / 1e9
    benchmark.extra_info.update(device=device, shape=list(shape))
