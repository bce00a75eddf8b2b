"""Multi-turn trajectories with tool calls: the loss mask covers exactly the model's own turns."""

import json
import random

import pytest

from engines.tiny import build_tokenizer
from trainer.rollout.trajectory import trajectory_to_sample
from trainer.types import Status


def _conversation(rng):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": f"{a}+{b}?"},
        {"role": "assistant", "content": "let me add",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}]},
        {"role": "tool", "content": str(a + b)},
        {"role": "user", "content": "sure?"},
        {"role": "assistant", "content": f"yes {a + b}"},
    ], a, b


def test_loss_mask_covers_only_assistant_turns():
    tok = build_tokenizer()
    rng = random.Random(7)
    for _ in range(5):
        msgs, a, b = _conversation(rng)
        s = trajectory_to_sample(msgs, tok, reward=1.0, metadata={"k": 1})
        resp = list(s.tokens[s.prompt_length:])
        assert len(s.loss_mask) == s.response_length == len(resp)
        trained = tok.decode([t for t, m in zip(resp, s.loss_mask) if m], skip_special_tokens=False)
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, sort_keys=True)
        assert trained == f"let me add<tool_call>{call}</tool_call><|im_end|>yes {a + b}<|im_end|>"
        untrained = tok.decode([t for t, m in zip(resp, s.loss_mask) if not m], skip_special_tokens=False)
        assert f"tool\n{a + b}" in untrained and "sure?" in untrained and "let me" not in untrained
        # The prompt is what an engine is given for the first assistant turn.
        assert s.prompt.endswith("<|im_start|>assistant\n") and f"{a}+{b}?" in s.prompt
        assert s.response.endswith("<|im_end|>") and s.reward == 1.0 and s.metadata == {"k": 1}


def test_truncation_and_bad_conversations():
    tok = build_tokenizer()
    msgs, _, _ = _conversation(random.Random(0))
    full = trajectory_to_sample(msgs, tok)
    cut = trajectory_to_sample(msgs, tok, max_length=10)
    assert cut.status == Status.TRUNCATED and cut.response_length == 10
    assert cut.tokens == full.tokens[: full.prompt_length + 10] and cut.loss_mask == full.loss_mask[:10]
    with pytest.raises(ValueError, match="at least one assistant turn"):
        trajectory_to_sample([{"role": "user", "content": "hi"}], tok)
    with pytest.raises(ValueError, match="first turn is the assistant"):
        trajectory_to_sample([{"role": "assistant", "content": "hi"}], tok)
    with pytest.raises(ValueError, match="only assistant turns"):
        trajectory_to_sample([{"role": "user", "content": "x", "tool_calls": [{"name": "f"}]},
                              {"role": "assistant", "content": "y"}], tok)
