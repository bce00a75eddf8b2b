"""SFT: the assistant-only loss mask (span tracking) is exact, truncation is counted, and training on a toy chat
set lowers the loss by a stated margin with metrics and checkpoints written."""

from __future__ import annotations

import random

import pytest

from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from trainer.backend.checkpoint import latest_checkpoint
from trainer.backend.steps import trainer_config_from
from trainer.config import OptimConfig, SFTTrainingConfig
from trainer.metrics import read_jsonl
from trainer.sft import compute_loss_mask, run_sft_training, tokenize_conversation


@pytest.fixture(autouse=True)
def _torch_path():
    """In-process training runs on the production CPU path (torch), not the Triton interpreter."""
    from kernels import use_backend

    with use_backend("torch"):
        yield


def _toy_chats(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        chat = [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]
        if rng.random() < 0.5:  # multi-turn
            chat += [{"role": "user", "content": "again"}, {"role": "assistant", "content": f"{a}+{b}={a + b}"}]
        if rng.random() < 0.3:
            chat = [{"role": "system", "content": "add"}] + chat
        chats.append(chat)
    return chats


def test_loss_mask_covers_exactly_assistant_tokens():
    tok = build_tokenizer()
    for chat in _toy_chats(20, seed=1):
        ids, mask = compute_loss_mask(tok, chat)
        # Independent check 1: transformers' {% generation %} assistant mask of the same template.
        enc = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(enc["input_ids"]) and mask == list(enc["assistant_masks"])
        # Independent check 2: the masked tokens are exactly each assistant content + end-of-turn, in order.
        want = [t for m in chat if m["role"] == "assistant"
                for t in tok(m["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]]
        assert [t for t, m in zip(ids, mask) if m] == want


def test_tokenize_conversation_and_truncation():
    tok = build_tokenizer()
    chat = _toy_chats(1, seed=2)[0]
    s, cut = tokenize_conversation(tok, chat, max_length=512)
    ids, mask = compute_loss_mask(tok, chat)
    assert not cut and s.tokens == tuple(ids) and s.prompt_length == 1 and s.loss_mask == tuple(mask[1:])
    s, cut = tokenize_conversation(tok, chat, max_length=12)
    assert cut and len(s.tokens) == 12
    with pytest.raises(ValueError, match="no assistant"):
        compute_loss_mask(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        compute_loss_mask(tok, [{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tok, chat, max_length=1)


def test_sft_lowers_loss(tmp_path):
    chats = _toy_chats(64, seed=3)
    cfg = SFTTrainingConfig(optim=OptimConfig(lr=5e-3, warmup_steps=2), num_steps=20, batch_size=8, max_length=64,
                            token_budget=256, micro_batch_buckets=64, output_dir=str(tmp_path / "sft"), save_every=10,
                            seed=0)
    with use_backend("torch"), pytest.warns(UserWarning, match="13 of 65 conversations lose trained"):
        # max_length 64 cuts the longest conversations: the warning counts them
        comp, state, hist = run_sft_training(tiny_model_config(), chats + [chats[0] * 6], cfg,
                                             tokenizer=build_tokenizer(),
                                             trainer_config=trainer_config_from(cfg, compile_backend="aot_eager"))
    print("sft loss", hist[0]["loss"], [round(h["loss"], 3) for h in hist[-5:]])
    first, last = hist[0]["loss"], sum(h["loss"] for h in hist[-5:]) / 5
    # Stated margin: the assistant-token NLL falls by at least 40% in 20 steps (from ~ln(128) = 4.85).
    assert last < 0.6 * first, (first, last)
    rows = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21)) and rows[0]["loss"] == pytest.approx(first)
    assert latest_checkpoint(tmp_path / "sft").name == "step_00000020" and state.step == 20


class _Killed(Exception):
    """A kill of the process after a chosen step: unlike Ctrl-C it writes no checkpoint."""


def test_resume_after_a_kill_logs_each_step_once(tmp_path, monkeypatch, capsys):
    from trainer.backend.checkpoint import load_latest
    from trainer.metrics import JSONLLogger

    chats = _toy_chats(16, seed=1)
    cfg = SFTTrainingConfig(optim=OptimConfig(lr=1e-3, warmup_steps=1), num_steps=12, batch_size=2, max_length=128,
                            token_budget=256, micro_batch_buckets=64, output_dir=str(tmp_path / "sft"), save_every=5,
                            seed=0)
    tcfg = trainer_config_from(cfg, compile=False)
    log = JSONLLogger.log

    def log_then_die_at_8(self, step, metrics):
        log(self, step, metrics)
        if step == 8:
            raise _Killed

    monkeypatch.setattr(JSONLLogger, "log", log_then_die_at_8)
    with use_backend("torch"), pytest.raises(_Killed):
        run_sft_training(tiny_model_config(), chats, cfg, tokenizer=build_tokenizer(), trainer_config=tcfg)
    monkeypatch.setattr(JSONLLogger, "log", log)
    assert latest_checkpoint(tmp_path / "sft").name == "step_00000005"
    assert [r["step"] for r in read_jsonl(tmp_path / "sft" / "metrics.jsonl")] == list(range(1, 9))
    with use_backend("torch"):
        comp, state, _ = run_sft_training(tiny_model_config(), chats, cfg, tokenizer=build_tokenizer(),
                                          trainer_config=tcfg, resume=True)
    assert state.step == 12
    assert [r["step"] for r in read_jsonl(tmp_path / "sft" / "metrics.jsonl")] == list(range(1, 13))
    # --resume where nothing was saved says so, naming the folder, and starts from step 0.
    capsys.readouterr()
    assert load_latest(comp, tmp_path / "empty")[0].step == 0
    assert f"no complete checkpoint under {tmp_path / 'empty' / 'checkpoints'}" in capsys.readouterr().err


def test_truncate_jsonl_drops_later_steps_and_a_torn_last_line(tmp_path):
    from trainer.metrics import truncate_jsonl

    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(f'{{"step": {s}, "loss": {s / 10}}}\n' for s in range(1, 9)) + '{"step": 9, "lo')
    assert truncate_jsonl(log, 5) == 4
    assert read_jsonl(log) == [{"step": s, "loss": s / 10} for s in range(1, 6)]
    assert truncate_jsonl(log, 0) == 5 and read_jsonl(log) == []
