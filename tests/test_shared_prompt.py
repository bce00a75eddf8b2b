"""Shared-prompt layout (trainer.batching.shared_prompt): a group's prompt runs once, and every log-prob, loss,
metric and
gradient equals the plain layout's (one sequence per sample) and the per-sequence float64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_support import assert_same_attention

from engines.tiny import tiny_model_config
from kernels import PolicyLossConfig, use_backend
from trainer.backend.attention import (
    PACKED_SDPA,
    packed_attention_kwargs,
    packed_hidden_states,
    supports_shared_prompts,
    tree_block_indices,
    tree_block_kwargs,
    tree_block_layout,
    tree_causal_mask,
)
from trainer.backend.models import load_hf_model
from trainer.backend.steps import build_components, compute_logprobs, forward_backward, trainer_config_from
from trainer.batching.micro_batches import attach_logprobs, build_micro_batches
from trainer.batching.shared_prompt import build_shared_micro_batches, prompt_trees, tree_cost, trie_nodes
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig, SFTTrainingConfig
from trainer.types import Sample


@pytest.fixture(autouse=True)
def _torch_path():
    with use_backend("torch"):
        yield


def force_layout(monkeypatch, layout: str | None) -> None:
    """packed_sdpa's shared-prompt layout forced to "tree" or "branch" (tree_block_layout picks by cost)."""
    if layout is not None:
        monkeypatch.setattr("trainer.backend.attention.tree_block_layout", lambda *args, **kw: layout)


@pytest.fixture(params=["tree", "branch"])
def packed_sdpa_layout(request, monkeypatch):
    force_layout(monkeypatch, request.param)
    return request.param


def grouped_samples(seed: int, groups: int = 6, vocab: int = 90, alike: bool = False) -> list[Sample]:
    """Groups of 1-5 samples sharing a random prompt (1-12 tokens), responses of 0-9 tokens with random loss masks
    and engine log-probs, the groups interleaved (a fleet returns them out of order); plus a sample with an empty
    prompt and a second group with the first group's prompt (same tokens, another group id: they share too).
    alike: a group's responses begin with the same 0-6 tokens, then one of two 0-4-token continuations (so some
    of its samples share more than others: a trie), then 0-5 of their own (some whole responses equal)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))  # noqa: E731
    prompts = [torch.randint(6, vocab, (rnd(1, 13),), generator=g).tolist() for _ in range(groups)]
    prompts.append(prompts[0])
    out = []
    for gi, prompt in enumerate(prompts):
        opening = torch.randint(6, vocab, (rnd(0, 7),), generator=g).tolist() if alike else []
        middles = [torch.randint(6, vocab, (rnd(0, 5),), generator=g).tolist() for _ in range(2)] if alike else [[]]
        for _ in range(rnd(1, 6)):
            own = torch.randint(6, vocab, (rnd(0, 6) if alike else rnd(0, 10),), generator=g).tolist()
            resp = opening + middles[rnd(0, len(middles))] + own
            r = len(resp)
            out.append(Sample(prompt="", tokens=prompt + resp, response_length=r, group_index=gi,
                              loss_mask=(torch.rand(r, generator=g) > 0.25).long().tolist(),
                              rollout_logprobs=(-torch.rand(r, generator=g) * 3).tolist()))
    out.append(Sample(prompt="", tokens=torch.randint(6, vocab, (5,), generator=g).tolist(), response_length=5))
    perm = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in perm]


def per_sample(mbs, values, samples) -> dict[int, torch.Tensor]:
    """Per-micro-batch [N] or [M] values -> {sample index: values at its trained response tokens, in order}."""
    out = {}
    for mb, v in zip(mbs, values):
        if mb.trees is not None:  # loss rows: sample by sample, in sample_index order
            cu = mb.segments.tolist()
            for k, i in enumerate(mb.sample_index):
                out[i] = v[cu[k]:cu[k + 1]]
        else:  # row positions: from the position predicting the first trained response token
            cu = mb.row.cu_seqlens.tolist()
            for k, i in enumerate(mb.sample_index):
                s = samples[i]
                first = cu[k] + max(s.prompt_length - 1, 0)
                out[i] = v[first:cu[k + 1] - 1]
    return out


def per_token(mbs, values, samples) -> list[torch.Tensor]:
    """Inverse of `per_sample`: per-sample lists (one value per response token) -> per-micro-batch [N] or [M]
    tensors at the positions predicting those tokens, 0 elsewhere: the shape `compute_logprobs` returns, for
    `attach_logprobs`."""
    out = []
    for mb in mbs:
        t = torch.zeros(mb.labels.shape[0])
        cu = (mb.segments if mb.trees is not None else mb.row.cu_seqlens).tolist()
        for k, i in enumerate(mb.sample_index):
            s = samples[i]
            v = torch.tensor(values[i][0 if s.prompt_length else 1:], dtype=torch.float32)  # trained tokens only
            first = cu[k] if mb.trees is not None else cu[k] + max(s.prompt_length - 1, 0)
            t[first:first + len(v)] = v
        out.append(t)
    return out


def reference_logprobs(model, s: Sample) -> torch.Tensor:
    """Log-probs of a sample's trained response tokens: its own forward in float64, full vocabulary."""
    ids = torch.tensor(s.tokens)[None]
    logp = F.log_softmax(model(input_ids=ids).logits[0].double(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return logp[max(s.prompt_length - 1, 0):]


def test_prompt_trees_share_identical_prompts_only_and_fit_the_budget():
    samples = grouped_samples(0)
    trees = prompt_trees(samples, token_budget=20)
    assert sorted(i for t in trees for i in t) == list(range(len(samples)))
    for t in trees:
        p = samples[t[0]].prompt_length
        assert all(samples[i].tokens[:p] == samples[t[0]].tokens[:p] and samples[i].prompt_length == p for i in t)
        assert tree_cost(samples, t) <= 20 or len(t) == 1
    # Without a budget limit, one tree per distinct prompt: the two groups with equal prompt tokens share one.
    distinct = {s.tokens[:s.prompt_length] for s in samples if s.prompt_length}
    empty = sum(1 for s in samples if s.prompt_length == 0)
    assert len(prompt_trees(samples, token_budget=10_000)) == len(distinct) + empty
    # A tree costs its prompt once: far fewer row tokens than one sequence per sample.
    unshared = sum(len(s.tokens) for s in samples)
    shared = sum(tree_cost(samples, t) for t in prompt_trees(samples, 10_000))
    assert shared < unshared


def test_trie_nodes_lay_out_every_run_that_samples_share_once():
    seqs = [(1, 2, 5, 6, 7, 8), (1, 2, 5, 6, 9), (1, 2, 5, 6, 7, 8), (1, 2, 5, 6, 7, 8, 3), (1, 2)]
    assert list(trie_nodes(seqs)) == [
        ([0, 1, 2, 3, 4], 0, 2, 0),  # the prompt: sample 4 ends here
        ([0, 1, 2, 3], 2, 4, 1),  # [5, 6], alike in the rest
        ([0, 2, 3], 4, 6, 2),  # [7, 8]: samples 0 and 2 end here, 3 goes on
        ([3], 6, 7, 3),  # [3]
        ([1], 4, 5, 2),  # [9]
    ]
    assert list(trie_nodes([(4, 4)])) == [([0], 0, 2, 0)] and list(trie_nodes([])) == []
    assert list(trie_nodes([(1,), (2,)])) == [([0, 1], 0, 0, 0), ([0], 0, 1, 1), ([1], 0, 1, 1)]  # empty root


def test_a_tree_is_its_samples_trie_and_each_sample_keeps_its_loss_rows():
    def sample(prompt, resp):
        return Sample(prompt="", tokens=tuple(prompt + resp), response_length=len(resp))

    samples = [sample([1, 2], [5, 6, 7, 8]), sample([1, 2], [5, 6, 9]), sample([1, 2], [5, 6, 7, 8]),
               sample([1, 2], [5, 6, 7, 8, 3]), sample([1, 2], [5, 6, 7, 4])]
    # [1, 2, 5, 6] once, then [7] (under it [8] -> [3], and [4]), then [9]
    assert tree_cost(samples, range(5)) == 4 + 1 + 1 + 1 + 1 + 1
    (mb,) = build_shared_micro_batches(samples, token_budget=64, bucket_size=1)
    assert mb.row.input_ids.tolist() == [1, 2, 5, 6, 7, 8, 3, 4, 9]
    assert mb.row.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 4]
    assert mb.trees.end.tolist() == [9, 9, 9, 9, 8, 7, 7, 8, 9]  # each node's subtree ends there
    assert mb.trees.paths == (((0, 4), (4, 5), (5, 6)), ((0, 4), (8, 9)), ((0, 4), (4, 5), (5, 6)),
                              ((0, 4), (4, 5), (5, 6), (6, 7)), ((0, 4), (4, 5), (7, 8)))
    # Each sample's response tokens are still trained once each, with their own labels; a token is predicted by
    # the hidden state of the token before it on the sample's own path.
    assert mb.labels.tolist() == [5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 8, 5, 6, 7, 8, 3, 5, 6, 7, 4]
    assert mb.trees.hidden_index.tolist() == [1, 2, 3, 4, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 5, 1, 2, 3, 4]


def test_tree_mask_is_each_samples_own_causal_mask():
    # Tree 0: prompt of 2, branches of 2 and 1; tree 1: prompt of 1, one branch of 2; then a 2-token padding tail.
    end = torch.tensor([5, 5, 4, 4, 5, 8, 8, 8, 10, 10])
    m = tree_causal_mask(end)[0, 0]
    allowed = {i: set(torch.nonzero(m[i]).flatten().tolist()) for i in range(10)}
    assert allowed[1] == {0, 1}  # prompt: itself causally
    assert allowed[3] == {0, 1, 2, 3}  # branch 0: prompt + own branch
    assert allowed[4] == {0, 1, 4}  # branch 1 does not see branch 0
    assert allowed[7] == {5, 6, 7} and allowed[9] == {8, 9}  # next tree; the tail is its own causal block
    f = tree_causal_mask(end, torch.float32)[0, 0]
    assert torch.equal(f == 0, m)
    # A deeper trie (the module docstring's): [p0 p1 p2 x0 x1 | y0 y1 | z0 | w0 w1], z under y, w beside y.
    m = tree_causal_mask(torch.tensor([10] * 5 + [8, 8, 8, 10, 10]))[0, 0]
    allowed = {i: set(torch.nonzero(m[i]).flatten().tolist()) for i in range(10)}
    assert allowed[7] == {0, 1, 2, 3, 4, 5, 6, 7}  # z0: the prefix, its parent y, itself
    assert allowed[9] == {0, 1, 2, 3, 4, 8, 9}  # w1: the prefix and w, not its sibling y's subtree


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("block_size", [4, 16])
def test_flex_tree_block_mask_equals_the_dense_tree_mask(block_size):
    """FlexAttention's shared-prompt mask (the CUDA path without flash-attn) against SDPA with the dense tree mask,
    through flex_attention's eager implementation on CPU, on real shared-prompt rows; full tiles hold only allowed
    pairs and every allowed pair lies in a listed tile."""
    from torch.nn.attention.flex_attention import flex_attention

    from trainer.backend.attention import flex_tree_block_mask

    mbs = build_shared_micro_batches(grouped_samples(3), token_budget=128, bucket_size=16)
    g = torch.Generator().manual_seed(7)
    for mb in mbs:
        end = mb.trees.end
        n = end.shape[0]
        q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
        mask = flex_tree_block_mask(end, block_size)
        dense = tree_causal_mask(end)
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=dense), rtol=0, atol=1e-5)
        allowed = dense[0, 0]
        nb = -(-n // block_size)
        pad = torch.zeros(nb * block_size, nb * block_size, dtype=torch.bool)
        pad[:n, :n] = allowed
        tiles = pad.view(nb, block_size, nb, block_size).permute(0, 2, 1, 3).reshape(nb, nb, -1)
        listed = mask.to_dense()[0, 0].bool()  # [nb, nb]: tiles listed as partial or full
        assert bool((tiles.any(-1) <= listed).all())  # every allowed pair is in a listed tile
        counts, cols = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
        full = torch.zeros(nb, nb, dtype=torch.bool)
        for i in range(nb):
            full[i, cols[i, :counts[i]].long()] = True
        assert bool(tiles[full].all())  # a full tile (mask_mod skipped) holds allowed pairs only
        if block_size == 4:  # prompts longer than a tile: some tiles are full, so the skip is exercised
            assert int(counts.sum()) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn, layout", [(PACKED_SDPA, "tree"), (PACKED_SDPA, "branch"), ("sdpa", None),
                                          ("eager", None)])
def test_shared_prompt_hidden_states_equal_each_samples_own_forward(arch, attn, layout, monkeypatch):
    force_layout(monkeypatch, layout)
    model = load_hf_model(tiny_model_config(arch), dtype=torch.float32, seed=1)
    model.set_attn_implementation(attn)
    samples = grouped_samples(1, alike=True)
    mbs = build_shared_micro_batches(samples, token_budget=64, bucket_size=16)
    assert len(mbs) >= 2 and all(mb.trees is not None for mb in mbs)
    assert any(len(path) > 2 for mb in mbs for path in mb.trees.paths)  # a trie deeper than prompt + branches
    got = {}
    with torch.no_grad():
        for mb in mbs:
            hidden = packed_hidden_states(model, mb.row, mb.trees)  # [N, H]
            for path in mb.trees.paths:  # each branch's sequence: its row ranges
                got.setdefault("rows", []).append(torch.cat([hidden[a:b] for a, b in path]))
        order = [i for mb in mbs for i in mb.sample_index]
        for i, h in zip(order, got["rows"]):
            ref = model.model(input_ids=torch.tensor(samples[i].tokens)[None]).last_hidden_state[0]
            torch.testing.assert_close(h, ref, atol=2e-5, rtol=1e-5)


def two_level(trees) -> tuple[list[int], float]:
    """(prompt length, branch lengths) per tree -> tree_block_layout's (tree lengths, branch cost: the whole
    sequences in one padded batch, as with compiled blocks)."""
    from trainer.backend.sdpa_chunks import chunked_cost

    branches = [p + r for p, lens in trees for r in lens]
    return [p + sum(lens) for p, lens in trees], chunked_cost(branches, waste=float("inf"))


def test_tree_block_layout_picks_the_fewer_score_elements():
    # 64 trees of 24 + 8 x 3 tokens (the demo): 64 * 48^2 < 512 * 27^2; long answers: 1 * 8100^2 > 8 * 1100^2 / 2.
    assert tree_block_layout(*two_level(((24, (3,) * 8),) * 64)) == "tree"
    assert tree_block_layout(*two_level(((100, (1000,) * 8),))) == "branch"
    # At the tie: one tree of 8 + 4 x 4 (24^2 = 576) against 4 branches of 12 (4 * 144 = 576) -> tree; one token
    # more per answer tips it: 28^2 = 784 against 4 * 13^2 = 676.
    assert tree_block_layout(*two_level(((8, (4, 4, 4, 4)),))) == "tree"
    assert tree_block_layout(*two_level(((8, (5, 5, 5, 5)),))) == "branch"
    # Branches of 512 tokens or more count half (causal block skipping): 624^2 = 389k against 2 * 512^2 / 2 = 262k
    # -> branch; two tokens shorter, 622^2 = 387k against the full 2 * 510^2 = 520k -> tree.
    assert tree_block_layout(*two_level(((400, (112, 112)),))) == "branch"
    assert tree_block_layout(*two_level(((398, (112, 112)),))) == "tree"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("additive", [False, True])
def test_tree_block_attention_equals_dense_tree_mask_sdpa(seed, kv_heads, additive):
    """packed_sdpa's tree layout (one padded sequence per tree, the tree mask) against SDPA over the whole row with
    the dense tree mask, output and q/k/v gradients under a random upstream gradient, on real shared-prompt rows
    (groups of 1-5, empty responses, an empty prompt, a padding tail)."""
    from trainer.backend.attention import packed_sdpa_attention

    class _Attn(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(seed)
    mb = build_shared_micro_batches(grouped_samples(seed, alike=seed > 0), token_budget=256, bucket_size=16)[0]
    row, trees = mb.row, mb.trees
    n, h, d = row.padded_len, 4, 8
    q = torch.randn(1, h, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    gather, scatter, mask = tree_block_indices(row.seq_index, trees.end, row.lengths)
    assert gather.shape[0] == len(row.lengths) and mask.shape == (len(row.lengths), 1, *gather.shape[1:] * 2)
    if additive:  # what packed_attention_kwargs passes: 0 / the dtype's min, made once for every layer
        # (kv_heads 1: a float32 mask under float64 q/k/v, a compute dtype other than the model's: converted)
        dt = torch.float32 if kv_heads == 1 else torch.float64
        kw = tree_block_kwargs(row.seq_index, trees.end, row.lengths, dt)
        assert kw["packed_gather_index"].equal(gather) and kw["packed_scatter_index"].equal(scatter)
        mask = kw["packed_block_mask"]
        assert mask.dtype == dt and mask.shape == (len(row.lengths), 1, *gather.shape[1:] * 2)
    out, _ = packed_sdpa_attention(_Attn(), q, k, v, None, scaling=0.3, packed_gather_index=gather,
                                   packed_scatter_index=scatter, packed_block_mask=mask)  # [1, N, H, D]
    dense = tree_causal_mask(trees.end)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.3,
                                          enable_gqa=kv_heads != h).transpose(1, 2)
    real = row.num_tokens  # the padding tail: zeros from packed_sdpa, its own causal block in the dense mask
    assert bool((out[:, real:] == 0).all())
    assert_same_attention(out, want, (q, k, v), real, g)


def test_an_attention_without_a_tree_path_says_how_to_fix_it():
    # flash-attn 2/3 have one (tests/test_shared_prompt_flash.py); transformers' flash_attention_4 has none here.
    model = load_hf_model(tiny_model_config(), dtype=torch.float32)
    mbs = build_shared_micro_batches(grouped_samples(2), token_budget=64, bucket_size=16)
    model.config._attn_implementation = "flash_attention_4"
    assert not supports_shared_prompts(model)
    with pytest.raises(ValueError, match="share_prompts = false"):
        packed_attention_kwargs(model, mbs[0].row, mbs[0].trees)


def _components(loss: str, seed: int = 3, temperature: float = 0.7):
    """loss "policy": a GRPO step's components (the policy loss at the rollout's temperature); "nll": SFT's."""
    shared = dict(token_budget=64, micro_batch_buckets=16, optim=OptimConfig(lr=1e-3), seed=seed)
    phase = SFTTrainingConfig(**shared) if loss == "nll" else RLTrainingConfig(
        **shared, rollout=RolloutConfig(apply_chat_template=False, temperature=temperature),
        loss=PolicyLossConfig(loss_agg="seq-mean-token-mean", kl_coef=0.05, rollout_correction="tis",
                              log_entropy=True))
    return build_components(tiny_model_config("qwen2"), trainer_config_from(phase, compile=False))


@pytest.mark.parametrize("alike", [False, True])
@pytest.mark.parametrize("seed", [4, 5])
def test_shared_prompt_logprobs_match_the_float64_reference(seed, alike):
    samples = grouped_samples(seed, alike=alike)
    comp = _components("policy", temperature=1.0)
    ref_model = load_hf_model(tiny_model_config("qwen2"), dtype=torch.float64, seed=3)
    mbs = build_shared_micro_batches(samples, token_budget=64, bucket_size=16)
    got = per_sample(mbs, compute_logprobs(comp, mbs), samples)
    assert sorted(got) == list(range(len(samples)))
    with torch.no_grad():
        for i, s in enumerate(samples):
            want = reference_logprobs(ref_model, s) if s.response_length else torch.zeros(0, dtype=torch.float64)
            mask = torch.tensor(s.effective_loss_mask[0 if s.prompt_length else 1:], dtype=torch.float64)
            torch.testing.assert_close(got[i].double(), want * mask, atol=1e-5, rtol=0)  # 0 off the loss mask


@pytest.mark.parametrize("alike", [False, True])
@pytest.mark.parametrize("seed", [6, 7])
def test_shared_prompt_loss_metrics_and_gradients_equal_the_plain_layout(seed, packed_sdpa_layout, alike):
    """The whole policy step (KL to a reference, TIS, entropy, per-sequence aggregation) in both layouts; with
    alike responses the trees also share parts of the responses (a trie deeper than prompt + branches)."""
    samples = grouped_samples(seed, alike=alike)
    g = torch.Generator().manual_seed(seed)
    adv = (torch.randn(len(samples), generator=g)).tolist()
    old = [(-torch.rand(s.response_length, generator=g) * 2).tolist() for s in samples]
    ref = [(-torch.rand(s.response_length, generator=g) * 2).tolist() for s in samples]
    results = {}
    for name, build in (("plain", build_micro_batches), ("shared", build_shared_micro_batches)):
        comp = _components("policy", seed=3)
        mbs = build(samples, token_budget=64, bucket_size=16, advantages=adv)
        mbs = attach_logprobs(mbs, per_token(mbs, old, samples), "old_logprobs")
        mbs = attach_logprobs(mbs, per_token(mbs, ref, samples), "ref_logprobs")
        tokens = sum(mb.row.num_tokens for mb in mbs)
        metrics = forward_backward(comp, mbs).result()
        grads = {n: p.grad.detach().full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                 for n, p in comp.root.named_parameters()}
        lp = per_sample(mbs, compute_logprobs(comp, mbs), samples)  # after the backward: same weights, no step
        results[name] = (metrics, grads, tokens, lp)
    (m_plain, g_plain, t_plain, lp_plain), (m_shared, g_shared, t_shared, lp_shared) = \
        results["plain"], results["shared"]
    assert t_shared < 0.8 * t_plain  # the prompts ran once per tree
    assert set(m_plain) == set(m_shared)
    for k in m_plain:
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-5, abs=1e-6), k
    for n in g_plain:
        rel = (g_shared[n] - g_plain[n]).norm() / g_plain[n].norm().clamp_min(1e-12)
        assert rel < 1e-4, (n, float(rel))
    for i in lp_plain:
        torch.testing.assert_close(lp_shared[i], lp_plain[i], atol=1e-5, rtol=0)


def test_shared_nll_equals_plain_nll():
    """The layout is loss-agnostic: the SFT loss through it equals the plain layout's."""
    samples = grouped_samples(8)
    out = []
    for build in (build_micro_batches, build_shared_micro_batches):
        comp = _components("nll")
        out.append(forward_backward(comp, build(samples, token_budget=64, bucket_size=16)).result()["loss"])
    assert out[1] == pytest.approx(out[0], rel=1e-5)
