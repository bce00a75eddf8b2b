"""Nothing lost (issue 30): a run stopped at any point and resumed trains on exactly the batches an uninterrupted
run would, logs each step once, and an engine that dies during the weight sync leaves a checkpoint and a clear
error. Faults are injected at a chosen point (a wrapper around the step, the sender, the engine), never by timing.

Runs use the tiny preset in process: the in-process engine (engines.local.LocalEngine, deterministic rollouts) and
the shared-memory weight sync, so a run is reproducible to the bit.
"""

from __future__ import annotations

import json
import signal
import threading

import pytest
from engine_support import digit_fraction

import trainer.rl as rl
from engines.local import LocalEngine
from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.backend.steps import build_components, trainer_config_from
from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.stops import sigterm_as_interrupt
from trainer.weight_sync import WeightSyncSender

TOK = build_tokenizer()
NUM_STEPS = 4
TRAIN_ON_BATCH = rl.train_on_batch  # the real step, before any test wraps it


@pytest.fixture(autouse=True)
def torch_path():
    with use_backend("torch"):
        yield


@pytest.fixture(scope="module")
def local():
    eng = LocalEngine("tiny", seed=1)
    yield eng
    eng.close()


def _config(out, **kw) -> RLTrainingConfig:
    rollout = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4, temperature=1.0, seed=5,
                            apply_chat_template=False)
    return RLTrainingConfig(optim=OptimConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=1.0), num_steps=NUM_STEPS,
                            token_budget=128, micro_batch_buckets=32, loss={"loss_agg": "token-mean"},
                            output_dir=str(out), rollout=rollout, deterministic=True, **kw)


def ctrl_c() -> None:
    raise KeyboardInterrupt  # what Ctrl-C does


def sigterm() -> None:
    """A real SIGTERM, to this (the main) thread: under trainer.stops.sigterm_as_interrupt, as `python -m trainer`
    runs, its handler raises here."""
    signal.raise_signal(signal.SIGTERM)
    threading.Event().wait(10)
    raise AssertionError("SIGTERM did not interrupt the step")


STOPS = {"ctrl-c": ctrl_c, "sigterm": sigterm}


class Recorder:
    """Wraps trainer.rl.train_on_batch: records each trained step's prompts and rewards, and stops the run while
    step `interrupt_at` trains (`stop`: one of STOPS)."""

    def __init__(self, interrupt_at: int | None = None, stop=ctrl_c) -> None:
        self.interrupt_at, self.stop = interrupt_at, stop
        self.steps: dict[int, tuple] = {}

    def __call__(self, comp, state, batch, *args, **kw):
        if state.step + 1 == self.interrupt_at:
            self.stop()
        metrics, state = TRAIN_ON_BATCH(comp, state, batch, *args, **kw)
        self.steps[state.step] = (tuple(s.prompt for s in batch.samples), tuple(s.reward for s in batch.samples))
        return metrics, state


class InterruptingSender(WeightSyncSender):
    """A sender whose sync of version `interrupt_at` raises KeyboardInterrupt (Ctrl-C during the post-step sync)."""

    interrupt_at: int | None = None

    def sync(self, weight_version=None, on_bucket=None):
        if weight_version == self.interrupt_at:
            raise KeyboardInterrupt
        return super().sync(weight_version, on_bucket)


def _run(engine, cfg, *, resume=False, sender_cls=WeightSyncSender, **sender_attrs):
    tcfg = trainer_config_from(cfg, compile=False)
    comp = build_components(tiny_model_config("llama"), tcfg)
    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    sender = sender_cls(comp.model, [engine], timeout_s=60)
    for k, v in sender_attrs.items():
        setattr(sender, k, v)
    sender.init_group()
    try:
        return run_rl(buffer, cfg, engine, sender, tcfg, comp, resume)
    finally:
        sender.close()


def run_rl(buffer, cfg, engine, sender, tcfg, comp, resume):
    return rl.run_rl_training(None, buffer, cfg, engines=[engine], sender=sender, tokenizer=TOK,
                              reward_fn=digit_fraction, trainer_config=tcfg, components=comp, resume=resume)


def _logged_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stop", sorted(STOPS))
@pytest.mark.parametrize("mode", [{}, {"async_rollout": True}, {"async_rollout": True, "max_staleness": 2}],
                         ids=["sync", "async", "async-2-ahead"])
def test_ctrl_c_while_a_step_trains_resumes_on_the_same_batches(local, tmp_path, monkeypatch, mode, stop):
    """Ctrl-C (or SIGTERM, which a scheduler stops a job with) while step 3 trains: the checkpoint holds step 2's
    weights and the data position after batch 2 (not after batch 3, or batches 3 and 4 two steps ahead, already
    drawn), so the resumed run trains steps 3 and 4 on the uninterrupted run's prompts. In synchronous mode the
    rewards are the same too; in async mode batch 3 was generated by older weights in the uninterrupted run than
    after the resume, so only the prompts can agree."""
    async_rollout = mode.get("async_rollout", False)
    ref = Recorder()
    monkeypatch.setattr(rl, "train_on_batch", ref)
    _run(local, _config(tmp_path / "full", **mode))
    assert sorted(ref.steps) == [1, 2, 3, 4]

    cut_cfg = _config(tmp_path / "cut", **mode)
    cut = Recorder(interrupt_at=3, stop=STOPS[stop])
    monkeypatch.setattr(rl, "train_on_batch", cut)
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        _run(local, cut_cfg)
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert saved["extra"]["data_buffer"]["draws"] == 2 * 2  # two batches of two prompts, not three
    resumed = Recorder()
    monkeypatch.setattr(rl, "train_on_batch", resumed)
    _, state, _ = _run(local, cut_cfg, resume=True)
    assert state.step == NUM_STEPS and sorted(resumed.steps) == [3, 4]
    for step in (3, 4):
        prompts, rewards = resumed.steps[step]
        assert prompts == ref.steps[step][0], f"step {step} trained on other prompts than the uninterrupted run"
        if not async_rollout:
            assert rewards == ref.steps[step][1]
    assert _logged_steps(tmp_path / "cut") == [1, 2, 3, 4]


def test_with_two_ppo_epochs_a_batch_is_two_steps_and_a_resume_trains_the_same_batches(local, tmp_path, monkeypatch):
    """Was: each batch advanced the step by ppo_epochs while the rollout side and its resume points counted batches
    by the step: every checkpoint failed ("no resumable state recorded for step 2"), at the end of the run and on
    Ctrl-C alike, and the rollout process generated a batch for each skipped step number, which nothing trained.
    Now the rollout side counts batches (trainer.rl.batches_trained): 4 steps are 2 batches, and a Ctrl-C while
    the second trains resumes on the uninterrupted run's batch."""
    ref = Recorder()
    monkeypatch.setattr(rl, "train_on_batch", ref)
    _, state, _ = _run(local, _config(tmp_path / "full", ppo_epochs=2))
    assert state.step == NUM_STEPS and sorted(ref.steps) == [2, 4]
    assert (tmp_path / "full" / "checkpoints" / "step_00000004" / "state.json").is_file()
    cut_cfg = _config(tmp_path / "cut", ppo_epochs=2)
    monkeypatch.setattr(rl, "train_on_batch", Recorder(interrupt_at=3))
    with pytest.raises(KeyboardInterrupt):
        _run(local, cut_cfg)
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step_00000002" / "state.json").read_text())
    assert saved["extra"]["data_buffer"]["draws"] == 2  # one batch of two prompts
    resumed = Recorder()
    monkeypatch.setattr(rl, "train_on_batch", resumed)
    _, state, _ = _run(local, cut_cfg, resume=True)
    assert state.step == NUM_STEPS and sorted(resumed.steps) == [4]
    assert resumed.steps[4] == ref.steps[4]  # the same prompts and rewards as the uninterrupted run's second batch


def test_ctrl_c_during_the_post_step_sync_keeps_the_step_in_the_log(local, tmp_path):
    """Step 2 trained, then Ctrl-C in its sync: the checkpoint holds step 2, so the log must hold it as well."""
    cfg = _config(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        _run(local, cfg, sender_cls=InterruptingSender, interrupt_at=2)
    assert (tmp_path / "checkpoints" / "step_00000002" / "state.json").is_file()
    assert _logged_steps(tmp_path) == [1, 2]
    _, state, history = _run(local, cfg, resume=True)
    assert state.step == NUM_STEPS and [m["step"] for m in history] == [3, 4]
    assert _logged_steps(tmp_path) == [1, 2, 3, 4]


class DiesInSync:
    """The in-process engine, except that it dies when the weight update of version `at` reaches it: its load
    call fails with BrokenPipeError (the connection to a dead process) and serves nothing after."""

    def __init__(self, engine, at: int) -> None:
        self._engine, self.at = engine, at

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def colocated_weights(self, body):
        if body.get("op") == "load" and str(body.get("weight_version")) == str(self.at):  # sent as a string
            raise BrokenPipeError(32, "Broken pipe")
        return await self._engine.colocated_weights(body)


class BrokenChannelSender(WeightSyncSender):
    """A sender whose signal channel to the engine breaks (BrokenPipeError: the engine process is gone) while the
    sync of version `break_at` hands out its first bucket."""

    break_at: int | None = None

    def sync(self, weight_version=None, on_bucket=None):
        import trainer.weight_sync.sender as sender_module

        real = sender_module.send_seq

        def broken(sock, seq):
            raise BrokenPipeError(32, "Broken pipe")

        if weight_version == self.break_at:
            sender_module.send_seq = broken
        try:
            return super().sync(weight_version, on_bucket)
        finally:
            sender_module.send_seq = real


@pytest.mark.parametrize("fault", ["engine call", "signal channel"])
def test_an_engine_dying_in_the_weight_sync_leaves_a_checkpoint_and_a_clear_error(local, tmp_path, fault):
    """The engine dies in step 2's sync: the error names the engine and says how to go on, the trained step 2 is
    checkpointed and logged, and the run resumes from it with a healthy engine."""
    from engines.weight_sync.wire import WeightSyncError

    cfg = _config(tmp_path)
    with pytest.raises(WeightSyncError) as failed:
        if fault == "engine call":
            _run(DiesInSync(local, at=2), cfg)
        else:
            _run(local, cfg, sender_cls=BrokenChannelSender, break_at=2)
    message = str(failed.value)
    assert local.url in message and "BrokenPipeError" in message and "--resume" in message, message
    assert (tmp_path / "checkpoints" / "step_00000002" / "state.json").is_file()
    assert _logged_steps(tmp_path) == [1, 2]
    _, state, history = _run(local, cfg, resume=True)
    assert state.step == NUM_STEPS and [m["step"] for m in history] == [3, 4]


def test_a_damaged_newest_checkpoint_resumes_the_run_from_the_previous_one(local, tmp_path, capsys):
    """Bytes flipped in a shard of step 4's checkpoint: --resume warns naming the file, resumes from step 2 (the
    data position of step 2 with it) and trains steps 3 and 4 again on the same prompts, each logged once."""
    cfg = _config(tmp_path, save_every=2)
    _run(local, cfg)
    shard = tmp_path / "checkpoints" / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    _, state, history = _run(local, cfg, resume=True)
    assert f"({shard}: sha256" in capsys.readouterr().err
    assert state.step == NUM_STEPS and [m["step"] for m in history] == [3, 4]
    assert _logged_steps(tmp_path) == [1, 2, 3, 4]
