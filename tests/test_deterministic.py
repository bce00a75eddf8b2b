"""`[rl] deterministic = true`: a run is reproducible from its seeds whatever the arrival order of requests.

Each run's requests reach the engine after a random delay drawn from a per-run generator, so two runs see
different arrival orders. Without the option the embedded engine batches whatever has arrived, the logits of a
row change in their last bits with the batch around it, and the engine log-probs (so the mismatch metrics, and
with TIS the loss) differ between the runs; with it each request is the engine's whole batch.

The runs share one engine: every run syncs its own starting weights to it first, and each row samples from its
own seeded generator, so nothing of one run leaks into the next.
"""

import random
import warnings

import pytest
import trio
from engine_support import digit_fraction

from engines.sglang import SGLangEngine
from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.backend.steps import build_components, trainer_config_from
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.rl import run_rl_training
from trainer.weight_sync import WeightSyncSender

ENGINE_SEED = 2  # for the shared `engine` fixture (tests/conftest.py)
TOK = build_tokenizer()

class Jittered:
    """An engine client whose generate requests leave after a random delay (0-20 ms) from its own generator."""

    def __init__(self, engine, seed: int) -> None:
        self._engine = engine
        self._rng = random.Random(seed)

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompts, params, *, rids=None):
        await trio.sleep(self._rng.random() * 0.02)
        return await self._engine.generate(prompts, params, rids=rids)


def _run(engine, tmp_path, *, deterministic: bool, jitter_seed: int) -> list[dict]:
    # Async mode: the loss's TIS weights use the engine's log-probs, so the loss itself sees engine numerics. The
    # filter replaces groups whose samples all score the same, so the batch's groups depend on the rewards.
    rollout = RolloutConfig(apply_chat_template=False,
                            rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=6, temperature=1.0, seed=5,
                            max_staleness=1, dynamic_filters=("check_reward_nonzero_std",))
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), num_steps=10,
                           token_budget=256, micro_batch_buckets=64, loss={"loss_agg": "token-mean"},
                           output_dir=str(tmp_path), rollout=rollout, async_rollout=True,
                           deterministic=deterministic)
    tcfg = trainer_config_from(cfg, compile=False)
    comp = build_components(tiny_model_config("llama"), tcfg)
    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    with use_backend("torch"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client = Jittered(SGLangEngine(engine.url), jitter_seed)
        sender = WeightSyncSender(comp.model, [client])
        sender.init_group()
        try:
            _, state, history = run_rl_training(None, buffer, cfg, engines=[client], sender=sender, tokenizer=TOK,
                                                reward_fn=digit_fraction, trainer_config=tcfg, components=comp)
        finally:
            sender.close()
    assert state.step == 10
    return [{k: v for k, v in m.items() if not _is_timing(k)} for m in history]


def _is_timing(key: str) -> bool:
    return key.startswith("time_") or key.endswith("_per_s") or key.endswith("_seconds")


def test_ten_deterministic_steps_repeat_exactly_under_different_arrival_orders(engine, tmp_path):
    a = _run(engine, tmp_path / "a", deterministic=True, jitter_seed=1)
    b = _run(engine, tmp_path / "b", deterministic=True, jitter_seed=2)
    assert len(a) == 10
    for step, (ma, mb) in enumerate(zip(a, b), start=1):
        assert ma == mb, {k: (ma[k], mb.get(k)) for k in ma if ma[k] != mb.get(k)} | {"step": step}
    # The runs did something worth comparing: the filter replaced groups, TIS ran, the reward moved.
    assert sum(m["rollout/groups_filtered"] for m in a) > 0
    assert all(0 < m["mismatch/tis_weight_mean"] for m in a)
    assert len({m["reward_mean"] for m in a}) > 3


def test_without_the_option_the_arrival_order_shows_in_the_metrics(engine, tmp_path):
    """The comparison above can fail: the same two runs without `deterministic` differ (engine numerics)."""
    a = _run(engine, tmp_path / "a", deterministic=False, jitter_seed=1)
    b = _run(engine, tmp_path / "b", deterministic=False, jitter_seed=2)
    assert [m["mismatch/logprob_abs_diff_mean"] for m in a] != [m["mismatch/logprob_abs_diff_mean"] for m in b]


def test_deterministic_rejects_over_sampling():
    with pytest.raises(ValueError, match=r"deterministic: needs rollout.over_sampling_factor = 1.0 \(got 1.5\)"):
        RLTrainingConfig(deterministic=True, rollout=RolloutConfig(apply_chat_template=False, over_sampling_factor=1.5))
