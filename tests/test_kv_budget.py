"""The embedded engine's KV budget ([engines] kv_cache_tokens; issue 42 item 1: the cache had no bound).

- Under a budget the engine admits a queued row only while the batch's worst case fits: the cache it builds never
  holds more than half the budget (the other half is a growing cache's copy), fewer rows run at once than without
  it, and every completion equals the unbounded engine's (each row's draws are keyed by its seed and position, so
  admission order changes no token; the log-probs agree to float32 rounding).
- A row that cannot fit alone is refused with an error that names the budget; a bad value is a config error.
- The cells a model's cache costs, and the default: unlimited on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import trio

from engines.embedded.generation import DecodeBatch
from engines.embedded.graphs import BufferPool, GraphDecode
from engines.embedded.presets import build_tiny_model
from engines.embedded.server import auto_kv_cache_tokens, kv_cell_bytes, kv_cells_needed
from engines.protocol import SamplingParams
from engines.registry import EngineSpec, build_engine


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 200, (int(torch.randint(2, 14, (), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _generate(kv_cache_tokens, prompts, params, monkeypatch, graphs=False):
    """Completions of `prompts` (one request each, all at once) and what the batch held at every step: (rows,
    cache cells)."""
    seen = []
    step = DecodeBatch.step

    def recording(self, new=()):
        out = step(self, new)
        if self.cache is not None:
            seen.append((len(self), self.cache.rows_capacity * self.cache.capacity))
        return out

    monkeypatch.setattr(DecodeBatch, "step", recording)
    engine = build_engine(EngineSpec("local"), model_folder="tiny", seed=0, kv_cache_tokens=kv_cache_tokens,
                          cuda_graphs=graphs)
    try:
        async def all_at_once():
            out = [None] * len(prompts)
            async with trio.open_nursery() as nursery:
                for i, p in enumerate(prompts):
                    async def one(i=i, p=p):
                        out[i] = (await engine.generate([p], params))[0]
                    nursery.start_soon(one)
            return out

        return trio.run(all_at_once), seen
    finally:
        engine.close()
        monkeypatch.setattr(DecodeBatch, "step", step)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_budget_bounds_the_cache_and_changes_no_token(monkeypatch, graphs):
    prompts = _prompts(24, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=9)
    free, free_seen = _generate(None, prompts, params, monkeypatch, graphs)
    budget = 1600
    bounded, seen = _generate(budget, prompts, params, monkeypatch, graphs)
    most = max(rows for rows, _ in free_seen)
    assert most >= 40  # unbounded: (nearly) every one of the 48 rows at once
    assert 2 * max(cells for _, cells in seen) <= budget
    assert max(rows for rows, _ in seen) <= most * 2 // 3 and len(seen) > len(free_seen)  # fewer at once, more steps
    # The same tokens; the log-probs to float32 rounding (a row decodes beside other rows: other matmul shapes)
    tol = 1e-5
    for a, b in zip(free, bounded):
        for x, y in zip(a, b):
            assert x.output_ids == y.output_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= tol


def test_a_row_that_cannot_fit_alone_is_refused_naming_the_budget():
    from trainer.config import EnginesConfig

    engine = build_engine(EngineSpec("local"), model_folder="tiny", seed=0, kv_cache_tokens=100)
    try:
        params = SamplingParams(max_new_tokens=60, seed=1)
        with pytest.raises(Exception, match=r"needs 130 KV-cache cells and this engine holds 100 \(\[engines\] "
                                            r"kv_cache_tokens\)"):
            trio.run(engine.generate, [[5] * 5], params)
        ok = trio.run(engine.generate, [[5] * 5], SamplingParams(max_new_tokens=40, seed=1))  # 90 cells: fits
        assert len(ok[0][0].output_ids) >= 1
    finally:
        engine.close()
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="kv_cache_tokens = "):
            EnginesConfig(kv_cache_tokens=bad)


def test_cell_bytes_and_the_cpu_default():
    model = build_tiny_model(0, arch="qwen2")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fp32 = kv_cell_bytes(model)
    assert fp32 == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    assert kv_cell_bytes(model.to(torch.bfloat16)) == fp32 // 2
    assert auto_kv_cache_tokens(model) is None
    assert kv_cells_needed(3, 10) == 60


def test_the_graph_pool_keeps_at_most_its_idle_cells_and_drops_their_graphs():
    like = [(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))]
    dropped = []
    pool = BufferPool(max_idle_cells=2 * 8 * 16 + 4 * 32, on_drop=dropped.append)
    caches = [pool.allocate(like, 8, 16), pool.allocate(like, 8, 16), pool.allocate(like, 4, 32)]
    for c in caches:
        pool.give(c)
    assert not dropped  # 128 + 128 + 128 cells idle: within the cap
    pool.give(pool.allocate(like, 16, 16))  # 256 more: the two oldest sets go
    assert [d is c.layers[0].key_buffer for d, c in zip(dropped, caches)] == [True, True]
    assert len(pool.idle) == 2 and pool.idle_cells == 4 * 32 + 16 * 16
    model = build_tiny_model(0, arch="llama")
    graphs = GraphDecode(model, pad_id=0, max_idle_cells=0)
    graphs.steps = {(4, 111, 16): "a", (4, 222, 16): "b"}
    graphs._drop(type("B", (), {"data_ptr": lambda self: 111})())
    assert list(graphs.steps) == [(4, 222, 16)]


def test_the_default_budget_is_measured_when_a_batch_starts(monkeypatch):
    """Unset, the budget is measured when a batch starts (on CUDA: a share of the memory free then, after the run's
    trainer has built its model), not when the engine starts; here the measurement is a stand-in that returns 1,600
    cells, and the batch is held to it as to a given budget."""
    import engines.embedded.server as server_mod

    calls = []

    def measured(model, idle_bytes=0):
        calls.append(idle_bytes)
        return 1600

    monkeypatch.setattr(server_mod, "auto_kv_cache_tokens", measured)
    prompts = _prompts(24, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=20, n=2, seed=9)
    _, seen = _generate(None, prompts, params, monkeypatch, graphs=True)
    assert calls and all(isinstance(c, int) and c >= 0 for c in calls)
    assert 2 * max(cells for _, cells in seen) <= 1600 and max(rows for rows, _ in seen) < 40


def test_a_failed_step_gives_its_buffers_back_to_the_pool(monkeypatch):
    """A step that raises fails its requests; with graphs, the batch's cache buffers go back to the pool (its
    graphs would hold them otherwise) and the next request runs."""
    engine = build_engine(EngineSpec("local"), model_folder="tiny", seed=0, cuda_graphs=True)
    step = DecodeBatch.step
    calls = []

    def failing(self, new=()):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a step failed")
        return step(self, new)

    try:
        monkeypatch.setattr(DecodeBatch, "step", failing)
        with pytest.raises(Exception, match="a step failed"):
            trio.run(engine.generate, [[5, 6, 7]], SamplingParams(max_new_tokens=8, seed=1))
        pool = engine.server.graphs.pool
        assert len(pool.idle) == 1 and engine.server.batch.cache is None
        monkeypatch.setattr(DecodeBatch, "step", step)
        out = trio.run(engine.generate, [[5, 6, 7]], SamplingParams(max_new_tokens=8, seed=1))
        assert len(out[0][0].output_ids) == 8 and pool.allocated == 1  # the same buffers, reused
    finally:
        engine.close()


@pytest.mark.gpu
def test_the_measured_budget_on_cuda_admits_and_bounds(monkeypatch):
    """On CUDA the unset budget is measured when a batch starts: a positive number of cells, 40 % of the free memory
    in this model's cell size; an engine generates under it the tokens it generates under a given large budget."""
    model = build_tiny_model(0, arch="qwen2", dtype=torch.bfloat16).cuda()
    measured = auto_kv_cache_tokens(model)
    free, _ = torch.cuda.mem_get_info()
    assert measured is not None and 0 < measured <= 0.41 * (free + torch.cuda.memory_reserved()) / kv_cell_bytes(model)
    engine = build_engine(EngineSpec("local"), model_folder="tiny", seed=0, device="cuda", dtype="float32")
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=2)
        out = trio.run(engine.generate, _prompts(8, seed=3), params)
        assert engine.server.kv_budget is not None and engine.server.kv_budget > 0
    finally:
        engine.close()
    given = build_engine(EngineSpec("local"), model_folder="tiny", seed=0, device="cuda", dtype="float32",
                         kv_cache_tokens=10 ** 9)
    try:
        want = trio.run(given.generate, _prompts(8, seed=3), params)
    finally:
        given.close()
    for a, b in zip(out, want):
        assert [c.output_ids for c in a] == [c.output_ids for c in b]
