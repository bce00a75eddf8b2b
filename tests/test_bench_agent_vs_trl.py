"""bench/bench_agent_vs_trl.py: TRL's tool loop sees the same tokens as ours (prompt, tool result, parsed call), its
reward reads the same episode text, and one toy step of each side runs (CI size: --benchmark-disable style)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_agent_vs_trl as bench  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed: pip install -e '.[trl]' (or '.[dev]')")
TOY = bench.agent_bench_config(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_limit=2)


def _calculator():
    from trainer.cli import load_run_config
    from trainer.preflight import phase_configs
    from trainer.rollout.loading import load_callable

    cfg = load_run_config(bench.AGENT_CONFIG, [], mode="rl")
    return load_callable(phase_configs(cfg).rl.rollout.tools[0], "tools")


@needs_trl
def test_trl_sees_our_prompt_tool_result_and_call_tokens():
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    from engines.tiny import build_tokenizer
    from trainer.rollout.episodes import render_continuation
    from trainer.rollout.samples import stop_token_ids

    ours, theirs = build_tokenizer(), bench.agent_tokenizer(build_tokenizer())
    assert supports_tool_calling(theirs) and is_chat_template_prefix_preserving(theirs)
    calc = _calculator()
    for prompt in ("37*84=", "10*99="):
        msgs = [{"role": "user", "content": prompt}]
        assert theirs.apply_chat_template(msgs, tools=[calc], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == \
            ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    # The tool result's tokens: TRL's suffix (the template after the eos-trimmed assistant turn, as its
    # _get_tool_suffix_ids slices it) = ours (trainer.rollout.episodes.render_continuation after <|im_end|>).
    tool = [{"role": "tool", "name": "calculator", "content": "3108"}]
    call = [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "calculator", "arguments": {}}}]}]
    prefix = theirs.apply_chat_template(call, tokenize=True, return_dict=False)
    full = theirs.apply_chat_template(call + tool, add_generation_prompt=True, tokenize=True, return_dict=False)
    cut = max(i for i, t in enumerate(prefix) if t == theirs.eos_token_id) + 1
    assert full[:cut] == prefix[:cut]
    want = render_continuation(ours, tool, turn_end_ids=frozenset(stop_token_ids(ours, chat=True)), tools=(calc,))
    assert full[cut:] == want and ours.decode(want) == "\n<|im_start|>tool\n3108<|im_end|>\n<|im_start|>assistant\n"


@needs_trl
def test_trl_parses_the_sft_tool_call_and_scores_the_episode_like_ours():
    from trl.chat_template_utils import parse_response

    from engines.tiny import build_tokenizer

    theirs = bench.agent_tokenizer(build_tokenizer())
    calc = _calculator()
    expression = "37*84"
    text = '<tool_call>' + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + \
        '</tool_call><|im_end|>'
    prefix = theirs.apply_chat_template([{"role": "user", "content": "37*84="}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    parsed = parse_response(theirs, theirs.encode(text, add_special_tokens=False), prefix=prefix, tools=[calc])
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                      "arguments": {"expression": expression}}}]
    episode = [parsed, {"role": "tool", "name": "calculator", "content": calc(expression)},
               {"role": "assistant", "content": "3108"}]
    assert bench.episode_text(episode).endswith("</tool_call>\n3108\n3108")
    reward = bench.trl_agent_reward_fn("arithmetic")
    # The last integer decides: the answer after the call; a call without an answer scores its own result;
    # a wrong answer after a right tool result scores 0.
    assert reward(["37*84="] * 3, [episode, episode[:2], episode[:2] + [{"role": "assistant", "content": "31"}]],
                  answer=["3108"] * 3) == [1.0, 1.0, 0.0]


@needs_trl
def test_trl_agent_args_bound_the_tool_loop_like_our_turns(tmp_path):
    cfg = bench.single.run_config(TOY, tmp_path)
    args = bench.trl_agent_args(TOY, cfg, tmp_path / "trl")
    from trainer.preflight import phase_configs

    rl = phase_configs(cfg).rl
    assert args.max_completion_length == rl.rollout.max_turns * TOY.max_new_tokens == 3 * 8
    assert args.max_tool_calling_iterations == rl.rollout.max_turns - 1
    assert (args.learning_rate, args.beta, args.num_generations, args.loss_type) == \
        (rl.optim.lr, rl.loss.kl_coef, TOY.group_size, "grpo")


def test_rotation_and_spread():
    assert [bench.rotated(("a", "b", "c"), k) for k in range(4)] == \
        [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


@needs_trl
def test_one_toy_step_of_each_side(tmp_path):
    """The toy config through both sides' workers' functions: figures present and sane."""
    trl = bench.run_trl_agent(TOY, tmp_path / "trl")
    ours = bench.run_ours_agent(TOY, tmp_path / "ours", "ours-sync", profile=True)
    for res in (trl, ours):
        assert res["steps"] == 1 and res["samples"] == 4 and res["samples_per_s"] > 0 and res["tokens_per_s"] > 0
        assert len(res["reward_per_step"]) == 1 and 0.0 <= res["accuracy"] <= 1.0
    assert trl["accuracy_initial"] == ours["accuracy_initial"]  # one evaluator, one initial model
    assert 0 < ours["engine_s"]["decode"] + ours["engine_s"]["prefill"] <= ours["engine_s"]["step"]
