"""An LLM judge (trainer/rewards/judge.py) through the in-process embedded engine (engines.local.LocalEngine, the tiny
preset). A random tiny model's text is unpredictable, so the plumbing is tested with parsers that map the judge's
actual text deterministically, checked against the engine's own greedy answer to the same prompt decoded here."""

import pytest
import trio

from engines.local import LocalEngine
from engines.protocol import EngineUnavailableError, SamplingParams
from engines.tiny import build_tokenizer
from trainer.rewards.judge import JudgeConfig, judge_samples, parse_score, parse_yes_no
from trainer.rollout.samples import stop_token_ids
from trainer.types import Sample, Status

TEMPLATE = "Q: {prompt}\nA: {response}\nRef: {answer}\nScore 0-9:"
MAX_NEW = 12


# Parsers named as "path/to/this_file.py:function" in the configs below.
def judge_length_mod3(text):
    return len(text) % 3


def judge_even_length_only(text):
    if len(text) % 2:
        raise ValueError(f"odd length {len(text)}")
    return len(text) % 3


def judge_never_reads(text):
    return None


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine("tiny", seed=5)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_samples(n=8):
    return [Sample(prompt=f"{i}+{2 * i + 1}=", tokens=(1, 2, 3), response=f"{3 * i + 1}<|im_end|>", response_length=1,
                   index=i, status=Status.COMPLETED, metadata={"answer": str(3 * i + 1), "row": i}) for i in range(n)]


def greedy_judge_texts(engine, tok, samples, config):
    """The judge's answers computed here: the template filled by hand (end marker cut), the tokenizer's chat
    template, one engine call per sample, decoded without special tokens."""
    texts = []
    for s in samples:
        user = TEMPLATE.format(prompt=s.prompt, response=s.response.removesuffix("<|im_end|>"),
                               answer=s.metadata["answer"])
        ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        params = SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens,
                                stop_token_ids=tuple(stop_token_ids(tok, chat=True)))
        [[completion]] = trio.run(engine.generate, [ids], params)
        assert completion.prompt_ids == list(ids)
        texts.append(tok.decode(completion.output_ids, skip_special_tokens=True))
    return texts


def test_judge_rewards_follow_the_judges_own_text_in_input_order(engine, tok):
    samples = make_samples()
    config = JudgeConfig(template=TEMPLATE, parser=f"{__file__}:judge_length_mod3", max_new_tokens=MAX_NEW)
    out, counts = trio.run(judge_samples, engine, samples, config, tok)
    texts = greedy_judge_texts(engine, tok, samples, config)
    assert counts == {"judge/judged": 8, "judge/failed": 0, "judge/unparseable": 0}
    assert len({*texts}) > 1  # the judge's answers differ between samples: a mix-up would show
    for s, o, text in zip(samples, out, texts):
        assert (o.prompt, o.index, o.metadata["row"]) == (s.prompt, s.index, s.metadata["row"])
        assert o.status == Status.COMPLETED and o.metadata["judge_text"] == text
        assert o.reward == float(len(text) % 3)


def test_unparseable_answers_fail_their_sample_only(engine, tok):
    samples = make_samples()
    config = JudgeConfig(template=TEMPLATE, parser=f"{__file__}:judge_even_length_only", max_new_tokens=MAX_NEW)
    out, counts = trio.run(judge_samples, engine, samples, config, tok)
    texts = greedy_judge_texts(engine, tok, samples, config)
    odd = [i for i, t in enumerate(texts) if len(t) % 2]
    assert 0 < len(odd) < len(samples)  # both kinds in one batch
    assert counts == {"judge/judged": 8, "judge/failed": len(odd), "judge/unparseable": len(odd)}
    for i, (o, text) in enumerate(zip(out, texts)):
        assert o.prompt == samples[i].prompt
        if i in odd:
            assert o.status == Status.FAILED and o.reward == 0.0
            assert "UnparseableJudgeAnswer" in o.metadata["reward_error"]
            assert repr(text[:300]) in o.metadata["reward_error"] and "odd length" in o.metadata["reward_error"]
        else:
            assert o.status == Status.COMPLETED and o.reward == float(len(text) % 3)
    # The built-in "score" parser on the same answers: the first number where there is one, FAILED where not.
    config = JudgeConfig(template=TEMPLATE, parser="score", max_score=5.0, max_new_tokens=MAX_NEW)
    out, counts = trio.run(judge_samples, engine, samples, config, tok)
    scores = [parse_score(t, max_score=5.0) for t in texts]
    assert 0 < scores.count(None) < len(samples)
    assert counts == {"judge/judged": 8, "judge/failed": scores.count(None), "judge/unparseable": scores.count(None)}
    for o, text, score in zip(out, texts, scores):
        if score is None:
            assert o.status == Status.FAILED and f"no reward in the judge's answer {text[:300]!r}" in \
                o.metadata["reward_error"]
        else:
            assert o.status == Status.COMPLETED and o.reward == score
    # A parser that finds nothing fails every sample, naming the text.
    config = JudgeConfig(template=TEMPLATE, parser=f"{__file__}:judge_never_reads", max_new_tokens=MAX_NEW)
    out, counts = trio.run(judge_samples, engine, samples, config, tok)
    assert counts == {"judge/judged": 8, "judge/failed": 8, "judge/unparseable": 8}
    for o, text in zip(out, texts):
        assert o.status == Status.FAILED and f"no reward in the judge's answer {text[:300]!r}" in \
            o.metadata["reward_error"]


def test_failed_samples_pass_through_and_missing_answers_fail(engine, tok):
    samples = make_samples(4)
    samples[1] = Sample(prompt="x", tokens=(1,), status=Status.FAILED, metadata={"reward_error": "earlier"})
    samples[2] = Sample(prompt="no answer", tokens=(1, 2), response="7", response_length=1, status=Status.COMPLETED)
    config = JudgeConfig(template=TEMPLATE, parser=f"{__file__}:judge_length_mod3", max_new_tokens=MAX_NEW)
    out, counts = trio.run(judge_samples, engine, samples, config, tok)
    assert out[1] is samples[1]  # unjudged, uncounted
    assert out[2].status == Status.FAILED and "uses {answer}" in out[2].metadata["reward_error"]
    assert out[0].status == out[3].status == Status.COMPLETED
    assert counts == {"judge/judged": 3, "judge/failed": 1, "judge/unparseable": 0}


class BrokenEngine:
    url = "local://broken"

    async def generate(self, prompts, params, *, rids=None):
        raise EngineUnavailableError(f"{self.url}/generate: no answer in 1 s")


def test_engine_errors_fail_the_batch_naming_the_engine(tok):
    samples = make_samples(3)
    out, counts = trio.run(judge_samples, BrokenEngine(), samples, JudgeConfig(template=TEMPLATE), tok)
    assert counts == {"judge/judged": 3, "judge/failed": 3, "judge/unparseable": 0}
    for s, o in zip(samples, out):
        assert o.prompt == s.prompt and o.status == Status.FAILED and o.reward == 0.0
        assert "judge engine local://broken failed: EngineUnavailableError" in o.metadata["reward_error"]


def test_builtin_parsers():
    assert parse_score("Score: 7/10") == 7.0
    assert parse_score("I'd say -2.5e1 overall") == -25.0
    assert parse_score("about 12", max_score=10) == 10.0 and parse_score("-3", min_score=0) == 0.0
    assert parse_score("no digits here") is None
    assert parse_yes_no("Yes, it is.") == 1.0 and parse_yes_no("Answer: NO") == 0.0
    assert parse_yes_no("nothing to say, yesterday") is None  # "no" / "yes" only as whole words
    assert parse_yes_no("No. Well, yes") == 0.0  # the first one counts


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown field\\(s\\) \\['question'\\]"):
        JudgeConfig(template="{question} {response}")
    with pytest.raises(ValueError, match="no \\{response\\} field"):
        JudgeConfig(template="{prompt}")
    with pytest.raises(ValueError, match="literal braces"):
        JudgeConfig(template="{response} {")
    with pytest.raises(ValueError, match="'module:function'"):
        JudgeConfig(template="{response}", parser="regex")
    with pytest.raises(ValueError, match="min_score=5 > max_score=1"):
        JudgeConfig(template="{response}", min_score=5, max_score=1)
    JudgeConfig(template="{{literal}} {response}")  # doubled braces are text
