"""Built-in verifiable rewards, reward loading and failure isolation, and the shipped data sets."""

import json
import os
import random

import pytest

from engines.tiny import build_tokenizer
from examples.tasks.datasets import make_arithmetic_problems, make_countdown_problems, write_demo_data
from trainer.data.buffer import load_jsonl
from trainer.rewards.rules import (
    arithmetic_reward,
    compute_rewards,
    countdown_reward,
    extract_gsm8k_answer,
    gsm8k_reward,
    load_reward_fn,
    math_reward,
)
from trainer.stops import RunStopped
from trainer.types import Sample, Status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sample(response, **meta):
    return Sample(prompt="q", tokens=(7, 8), response=response, metadata=meta)


def test_arithmetic_problems_are_correct_distinct_and_tokenizable():
    tok = build_tokenizer()
    seed = random.randint(0, 10_000)
    probs = make_arithmetic_problems(300, seed=seed, max_operand=30, ops="+-*")
    assert len({p["prompt"] for p in probs}) == 300
    for p in probs:
        a, op, b = p["prompt"][:-1].partition("+") if "+" in p["prompt"] else (
            p["prompt"][:-1].partition("*") if "*" in p["prompt"] else p["prompt"][:-1].partition("-"))
        expect = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(p["answer"]) == expect
        assert tok.unk_token_id not in tok(p["prompt"] + p["answer"], add_special_tokens=False)["input_ids"]
    assert make_arithmetic_problems(50, seed=seed) == make_arithmetic_problems(50, seed=seed)
    with pytest.raises(ValueError, match="distinct problems"):
        make_arithmetic_problems(10_000, max_operand=5)


def test_arithmetic_reward_exact_match_on_final_integer():
    rng = random.Random(3)
    for _ in range(50):
        ans = rng.randint(-99, 99)
        other = ans + rng.choice([-1, 1]) * rng.randint(1, 9)
        assert arithmetic_reward(_sample(f"{ans}", answer=str(ans))) == 1.0
        assert arithmetic_reward(_sample(f"{other} no, {ans}<|im_end|>junk 5", answer=str(ans))) == 1.0
        assert arithmetic_reward(_sample(f"{ans} no {other}", answer=str(ans))) == 0.0
        assert arithmetic_reward(_sample(f"{ans}{rng.randint(0, 9)}", answer=str(ans))) == 0.0
    assert arithmetic_reward(_sample("no digits", answer="4")) == 0.0


def test_countdown_problems_solvable_and_reward_rules():
    for p in make_countdown_problems(40, seed=1):
        assert p["target"] > 0 and len(p["numbers"]) == 3
    meta = {"numbers": [3, 5, 7], "target": 22}
    assert countdown_reward(_sample("3*5+7", **meta)) == 1.0
    assert countdown_reward(_sample("(7+5)*3-14 = 22", **meta)) == 0.0  # 14 was not offered
    assert countdown_reward(_sample("3*5+7+3", **meta)) == 0.0  # 3 used twice
    assert countdown_reward(_sample("3+5+7", **meta)) == 0.1  # well-formed, wrong value
    assert countdown_reward(_sample("7/(5-5)", **meta)) == 0.0
    assert countdown_reward(_sample("__import__('os')", **meta)) == 0.0
    assert countdown_reward(_sample("(7*3+5)/1", numbers=[7, 3, 5, 1], target=26)) == 1.0


def test_raising_reward_marks_failed_and_counts(tmp_path):
    def flaky(sample):
        if "boom" in sample.response:
            raise RuntimeError("reward server down")
        if "nan" in sample.response:
            return float("nan")
        return 0.5

    samples = [_sample("fine"), _sample("boom"), _sample("nan"), _sample("fine too")]
    scored, failed = compute_rewards(samples, flaky)
    assert failed == 2
    assert [s.status for s in scored] == [Status.PENDING, Status.FAILED, Status.FAILED, Status.PENDING]
    assert [s.reward for s in scored] == [0.5, 0.0, 0.0, 0.5]
    assert "RuntimeError: reward server down" in scored[1].metadata["reward_error"]
    # A missing answer is a reward error too, not a crash.
    scored, failed = compute_rewards([_sample("3")], arithmetic_reward)
    assert failed == 1 and "answer" in scored[0].metadata["reward_error"]


def test_load_reward_fn_builtin_module_and_file(tmp_path):
    assert load_reward_fn("arithmetic") is arithmetic_reward
    assert load_reward_fn("trainer.rewards.rules:countdown_reward") is countdown_reward
    f = tmp_path / "my_reward.py"
    f.write_text("def score(sample):\n    return float(len(sample.response))\n")
    assert load_reward_fn(f"{f}:score")(_sample("abcd")) == 4.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        load_reward_fn("trainer.rewards.rules:nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("not_a_module_xyz:fn")
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("unknown_builtin")


def test_shipped_data_is_what_the_script_writes(tmp_path):
    paths = write_demo_data(str(tmp_path))
    for path in paths.values():
        shipped = os.path.join(ROOT, "data", os.path.basename(path))
        with open(shipped) as a, open(path) as b:
            assert a.read() == b.read(), (f"data/{os.path.basename(path)} is stale: rerun "
                                          f"python -m examples.tasks.datasets")
    train = {p.prompt for p in load_jsonl(paths["arithmetic_train"])}
    test = load_jsonl(paths["arithmetic_test"])
    assert not train & {p.prompt for p in test}  # held-out really is held out
    assert all(arithmetic_reward(_sample(p.answer, answer=p.answer)) == 1.0 for p in test)
    with open(paths["countdown_test"]) as f:
        assert all(json.loads(line)["task"] == "countdown" for line in f)


# ----------------------------------------------------------------------------------------------- gsm8k / math
GSM8K_REF = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 1,234"


@pytest.mark.parametrize("response, expect", [
    ("She sold 1234 clips.\n#### 1234", 1.0),
    ("#### 1,234", 1.0),
    ("#### $1,234.00<|im_end|>", 1.0),
    ("48+24=72 so the total is 1234", 1.0),  # no "####": the last number
    ("#### 1234 (and 99 more words 7)", 1.0),  # the number right after the last ####
    ("#### 1235", 0.0),
    ("#### 123", 0.0),
    ("#### 1234\nwait, #### 72", 0.0),  # the LAST "####" counts
    ("I do not know", 0.0),
    ("", 0.0),
])
def test_gsm8k_reward_final_answer(response, expect):
    assert gsm8k_reward(_sample(response, answer=GSM8K_REF)) == expect


def test_gsm8k_reward_random_numbers_and_plain_reference():
    rng = random.Random(11)
    for _ in range(100):
        n = rng.randint(-10**7, 10**7)
        wrong = n + rng.choice([-1, 1]) * rng.randint(1, 1000)
        assert gsm8k_reward(_sample(f"so #### {n:,}", answer=str(n))) == 1.0
        assert gsm8k_reward(_sample(f"#### {n}", answer=f"steps\n#### {n:,}")) == 1.0
        assert gsm8k_reward(_sample(f"#### {wrong:,}", answer=str(n))) == 0.0
    assert extract_gsm8k_answer("####") is None
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k_reward(_sample("#### 3", answer="#### unknown"))


@pytest.mark.parametrize("reference, response, expect", [
    ("0.5", "so the answer is $\\boxed{\\frac{1}{2}}$", 1.0),  # numeric equivalence
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\boxed{1/2}", 1.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),  # symbolic equivalence
    ("\\sqrt{2}", "\\boxed{\\sqrt 2}", 1.0),
    ("\\frac{\\pi}{4}", "\\boxed{\\pi/4}", 1.0),
    ("42", "first \\boxed{41}, then \\boxed{42}", 1.0),  # the last boxed answer
    ("0.5", "\\boxed{\\frac{1}{3}}", 0.0),
    ("x^2+2x+1", "\\boxed{(x-1)^2}", 0.0),
    ("\\sqrt{2}", "\\boxed{1.41}", 0.0),
    ("42", "no answer here", 0.0),
])
def test_math_reward_math_verify(reference, response, expect):
    assert math_reward(_sample(response, answer=reference)) == expect


def test_new_rewards_load_by_name_and_failures_are_counted():
    assert load_reward_fn("gsm8k") is gsm8k_reward and (load_reward_fn("trainer.rewards.rules:math_reward")
                                                              is math_reward)
    samples = [_sample("#### 3", answer="3"), _sample("#### 3"), _sample("\\boxed{3}", answer="3"),
               _sample("\\boxed{3}", answer="#### nothing")]
    scored, failed = compute_rewards(samples[:2], gsm8k_reward)
    assert failed == 1 and [s.reward for s in scored] == [1.0, 0.0]
    assert scored[1].status == Status.FAILED and "answer_key" in scored[1].metadata["reward_error"]
    scored, failed = compute_rewards(samples[2:], gsm8k_reward)
    assert failed == 1 and scored[0].reward == 1.0 and "holds no number" in scored[1].metadata["reward_error"]
    scored, failed = compute_rewards(samples[:2], math_reward)
    assert failed == 1 and scored[0].reward == 1.0


@pytest.mark.parametrize("value, shown", [("1.0", "str '1.0'"), (1e300, "returned 1e+300, beyond +-1e+06"),
                                          (-1e7, "returned -1e+07, beyond"), (float("inf"), "non-finite value inf"),
                                          (float("nan"), "non-finite value nan")])
def test_a_reward_must_be_a_finite_number_of_sane_size(value, shown):
    (s,), failed = compute_rewards([_sample("1")], lambda _: value)
    assert failed == 1 and s.status == Status.FAILED and s.reward == 0.0
    assert shown in s.metadata["reward_error"]
    (ok,), failed = compute_rewards([_sample("1")], lambda _: True)  # a bool is a reward (1.0)
    assert failed == 0 and ok.reward == 1.0 and ok.status != Status.FAILED


def test_a_reward_past_its_timeout_fails_its_sample_without_stalling_the_step():
    import threading
    import time

    import trio

    from trainer.config import DataConfig
    from trainer.rewards.rules import acompute_reward, with_timeout

    release = threading.Event()

    def stuck(sample):  # a sync reward that hangs (a network call, a pathological parse)
        if sample.response == "hang":
            release.wait(30)
        return 1.0

    async def stuck_async(sample):
        await trio.sleep(30)

    async def score(fn, responses):
        return [await acompute_reward(_sample(r), with_timeout(fn, 0.2)) for r in responses]

    t0 = time.monotonic()
    fast, slow = trio.run(score, stuck, ["ok", "hang"])
    slow_async, = trio.run(score, stuck_async, ["x"])
    release.set()
    assert time.monotonic() - t0 < 5
    assert fast.reward == 1.0 and fast.status != Status.FAILED
    for s in (slow, slow_async):
        assert s.status == Status.FAILED and s.reward == 0.0
        assert "took longer than 0.2 s ([data] reward_timeout_s)" in s.metadata["reward_error"]
    assert DataConfig().reward_timeout_s == 60.0
    with pytest.raises(ValueError, match="reward_timeout_s"):
        DataConfig(reward_timeout_s=0)


def test_the_regex_built_ins_score_inline_and_give_what_the_thread_hop_gave():
    """arithmetic and gsm8k (one linear regex scan) skip the worker thread; the others keep their time limit."""
    import trio

    from trainer.rewards.rules import (
        INLINE_REWARDS,
        acompute_reward,
        arithmetic_reward,
        countdown_reward,
        gsm8k_reward,
        math_reward,
        no_reward,
        with_timeout,
    )

    assert with_timeout(arithmetic_reward, 1.0) is arithmetic_reward and with_timeout(gsm8k_reward, 1.0) is gsm8k_reward
    assert all(with_timeout(fn, 1.0) is not fn for fn in (countdown_reward, math_reward))
    responses = ["12", "the answer is 7", "-3", "", "no number", "1 2 3 <|im_end|> 9"]

    async def score(fn):
        return [await acompute_reward(_sample(r, answer="7"), fn) for r in responses]

    # no_reward (the reward of a run without one) is inline too: it reads the sample's metadata, nothing to scan
    assert set(INLINE_REWARDS) == {arithmetic_reward, gsm8k_reward, no_reward}
    for fn in (arithmetic_reward, gsm8k_reward):
        inline, hopped = trio.run(score, with_timeout(fn, 1.0)), trio.run(score, _thread_hop(fn))
        assert [(s.reward, s.status) for s in inline] == [(s.reward, s.status) for s in hopped]
        assert inline[1].reward == 1.0 and inline[0].reward == 0.0


def _thread_hop(fn):
    import trio

    async def hop(sample):
        return await trio.to_thread.run_sync(fn, sample)

    return hop


def test_evaluation_bounds_each_reward_call_and_names_the_error_when_all_fail():
    import threading
    import time

    from engines.protocol import Completion
    from trainer.cli import evaluate
    from trainer.data.buffer import Prompt

    tok = build_tokenizer()

    class Echo:  # answers every prompt with "7"
        async def generate(self, prompts, params):
            ids = tok("7", add_special_tokens=False)["input_ids"]
            return [[Completion(output_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", weight_version=0)]
                    for _ in prompts]

    prompts = [Prompt(prompt=f"{i}+7=", answer=str(i + 7), metadata={}, index=i) for i in range(3)]
    release = threading.Event()

    def hangs_on_first(sample):
        if sample.prompt == "0+7=":
            release.wait(30)
        return 1.0

    t0 = time.monotonic()
    got = evaluate([Echo()], prompts, tokenizer=tok, reward_fn=hangs_on_first, max_new_tokens=2, chat=False,
                   reward_timeout_s=0.2)
    release.set()
    assert time.monotonic() - t0 < 5 and got["failed"] == 1 and got["accuracy"] == pytest.approx(2 / 3)

    def broken(sample):
        raise KeyError("no_such_field")

    for _ in range(2):  # the second time nothing is printed above: the error must be in the message
        # A run-time stop (one `error:` line from the command line, not a traceback).
        with pytest.raises(RunStopped, match="failed on all 3 samples; the first: reward function failed: "
                                               "KeyError: 'no_such_field'"):
            evaluate([Echo()], prompts, tokenizer=tok, reward_fn=broken, max_new_tokens=2, chat=False)


def test_hung_sync_rewards_free_their_threads_at_their_deadline():
    """48 sync rewards that hang, scored concurrently with 16 that answer: on one shared thread limiter (trio's 40)
    the hung ones held every slot past their deadline and the good ones timed out waiting for a thread; in the
    "rewards" pool (trainer.rollout.blocking) each hung call gives its slot back at its deadline."""
    import threading
    import time

    import trio

    from trainer.rewards.rules import acompute_reward, with_timeout
    from trainer.rollout.blocking import abandoned_threads

    release = threading.Event()

    def reward(sample):
        if sample.response == "hang":
            release.wait(60)
        return 1.0

    bounded = with_timeout(reward, 0.5)

    async def score():
        out = {}

        async def one(i, response):
            await trio.sleep(0.05 * (response == "ok"))  # the hung calls take their threads first
            out[i] = await acompute_reward(_sample(response), bounded)

        async with trio.open_nursery() as nursery:
            for i, r in enumerate(["hang"] * 48 + ["ok"] * 16):
                nursery.start_soon(one, i, r)
        return [out[i] for i in range(64)]

    t0 = time.monotonic()
    try:
        scored = trio.run(score)
        hung_threads = abandoned_threads()
    finally:
        release.set()
    assert time.monotonic() - t0 < 10
    assert [s.reward for s in scored[48:]] == [1.0] * 16
    assert all(s.status != Status.FAILED for s in scored[48:])
    assert all(s.status == Status.FAILED and "took longer than 0.5 s" in s.metadata["reward_error"]
               for s in scored[:48])
    assert hung_threads == 48
