"""The engine's decode step as CUDA graphs ([engines] cuda_graphs, engines/embedded/graphs.py; issue 42 item 8).

On the CPU the graph's static step runs uncaptured: the same code a capture records (rows padded to a power of two,
attention over the buffers' whole capacity under a mask built on the device, the new key/value written at a device
column, pooled buffers). Proven here against the engine's eager step:
- through a DecodeBatch run with joins (in place and by a cache rebuild), shared group rows, aborts, stops and
  growth, every decode step runs the eager forward and the static step on the same cache state: the logits and the
  written key/value agree (float64: to 1e-12; float32: to 1e-5), row counts that are not a power of two included
  (pad rows), and the run's tokens equal the eager run's; through the engine's CPU attention and through
  transformers' sdpa (what a CUDA model attends with);
- a second batch gets the same buffers back from the pool and reuses every static step built by the first (no new
  buffers, no new captures), with the same results;
- a capture that fails warns once and the engine decodes eagerly from then on, with the same tokens;
- a model the static step would not compute (a sliding window; eager, flex or flash attention) decodes without
  graphs, with a warning;
- the server and the in-process engine take the switch ([engines] cuda_graphs -> build_engine -> LocalEngine):
  their completions equal an engine's without it.
On a GPU (`gpu` mark): the captured graphs replay the eager decode's tokens.
"""

from __future__ import annotations

import pytest
import torch
import trio
from test_fast_decode import _rows, _run, sliding_window_model

from engines.embedded.attention import use_engine_attention
from engines.embedded.generation import DecodeBatch, Row, generate_rows
from engines.embedded.graphs import GraphDecode, bucket
from engines.embedded.presets import build_tiny_model


def test_buckets_are_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100, 512, 513)] == [1, 2, 4, 4, 8, 8, 16, 128, 512, 1024]
    with pytest.raises(AssertionError):
        bucket(0)


@pytest.mark.parametrize("attention", ["engine", "sdpa"])  # the CPU's, and transformers' sdpa (the CUDA path's)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_steps_decode_what_the_eager_forward_does(arch, dtype, attention):
    g = torch.Generator().manual_seed(11 if arch == "llama" else 12)
    model = build_tiny_model(int(torch.randint(0, 1000, (), generator=g)), arch=arch, dtype=dtype)
    if attention == "engine":
        use_engine_attention(model)
    assert model.config._attn_implementation == ("engine_sdpa" if attention == "engine" else "sdpa")
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    graphs = GraphDecode(model, pad_id=0)
    static = graphs.decode
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    seen = []

    def both(cache, last, pos):  # the eager forward, then the static step over the same cache state
        p, length = cache.rows, cache.length
        columns = torch.arange(length + 1)
        mask = columns[None, :] >= (length - pos)[:, None]
        ref = model(input_ids=last[:, None], attention_mask=mask, position_ids=pos[:, None], past_key_values=cache,
                    use_cache=True).logits[:, -1].float()
        written = [(layer.keys[:, :, -1].clone(), layer.values[:, :, -1].clone()) for layer in cache.layers]
        cache.view(p, length)  # the static step rewrites the same column
        out = static(cache, last, pos)
        assert cache.rows == p and cache.length == length + 1
        for (k, v), layer in zip(written, cache.layers):
            assert torch.allclose(layer.keys[:, :, -1], k, atol=tol, rtol=0)
            assert torch.allclose(layer.values[:, :, -1], v, atol=tol, rtol=0)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert (out - ref).abs().max() <= tol, (out - ref).abs().max()
        seen.append(p)
        return out

    graphs.decode = both
    results = _run(model, rows, joins, aborts, graphs=graphs)
    assert len(seen) > 40 and any(p != bucket(p) for p in seen) and max(seen) >= 4  # pad rows were decoded too
    reference = _run(model, rows, joins, aborts)
    assert set(results) == set(reference) == set(range(len(rows)))
    for i in results:
        assert results[i].output_ids == reference[i].output_ids
        assert results[i].finish_reason == reference[i].finish_reason
        assert max([abs(a - b) for a, b in zip(results[i].logprobs, reference[i].logprobs)] + [0.0]) <= 10 * tol


def test_a_second_batch_reuses_the_pooled_buffers_and_every_step():
    g = torch.Generator().manual_seed(13)
    model = build_tiny_model(7, arch="qwen2")
    use_engine_attention(model)
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    graphs = GraphDecode(model, pad_id=0)
    first = _run(model, rows, joins, aborts, graphs=graphs)
    allocated, captured, steps = graphs.pool.allocated, graphs.captures, len(graphs.steps)
    assert allocated >= 2 and captured >= 4  # rebuilds took new shapes; several buckets ran
    second = _run(model, rows, joins, aborts, graphs=graphs)
    assert (graphs.pool.allocated, graphs.captures, len(graphs.steps)) == (allocated, captured, steps)
    for i in first:
        assert (second[i].output_ids, second[i].logprobs) == (first[i].output_ids, first[i].logprobs)


def test_pooled_buffers_come_back_zeroed():
    model = build_tiny_model(3, arch="llama")
    graphs = GraphDecode(model, pad_id=0)
    like = [(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))]
    cache = graphs.pool.allocate(like, 5, 20)
    assert (cache.rows_capacity, cache.capacity) == (8, 32)
    cache.layers[0].key_buffer.normal_()
    cache.layers[0].value_buffer.fill_(float("nan"))
    buffer = cache.layers[0].key_buffer
    graphs.pool.give(cache)
    again = graphs.pool.allocate(like, 7, 17)  # rounds to the same shape: the same buffers, zeroed
    assert again.layers[0].key_buffer is buffer and graphs.pool.allocated == 1
    assert torch.count_nonzero(again.layers[0].key_buffer) == 0
    assert torch.count_nonzero(again.layers[0].value_buffer) == 0


@pytest.mark.parametrize("engine_attention", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_static_step_reads_nothing_on_the_host(arch, engine_attention):
    """A capture fails on any device-to-host read (a scalar read, a data-dependent size): the static step makes none,
    through transformers' sdpa (the CUDA path) and the engine's CPU attention alike."""
    from test_decode_batch import _HostReads

    g = torch.Generator().manual_seed(15)
    model = build_tiny_model(9, arch=arch)
    if engine_attention:
        use_engine_attention(model)
    graphs = GraphDecode(model, pad_id=0)
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    batch = DecodeBatch(model, pad_id=0, graphs=graphs)
    batch.step([(rows[i], i) for i in (0, 1, 2, 3, 4, 5)])
    checked = 0
    with torch.inference_mode():
        for _ in range(6):
            rows = bucket(batch.cache.rows)
            step = graphs._step(graphs._key(batch.cache, rows), batch.cache, rows)
            step.col.fill_(batch.cache.length)
            with _HostReads() as rec:
                logits = graphs._forward(step)
            assert rec.events == [], rec.events
            assert logits.shape == (bucket(batch.cache.rows), model.config.vocab_size)
            checked += 1
            batch.step()
    assert checked == 6


def test_a_failed_capture_warns_and_decodes_eagerly(monkeypatch):
    g = torch.Generator().manual_seed(14)
    model = build_tiny_model(8, arch="llama")
    use_engine_attention(model)
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    graphs = GraphDecode(model, pad_id=0)
    graphs.capture = True  # as on CUDA; the capture itself fails

    def fail(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", fail)
    with pytest.warns(RuntimeWarning, match="cuda_graphs: capturing the decode step failed"):
        results = _run(model, rows, joins, aborts, graphs=graphs)
    assert graphs.failed is not None and "not permitted" in graphs.failed and not graphs.steps
    reference = _run(model, rows, joins, aborts)
    for i in reference:
        assert (results[i].output_ids, results[i].logprobs) == (reference[i].output_ids, reference[i].logprobs)


def test_the_config_switch_reaches_the_in_process_engine():
    from engines.protocol import SamplingParams
    from engines.registry import EngineSpec, build_engine
    from trainer.config import EnginesConfig

    with pytest.raises(ValueError, match="cuda_graphs = .yes.: true or false"):
        EnginesConfig(cuda_graphs="yes")
    assert EnginesConfig(cuda_graphs=True).cuda_graphs is True
    prompts = [[1, 5, 9, 13], [2, 7], [3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=5)
    out = {}
    for graphs in (True, False):
        engine = build_engine(EngineSpec("local"), model_folder="tiny", seed=0, cuda_graphs=graphs)
        try:
            assert (engine.server.graphs is not None) == graphs
            assert (engine.server.batch.graphs is engine.server.graphs)
            out[graphs] = trio.run(engine.generate, prompts, params)
            if graphs:
                assert engine.server.graphs.captures >= 2
        finally:
            engine.close()
    for a, b in zip(out[True], out[False]):
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= 1e-5


def test_models_the_static_step_would_not_compute_decode_without_graphs():

    from engines.embedded.graphs import unsupported
    from engines.embedded.presets import build_tokenizer
    from engines.embedded.server import EngineServer

    plain = build_tiny_model(1, arch="qwen2")
    assert unsupported(plain) is None
    use_engine_attention(plain)
    assert unsupported(plain) is None
    sliding = sliding_window_model()
    assert "sliding" in unsupported(sliding)
    flex = build_tiny_model(1, arch="llama")
    flex.set_attn_implementation("flex_attention")
    assert "flex_attention" in unsupported(flex)
    eager = build_tiny_model(1, arch="llama")
    eager.set_attn_implementation("eager")  # adds a given mask to its scores: a bool one would mask nothing
    assert "'eager'" in unsupported(eager)
    with pytest.warns(RuntimeWarning, match="cuda_graphs: this model decodes without graphs: layer types"):
        server = EngineServer(sliding, build_tokenizer(), model_path="tiny", cuda_graphs=True)
    try:
        assert server.graphs is None and server.batch.graphs is None
    finally:
        server.model_thread.shutdown(wait=True)


@pytest.mark.gpu
@pytest.mark.parametrize("engine_attention", [False, True])
def test_captured_graphs_replay_the_eager_decode_on_cuda(engine_attention):
    """Captured and replayed on CUDA (float32, so the tokens are comparable), through transformers' sdpa and the
    engine's attention: the tokens of a mixed batch (groups, different lengths, stops) equal the eager decode's,
    every static step was captured once, none failed; every graph writes its logits into rows of one output buffer
    (a new one only when a larger bucket comes)."""
    model = build_tiny_model(21, arch="qwen2").cuda()
    if engine_attention:
        use_engine_attention(model)
    g = torch.Generator().manual_seed(21)
    rows = [Row(prompt=tuple(torch.randint(6, model.config.vocab_size, (int(n),), generator=g).tolist()),
                temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=int(m), stop_ids=frozenset(), seed=100 + i)
            for i, (n, m) in enumerate(zip(torch.randint(1, 40, (37,), generator=g),
                                           torch.randint(1, 60, (37,), generator=g)))]
    graphs = GraphDecode(model, pad_id=0)
    with torch.inference_mode():
        eager = generate_rows(model, rows, pad_id=0)
        captured = generate_rows(model, rows, pad_id=0, graphs=graphs)
        again = generate_rows(model, rows, pad_id=0, graphs=graphs)
    assert graphs.failed is None, graphs.failed
    assert graphs.captures >= 3 and graphs.captures == len(graphs.steps)
    largest = max(rows for rows, *_ in graphs.steps)
    assert graphs._logits.shape[0] == largest
    buffers = {step.logits.untyped_storage().data_ptr() for step in graphs.steps.values()}
    assert graphs._logits.untyped_storage().data_ptr() in buffers and len(buffers) <= largest.bit_length()
    for e, c, a in zip(eager, captured, again):
        assert c.output_ids == e.output_ids == a.output_ids
        assert max([abs(p - q) for p, q in zip(c.logprobs, e.logprobs)] + [0.0]) <= 1e-4


def test_graphs_past_the_limit_go_least_recently_used_first():
    g = torch.Generator().manual_seed(16)
    model = build_tiny_model(10, arch="qwen2")
    use_engine_attention(model)
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    graphs = GraphDecode(model, pad_id=0, max_graphs=2)
    sizes = []
    decode = graphs.decode

    def tracked(cache, last, pos):
        out = decode(cache, last, pos)
        sizes.append(len(graphs.steps))
        return out

    graphs.decode = tracked
    results = _run(model, rows, joins, aborts, graphs=graphs)
    assert max(sizes) == 2 and graphs.captures > 2  # evicted ones were built again when needed
    reference = _run(model, rows, joins, aborts)
    for i in reference:
        assert results[i].output_ids == reference[i].output_ids


def test_a_capture_that_fails_a_few_times_leaves_those_steps_eager(monkeypatch):
    """Two failed captures (e.g. another thread's work in the way) decode those steps eagerly and keep graphs on;
    the third capture succeeds and replays. (The capture is a stand-in that records the step's forward as its
    replay: no CUDA here.)"""
    g = torch.Generator().manual_seed(17)
    model = build_tiny_model(11, arch="llama")
    use_engine_attention(model)
    rows, joins, aborts = _rows(g, model.config.vocab_size)
    graphs = GraphDecode(model, pad_id=0)
    graphs.capture = True
    attempts = []

    def capture(step):
        attempts.append(1)
        if len(attempts) <= 2:
            raise RuntimeError("operation not permitted when stream is capturing")
        step.graph = type("Replay", (), {"replay": lambda self: setattr(step, "logits", graphs._forward(step))})()

    monkeypatch.setattr(graphs, "_capture", capture)
    results = _run(model, rows, joins, aborts, graphs=graphs)
    assert graphs.failures == 2 and graphs.failed is None and graphs.captures >= 3
    reference = _run(model, rows, joins, aborts)
    for i in reference:
        assert results[i].output_ids == reference[i].output_ids
