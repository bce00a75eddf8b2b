"""KV reuse across turns in the embedded engine (engines/embedded/prefix_cache.py; issue 43 item 2).

- Multi-turn episodes through a DecodeBatch with a prefix cache give the tokens and log-probs (<= 1e-5, float32) of
  the same episodes prefilled whole, greedy and sampled rows, groups of n sharing a prompt, rows of several
  prompts sharing cached prefixes in one prefill beside rows with none, rows joining at different steps; each
  later turn prefills only its new tokens (the reused count is checked against the previous turn's).
- Under a small budget entries are evicted (LRU by tokens, the budget never exceeded) and the results stay the same.
- A cached prefix is reused only for the same adapter slot and weight version; a new version or a rewritten adapter
  slot drops the entries.
- Through the engine (LocalEngine, the SGLang protocol's meta_info "cached_tokens" -> Completion.cached_tokens):
  multi-turn requests with and without the cache agree; a weight update invalidates the cache; /flush_cache too.
"""

from __future__ import annotations

import pytest
import torch
import trio
from engine_support import random_peft_adapter
from safetensors.torch import save_file

from engines.embedded.generation import DecodeBatch, Row
from engines.embedded.prefix_cache import BLOCK, PrefixCache
from engines.embedded.presets import build_tiny_model
from engines.local import LocalEngine
from engines.protocol import SamplingParams

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    """The tiny qwen2 model with sharp attention: its random init (std 0.02) makes attention nearly uniform, so a
    wrong key or position would hardly change a log-prob; queries and keys scaled up make them count."""
    model = build_tiny_model(7, arch="qwen2", dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(12.0)
                proj.bias.mul_(12.0)
    return model


def _run(batch: DecodeBatch, rows: list[Row], per_step: int | None = None):
    """Every row to its end; `per_step` rows join per step (None: all at once)."""
    results, pending = {}, [(r, i) for i, r in enumerate(rows)]
    while pending or len(batch):
        take = pending if per_step is None else pending[:per_step]
        pending = pending[len(take):]
        for i, res in batch.step(take):
            results[i] = res
    return [results[i] for i in range(len(rows))]


def _episodes(model, cache: PrefixCache | None, *, seed: int, groups=3, n=4, turns=3, per_step=None):
    """Multi-turn episodes: turn t+1's prompt = turn t's prompt + its output + random "tool" tokens; each turn
    also starts one fresh episode (its own prompt, no cached prefix). Returns per turn the rows and results."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    stop = frozenset({int(torch.randint(4, vocab, (), generator=g))})

    def rand(lo, hi):
        return tuple(torch.randint(4, vocab, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist())

    prompts = [p for p in (rand(10, 30) for _ in range(groups)) for _ in range(n)]  # n rows share a prompt
    batch = DecodeBatch(model, pad_id=0, prefix_cache=cache)
    out = []
    for turn in range(turns):
        fresh = rand(5, 25)
        rows = []
        for i, p in enumerate(prompts + [fresh]):
            greedy = i % 2 == 0
            rows.append(Row(p, 0.0 if greedy else 0.9, 1.0 if i % 3 else 0.9, -1 if i % 4 else 20,
                            int(torch.randint(3, 14, (), generator=g)), stop, 1000 * seed + 10 * i + turn))
        res = _run(batch, rows, per_step)
        out.append((rows, res))
        prompts = [r.prompt + tuple(x.output_ids) + rand(2, 9) for r, x in zip(rows[:-1], res[:-1])]
    return out, batch


@pytest.mark.parametrize("per_step", [None, 3])
def test_later_turns_prefill_only_new_tokens_with_the_same_tokens_and_logprobs(model, per_step):
    for seed in (1, 2):
        cache = PrefixCache(1 << 20)
        ours, _ = _episodes(model, cache, seed=seed, per_step=per_step)
        fresh, _ = _episodes(model, None, seed=seed, per_step=per_step)
        reused = 0
        for turn, ((rows, got), (rows_ref, want)) in enumerate(zip(ours, fresh)):
            assert [r.prompt for r in rows] == [r.prompt for r in rows_ref]
            for k, (r, a, b) in enumerate(zip(rows, got, want)):
                assert a.output_ids == b.output_ids, (seed, turn, k)
                assert a.finish_reason == b.finish_reason
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
                assert b.cached_tokens == 0
                assert 0 <= a.cached_tokens <= len(r.prompt) - 1
                if turn == 0 or k == len(rows) - 1:
                    continue
                # The previous turn's prompt and output but its last token are cached (up to one block missed
                # where another entry shares the blocks; see prefix_cache's docstring).
                prev_rows, prev = ours[turn - 1]
                own = len(prev_rows[k].prompt) + len(prev[k].output_ids) - 1
                assert a.cached_tokens >= own - (BLOCK - 1), (seed, turn, k, a.cached_tokens, own)
                reused += a.cached_tokens
            assert got[-1].cached_tokens <= BLOCK * (len(rows[-1].prompt) // BLOCK)  # the fresh episode
        assert reused > 0


def test_eviction_under_a_small_budget_keeps_results_identical(model):
    budget = 80
    cache = PrefixCache(budget)
    ours, _ = _episodes(model, cache, seed=3, groups=4, n=3, turns=4)
    fresh, _ = _episodes(model, None, seed=3, groups=4, n=3, turns=4)
    assert cache.evicted > 0 and 0 < cache.tokens <= budget
    assert sum(e.cached_tokens for _, res in ours for e in res) > 0
    for (_, got), (_, want) in zip(ours, fresh):
        for a, b in zip(got, want):
            assert a.output_ids == b.output_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL


def test_the_cache_is_keyed_by_adapter_and_weight_version():
    cache = PrefixCache(1000)
    tokens = tuple(range(10, 30))
    kv = [(torch.randn(2, 20, 4), torch.randn(2, 20, 4))]
    cache.store(tokens, 1, 5, kv)
    prompt = tokens + (3, 4)
    entry, n = cache.lookup(prompt, 1, 5)
    assert n == 20 and entry.kv[0][0] is kv[0][0]
    assert cache.lookup(prompt, 0, 5) == (None, 0)  # another adapter
    assert cache.lookup(tokens[:13], 1, 5)[1] == 12  # the prompt's last token is always fed
    cache.drop_adapter(2)
    assert cache.lookup(prompt, 1, 5)[1] == 20
    cache.drop_adapter(1)
    assert cache.lookup(prompt, 1, 5) == (None, 0) and cache.tokens == 0 and not cache.index
    cache.store(tokens, 1, 5, kv)
    assert cache.lookup(prompt, 1, 6) == (None, 0) and len(cache) == 0  # new weights drop everything
    # LRU: a used entry survives the next eviction, the unused one goes.
    a, b, c = (tuple(range(s, s + 20)) for s in (100, 200, 300))
    cache = PrefixCache(45)
    cache.store(a, 0, 0, kv)
    cache.store(b, 0, 0, kv)
    assert cache.lookup(a + (1,), 0, 0)[1] == 20
    cache.store(c, 0, 0, kv)
    assert cache.lookup(a + (1,), 0, 0)[1] == 20 and cache.lookup(b + (1,), 0, 0) == (None, 0)
    assert cache.tokens == 40 and cache.evicted == 1
    with pytest.raises(AssertionError, match="budget"):
        PrefixCache(-1)


def _turns(engine: LocalEngine, seed: int, turns: int = 3):
    """Multi-turn requests through the engine: two prompts, n = 3 sampled (and one greedy request), each next
    turn the last prompt + the first sample's output + 3 tool tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(4, 200, (int(torch.randint(8, 20, (), generator=g)),), generator=g).tolist()
               for _ in range(2)]
    out = []
    for turn in range(turns):
        for params in (SamplingParams(temperature=0.8, max_new_tokens=10, n=3, seed=seed + turn),
                       SamplingParams(temperature=0.0, max_new_tokens=6)):
            groups = trio.run(engine.generate, prompts, params)
            out.append(groups)
        prompts = [p + groups[i][0].output_ids + [5, 6, 7] for i, p in enumerate(prompts)]
    return out


def test_multi_turn_requests_through_the_engine_with_and_without_reuse(tmp_path):
    ours, fresh = LocalEngine("tiny", seed=4), LocalEngine("tiny", seed=4, prefix_cache_tokens=0)
    try:
        got, want = _turns(ours, 9), _turns(fresh, 9)
        reused = 0
        for k, (ga, gb) in enumerate(zip(got, want)):
            for a, b in zip((c for g in ga for c in g), (c for g in gb for c in g)):
                assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= TOL
                assert b.cached_tokens == 0
                reused += a.cached_tokens if k >= 2 else 0
        assert reused > 0
        # A weight update (the same weights, a new version) drops the cache: the same prompt is prefilled whole.
        prompt = got[-1][0][0].prompt_ids
        params = SamplingParams(temperature=0.0, max_new_tokens=4)
        before = trio.run(ours.generate, [prompt], params)[0][0]
        assert before.cached_tokens > 0
        save_file({k: v.clone().contiguous() for k, v in ours.server.model.state_dict().items()},
                  str(tmp_path / "model.safetensors"))
        trio.run(lambda: ours.update_weights_from_disk(str(tmp_path), weight_version=1))
        after = trio.run(ours.generate, [prompt], params)[0][0]
        assert after.cached_tokens == 0 and after.output_ids == before.output_ids
        assert trio.run(ours.generate, [prompt], params)[0][0].cached_tokens > 0
        trio.run(ours.flush_cache)
        assert trio.run(ours.generate, [prompt], params)[0][0].cached_tokens == 0
    finally:
        ours.close()
        fresh.close()



def test_the_reused_count_reaches_the_rollout_batch_metrics():
    """meta_info "cached_tokens" -> Completion.cached_tokens -> the sample's metadata, summed over its turns ->
    build_batch_metadata's prefill_tokens_reused (logged as rollout/prefill_tokens_reused by trainer/rl.py)."""
    from engines.sglang import parse_generate
    from trainer.rollout.samples import build_batch_metadata, extend_sample
    from trainer.types import Sample, Status

    def answer(ids, cached):
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "2",
                                                 "output_token_logprobs": [[-0.5, t, None] for t in ids],
                                                 **({"cached_tokens": cached} if cached is not None else {})}}

    (a,), (b,) = parse_generate([answer([5, 6], 17), answer([7], None)], [[1, 2], [3, 4]], 1)
    assert (a.cached_tokens, b.cached_tokens) == (17, 0)  # a stock server that does not say: 0
    s = Sample(prompt="p", tokens=(1, 2))
    assert "prefill_tokens_reused" not in extend_sample(s, [5], [-0.1], status=Status.COMPLETED,
                                                        weight_version=0).metadata
    for cached in (0, 17, 40):  # three turns
        s = extend_sample(s, [5, 6], [-0.1, -0.2], status=Status.COMPLETED, weight_version=2, cached_tokens=cached,
                          loss_mask_value=1)
        s = extend_sample(s, [9, 9], [0.0, 0.0], status=Status.COMPLETED, weight_version=None, loss_mask_value=0)
    assert s.metadata["prefill_tokens_reused"] == 57
    other = extend_sample(Sample(prompt="q", tokens=(3,)), [5], [-0.1], status=Status.COMPLETED, weight_version=2,
                          cached_tokens=b.cached_tokens)
    assert build_batch_metadata([s, other])["prefill_tokens_reused"] == 57
    assert build_batch_metadata([other])["prefill_tokens_reused"] == 0


def _adapter(folder, seed: int, targets: list[str]):
    """A PEFT adapter of the tiny base (build_tiny_model(5)) with random A and B; returns its tensors, scaling
    and the merged reference model."""
    import copy

    from engines.embedded.lora import read_peft_folder

    pm = random_peft_adapter(build_tiny_model(5), folder, r=4, alpha=8.0, targets=targets, seed=seed)
    return (*read_peft_folder(str(folder)), copy.deepcopy(pm).merge_and_unload().eval())


def _check_against(model, c) -> None:
    """Greedy completion `c`: its tokens and log-probs = a plain forward of prompt + output under `model`."""
    ids = c.prompt_ids + c.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(c.prompt_ids) - 1:-1].double()
    want = logits.log_softmax(-1).gather(-1, torch.tensor(c.output_ids)[:, None])[:, 0]
    assert (torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max().item() <= TOL
    assert logits.argmax(-1).tolist() == c.output_ids


def test_a_cached_prefix_serves_only_its_adapter_and_a_replaced_adapter_drops_it(tmp_path):
    """Turn 2 of a conversation under adapter "a" reuses only "a"'s turn 1 (not the base's, whose tokens are the
    same prompt), and equals "a"'s merged model; replacing "a" in place (new weights, same name and slot) drops its
    entries: the next request prefills whole and equals the new merged model."""
    a_tensors, a_scaling, a_ref = _adapter(tmp_path / "a", 11, ["q_proj", "v_proj"])
    b_tensors, b_scaling, b_ref = _adapter(tmp_path / "b", 12, ["k_proj", "o_proj"])
    eng = LocalEngine("tiny", seed=5)
    try:
        trio.run(lambda: eng.load_adapter_tensors("a", a_tensors, a_scaling))
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        prompt = [1] + list(range(30, 50))
        (base1,), = trio.run(eng.generate, [prompt], greedy)
        turn2 = prompt + base1.output_ids + [5, 6, 7]
        (a2,), = trio.run(lambda: eng.generate([turn2], greedy, adapter="a"))
        assert a2.cached_tokens == 0  # the base's turn 1 is not "a"'s
        _check_against(a_ref, a2)
        turn3 = turn2 + a2.output_ids + [8, 9]
        (a3,), = trio.run(lambda: eng.generate([turn3], greedy, adapter="a"))
        assert a3.cached_tokens >= len(turn2) + len(a2.output_ids) - 1 - (BLOCK - 1)
        _check_against(a_ref, a3)
        (base3,), = trio.run(eng.generate, [turn3], greedy)
        assert 0 < base3.cached_tokens <= len(prompt) + len(base1.output_ids)  # its own turn 1, not "a"'s turns
        _check_against(build_tiny_model(5), base3)
        trio.run(lambda: eng.load_adapter_tensors("a", b_tensors, b_scaling))  # replaced in place
        (new3,), = trio.run(lambda: eng.generate([turn3], greedy, adapter="a"))
        assert new3.cached_tokens == 0
        _check_against(b_ref, new3)
    finally:
        eng.close()


def test_the_engines_option_reaches_the_engines(tmp_path):
    """[engines] prefix_cache_tokens: checked by the config; unset, the run turns the cache on for multi-turn
    rollouts and off for single-turn ones; an in-process engine gets it (0: no cache), a launched embedded engine
    gets it on its command line (--prefix-cache-tokens)."""
    from engines.registry import EngineSpec, LaunchOptions, build_engine, launch_engine
    from trainer.cli import load_run_config
    from trainer.config import EnginesConfig
    from trainer.run import prefix_cache_tokens

    assert EnginesConfig(prefix_cache_tokens=0).prefix_cache_tokens == 0
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        EnginesConfig(prefix_cache_tokens=-5)
    off = build_engine(EngineSpec(kind="local"), model_folder="tiny", prefix_cache_tokens=0)
    small = build_engine(EngineSpec(kind="local"), model_folder="tiny", prefix_cache_tokens=64)
    default = build_engine(EngineSpec(kind="local"), model_folder="tiny")
    try:
        assert off.server.prefix_cache is None and small.server.prefix_cache.budget == 64
        assert default.server.prefix_cache.budget == 32768
    finally:
        for e in (off, small, default):
            e.close()
    # The run's policy when unset: on (the engine's default) for multi-turn rollouts, off for single-turn ones.
    assert prefix_cache_tokens(load_run_config("configs/agent_demo.toml", mode="rl")) is None
    assert prefix_cache_tokens(load_run_config("configs/demo.toml", mode="rl")) == 0
    assert prefix_cache_tokens(load_run_config("configs/demo.toml", ["engines.prefix_cache_tokens=500"],
                                               mode="rl")) == 500
    proc = launch_engine(EngineSpec(kind="embedded"), LaunchOptions("tiny", api_key="k", prefix_cache_tokens=0))
    assert proc.extra_args == ("--prefix-cache-tokens", "0")  # not launched: its command line only
    assert launch_engine(EngineSpec(kind="embedded"), LaunchOptions("tiny", api_key="k")).extra_args == ()
