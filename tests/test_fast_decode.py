"""The engine's plain decode step (engines/embedded/fast_decode.py) computes the model's forward exactly.

- Through a DecodeBatch run with joins (in place and by a cache rebuild), shared group rows, aborts, stops and
  growth past the first capacity, every decode step runs both the model's forward and the plain step on the same
  cache state: the logits are equal bit for bit (llama and qwen2, float32 and float64), and the tokens and
  log-probs of the run equal a run decoded by the forward alone.
- Models where it would not be exact keep the forward: half precision, attention other than the engine's, a sliding
  window, an unsupported architecture.
- The engine server decodes with it on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from engines.embedded.attention import use_engine_attention
from engines.embedded.fast_decode import plain_decode, supports_plain_decode
from engines.embedded.generation import DecodeBatch, Row
from engines.embedded.presets import build_tiny_model, build_tokenizer
from engines.tiny import tiny_model_config


def _rows(g: torch.Generator, vocab: int) -> tuple[list[Row], dict[int, list[int]], dict[int, set[str]]]:
    def prompt(n):
        return tuple(torch.randint(6, vocab, (n,), generator=g).tolist())

    def row(i, p, max_new, **kw):
        return Row(prompt=p, max_new_tokens=max_new, temperature=float(torch.rand((), generator=g)) + 0.5,
                   top_k=0, top_p=1.0, seed=int(torch.randint(0, 2**62, (), generator=g)), rid=f"r{i}",
                   stop_ids=frozenset(kw.get("stops", ())))

    group = prompt(5)
    common = frozenset(range(6, 40))
    rows = [row(0, prompt(3), 40), row(1, prompt(9), 25), row(2, prompt(1), 8, stops=common), row(3, group, 30),
            row(4, group, 30), row(5, group, 30, stops=common), row(6, prompt(30), 20), row(7, prompt(4), 35)]
    joins = {0: [0, 1, 2], 2: [3, 4, 5], 4: [6], 9: [7]}  # row 6's prompt is longer than the filled length
    aborts = {6: {"r1"}}
    return rows, joins, aborts


def _run(model, rows, joins, aborts, decode_fn=None, graphs=None):
    """The schedule (joins and aborts by step) through one DecodeBatch; its results by row index."""
    batch = DecodeBatch(model, pad_id=0, decode_fn=decode_fn, graphs=graphs)
    results, step = {}, 0
    while step <= max(joins) or len(batch):
        if step in aborts:
            results.update(batch.abort(aborts[step]))
        results.update(batch.step([(rows[i], i) for i in joins.get(step, [])]))
        step += 1
    return results


def sliding_window_model():
    """A tiny qwen2 whose every layer attends through a sliding window of 8 tokens."""
    from transformers import AutoModelForCausalLM

    config = tiny_model_config("qwen2")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_plain_decode_equals_the_forward_bit_for_bit(arch, dtype):
    g = torch.Generator().manual_seed(5 if arch == "llama" else 6)
    model = build_tiny_model(int(torch.randint(0, 1000, (), generator=g)), arch=arch, dtype=dtype)
    use_engine_attention(model)
    plain = plain_decode(model)
    assert plain is not None
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    compared = []

    def both(**kw):  # the forward, then the plain step over the same cache columns: equal logits
        cache = kw["past_key_values"]
        rows_before, length_before = cache.rows, cache.length
        ref = model(**kw).logits
        written = [(layer.keys[:, :, -1].clone(), layer.values[:, :, -1].clone()) for layer in cache.layers]
        cache.view(rows_before, length_before)  # the plain step rewrites the same column
        out = plain(**kw).logits
        assert cache.length == length_before + 1
        for (k, v), layer in zip(written, cache.layers):
            assert torch.equal(layer.keys[:, :, -1], k) and torch.equal(layer.values[:, :, -1], v)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.equal(out, ref), (out - ref).abs().max()
        compared.append(out.shape[0])
        return CausalLMOutputWithPast(logits=out)

    results = _run(model, rows, joins, aborts, both)
    assert len(compared) > 40 and max(compared) >= 4
    reference = _run(model, rows, joins, aborts, model.forward)
    assert set(results) == set(reference) == set(range(len(rows)))
    for i in results:
        assert results[i].output_ids == reference[i].output_ids
        assert results[i].logprobs == reference[i].logprobs
        assert results[i].finish_reason == reference[i].finish_reason


def test_models_where_it_would_not_be_exact_keep_the_forward():
    model = build_tiny_model(1, arch="qwen2")
    assert plain_decode(model) is None  # still "sdpa": the forward would attend through transformers' sdpa
    use_engine_attention(model)
    assert supports_plain_decode(model)
    half = build_tiny_model(1, arch="qwen2", dtype=torch.bfloat16)
    use_engine_attention(half)
    assert plain_decode(half) is None
    from transformers import AutoModelForCausalLM, GPT2Config

    sliding = sliding_window_model()
    use_engine_attention(sliding)
    assert any(t == "sliding_attention" for t in sliding.config.layer_types)
    assert plain_decode(sliding) is None

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).eval()
    assert plain_decode(gpt2) is None


def test_the_engine_server_decodes_with_it_on_the_cpu():
    from engines.embedded.server import EngineServer

    model = build_tiny_model(2, arch="qwen2")
    use_engine_attention(model)
    server = EngineServer(model, build_tokenizer(), model_path="tiny")
    try:
        assert server.decode_fn is not None and server.decode_fn.__module__ == "engines.embedded.fast_decode"
        assert server.batch.decode_fn is server.decode_fn
    finally:
        server.model_thread.shutdown(wait=True)
