"""The shared-prompt (tree) layout on flash-attn (trainer.backend.attention.tree_flash_attention): each branch's
sequence (its tree's prompt, then the branch) is one varlen segment of a gathered layout, attended by flash-attn's
causal varlen kernel and scattered back to the row.

flash-attn cannot run on this machine, so the tests prove everything around the kernel, by construction: the
indices against a plain construction from the trees, and the attention function and a whole model with the kernel
replaced by a float64 reference varlen causal attention (`reference_kernel`), patched in where transformers loads
flash-attn, so transformers' own flash_attention_forward routes cu_seq_lens / max_length to it as it would to
flash-attn. What remains for a GPU with flash-attn: the real kernel on these inputs (bf16 numerics) and no host
sync in the call.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers.modeling_flash_attention_utils as fa_utils
from transformers import AttentionInterface
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engines.tiny import tiny_model_config
from trainer.backend.attention import (
    packed_attention_kwargs,
    packed_hidden_states,
    packed_placeholder_mask,
    supports_shared_prompts,
    tree_causal_mask,
    tree_flash_attention,
    tree_varlen_indices,
)
from trainer.backend.models import load_hf_model
from trainer.batching.micro_batches import build_micro_batches
from trainer.batching.shared_prompt import build_shared_micro_batches
from trainer.types import Sample

FLASH = ("flash_attention_2", "flash_attention_3")


@pytest.fixture
def reference_kernel(monkeypatch):
    """flash-attn's varlen kernel replaced by causal SDPA per segment in float64, with flash_attn_varlen_func's
    signature (transformers reads it to pick the kwargs it passes); returns the list of recorded calls."""
    calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        # q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; query head h reads kv head h // (H / Hkv), as flash-attn.
        cu = cu_seqlens_q.tolist()
        calls.append(dict(cu=cu, cu_k=cu_seqlens_k.tolist(), max_q=max_seqlen_q, max_k=max_seqlen_k, causal=causal,
                          scale=softmax_scale, tokens=q.shape[0], dtype=cu_seqlens_q.dtype))
        assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and cu[-1] == q.shape[0]
        rep = q.shape[1] // k.shape[1]
        out = []
        for a, b in zip(cu, cu[1:]):
            qs, ks, vs = (x[a:b].transpose(0, 1).double() for x in (q, k, v))  # [h, L, D]
            o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0),
                                               is_causal=causal, scale=softmax_scale)
            out.append(o.transpose(0, 1).to(q.dtype))
        return torch.cat(out)

    def dense_kernel(*args, **kwargs):
        raise AssertionError("the dense (non-varlen) flash kernel must not be called on a packed row")

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        return dense_kernel, flash_attn_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input

    # transformers caches the loaded kernels in module globals: keep them, and restore them after the test.
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        if hasattr(fa_utils, name):
            monkeypatch.setattr(fa_utils, name, getattr(fa_utils, name))
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)
    monkeypatch.setattr(fa_utils, "_lazy_imports", lazy_imports)
    return calls


def random_trees(g: torch.Generator) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], int]:
    """1-4 trees: prompts of 0-9 tokens (an empty prompt has one branch, as prompt_trees makes it), 1-5 branches of
    0-7 tokens (a branch of 0 tokens keeps a prompt-only sequence); a padding tail of 0-5 -> (trees, N)."""
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))  # noqa: E731
    trees = []
    for _ in range(rnd(1, 5)):
        p = rnd(0, 10)
        lens = [rnd(1, 8)] if p == 0 else [rnd(0, 8) for _ in range(rnd(1, 6))]
        trees.append((p, tuple(lens)))
    total = sum(p + sum(lens) for p, lens in trees)
    return tuple(trees), total + rnd(0, 6)


def paths_of(trees) -> tuple[tuple[tuple[int, int], ...], ...]:
    """(prompt length, branch lengths) per tree -> PromptTrees.paths: each branch's row ranges, its tree's prompt
    (none when empty) then its own tokens (none when empty), as pack_tree_micro_batch lays a two-level trie."""
    paths, o = [], 0
    for p, lens in trees:
        b = o + p
        for r in lens:
            paths.append(tuple(x for x in ((o, o + p), (b, b + r)) if x[1] > x[0]))
            b += r
        o = b
    return tuple(paths)


def row_labels(trees, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] tree ids (-1 on the tail) and [N] subtree ends (PromptTrees.end: a prompt token's is its tree's end, a
    branch token's its branch's, the tail's N) of a row, as pack_tree_micro_batch lays a two-level trie."""
    seq, end, o = [], [], 0
    for t, (p, lens) in enumerate(trees):
        tree_end = o + p + sum(lens)
        seq += [t] * p
        end += [tree_end] * p
        b = o + p
        for r in lens:
            seq += [t] * r
            end += [b + r] * r
            b += r
        o = tree_end
    tail = n - len(seq)
    return torch.tensor(seq + [-1] * tail), torch.tensor(end + [n] * tail)


def expected_indices(paths, end: torch.Tensor):
    """(cu, gather, scatter, max_len) built another way: branch b's segment is every row token its last token
    attends (j <= last < end[j], the mask rule); a row token's output comes from the first segment holding it, or
    (the tail) from the zero row T."""
    end = end.tolist()
    lasts = [path[-1][1] - 1 for path in paths]
    segs = [[j for j in range(last + 1) if last < end[j]] for last in lasts]
    starts = [sum(len(s) for s in segs[:b]) for b in range(len(segs) + 1)]
    total = starts[-1]
    scatter = []
    for i in range(len(end)):
        b = next((b for b, seg in enumerate(segs) if i in seg), None)
        scatter.append(total if b is None else starts[b] + segs[b].index(i))
    return starts, [i for s in segs for i in s], scatter, max(len(s) for s in segs)


@pytest.mark.parametrize("seed", range(25))
def test_tree_varlen_indices_equal_a_construction_from_the_row(seed):
    trees, n = random_trees(torch.Generator().manual_seed(seed))
    seq, end = row_labels(trees, n)
    cu, gather, scatter, max_len = tree_varlen_indices(paths_of(trees), n)
    want_cu, want_gather, want_scatter, want_max = expected_indices(paths_of(trees), end)
    assert cu.tolist() == want_cu and gather.tolist() == want_gather and scatter.tolist() == want_scatter
    assert max_len == want_max and isinstance(max_len, int)
    assert cu.dtype == gather.dtype == scatter.dtype == torch.int32  # flash-attn takes int32 cu_seqlens
    # One copy: the three tensors are views of one buffer.
    assert len({t.untyped_storage().data_ptr() for t in (cu, gather, scatter)}) == 1
    # Each segment is a sample's own sequence: the row positions it gathers carry the position ids 0, 1, 2, ...
    # (the prompt's 0..P-1, then the branch's P, P+1, ...), as the packer numbers them.
    row_pos = [k for p, lens in trees for k in [*range(p), *(j for r in lens for j in range(p, p + r))]]
    gathered = [row_pos[i] for i in gather.tolist()]
    assert gathered == [j for a, b in zip(want_cu, want_cu[1:]) for j in range(b - a)]


def test_tree_varlen_indices_on_real_micro_batches():
    """The packer's rows (tries deeper than prompt + branches, from build_shared_micro_batches) give the same
    indices, and each segment's tokens are its sample's, in order."""
    samples = random_samples(11)
    mbs = build_shared_micro_batches(samples, token_budget=64, bucket_size=16)
    assert len(mbs) >= 2 and any(len(path) > 2 for mb in mbs for path in mb.trees.paths)
    for mb in mbs:
        cu, gather, scatter, max_len = tree_varlen_indices(mb.trees.paths, mb.row.padded_len)
        want = expected_indices(mb.trees.paths, mb.trees.end)
        assert (cu.tolist(), gather.tolist(), scatter.tolist(), max_len) == want
        ids, c = mb.row.input_ids[gather.long()].tolist(), cu.tolist()
        assert [tuple(ids[a:b]) for a, b in zip(c, c[1:])] == [samples[i].tokens for i in mb.sample_index]


def test_tree_varlen_indices_reject_a_bad_tree_structure():
    with pytest.raises(ValueError, match="PromptTrees.paths"):
        tree_varlen_indices((), 8)  # no branch
    with pytest.raises(ValueError, match="padded_len=4"):
        tree_varlen_indices((((0, 3), (3, 5)),), 4)  # more tokens than the row
    with pytest.raises(ValueError, match="non-empty"):
        tree_varlen_indices(((),), 4)  # an empty sequence
    with pytest.raises(ValueError, match=r"row positions \[2\] lie on no branch"):
        tree_varlen_indices((((0, 2), (3, 4)),), 8)  # a hole in the row


def attention_module(impl: str = "flash_attention_2") -> SimpleNamespace:
    """What transformers' flash_attention_forward reads from the attention module."""
    return SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl), is_causal=True, layer_idx=0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("impl", FLASH)
@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: GQA, 4 query heads over 2 kv heads
@pytest.mark.parametrize("seed", range(6))
def test_tree_flash_attention_equals_the_dense_tree_mask(reference_kernel, impl, kv_heads, seed):
    """Forward and q/k/v gradients (a random upstream gradient) of the gathered varlen path against SDPA with the
    dense tree mask, float64; the kernel receives the gathered layout's cu_seqlens and max length."""
    g = torch.Generator().manual_seed(100 + seed)
    trees, n = random_trees(g)
    seq, end = row_labels(trees, n)
    real = int((seq >= 0).sum())
    h, d, scale = 4, 8, 0.3
    q = torch.randn(1, h, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    up = torch.randn(1, n, h, d, generator=g, dtype=torch.float64)
    up[:, real:] = 0  # the tail's outputs feed nothing in training
    cu, gather, scatter, max_len = tree_varlen_indices(paths_of(trees), n)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len,
              tree_gather_index=gather, tree_scatter_index=scatter, position_ids=torch.arange(n)[None])
    out, weights = tree_flash_attention(attention_module(impl), q, k, v, packed_placeholder_mask("cpu"),
                                        dropout=0.0, scaling=scale, **kw)
    assert weights is None and out.shape == (1, n, h, d)
    grads = torch.autograd.grad(out, (q, k, v), up)
    rep = h // kv_heads
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=tree_causal_mask(end), scale=scale).transpose(1, 2)
    want = torch.autograd.grad(dense, (q, k, v), up)
    torch.testing.assert_close(out[:, :real], dense[:, :real], rtol=0, atol=1e-5)
    assert not out[:, real:].any()  # the padding tail: zeros, never computed
    for name, a, b in zip("qkv", grads, want):
        assert rel(a, b) < 1e-4, (name, rel(a, b))
    (call,) = reference_kernel  # one kernel call, on the gathered layout
    assert call["cu"] == call["cu_k"] == cu.tolist() and call["dtype"] == torch.int32
    assert call["max_q"] == call["max_k"] == max_len and call["causal"] and call["scale"] == scale
    assert call["tokens"] == cu[-1]


def test_the_gather_sums_the_prompt_gradients_over_the_branches(reference_kernel):
    """The prompt's K/V gradient is the sum of its copies' gradients: run the gathered layout on leaf copies (the
    plain layout, one prompt copy per sample) and add each copy's gradient into its row position."""
    trees, n = ((5, (3, 0, 4)), (2, (1, 2))), 20
    cu, gather, scatter, max_len = tree_varlen_indices(paths_of(trees), n)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    up = torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64)
    up[:, sum(p + sum(lens) for p, lens in trees):] = 0
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    out, _ = tree_flash_attention(attention_module(), q, k, v, None, scaling=0.5, tree_gather_index=gather,
                                  tree_scatter_index=scatter, **kw)
    got = torch.autograd.grad(out, (k, v), up)
    copies = [x.detach()[:, :, gather.long()].requires_grad_() for x in (q, k, v)]  # [1, h, T, D] leaves
    flat, _ = flash_attention_forward(attention_module(), *copies, None, scaling=0.5, **kw)  # [1, T, h, D]
    # A row token's upstream gradient lands on the copy its output is read from (a prompt token: the first
    # branch's); the other prompt copies' queries get none, their keys get their branch's queries' gradients.
    t = flat.shape[1]
    up_flat = torch.zeros(1, t + 1, 2, 8, dtype=torch.float64)
    up_flat[0, scatter.long()] = up[0]  # the tail (all zeros) lands on the extra row t
    per_copy = torch.autograd.grad(flat, copies[1:], up_flat[:, :t])
    for a, c in zip(got, per_copy):
        summed = torch.zeros_like(a).index_add_(2, gather.long(), c)
        torch.testing.assert_close(a, summed, rtol=0, atol=1e-12)
    # Tree 0's prompt has three copies; those with response tokens (branches 0 and 2) both contribute.
    assert all(float(c[:, :, cu[i]:cu[i] + 5].abs().sum()) > 0 for c in per_copy for i in (0, 2))


def test_without_tree_kwargs_it_is_transformers_flash_attention(reference_kernel):
    """Registered over transformers' flash names: a plain call (the plain layout's varlen kwargs) is unchanged."""
    assert all(ALL_ATTENTION_FUNCTIONS[name] is tree_flash_attention for name in FLASH)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7, scaling=0.4)
    a, _ = tree_flash_attention(attention_module(), q, k, v, None, **kw)
    b, _ = flash_attention_forward(attention_module(), q, k, v, None, **kw)
    assert torch.equal(a, b) and len(reference_kernel) == 2


def random_samples(seed: int, groups: int = 5, vocab: int = 90) -> list[Sample]:
    """Groups of 1-5 samples sharing a random prompt of 1-12 tokens, responses of 0-11 tokens (one of the group's
    two 0-3-token openings, so some samples share more than the prompt, then 0-7 of their own), interleaved; plus
    one sample with an empty prompt."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))  # noqa: E731
    out = []
    for gi in range(groups):
        prompt = torch.randint(6, vocab, (rnd(1, 13),), generator=g).tolist()
        openings = [torch.randint(6, vocab, (rnd(0, 4),), generator=g).tolist() for _ in range(2)]
        for _ in range(rnd(1, 6)):
            resp = openings[rnd(0, 2)] + torch.randint(6, vocab, (rnd(0, 8),), generator=g).tolist()
            out.append(Sample(prompt="", tokens=prompt + resp, response_length=len(resp), group_index=gi))
    out.append(Sample(prompt="", tokens=torch.randint(6, vocab, (5,), generator=g).tolist(), response_length=5))
    return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]


def trained_rows(model, mbs, samples) -> dict[int, torch.Tensor]:
    """{sample index: [R', H] hidden states that predict its response tokens} from packed forwards, in either
    layout (tree: the loss rows hidden_index; plain: the row positions from the prompt's last token on)."""
    out = {}
    for mb in mbs:
        hidden = packed_hidden_states(model, mb.row, mb.trees)  # [N, H]
        if mb.trees is not None:
            rows, cu = hidden[mb.trees.hidden_index], mb.segments.tolist()
            for k, i in enumerate(mb.sample_index):
                out[i] = rows[cu[k]:cu[k + 1]]
        else:
            cu = mb.row.cu_seqlens.tolist()
            for k, i in enumerate(mb.sample_index):
                first = cu[k] + max(samples[i].prompt_length - 1, 0)
                out[i] = hidden[first:cu[k + 1] - 1]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_layout_on_flash_equals_the_plain_layout_in_a_model(reference_kernel, seed):
    """A tiny Qwen2 (GQA) with attn_implementation "flash_attention_2" and the reference kernel, float64: the same
    hidden states and parameter gradients (a random loss on every trained row) in both layouts."""
    samples = random_samples(seed)
    model = load_hf_model(tiny_model_config("qwen2"), dtype=torch.float64, seed=1)
    model.config._attn_implementation = "flash_attention_2"  # flash-attn is not installed: set, not loaded
    assert supports_shared_prompts(model)
    results = {}
    for name, build in (("plain", build_micro_batches), ("shared", build_shared_micro_batches)):
        mbs = build(samples, token_budget=64, bucket_size=16)
        model.zero_grad()
        reference_kernel.clear()
        rows = trained_rows(model, mbs, samples)
        g = torch.Generator().manual_seed(seed)
        loss = sum((torch.randn(rows[i].shape, generator=g, dtype=torch.float64) * rows[i]).sum()
                   for i in range(len(samples)))
        loss.backward()
        segments = sorted(b - a for call in reference_kernel for a, b in zip(call["cu"], call["cu"][1:]))
        results[name] = (rows, {p: w.grad.clone() for p, w in model.named_parameters() if w.grad is not None},
                         sum(mb.row.padded_len for mb in mbs), segments)
    (rows_p, grads_p, n_p, _), (rows_s, grads_s, n_s, segments) = results["plain"], results["shared"]
    assert n_s < n_p  # the prompts ran once per tree
    assert sorted(rows_s) == list(range(len(samples)))
    for i in rows_p:
        torch.testing.assert_close(rows_s[i], rows_p[i], rtol=0, atol=1e-5)
    assert set(grads_s) == set(grads_p) and len(grads_p) > 10  # every backbone parameter (the head is unused)
    for p in grads_p:
        assert rel(grads_s[p], grads_p[p]) < 1e-4, (p, rel(grads_s[p], grads_p[p]))
    # The shared rows ran the kernel on the gathered layout: one segment per sample (its prompt, then its
    # response), in each of the model's two layers.
    layers = model.config.num_hidden_layers
    assert segments == sorted([len(s.tokens) for s in samples] * layers)


def test_the_plain_flash_layout_skips_transformers_packed_sequence_detection(reference_kernel, monkeypatch):
    """The plain layout on flash passes the placeholder mask, so transformers' mask code returns it untouched and
    never runs find_packed_sequence_indices on the position_ids (a host read on CUDA: issue 42 item 7); the
    cu_seq_lens say where the sequences start. Each sequence's hidden states equal its own forward."""
    import transformers.masking_utils as masking_utils

    def detect(*args, **kwargs):
        raise AssertionError("find_packed_sequence_indices ran: a host read of the position_ids on CUDA")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", detect)
    samples = random_samples(3)
    model = load_hf_model(tiny_model_config("qwen2"), dtype=torch.float64, seed=2)
    model.config._attn_implementation = "flash_attention_2"  # flash-attn is not installed: set, not loaded
    mbs = build_micro_batches(samples, token_budget=64, bucket_size=16)
    assert len(mbs) >= 2
    for mb in mbs:
        kw = packed_attention_kwargs(model, mb.row)
        assert kw["attention_mask"].shape == packed_placeholder_mask("cpu").shape
        with torch.no_grad():
            hidden = packed_hidden_states(model, mb.row)  # [N, H]
        cu = mb.row.cu_seqlens.tolist()
        model.config._attn_implementation = "sdpa"  # each sequence alone, no packing: plain causal sdpa
        try:
            for k, i in enumerate(mb.sample_index):
                ids = torch.tensor([samples[i].tokens])
                with torch.no_grad():
                    alone = model.model(input_ids=ids).last_hidden_state[0]
                torch.testing.assert_close(hidden[cu[k]:cu[k + 1]], alone, rtol=0, atol=1e-10)
        finally:
            model.config._attn_implementation = "flash_attention_2"
    assert reference_kernel and all(call["causal"] for call in reference_kernel)


def test_a_flash_name_registered_to_another_function_fails_clearly(monkeypatch):
    """If something re-registers flash_attention_2 after this module, the tree kwargs would be ignored: refuse."""
    model = load_hf_model(tiny_model_config("qwen2"), dtype=torch.float32)
    model.config._attn_implementation = "flash_attention_2"
    mb = build_shared_micro_batches(random_samples(3), token_budget=64, bucket_size=16)[0]
    assert "tree_gather_index" in packed_attention_kwargs(model, mb.row, mb.trees)
    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", flash_attention_forward)
    with pytest.raises(ValueError, match="share_prompts = false"):
        packed_attention_kwargs(model, mb.row, mb.trees)
