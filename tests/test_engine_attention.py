"""The engine's CPU decode attention (engines/embedded/attention.py) against transformers' sdpa: the same outputs on
fresh random inputs (float64), the same decoded log-probs through a whole engine model, and sdpa's path for
everything else."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engines.embedded.attention import ENGINE_SDPA, MAX_QUERY_TOKENS, engine_attention, use_engine_attention
from engines.embedded.presets import build_tiny_model, load_engine_model


class _Attn(torch.nn.Module):
    is_causal = True

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("q_len", [1, 3, MAX_QUERY_TOKENS])
def test_decode_attention_equals_transformers_sdpa(kv_heads, seed, q_len):
    """q_len query tokens a row (a decode step: 1; a speculative step: the last token and its draft, causal among
    themselves) against strided cache views of q_len-90 keys, random padding masks (every row keeps the keys of the
    tokens fed now), a non-default scale: equal to sdpa_attention_forward to 1e-12 in float64."""
    g = torch.Generator().manual_seed(seed)
    b, h, d, cap = 7, 4, 16, 128
    length = int(torch.randint(q_len, 91, (1,), generator=g))
    q = torch.randn(b, h, q_len, d, generator=g, dtype=torch.float64)
    k_buf, v_buf = (torch.randn(b, kv_heads, cap, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = k_buf[:, :, :length], v_buf[:, :, :length]  # the cache's views: strided
    real = torch.randint(q_len, length + 1, (b,), generator=g)  # row i's real keys are its last real[i]
    columns = torch.arange(length)
    padding = columns[None, :] >= (length - real)[:, None]  # [B, L]
    causal = columns[None, :] <= (length - q_len + torch.arange(q_len))[:, None]  # [q, L]: query j at L - q + j
    mask = (padding[:, None, :] & causal[None])[:, None]  # [B, 1, q, L]
    module = _Attn(h // kv_heads)
    got, _ = engine_attention(module, q, k, v, mask, scaling=0.37)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.37)
    assert got.shape == want.shape == (b, q_len, h, d)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_a_row_with_every_key_masked_stays_finite_and_prefill_goes_to_sdpa():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(2))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    out, _ = engine_attention(_Attn(2), q, k, v, mask)
    assert bool(torch.isfinite(out).all())
    want, _ = sdpa_attention_forward(_Attn(2), q[:1], k[:1], v[:1], mask[:1])
    torch.testing.assert_close(out[:1], want, atol=1e-6, rtol=0)
    # Half precision keeps SDPA (float32 accumulation), bit for bit.
    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert torch.equal(engine_attention(_Attn(2), *half, mask)[0], sdpa_attention_forward(_Attn(2), *half, mask)[0])
    # More query tokens a row than a speculative step feeds (prefill): SDPA with enable_gqa, bit for bit the path
    # transformers takes (test_prefill_attention_is_transformers_sdpa_bit_for_bit).
    n = MAX_QUERY_TOKENS + 1
    q = torch.randn(2, 4, n, 8, generator=g)
    k, v = (torch.randn(2, 2, n + 2, 8, generator=g) for _ in range(2))
    pmask = torch.ones(2, 1, n, n + 2, dtype=torch.bool).tril(2)
    a, _ = engine_attention(_Attn(2), q, k, v, pmask)
    b, _ = sdpa_attention_forward(_Attn(2), q, k, v, pmask)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_attention_is_transformers_sdpa_bit_for_bit(kv_heads, dtype, seed):
    """A prefill (more query tokens a row than a speculative step feeds) reads each KV head for its query heads
    (SDPA's enable_gqa) where transformers' sdpa path copies the keys and values per query head first: the same
    numbers, bit for bit, on strided cache views with left padding and the causal part (an agent's turn-2 prefill:
    new tokens after a reused prefix)."""
    g = torch.Generator().manual_seed(seed)
    b, h, d, cap = 5, 4, 16, 160
    q_len = MAX_QUERY_TOKENS + 1 + int(torch.randint(0, 30, (1,), generator=g))
    length = q_len + int(torch.randint(0, 100, (1,), generator=g))
    q = torch.randn(b, h, q_len, d, generator=g, dtype=dtype)
    k_buf, v_buf = (torch.randn(b, kv_heads, cap, d, generator=g, dtype=dtype) for _ in range(2))
    k, v = k_buf[:, :, :length], v_buf[:, :, :length]
    real = torch.randint(q_len, length + 1, (b,), generator=g)
    columns = torch.arange(length)
    padding = columns[None, :] >= (length - real)[:, None]
    causal = columns[None, :] <= (length - q_len + torch.arange(q_len))[:, None]
    mask = (padding[:, None, :] & causal[None])[:, None]  # [B, 1, q, L]
    module = _Attn(h // kv_heads)
    got, _ = engine_attention(module, q, k, v, mask, scaling=0.29)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.29)
    assert got.shape == want.shape == (b, q_len, h, d) and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_models_use_it_and_decode_the_same_logits(tmp_path, dtype):
    """load_engine_model switches a model to ENGINE_SDPA; a batch of left-padded rows decoded step by step with a
    cache gives the logits of the same model under transformers' sdpa: float32 (the CPU's matmul path) to 1e-5;
    bf16 (the CUDA engines' dtype: the folded SDPA path) bit for bit, transformers' decode packing the query heads as
    ours does since 5.2x (the same kernel on the same numbers)."""
    build_tiny_model(0, arch="qwen2", hidden_size=64, num_heads=4, num_kv_heads=2).save_pretrained(tmp_path / "m")
    from engines.tiny import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path / "m")
    ours, _ = load_engine_model(str(tmp_path / "m"), dtype=dtype)
    assert ours.config._attn_implementation == ENGINE_SDPA
    ref, _ = load_engine_model(str(tmp_path / "m"), dtype=dtype)
    ref.set_attn_implementation("sdpa")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(6, 200, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding: rows of 9, 5 and 7 real tokens
    mask[2, :2] = 0
    outs = []
    for model in (ours, ref):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache, m, logits = out.past_key_values, mask, [out.logits[:, -1]]
            for _ in range(6):
                nxt = logits[-1].argmax(-1, keepdim=True)
                m = torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], 1)
                out = model(input_ids=nxt, attention_mask=m, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1])
        outs.append(torch.stack(logits))
    if dtype == torch.bfloat16:
        import transformers.integrations.sdpa_attention as sdpa_module

        if hasattr(sdpa_module, "pack_gqa"):
            assert torch.equal(outs[0], outs[1])
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=5e-2, rtol=0)
    else:
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    use_engine_attention(ref)  # only sdpa models are switched: this one is sdpa again -> switched
    assert ref.config._attn_implementation == ENGINE_SDPA


def _decode_case(g, b, h, kv_heads, d, cap, dtype, device="cpu"):
    """A decode step's inputs: q [B, H, 1, D] as q_proj's view (one token a row), strided cache views [B, Hkv, L, D]
    of a buffer of `cap` columns, a left-padding mask [B, 1, 1, L] (every row keeps at least its newest key)."""
    length = int(torch.randint(1, cap + 1, (1,), generator=g))
    q = torch.randn(b, 1, h, d, generator=g).to(device, dtype).transpose(1, 2)
    k_buf, v_buf = (torch.randn(b, kv_heads, cap, d, generator=g).to(device, dtype) for _ in range(2))
    real = torch.randint(1, length + 1, (b,), generator=g)
    mask = torch.arange(length)[None, :] >= (length - real)[:, None]  # [B, L]
    return q, k_buf[:, :, :length], v_buf[:, :, :length], mask[:, None, None, :].to(device)


def _attention64(q, k, v, mask, scale):
    """The float64 reference on the same values: [B, H, q, D] queries, [B, Hkv, L, D] keys/values, mask
    [B, 1, q, L] -> [B, q, H, D]."""
    q, k, v = (t.double() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_half_precision_decode_folds_the_query_heads_instead_of_copying_the_cache(kv_heads, dtype, seed,
                                                                                  monkeypatch):
    """A decode step off the matmul path (half precision here; CUDA takes the same branch) runs SDPA on the queries
    folded as [B, Hkv, n_rep, D], also where transformers' sdpa path copies each KV head per query head (repeat_kv):
    under torch.compile (the CUDA engine's decode) and in transformers before its own pack_gqa (5.17, the GPU
    machine's). Ours never calls repeat_kv; it equals transformers' pack_gqa path bit for bit (where transformers
    has one) and is as close to the float64 attention as the repeat_kv path is; a speculative step's too."""
    import transformers.integrations.sdpa_attention as sdpa_module

    g = torch.Generator().manual_seed(seed)
    q, k, v, mask = _decode_case(g, 9, 8, kv_heads, 32, 70, dtype)
    module = _Attn(8 // kv_heads)
    n_rep = 8 // kv_heads
    exact = _attention64(q, k, v, mask, 0.21)
    installed, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.21)
    copied = torch.nn.functional.scaled_dot_product_attention(
        q, sdpa_module.repeat_kv(k, n_rep), sdpa_module.repeat_kv(v, n_rep), attn_mask=mask, scale=0.21).transpose(1, 2)
    copies = []
    repeat_kv = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda x, n: copies.append(n) or repeat_kv(x, n))
    # as a compiled decode traces it (transformers 5.2x packs the queries itself only outside torch.compile)
    monkeypatch.setattr(sdpa_module, "is_torchdynamo_compiling", lambda: True, raising=False)
    got, _ = engine_attention(module, q, k, v, mask, scaling=0.21)
    assert copies == []
    assert got.shape == installed.shape == (9, 1, 8, 32) and got.dtype == dtype
    if hasattr(sdpa_module, "pack_gqa"):
        assert torch.equal(got, installed)
    ours, theirs = ((t.double() - exact).abs().max().item() for t in (got, copied))
    eps = torch.finfo(dtype).eps
    assert ours <= theirs + eps and ours <= 4 * eps, (ours, theirs)
    # A speculative step (3 query tokens a row, causal among themselves): folded too, the mask repeated per head
    q3 = torch.randn(9, 8, 3, 32, generator=g).to(dtype)
    keep = mask.clone()
    keep[..., -3:] = True  # every row holds the three tokens fed now
    mask3 = keep.expand(9, 1, 3, k.shape[2]).tril(k.shape[2] - 3)
    got3, _ = engine_attention(module, q3, k, v, mask3, scaling=0.21)
    assert copies == [] and got3.shape == (9, 3, 8, 32)
    copied3 = torch.nn.functional.scaled_dot_product_attention(
        q3, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask3, scale=0.21).transpose(1, 2)
    exact3 = _attention64(q3, k, v, mask3, 0.21)
    ours, theirs = ((t.double() - exact3).abs().max().item() for t in (got3, copied3))
    assert ours <= theirs + eps and ours <= 4 * eps, (ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["fold", "matmuls"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_values_with_their_own_head_dim(dtype, q_len):
    """Values of another head dim than queries and keys (MLA-style models: 24 vs 16 here): the output is
    [B, q, H, Dv], transformers' sdpa result on both of our paths (it reshaped to the query's D before)."""
    g = torch.Generator().manual_seed(8)
    b, h, hkv, length = 3, 4, 2, 11
    q = torch.randn(b, h, q_len, 24, generator=g).to(dtype)
    k = torch.randn(b, hkv, length, 24, generator=g).to(dtype)
    v = torch.randn(b, hkv, length, 16, generator=g).to(dtype)
    mask = torch.ones(b, 1, q_len, length, dtype=torch.bool).tril(length - q_len)
    mask[0, ..., :4] = False
    got, _ = engine_attention(_Attn(2), q, k, v, mask)
    want, _ = sdpa_attention_forward(_Attn(2), q, k, v, mask)
    assert got.shape == want.shape == (b, q_len, h, 16)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)


@pytest.mark.gpu
def test_cuda_decode_reads_the_cache_without_copying_it(monkeypatch):
    """On CUDA (bf16, a Qwen2.5-0.5B-like 14 query over 2 KV heads, 256 rows x 2048 columns), as the compiled decode
    traces it: the decode attention never calls repeat_kv, allocates less than a tenth of the per-query-head copy
    transformers' sdpa makes there, and its outputs are transformers' to bf16 rounding."""
    import transformers.integrations.sdpa_attention as sdpa_module

    g = torch.Generator().manual_seed(7)
    q, k, v, mask = _decode_case(g, 256, 14, 2, 64, 2048, torch.bfloat16, device="cuda")
    module = _Attn(7)
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    copies = []
    repeat_kv = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda x, n: copies.append(n) or repeat_kv(x, n))
    monkeypatch.setattr(sdpa_module, "is_torchdynamo_compiling", lambda: True, raising=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got, _ = engine_attention(module, q, k, v, mask)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert copies == []
    copy = 2 * k.shape[0] * 14 * k.shape[2] * 64 * 2  # repeat_kv's keys and values [B, H, L, D] in bf16
    assert extra < copy / 10, (extra, copy)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)
