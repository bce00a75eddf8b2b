"""Sequence packing benchmarks: training tokens/s packed vs padded, planner time, pack/unpack bandwidth.

    make bench                                   (pytest-benchmark, the issue's sizes)
    .venv/bin/python bench/bench_packing.py      (side-by-side table: padded vs packed tokens/s, the ratio,
                                                  planner time for 100k sequences)

Workload: RL-like response lengths, log-normal (median 200, sigma 1) clipped to a maximum length; a tiny Llama
(hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 97, fp32). One "step" is forward + backward of a weighted
next-token loss over every sample:
    padded   batches of 16 in order, each padded to its longest sample, 2D attention mask (the usual trainer)
    packed   planner micro-batches, rows bucketed to multiples of 256, block-diagonal causal mask
Tokens/s counts real tokens only, so the ratio is the useful work per second.

test_shared_prompt_attention: packed_sdpa forward + backward on one layer of a shared-prompt row shaped like the
demo's GRPO step (64 groups of 8, prompts of ~24 tokens, answers of 1-6), one padded sequence per tree (tree mask)
against one per branch (causal).

test_agent_row_attention: the same on the agent recipe's rows (branches of 113 and of 210-280 tokens), the branches
in one padded batch against the length-chunked layout (trainer.backend.sdpa_chunks).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _bench_utils import plan_entry, skip_unless_fits  # noqa: E402  (bench/ is on the path)

from kernels import pack, pack_batch, shift_left, unpack, use_backend  # noqa: E402
from trainer.backend.attention import default_attn_implementation, packed_logits  # noqa: E402
from trainer.batching.planner import bucket_length, plan_micro_batches, plan_stats  # noqa: E402

V = 97
PAD_BATCH = 16
# (samples, max length, token budget): full sizes for the measurement, small ones for the CI smoke run.
FULL = (128, 2048, 4096)  # the CLI also times budget = max length
SMALL = (16, 128, 256)


# The tiny Llama's shape (tiny_llama below) for the memory plan.
_LAYERS, _HIDDEN, _MLP, _HEADS = 2, 64, 128, 4


def step_bytes(layout: str, sizes: tuple = FULL) -> int:
    """Planned peak device bytes of one training step (fp32, 4 bytes), bounded by the largest forward: a padded
    batch of PAD_BATCH rows of the longest sample, or one packed row of the token budget (rows x L tokens).
    Per token: every block's saved activations (8 hidden-wide and 4 MLP-wide, generously) and the logits with
    their log_softmax and gradients (4 x V); per row: attention scores and probabilities with their gradients in
    every layer if materialised (4 x heads x L^2) and the mask (L^2); weights, gradients: negligible."""
    _, max_len, budget = sizes
    rows, length = (PAD_BATCH, max_len) if layout == "padded" else (1, max(budget, max_len))
    per_token = (_LAYERS * (8 * _HIDDEN + 4 * _MLP) + 4 * V) * 4
    per_row = (4 * _LAYERS * _HEADS + 1) * length * length * 4
    return rows * (length * per_token + per_row)


def pack_bytes(B: int, L: int, D: int) -> int:
    """Pack/unpack: the padded [B, L, D] fp32 input, the packed [<= B·L, D] copy and the unpacked output."""
    return 3 * B * L * D * 4


PACK_GPU = (64, 2048, 256)  # (B, L, D) at full size


def planned_cases(memory_bytes: float) -> list[dict]:
    """Every case this file runs on a GPU, with its planned bytes against `memory_bytes` (the planner runs on the
    host: no device bytes)."""
    out = [plan_entry(f"test_train_step_tokens_per_s[{lay}]", step_bytes(lay), memory_bytes)
           for lay in ("padded", "packed")]
    out += [plan_entry(f"test_pack_unpack_bandwidth[{op}-{p}]", pack_bytes(*PACK_GPU), memory_bytes)
            for op in ("pack", "unpack") for p in ("torch", "triton")]
    return out + [plan_entry("test_planner_time", 0, memory_bytes)]


def tiny_llama(device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    impl = default_attn_implementation(device, torch.float32)  # the model below is fp32
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32).to(device).train()


def lognormal_lengths(n: int, max_len: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(200), 1.0, n), 2, max_len).astype(int).tolist()


def make_workload(n, max_len, budget, device):
    lengths = lognormal_lengths(n, max_len)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (L,), generator=g).to(device) for L in lengths]
    plan = plan_micro_batches(lengths, token_budget=budget)[0]
    with use_backend("torch") if device == "cpu" else contextlib.nullcontext():
        rows = [pack_batch([seqs[i] for i in mb], pad_to=bucket_length(sum(lengths[i] for i in mb),
                                                                       token_budget=budget)) for mb in plan]
    padded = []
    for k in range(0, n, PAD_BATCH):
        chunk = seqs[k : k + PAD_BATCH]
        ids = torch.nn.utils.rnn.pad_sequence(chunk, batch_first=True, padding_value=0)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(chunk):
            mask[r, : s.shape[0]] = 1
        padded.append((ids, mask))
    return lengths, plan, rows, padded


def step_padded(model, padded):
    for ids, mask in padded:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [b, L, V]
        tgt = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
        F.cross_entropy(logits[:, :-1].reshape(-1, V), tgt.reshape(-1), ignore_index=-100, reduction="sum").backward()
    model.zero_grad(set_to_none=True)


def step_packed(model, rows):
    for row in rows:
        logits = packed_logits(model, row)  # [N, V]
        tgt = shift_left(row.input_ids, row.seq_index, fill=-100)
        F.cross_entropy(logits, tgt, ignore_index=-100, reduction="sum").backward()
    model.zero_grad(set_to_none=True)


def _sizes(request):
    return SMALL if request.config.getoption("benchmark_disable") else FULL


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_train_step_tokens_per_s(benchmark, request, layout):
    n, max_len, budget = _sizes(request)
    device = _device()
    if device == "cuda":
        skip_unless_fits(step_bytes(layout, (n, max_len, budget)))
    model = tiny_llama(device)
    lengths, plan, rows, padded = make_workload(n, max_len, budget, device)

    def run():
        if layout == "padded":
            step_padded(model, padded)
        else:
            step_packed(model, rows)
        _sync()

    benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=1)  # a full-size round is a minute on CPU
    real = sum(lengths)
    processed = (sum(r.padded_len for r in rows) if layout == "packed"
                 else sum(ids.numel() for ids, _ in padded))
    benchmark.extra_info.update(real_tokens=real, processed_tokens=processed, padding_efficiency=real / processed)
    if benchmark.stats is not None:
        benchmark.extra_info["tokens_per_s"] = real / benchmark.stats.stats.median


def test_planner_time(benchmark, request):
    n = 2_000 if request.config.getoption("benchmark_disable") else 100_000
    lengths = lognormal_lengths(n, 4096, seed=3)
    plan = benchmark.pedantic(plan_micro_batches, args=(lengths,), kwargs={"token_budget": 8192, "num_ranks": 8},
                              rounds=3, iterations=1)
    stats = plan_stats(lengths, plan, token_budget=8192)
    benchmark.extra_info.update(sequences=n, micro_batches_per_rank=stats.micro_batches_per_rank,
                                padding_efficiency=stats.padding_efficiency)
    assert stats.padding_efficiency > 0.9


@pytest.mark.parametrize("provider", ["torch", "triton"])
@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_pack_unpack_bandwidth(benchmark, request, provider, op):
    device = _device()
    if provider == "triton" and device == "cpu" and not request.config.getoption("benchmark_disable"):
        pytest.skip("the Triton path on CPU is the interpreter: a correctness tool, not a timing")
    B, L, D = (8, 64, 4) if request.config.getoption("benchmark_disable") else PACK_GPU
    if device == "cuda":
        skip_unless_fits(pack_bytes(B, L, D))
    lengths = torch.randint(1, L + 1, (B,), generator=torch.Generator().manual_seed(0)).tolist()
    x = torch.randn(B, L, D, device=device)
    flat = pack(x, lengths)
    with use_backend(provider):
        fn = (lambda: pack(x, lengths)) if op == "pack" else (lambda: unpack(flat, lengths, max_len=L))

        def run():
            fn()
            _sync()

        benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    moved = 2 * sum(lengths) * D * 4 + (B * L - sum(lengths)) * D * 4 * (op == "unpack")  # read + write bytes
    if benchmark.stats is not None:
        benchmark.extra_info["GB_per_s"] = moved / benchmark.stats.stats.median / 1e9


def shared_prompt_attention_inputs(n_trees: int, device: str, seed: int = 0):
    """One layer's q [1, 4, N, 32] and k/v [1, 2, N, 32] (fp32, requiring grad) over a shared-prompt row shaped like
    the demo's GRPO step: n_trees groups of 8, prompts of 23-25 tokens, answers of 1-6; and the row's tree kwargs
    for both packed_sdpa layouts."""
    from trainer.backend.attention import tree_block_kwargs, tree_branch_indices
    from trainer.batching.shared_prompt import build_shared_micro_batches
    from trainer.types import Sample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for t in range(n_trees):
        prompt = torch.randint(6, V, (int(torch.randint(23, 26, (), generator=g)),), generator=g).tolist()
        for _ in range(8):
            r = int(torch.randint(1, 7, (), generator=g))
            samples.append(Sample(prompt="", tokens=prompt + torch.randint(6, V, (r,), generator=g).tolist(),
                                  response_length=r, group_index=t))
    mb = build_shared_micro_batches(samples, token_budget=64 * n_trees, bucket_size=64)[0]
    row, trees = mb.row, mb.trees
    layouts = {"tree": tree_block_kwargs(row.seq_index.to(device), trees.end.to(device), row.lengths,
                                         torch.float32)}  # what the trainer passes
    gather, scatter = tree_branch_indices(trees.paths, row.padded_len, device)
    layouts["branch"] = dict(packed_gather_index=gather, packed_scatter_index=scatter)
    n = row.padded_len
    q = torch.randn(1, 4, n, 32, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 32, device=device, requires_grad=True) for _ in range(2))
    return (q, k, v), layouts


class _CausalAttention(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("layout", ["tree", "branch"])
def test_shared_prompt_attention(benchmark, request, layout):
    """packed_sdpa forward + backward on one layer of a shared-prompt row, in each of its two layouts (the trainer
    picks the one with fewer score elements: trainer.backend.attention.tree_block_layout)."""
    (q, k, v), layouts = shared_prompt_attention_inputs(8 if request.config.getoption("benchmark_disable") else 64,
                                                        _device())
    _time_attention(benchmark, (q, k, v), layouts[layout])
    benchmark.extra_info["score_elements"] = int(layouts[layout]["packed_gather_index"].shape[0]
                                                 * layouts[layout]["packed_gather_index"].shape[1] ** 2)


def _time_attention(benchmark, qkv: tuple[torch.Tensor, ...], kwargs: dict) -> None:
    """packed_sdpa forward + backward (under a fixed random upstream gradient) on q, k, v with `kwargs`."""
    from trainer.backend.attention import packed_sdpa_attention

    q = qkv[0]
    up = torch.randn(1, q.shape[2], q.shape[1], q.shape[3], device=q.device)

    def run():
        out, _ = packed_sdpa_attention(_CausalAttention(), *qkv, None, **kwargs)
        torch.autograd.grad((out * up).sum(), qkv)
        _sync()

    benchmark.pedantic(run, rounds=10, iterations=1, warmup_rounds=2)


def agent_row_attention_inputs(n_trees: int, device: str, seed: int = 0):
    """One layer's q [1, 4, N, 32] and k/v [1, 2, N, 32] (fp32, requiring grad) over shared-prompt rows shaped like
    the agent recipe's GRPO step (configs/agent_demo.toml; the lengths of its step 1, recorded: 16 groups of 8, prompts
    of 25 tokens, branches of 111-116 tokens (a tool call and the answer) for 3 in 4, 210-280 (two calls) for 1 in
    5, 2-100 (cut short) for the rest); and the per-branch layout's kwargs, as one padded batch and in chunks of
    each branch's owned queries (what eager blocks get)."""
    from trainer.backend.attention import tree_branch_indices
    from trainer.backend.sdpa_chunks import branch_owned_chunks

    rng = np.random.default_rng(seed)
    trees = []
    for _ in range(n_trees):
        u = rng.random(8)
        lens = np.where(u < 0.75, rng.integers(111, 117, 8), np.where(u < 0.95, rng.integers(210, 281, 8),
                                                                      rng.integers(2, 101, 8)))
        trees.append((25, tuple(int(x) for x in lens)))
    trees = tuple(trees)
    n = sum(p + sum(lens) for p, lens in trees)
    paths, o = [], 0  # each branch: its tree's prompt, then its own tokens (PromptTrees.paths)
    for p, lens in trees:
        b = o + p
        for r in lens:
            paths.append(((o, o + p), (b, b + r)))
            b += r
        o = b
    gather, scatter = tree_branch_indices(paths, n, device)
    layouts = {"one_batch": dict(packed_gather_index=gather, packed_scatter_index=scatter)}
    owned = branch_owned_chunks(paths, n, device)
    layouts["chunked"] = dict(packed_query_index=owned.query_index, packed_gather_index=owned.key_index,
                              packed_scatter_index=owned.scatter, packed_chunks=owned.chunks,
                              packed_chunk_masks=owned.masks, cost=owned.cost)
    q = torch.randn(1, 4, n, 32, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 32, device=device, requires_grad=True) for _ in range(2))
    return (q, k, v), layouts, trees


@pytest.mark.parametrize("layout", ["one_batch", "chunked"])
def test_agent_row_attention(benchmark, request, layout):
    """packed_sdpa forward + backward on one layer of the agent step's shared-prompt rows (branches of 113 and of
    210-280 tokens): the branches in one batch padded to the longest, or each branch's owned queries in batches of
    alike shapes (trainer.backend.sdpa_chunks.branch_owned_chunks, what eager blocks get). extra_info: the score
    elements each computes."""
    (q, k, v), layouts, trees = agent_row_attention_inputs(2 if request.config.getoption("benchmark_disable")
                                                           else 16, _device())
    kwargs = dict(layouts[layout])
    cost = kwargs.pop("cost", None)
    _time_attention(benchmark, (q, k, v), kwargs)
    lengths = [p + r for p, lens in trees for r in lens]
    benchmark.extra_info["score_elements"] = int(cost if cost is not None else len(lengths) * max(lengths) ** 2)


def _best_time(fn, arg) -> float:
    fn(model := arg[0], arg[1])  # warm-up
    _sync()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn(model, arg[1])
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    n, max_len, budget = FULL
    device = _device()
    model = tiny_llama(device)
    lengths, _, _, padded = make_workload(n, max_len, budget, device)
    real = sum(lengths)
    print(f"{n} samples, lengths log-normal median 200 clipped to {max_len}, {real} real tokens, device {device}")
    t_pad = _best_time(step_padded, (model, padded))
    eff = real / sum(i.numel() for i, _ in padded)
    label = f"padded (batches of {PAD_BATCH})"
    print(f"  {label:24s} {real / t_pad:8.0f} tokens/s  (best of 2: {t_pad:.2f} s, "
          f"padding efficiency {eff:.3f}, {len(padded)} forwards)")
    # The dense block-diagonal mask costs N^2 per row on CPU SDPA, so the budget trades padding for masked work.
    for b in sorted({max_len, budget}):
        _, _, rows, _ = make_workload(n, max_len, b, device)
        t = _best_time(step_packed, (model, rows))
        eff = real / sum(r.padded_len for r in rows)
        label = f"packed (budget {b})"
        print(f"  {label:24s} {real / t:8.0f} tokens/s  (best of 2: {t:.2f} s, padding "
              f"efficiency {eff:.3f}, {len(rows)} forwards)  ratio vs padded {t_pad / t:.2f}x")
    big = lognormal_lengths(100_000, 4096, seed=3)
    t0 = time.perf_counter()
    plan = plan_micro_batches(big, token_budget=8192, num_ranks=8)
    dt = time.perf_counter() - t0
    st = plan_stats(big, plan, token_budget=8192)
    print(f"  planner: 100k sequences, budget 8192, 8 ranks: {dt:.3f} s, {st.micro_batches_per_rank} micro-batches "
          f"per rank, padding efficiency {st.padding_efficiency:.4f}")


if __name__ == "__main__":
    main()
