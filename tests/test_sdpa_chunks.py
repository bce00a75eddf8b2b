"""packed_sdpa's length-chunked layout (trainer.backend.sdpa_chunks): the chunks bound the padding, partition the
sequences, and attention over them equals SDPA with the dense document / tree mask (float64, forward and gradients);
compiled blocks keep the one-batch layout."""

import pytest
import torch
import torch.nn.functional as F
from attention_support import assert_same_attention

from kernels import pack_batch, use_backend
from trainer.backend.attention import (
    MIN_BRANCH_QUERIES,
    PACKED_SDPA,
    block_causal_mask,
    packed_attention_kwargs,
    packed_hidden_states,
    packed_sdpa_attention,
    tree_block_layout,
    tree_causal_mask,
)
from trainer.backend.sdpa_chunks import WASTE, branch_owned_chunks, chunked_cost, owned_queries, plain_chunked_indices
from trainer.batching.shared_prompt import build_shared_micro_batches
from trainer.types import Sample


class _Attn(torch.nn.Module):
    is_causal = True


def _random_lengths(g: torch.Generator, n_max: int = 60, l_max: int = 400) -> list[int]:
    n = int(torch.randint(1, n_max, (1,), generator=g))
    return torch.randint(1, l_max, (n,), generator=g).tolist()


def _chunk_members(gather: torch.Tensor, chunks, starts: dict[int, int]) -> list[list[int]]:
    """The sequences (by the row position of their first token) in each chunk, read back from the flat gather."""
    out, o = [], 0
    for s, width in chunks:
        block = gather[o:o + s * width].view(s, width)
        out.append([starts[int(r[0])] for r in block])
        o += s * width
    return out


def test_chunks_bound_the_score_elements_and_partition_the_sequences():
    """Random rows: each chunk, padded to its longest, computes <= WASTE x its real score elements; every sequence is
    in exactly one chunk, its slots hold its row positions in order and then its last token again; every real row
    token's output is read from a slot holding that token, the padding tail from the zero row past the chunks."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        lengths = _random_lengths(g)
        total = sum(lengths)
        padded = total + int(torch.randint(0, 50, (1,), generator=g))
        gather, scatter, chunks = plain_chunked_indices(lengths, padded)
        starts = {}
        o = 0
        for i, n in enumerate(lengths):
            starts[o] = i
            o += n
        members = _chunk_members(gather, chunks, starts)
        assert sorted(i for m in members for i in m) == list(range(len(lengths)))
        for (s, width), m in zip(chunks, members):
            assert len(m) == s and width == max(lengths[i] for i in m)
            assert s * width ** 2 <= WASTE * sum(lengths[i] ** 2 for i in m) + 1e-9
        flat = sum(s * w for s, w in chunks)
        assert gather.shape == (flat,) and scatter.shape == (padded,)
        assert torch.equal(gather[scatter[:total]], torch.arange(total))
        assert bool((scatter[total:] == flat).all())
        o = 0
        for (s, width) in chunks:  # a sequence's slots: its positions, then its last token repeated
            for row in gather[o:o + s * width].view(s, width):
                n = lengths[starts[int(row[0])]]
                assert torch.equal(row[:n], torch.arange(int(row[0]), int(row[0]) + n))
                assert bool((row[n:] == row[n - 1]).all())
            o += s * width
    # The agent step's shape: 69 sequences of ~140 and 8 of 240-300 make two chunks, not one padded to 300.
    lengths = [136] * 60 + [138] * 9 + [240, 256, 258, 271, 290, 293, 297, 297]
    _, _, chunks = plain_chunked_indices(lengths, sum(lengths))
    assert sorted(chunks) == [(8, 297), (69, 138)]
    assert chunked_cost(lengths) == 8 * 297 ** 2 + 69 * 138 ** 2 < len(lengths) * 297 ** 2 / 3


def _qkv(g: torch.Generator, n: int, h: int, kv_heads: int, d: int, *, token_major: bool):
    """q [1, h, n, d], k/v [1, kv_heads, n, d], float64, requiring grad; `token_major`: views of [1, n, heads, d]
    memory, the layout a model's projections hand the attention function (the gathers read whole token rows)."""
    def one(heads: int) -> torch.Tensor:
        if token_major:
            return torch.randn(1, n, heads, d, generator=g, dtype=torch.float64, requires_grad=True).transpose(1, 2)
        return torch.randn(1, heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    return one(h), one(kv_heads), one(kv_heads)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_packed_sdpa_equals_dense_block_causal_sdpa(kv_heads, seed):
    """The attention function on the chunked layout against SDPA over the whole row with the dense document mask:
    output and q/k/v gradients under a random upstream gradient, float64, lengths 1-120 (several chunks, one-token
    sequences), a padding tail (zeros out)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 120, 3, 60, 64, 7, 118, 30, 1, 90]
    with use_backend("torch"):
        batch = pack_batch([torch.zeros(n, dtype=torch.int64) for n in lengths], pad_to=sum(lengths) + 13)
    gather, scatter, chunks = plain_chunked_indices(batch.lengths, batch.padded_len)
    assert len(chunks) >= 4  # the case under test: several SDPA calls
    n, h, d = batch.padded_len, 4, 8
    q, k, v = _qkv(g, n, h, kv_heads, d, token_major=seed % 2 == 1)
    out, _ = packed_sdpa_attention(_Attn(), q, k, v, None, scaling=0.3, packed_gather_index=gather,
                                   packed_scatter_index=scatter, packed_chunks=chunks)  # [1, N, H, D]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(batch.seq_index), scale=0.3,
                                          enable_gqa=kv_heads != h).transpose(1, 2)
    assert bool((out[:, batch.num_tokens:] == 0).all())
    assert_same_attention(out, want, (q, k, v), batch.num_tokens, g)


def _uneven_groups(seed: int, groups: int = 5, vocab: int = 90) -> list[Sample]:
    """Groups of 2-6 samples sharing a prompt of 1-12 tokens, responses of 1-150 tokens (one of the group's two
    0-39-token openings, then 1-110 of their own): branches of very different lengths in one row (one, two and
    three-turn episodes), some sharing more than the prompt."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    out = []
    for gi in range(groups):
        prompt = torch.randint(3, vocab, (rnd(1, 13),), generator=g).tolist()
        openings = [torch.randint(3, vocab, (rnd(0, 40),), generator=g).tolist() for _ in range(2)]
        for i in range(rnd(2, 7)):
            resp = openings[rnd(0, 2)] + torch.randint(3, vocab, (rnd(1, 111),), generator=g).tolist()
            out.append(Sample(prompt="", tokens=prompt + resp, response_length=len(resp), group_index=gi, index=i))
    return out


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_owned_branch_attention_equals_dense_tree_mask_sdpa(seed, kv_heads):
    """The shared-prompt row's per-branch layout, each branch's queries cut to the tokens it owns, in chunks,
    against SDPA with the dense tree mask (float64, output and gradients): each branch sees what it shares and
    itself, a shared token's output is its first branch's. Also: it computes fewer score elements than the whole
    sequences, and its chunks bound their padding."""
    g = torch.Generator().manual_seed(seed + 10)
    with use_backend("torch"):
        mb = build_shared_micro_batches(_uneven_groups(seed), token_budget=4096, bucket_size=16)[0]
    row, trees = mb.row, mb.trees
    owned = branch_owned_chunks(trees.paths, row.padded_len)
    assert len(owned.chunks) >= 2 and any(m is not None for m in owned.masks)
    # The host count the layout choice reads first: each branch's owned tokens, as the layout runs them.
    counts = owned_queries(trees.paths)
    assert sum(counts) == row.num_tokens and sum(1 for q in counts if q) == sum(c[0] for c in owned.chunks)
    lengths = [sum(b - a for a, b in path) for path in trees.paths]
    assert owned.cost < chunked_cost(lengths, waste=1.5)
    assert owned.cost == sum(s * qc * kc for s, qc, kc in owned.chunks)
    n, h, d = row.padded_len, 4, 8
    q, k, v = _qkv(g, n, h, kv_heads, d, token_major=seed >= 2)
    masks = owned.masks if seed % 2 else tuple(None if m is None else torch.where(m, 0.0, -1e30) for m in owned.masks)
    out, _ = packed_sdpa_attention(_Attn(), q, k, v, None, packed_query_index=owned.query_index,
                                   packed_gather_index=owned.key_index, packed_scatter_index=owned.scatter,
                                   packed_chunks=owned.chunks, packed_chunk_masks=masks)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=tree_causal_mask(trees.end),
                                          enable_gqa=kv_heads != h).transpose(1, 2)
    assert_same_attention(out, want, (q, k, v), row.num_tokens, g)


def test_owned_chunks_skip_a_branch_that_owns_nothing():
    """Two equal samples and one that is a prefix of them: only the first owns tokens, one chunk of one branch,
    causal, its whole sequence; every row token reads its output from it."""
    prompt, resp = [3, 4, 5], [6, 7, 8]
    samples = [Sample(prompt="", tokens=prompt + resp, response_length=3),
               Sample(prompt="", tokens=prompt + resp, response_length=3),
               Sample(prompt="", tokens=prompt + resp[:1], response_length=1)]
    with use_backend("torch"):
        (mb,) = build_shared_micro_batches(samples, token_budget=64, bucket_size=8)
    owned = branch_owned_chunks(mb.trees.paths, mb.row.padded_len)
    assert owned.chunks == ((1, 6, 6),) and owned.masks == (None,) and owned.cost == 36
    assert owned.scatter.tolist() == [0, 1, 2, 3, 4, 5, 6, 6]  # then the padding tail: the zero row


def test_tree_block_layout_compares_the_tree_with_the_branch_cost():
    """One long branch among short ones: padded to it, the branches cost more than the tree (8 x 210^2 = 352,800
    against 280^2 = 78,400); in chunks they cost less (210^2 + 7 x 20^2 = 46,900)."""
    trees, branches = [10 + 200 + 7 * 10], [210] + [20] * 7
    assert tree_block_layout(trees, chunked_cost(branches, waste=float("inf"))) == "tree"
    assert tree_block_layout(trees, chunked_cost(branches)) == "branch"
    assert chunked_cost([210] + [20] * 7) == 210 ** 2 + 7 * 20 ** 2
    assert tree_block_layout(trees, 280 ** 2) == "tree" and tree_block_layout(trees, 280 ** 2 - 1) == "branch"
    # Branches of a few queries each pay SDPA's per-sequence share: fewer score elements, still the tree.
    assert tree_block_layout(trees, 1000, branch_queries=MIN_BRANCH_QUERIES) == "branch"
    assert tree_block_layout(trees, 1000, branch_queries=MIN_BRANCH_QUERIES - 0.5) == "tree"


@pytest.mark.parametrize("answers, layout", [((1, 7), "tree"), ((5, 20), "tree"), ((30, 60), "owned")])
def test_a_row_gets_owned_queries_where_they_pay(answers, layout):
    """64 groups of 8 with 24-token prompts: the demo's short answers keep the tree layout (one layer's forward +
    backward 19 ms against 49 ms with owned queries, measured), long answers get the owned queries (21 vs 37 ms)."""
    from engines.tiny import tiny_model_config
    from trainer.backend.models import load_hf_model

    model = load_hf_model(tiny_model_config("qwen2"), dtype=torch.float32)
    model.set_attn_implementation(PACKED_SDPA)
    g = torch.Generator().manual_seed(0)
    samples = []
    for t in range(64):
        prompt = torch.randint(6, 90, (24,), generator=g).tolist()
        for _ in range(8):
            r = int(torch.randint(*answers, (), generator=g))
            samples.append(Sample(prompt="", tokens=prompt + torch.randint(6, 90, (r,), generator=g).tolist(),
                                  response_length=r, group_index=t))
    with use_backend("torch"):
        (mb,) = build_shared_micro_batches(samples, token_budget=100_000, bucket_size=64)
    kw = packed_attention_kwargs(model, mb.row, mb.trees)
    assert ("packed_query_index" in kw) == (layout == "owned")
    assert ("packed_block_mask" in kw) == (layout == "tree")


def test_compiled_blocks_keep_one_padded_batch_and_both_equal_each_sequence_alone():
    """A model whose blocks run compiled gets the one-batch layout ([S, Lmax] gather, no chunk list to specialise
    on); eager blocks get the chunks. Both forwards equal each sequence run alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.backend.parallel import ParallelConfig, compile_blocks

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = PACKED_SDPA
    lengths = [5, 90, 2, 40]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    with use_backend("torch"):
        batch = pack_batch(seqs, pad_to=144)
    with torch.no_grad():
        alone = torch.cat([model.model(input_ids=s[None]).last_hidden_state[0] for s in seqs])
        kw = packed_attention_kwargs(model, batch)
        assert "packed_chunks" in kw and kw["packed_gather_index"].dim() == 1
        eager = packed_hidden_states(model, batch)
        compile_blocks(model, ParallelConfig(compile_backend="eager"))
        kw = packed_attention_kwargs(model, batch)
        assert "packed_chunks" not in kw and kw["packed_gather_index"].shape == (4, 90)
        compiled = packed_hidden_states(model, batch)
    total = sum(lengths)
    torch.testing.assert_close(eager[:total], alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled[:total], alone, atol=1e-5, rtol=0)


def test_compiled_blocks_give_every_row_the_same_arguments_an_all_padding_row_too():
    """Compiled packed_sdpa blocks (aot_eager) over rows of several sequences, of one, and all padding (the row a rank
    with fewer micro-batches runs to keep in step): two graphs (a batch of one sequence specialises; the padding row
    is one too), the real rows' hidden states equal the eager model's, the padding row's attention outputs are 0 (as
    any padding tail's) and its hidden states finite."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.backend.parallel import ParallelConfig, compile_blocks
    from trainer.batching.micro_batches import _padding_row

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(cfg).eval()
    eager.config._attn_implementation = PACKED_SDPA
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(eager.state_dict())
    model.config._attn_implementation = PACKED_SDPA
    compile_blocks(model, ParallelConfig(compile_backend="aot_eager"))
    g = torch.Generator().manual_seed(5)
    with use_backend("torch"):
        rows = [pack_batch([torch.randint(0, 97, (n,), generator=g) for n in lengths], pad_to=pad)
                for lengths, pad in (([30, 50, 7], 96), ([100], 128), ([60, 61], 128), ([40], 64))]
    padding = _padding_row(64, pad_id=0, num_tokens=0, num_seqs=0).row
    kw = packed_attention_kwargs(model, padding)
    assert kw["packed_gather_index"].shape == (1, 64) and (kw["packed_scatter_index"] == 64).all()
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        for batch in rows[:2] + [padding] + rows[2:]:
            got = packed_hidden_states(model, batch)
            if batch is padding:
                assert torch.isfinite(got).all()
                continue
            want = packed_hidden_states(eager, batch)
            torch.testing.assert_close(got[:batch.num_tokens], want[:batch.num_tokens], atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters)


def test_index_tensors_reach_cuda_through_pinned_memory(monkeypatch):
    """packed_sdpa on CUDA ([trainer] attention = "packed_sdpa"): every index or mask tensor its layouts build on
    the host goes to the device through kernels.packing.host_to_device (pinned memory, non_blocking), never by a
    plain `.to(device)` from pageable memory, which waits for the device's queued work. Asked for "cuda" here
    (no GPU), each must pass through it: a plain `.to("cuda")` would raise."""
    import trainer.backend.attention as attention
    import trainer.backend.sdpa_chunks as sdpa_chunks

    moved = []

    def to_device(host, device):
        assert host.device.type == "cpu"
        if torch.device(device).type == "cuda":
            moved.append(host)
        return host

    monkeypatch.setattr(sdpa_chunks, "host_to_device", to_device)
    monkeypatch.setattr(attention, "host_to_device", to_device)
    with use_backend("torch"):
        mb = build_shared_micro_batches(_uneven_groups(1), token_budget=4096, bucket_size=16)[0]
    lengths = [5, 17, 3, 40, 9]
    gather, scatter, chunks = plain_chunked_indices(lengths, sum(lengths) + 6, device="cuda")
    want = plain_chunked_indices(lengths, sum(lengths) + 6)
    assert torch.equal(gather, want[0]) and torch.equal(scatter, want[1]) and chunks == want[2]
    owned = branch_owned_chunks(mb.trees.paths, mb.row.padded_len, device="cuda")
    tensors = [owned.query_index, owned.key_index, owned.scatter, *[m for m in owned.masks if m is not None]]
    branches = attention.tree_branch_indices(mb.trees.paths, mb.row.padded_len, device="cuda")
    for t in (gather, scatter, *tensors, *branches):
        assert any(t is m for m in moved)
    assert len(moved) == 2 + len(tensors) + 2
