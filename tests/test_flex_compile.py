"""trainer.backend.flex: FlexAttention over the trainer's packed rows through kernels.device.dynamic_compile (issue
42: the compiles a GPU run pays before its first steps). Proven on the CPU under aot_eager (dynamo and AOT autograd,
the graphs and recompiles inductor gets), forward only: the CPU has no FlexAttention backward.

- The function transformers calls for "flex_attention" is ours once trainer.backend.attention is imported.
- flex_attention over packed rows of four lengths: one graph through dynamic_compile, three as transformers compiles
  it (static; dynamic, but the first row's block count tied to the KV heads by duck sizing; then untied); the outputs
  equal the eager flex_attention's. (A row of one 128-token block would add a graph on either path: a size of 1
  specialises; training rows are longer.)
- A model on it gives packed_sdpa's logits on plain and shared-prompt (tree) rows, at 4 query heads (GQA inside
  flex) and 6 (the KV heads repeated, as transformers repeats them for a head count that is not a power of two).
- Calls it does not take (no BlockMask; a softcap, attention sinks, a position bias, dropout) are transformers'
  flex_attention_forward's, call for call.
"""

from __future__ import annotations

import pytest
import torch
from test_packed_attention import V, random_sequences
from test_shared_prompt import grouped_samples
from torch.nn.attention.flex_attention import flex_attention
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import trainer.backend.flex as flex
from kernels import pack_batch, use_backend
from trainer.backend.attention import PACKED_SDPA, flex_block_mask, packed_attention_kwargs
from trainer.batching.shared_prompt import build_shared_micro_batches

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def aot_eager(monkeypatch):
    """The packed calls compiled by aot_eager, from a fresh dynamo cache."""
    monkeypatch.setattr(flex, "BACKEND", "aot_eager")
    monkeypatch.setattr(flex, "_compiled", {})
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _bucketed(lengths: list[int]) -> int:
    """The packed row's length: the tokens rounded up to a multiple of 16 (a bucket)."""
    return -(-sum(lengths) // 16) * 16


def _graphs(fn) -> int:
    """Graphs dynamo holds for `fn`'s code (each a compile of its own under inductor)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


def test_transformers_calls_ours_for_flex_attention():
    assert ALL_ATTENTION_FUNCTIONS["flex_attention"] is flex.packed_flex_attention


def test_flex_over_packed_rows_is_one_graph_for_every_length(aot_eager):
    g = torch.Generator().manual_seed(3)
    rows = []
    for lengths in ([90, 40, 126], [30, 5, 60, 1, 70], [200, 180], [17, 300, 50]):
        with use_backend("torch"):
            batch = pack_batch(random_sequences(sum(lengths), lengths), pad_to=_bucketed(lengths))
        n = batch.padded_len
        q, k, v = torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g), \
            torch.randn(1, 2, n, 16, generator=g)
        rows.append((q, k, v, flex_block_mask(batch.seq_index)))
    assert rows[0][3].kv_num_blocks.shape[-1] == 2 == rows[0][1].shape[1]  # 2 row blocks, 2 KV heads
    graphs = {}
    for name, fn in (("transformers", torch.compile(flex_attention, backend="aot_eager")),
                     ("ours", flex.compiled_flex_attention())):
        torch._dynamo.reset()
        for q, k, v, mask in rows:
            out = fn(q, k, v, block_mask=mask, enable_gqa=True)
            torch.testing.assert_close(out, flex_attention(q, k, v, block_mask=mask, enable_gqa=True), rtol=0,
                                       atol=1e-6)
        graphs[name] = _graphs(flex_attention)
    # transformers' compile: static at 256 tokens, dynamic at the next length but with the block count still tied to
    # the KV heads (2), then once more at 3 blocks
    assert graphs == {"transformers": 3, "ours": 1}, graphs


@pytest.mark.gpu
def test_flex_over_packed_rows_on_cuda_compiles_once_per_grad_mode():
    """On CUDA, inductor (FlexAttention's Triton templates): packed rows of four lengths, bf16, forward and backward,
    then forward under no_grad: one graph for each, the outputs and gradients as SDPA's under the dense
    block-causal mask (float32, bf16 tolerances)."""
    from torch._dynamo.utils import counters

    from trainer.backend.attention import block_causal_mask

    torch._dynamo.reset()
    counters.clear()
    fn = flex.compiled_flex_attention("inductor")
    g = torch.Generator().manual_seed(4)
    for grad in (True, False):
        for lengths in ([90, 40, 126], [30, 5, 60, 1, 70], [200, 180], [17, 300, 50]):
            with use_backend("torch"):
                batch = pack_batch(random_sequences(sum(lengths), lengths), pad_to=_bucketed(lengths))
            n = batch.padded_len
            qkv = [torch.randn(1, h, n, 64, generator=g).cuda().bfloat16().requires_grad_(grad) for h in (4, 2, 2)]
            mask = flex_block_mask(batch.seq_index.cuda())
            with torch.set_grad_enabled(grad):
                out = fn(*qkv, block_mask=mask, enable_gqa=True)
            ref_in = [t.detach().float().requires_grad_(grad) for t in qkv]
            dense = block_causal_mask(batch.seq_index.cuda())
            with torch.set_grad_enabled(grad):
                ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=dense, enable_gqa=True)
            real = batch.seq_index.cuda() >= 0
            torch.testing.assert_close(out.float()[:, :, real], ref[:, :, real], atol=2e-2, rtol=2e-2)
            if grad:
                up = torch.randn(out.shape, generator=g).cuda()
                got = torch.autograd.grad(out.float(), qkv, up.bfloat16().float())
                want = torch.autograd.grad(ref, ref_in, up)
                for a, b in zip(got, want):
                    assert (a.float() - b).norm() / b.norm() < 1e-2  # design.md: bf16 gradients
    assert counters["stats"]["unique_graphs"] <= 2 and not counters["graph_break"], dict(counters)


def _model(attn: str, heads: int, seed: int = 0):
    cls = LlamaConfig if heads == 6 else Qwen2Config
    cfg = cls(vocab_size=V, hidden_size=96 if heads == 6 else 64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


@pytest.mark.parametrize("heads", [4, 6])
def test_a_model_on_flex_attention_gives_packed_sdpas_logits(aot_eager, heads):
    flexed, ref = _model("flex_attention", heads), _model(PACKED_SDPA, heads)
    assert flexed.config._attn_implementation == "flex_attention"
    with use_backend("torch"):
        plain = [(pack_batch(random_sequences(heads + i, lengths), pad_to=_bucketed(lengths)), None)
                 for i, lengths in enumerate(([40, 7, 90], [130, 30]))]
        trees = [(mb.row, mb.trees) for mb in build_shared_micro_batches(grouped_samples(heads), token_budget=128,
                                                                         bucket_size=16)]
    with torch.no_grad():
        for batch, tree in plain + trees:
            ours = flexed(**packed_attention_kwargs(flexed, batch, tree)).logits[0, :batch.num_tokens]
            want = ref(**packed_attention_kwargs(ref, batch, tree)).logits[0, :batch.num_tokens]
            torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)
    assert _graphs(flex_attention) >= 1  # the calls went through the compiled function


def _rows(seed: int) -> list:
    """(PackedBatch, PromptTrees or None): plain rows of four lengths (one a single sequence), then shared-prompt
    (tree) rows."""
    with use_backend("torch"):
        plain = [(pack_batch(random_sequences(seed + i, lengths), pad_to=-(-sum(lengths) // 128) * 128), None)
                 for i, lengths in enumerate(([90, 40, 126], [500], [30, 5, 60, 1, 70, 200], [700, 20]))]
        mbs = build_shared_micro_batches(grouped_samples(seed, groups=60), token_budget=512, bucket_size=128)
    trees = [(mb.row, mb.trees) for mb in mbs]
    assert len({b.padded_len for b, _ in plain}) >= 4 and len({b.padded_len for b, _ in trees}) >= 2
    return plain + trees


def test_compiled_blocks_on_flex_attention_trace_one_graph_for_every_row_length(aot_eager):
    """compile_blocks over FlexAttention (the CUDA default without flash-attn), forward under no_grad (the KL
    reference's): one graph for every row length of the document mask and one for the tree mask, where dynamo's
    default traces the first length static too (the BlockMask's lengths are plain ints, which it guards on); the
    hidden states equal the eager model's."""
    from torch._dynamo.utils import counters

    from trainer.backend.attention import packed_hidden_states
    from trainer.backend.parallel import ParallelConfig, compile_blocks

    eager, rows = _model("flex_attention", 4), _rows(5)
    with torch.no_grad():
        wants = [packed_hidden_states(eager, batch, trees)[:batch.num_tokens] for batch, trees in rows]
    graphs = {}
    for name in ("dynamo's default", "ours"):
        model = _model("flex_attention", 4)
        if name == "ours":
            compile_blocks(model, ParallelConfig(compile_backend="aot_eager"))
        else:
            for block in model.model.layers:
                block.forward = torch.compile(block.forward, backend="aot_eager")
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            for (batch, trees), want in zip(rows, wants):
                got = packed_hidden_states(model, batch, trees)[:batch.num_tokens]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        graphs[name] = counters["stats"]["unique_graphs"]
        assert not counters["graph_break"], dict(counters["graph_break"])  # the BlockMask's lengths set in the graph
    # dynamo's default: the document mask static, then dynamic, then the tree mask (dynamic by then); ours one each
    assert graphs == {"dynamo's default": 3, "ours": 2}, graphs


def test_calls_without_a_block_mask_or_with_a_softcap_are_transformers(monkeypatch):
    seen = []

    def recording(module, query, key, value, attention_mask, scaling=None, **kwargs):
        seen.append((attention_mask, kwargs.get("softcap")))  # a call made by transformers' function
        return query.transpose(1, 2), None

    monkeypatch.setattr(flex, "flex_attention_forward", recording)
    q = k = v = torch.randn(1, 2, 8, 4)
    mask = flex_block_mask(torch.zeros(8, dtype=torch.long))
    dense = torch.zeros(1, 1, 8, 8)
    flex.packed_flex_attention(None, q, k, v, dense, scaling=0.5)
    modifiers = ({"softcap": 30.0}, {"s_aux": torch.zeros(2)}, {"position_bias": torch.zeros(1, 2, 8, 8)},
                 {"dropout": 0.1})
    for kw in modifiers:
        flex.packed_flex_attention(None, q, k, v, mask, scaling=0.5, **kw)
    assert [m for m, _ in seen] == [dense, *[mask] * len(modifiers)] and seen[1][1] == 30.0
