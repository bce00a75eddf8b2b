"""[rewards] sources (trainer/rewards/sources.py): rules, reward models (in process and through the scoring
server, trainer/rewards/server.py) and LLM judges combined into the RL reward, their failures, their
metrics, their config errors, and a short RL run that trains on a reward model."""

import dataclasses
import math
import os
import random
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
from test_reward_model import plain_scores, random_pairs, write_reward_model

from engines.local import LocalEngine
from engines.tiny import build_tokenizer
from trainer.cli import load_run_config
from trainer.config import (
    ConfigError,
    ModelSourceConfig,
    RewardsConfig,
    RuleSourceConfig,
    RunConfig,
    config_from_dict,
)
from trainer.rewards.rules import _clean as strip_special_markers
from trainer.rewards.rules import acompute_reward, arithmetic_reward
from trainer.rewards.sources import (
    ModelSource,
    RewardSources,
    build_reward_sources,
    combine_scores,
    score_batch,
    source_labels,
)
from trainer.rl import trained_samples
from trainer.types import RolloutBatch, Sample, Status

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/demo.toml"
TOK = build_tokenizer()


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    return write_reward_model(tmp_path_factory.mktemp("rm"), seed=3)


def finished_samples(prompts, completions, *, answers=None, group_size=1):
    """Finished samples as the rollout hands them over: the response ends with the template's end marker."""
    return [Sample(prompt=p, tokens=(1, 2, 3), response=c + "<|im_end|>", response_length=1, index=i,
                   group_index=i // group_size, status=Status.COMPLETED,
                   metadata={"row": i, **({"answer": answers[i]} if answers else {})})
            for i, (p, c) in enumerate(zip(prompts, completions))]


# ----------------------------------------------------------------------------------------------- combining
def direct_combination(raw, weights, normalize, failed):
    """The combined reward in numpy float64: per source, z-scores over the unfailed samples (0 where std is 0)."""
    labels = list(weights)
    keep = [i for i in range(len(raw)) if i not in failed]
    x = np.array([[raw[i][k] for k in labels] for i in keep], dtype=np.float64)  # [n_scored, n_sources]
    if normalize == "batch":
        # Population std (ddof 0); a source whose scores are all equal gives 0 (numpy's std of equal floats may be
        # rounding noise, not 0: the definition is "all equal", not "std below a threshold").
        mean, std, flat = x.mean(axis=0), x.std(axis=0), np.ptp(x, axis=0) == 0
        x = np.where(flat, 0.0, (x - mean) / np.where(flat, 1.0, std))
    combined = x @ np.array([weights[k] for k in labels])
    out = [None] * len(raw)
    for i, c in zip(keep, combined):
        out[i] = float(c)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("normalize", ["none", "batch"])
def test_combined_reward_equals_a_direct_computation(seed, normalize):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    weights = {"rule": float(rng.normal()), "model0": float(rng.uniform(0.1, 3)), "judge2": float(rng.normal()),
               "flat": float(rng.normal())}
    raw = [{"rule": float(rng.integers(0, 2)), "model0": float(rng.normal(3, 10)), "judge2": float(rng.uniform(0, 9)),
            "flat": 0.1} for _ in range(n)]  # "flat": every sample scores the same (std 0)
    failed = set(rng.choice(n, size=int(rng.integers(0, 3)), replace=False).tolist())
    scores = [None if i in failed else r for i, r in enumerate(raw)]
    got = combine_scores(scores, weights, normalize)
    want = direct_combination(raw, weights, normalize, failed)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert abs(g - w) <= 1e-12 * max(1.0, abs(w))
    if normalize == "batch":  # the constant source contributes exactly nothing
        without = combine_scores(scores, {k: v for k, v in weights.items() if k != "flat"}, normalize)
        assert got == without


def test_batch_normalisation_edge_cases():
    # One scored sample, or all equal: std 0, every normalised score 0; a lone failed sample stays None.
    assert combine_scores([{"a": 5.0}, None], {"a": 2.0}, "batch") == [0.0, None]
    assert combine_scores([{"a": 0.3}] * 3, {"a": 1.0}, "batch") == [0.0, 0.0, 0.0]
    assert combine_scores([{"a": 1.0}, {"a": 3.0}], {"a": 1.0}, "batch") == [-1.0, 1.0]
    assert combine_scores([None, None], {"a": 1.0}, "batch") == [None, None]
    with pytest.raises(ValueError, match="no score from source 'b'"):
        combine_scores([{"a": 1.0}], {"a": 1.0, "b": 1.0})


def bad_rule(sample):
    if sample.metadata["row"] % 3 == 0:
        raise KeyError("no such field")
    return 0.25


def test_rules_score_per_sample_and_a_failing_rule_fails_its_sample_naming_it():
    cfg = RewardsConfig(sources=[{"kind": "rule", "name": "arithmetic", "weight": 2.0},
                                 {"kind": "rule", "name": f"{__file__}:bad_rule", "weight": -1.0}])
    rewards = build_reward_sources(cfg, default_rule=None, engines=[], tokenizer=TOK, timeout_s=5.0)
    samples = finished_samples([f"{i}+1=" for i in range(6)], [str(i + 1 if i % 2 else i) for i in range(6)],
                               answers=[str(i + 1) for i in range(6)])
    fn = rewards.rollout_reward()
    scored = [trio.run(acompute_reward, s, fn) for s in samples]
    for s, o in zip(samples, scored):
        if s.metadata["row"] % 3 == 0:
            assert o.status == Status.FAILED and o.reward == 0.0
            assert "reward source 'bad_rule' (rule) failed: KeyError" in o.metadata["reward_error"]
        else:
            right = arithmetic_reward(s)
            assert o.metadata["reward_sources"] == {"arithmetic": right, "bad_rule": 0.25}
            assert o.reward == 2.0 * right - 0.25
    batch = score_batch(RolloutBatch(samples=tuple(scored), metadata={"reward_failed": 2}), rewards)
    assert [s.reward for s in batch.samples] == [s.reward for s in scored]  # no normalisation: the rollout's sum
    metrics = batch.metadata["reward_metrics"]
    assert metrics["reward/bad_rule_failed"] == 0.0  # a rule's failure is counted by the rollout (reward_failed)
    assert metrics["reward/arithmetic_mean"] == pytest.approx(np.mean([arithmetic_reward(s) for s in samples
                                                                        if s.metadata["row"] % 3]))


def test_labels():
    cfgs = [RuleSourceConfig(), RuleSourceConfig(name="arithmetic"), ModelSourceConfig(path="x"),
            RuleSourceConfig(name="pkg.mod:arithmetic"), ModelSourceConfig(url="http://h:1", label="rm")]
    assert source_labels(cfgs, "trainer.rewards.rules:arithmetic_reward") == [
        "arithmetic_reward", "arithmetic", "model2", "arithmetic3", "rm"]


# ----------------------------------------------------------------------------------------------- reward models
def model_rewards(folder, **source):
    cfg = RewardsConfig(sources=[{"kind": "model", **source}])
    return build_reward_sources(cfg, default_rule=None, engines=[], tokenizer=TOK)


def check_model_scores(rewards, folder, *, seed):
    """score_batch's rewards equal a plain transformers forward of each sample, whatever the order of the batch."""
    prompts, completions = random_pairs(seed, n=19)
    samples = finished_samples(prompts, completions)
    # What a reward model reads of a response: the text without the end marker and the surrounding white space.
    want = plain_scores(folder, prompts, [strip_special_markers(s.response) for s in samples])
    for perm_seed in range(3):
        perm = list(range(len(samples)))
        random.Random(perm_seed).shuffle(perm)
        batch = score_batch(RolloutBatch(samples=tuple(samples[i] for i in perm)), rewards)
        for s in batch.samples:
            w = want[s.metadata["row"]]
            assert s.status == Status.COMPLETED
            assert abs(s.reward - w) <= 1e-5 and abs(s.metadata["reward_sources"]["model0"] - w) <= 1e-5
        assert batch.metadata["reward_metrics"]["reward/model0_mean"] == pytest.approx(np.mean(want), abs=1e-5)
        assert batch.metadata["reward_mean"] == pytest.approx(np.mean(want), abs=1e-5)


def test_model_source_in_process_equals_a_plain_transformers_forward(rm_folder):
    check_model_scores(model_rewards(rm_folder, path=str(rm_folder), batch_size=4), rm_folder, seed=11)


@pytest.fixture(scope="module")
def reward_server(rm_folder, tmp_path_factory):
    """The scoring server as a real subprocess on loopback, with an API key from a file."""
    from engines.embedded.launch import PARENT_ENV, free_port, parent_tag

    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text("s3cret-key\n")
    os.chmod(key_file, 0o600)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), PARENT_ENV: parent_tag()}
    env.pop("RLKERNELS_ENGINE_API_KEY", None)
    log = tmp_path_factory.mktemp("log") / "stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.rewards.server", "--model", str(rm_folder),
                                 "--port", str(port), "--api-key-file", str(key_file), "--batch-size", "5",
                                 "--threads", "1"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the server exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the server did not answer /health within 120 s"
            try:
                if httpx.get(url + "/health", headers={"Authorization": "Bearer s3cret-key"}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, key_file
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_model_source_through_the_server_equals_a_plain_transformers_forward(rm_folder, reward_server):
    url, key_file = reward_server
    check_model_scores(model_rewards(rm_folder, url=url, api_key_file=str(key_file)), rm_folder, seed=12)


def test_server_refuses_bad_requests_and_a_missing_key(reward_server):
    from trainer.rewards.server import RewardServerError, score_remote

    url, key_file = reward_server
    assert httpx.post(url + "/score", json={"prompts": ["a"], "completions": []}).status_code == 401
    with pytest.raises(RewardServerError, match="HTTP 401"):
        score_remote(url, ["a"], ["b"])
    with pytest.raises(RewardServerError, match="HTTP 400: bad /score request: 1 prompts but 2 completions"):
        score_remote(url, ["a"], ["b", "c"], api_key="s3cret-key")
    resp = httpx.post(url + "/score", content=b"{not json", headers={"Authorization": "Bearer s3cret-key"})
    assert resp.status_code == 400 and "bad /score request" in resp.json()["error"]


def test_a_server_that_does_not_answer_fails_the_batch_naming_it(rm_folder):
    from engines.embedded.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rewards = model_rewards(rm_folder, url=url, timeout_s=5.0)
    samples = finished_samples(*random_pairs(3, n=4))
    samples[1] = Sample(prompt="x", tokens=(1,), status=Status.FAILED, metadata={"reward_error": "earlier"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = score_batch(RolloutBatch(samples=tuple(samples)), rewards)
    assert all(s.status == Status.FAILED for s in batch.samples)
    assert batch.samples[1].metadata["reward_error"] == "earlier"  # failed before: not touched
    for s in batch.samples[::2]:
        assert f"reward source 'model0' (model) failed: reward server {url}/score" in s.metadata["reward_error"]
    assert batch.metadata["reward_metrics"]["reward/model0_failed"] == 3.0
    assert batch.metadata["failed_fraction"] == 1.0


# ----------------------------------------------------------------------------------------------- judges
JUDGE_TEMPLATE = "Q: {prompt}\nA: {response}\nScore 0-9:"


def judge_even_length_only(text):  # a parser that reads some of a random tiny judge's answers and not others
    if len(text) % 2:
        return None
    return len(text) % 4


@pytest.fixture(scope="module")
def judge_engine():
    eng = LocalEngine("tiny", seed=5)
    yield eng
    eng.close()


def test_judge_source_through_the_embedded_engine_with_unparseable_answers(judge_engine, rm_folder):
    from trainer.rewards.judge import JudgeConfig, judge_samples

    cfg = RewardsConfig(sources=[
        {"kind": "model", "path": str(rm_folder), "weight": 0.5},
        {"kind": "judge", "template": JUDGE_TEMPLATE, "parser": f"{__file__}:judge_even_length_only",
         "max_new_tokens": 12, "weight": 2.0}], normalize="batch")
    rewards = build_reward_sources(cfg, default_rule=None, engines=[judge_engine], tokenizer=TOK)
    prompts, completions = random_pairs(7, n=12)
    samples = finished_samples(prompts, completions, group_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = score_batch(RolloutBatch(samples=tuple(samples)), rewards)
    # The judge's own answers, computed apart: the same engine, template and parser.
    judge_cfg = JudgeConfig(template=JUDGE_TEMPLATE, parser=f"{__file__}:judge_even_length_only", max_new_tokens=12)
    alone, _ = trio.run(judge_samples, judge_engine, samples, judge_cfg, TOK)
    unreadable = [i for i, a in enumerate(alone) if a.status == Status.FAILED]
    assert 0 < len(unreadable) < len(samples), "want both readable and unreadable answers in the batch"
    model = plain_scores(rm_folder, prompts, [strip_special_markers(s.response) for s in samples])
    raw = [{"model0": model[i], "judge1": alone[i].reward} for i in range(len(samples))]
    want = direct_combination(raw, {"model0": 0.5, "judge1": 2.0}, "batch", set(unreadable))
    for i, s in enumerate(batch.samples):
        assert s.metadata["judge_text"] == alone[i].metadata["judge_text"]
        if i in unreadable:
            assert s.status == Status.FAILED and s.reward == 0.0
            assert s.metadata["reward_error"].startswith("reward source 'judge1' (judge) failed: UnparseableJudge")
        else:
            assert s.status == Status.COMPLETED and abs(s.reward - want[i]) <= 1e-4
            assert s.metadata["reward_sources"]["judge1"] == alone[i].reward
    metrics = batch.metadata["reward_metrics"]
    assert metrics["judge/judged"] == 12 and metrics["judge/unparseable"] == metrics["judge/failed"] == len(unreadable)
    assert metrics["reward/judge1_failed"] == len(unreadable) and metrics["reward/model0_failed"] == 0
    # The loss leaves the unparseable ones out.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keep, counts = trained_samples(batch.samples, "reinforce")
    assert sorted(set(range(12)) - set(keep)) == unreadable
    assert counts["rollout/failed_fraction"] == len(unreadable) / 12


def test_an_environment_reward_cannot_be_combined():
    rewards = RewardSources(sources=(ModelSource("m", 1.0, lambda samples: [1.0] * len(samples)),))
    s = Sample(prompt="p", tokens=(1, 2), response="r", response_length=1, reward=0.5, status=Status.COMPLETED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [out] = score_batch(RolloutBatch(samples=(s,)), rewards).samples
    assert out.status == Status.FAILED and "the environment gave this sample its own reward" in \
        out.metadata["reward_error"]


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("table, message", [
    ({"sources": [{"kind": "model"}]}, "path and url: give a model source one of them"),
    ({"sources": [{"kind": "model", "path": "a", "url": "http://h:1"}]}, "path and url"),
    ({"sources": [{"kind": "model", "url": "h:1"}]}, "url = 'h:1': give an http(s):// address"),
    ({"sources": [{"kind": "rule", "path": "x"}]}, "path: a key of 'model' and 'judge' sources, and this one is "
                                                   "kind = 'rule'; drop path, or change kind"),
    ({"sources": [{"kind": "judge"}]}, "template: a judge source needs its prompt"),
    ({"sources": [{"kind": "judge", "template": "{prompt}"}]}, "judge template has no {response} field"),
    ({"sources": [{"kind": "judge", "template": "{response}", "parser": "regex"}]}, "'module:function'"),
    ({"sources": [{"kind": "judge", "template": "{response}", "engine": "localhost"}]}, "engine = 'localhost'"),
    ({"sources": [{"kind": "rm"}]}, "kind = 'rm': choose one of ('rule', 'model', 'judge')"),
    ({"sources": [{"kind": "rule", "weight": float("nan")}]}, "weight = nan: a finite number"),
    ({"sources": [{"kind": "rule", "label": "a/b"}]}, "label = 'a/b'"),
    ({"sources": [{"kind": "rule", "label": "x"}, {"kind": "rule", "label": "x"}]}, "must be unique"),
    ({"sources": [{"kind": "model", "path": "a", "batch_size": 0}]}, "batch_size: must be > 0"),
    ({"normalize": "zscore"}, "normalize = 'zscore': choose one of ('none', 'batch')"),
    ({"sources": [{"kind": "rule", "nme": "x"}]}, "unknown config key(s) ['nme'] in [rewards.sources[0]]"),
])
def test_config_errors_name_the_key_and_the_fix(table, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(RunConfig, {"rewards": table}, "")
    assert message in str(e.value)


def test_no_sources_changes_nothing_and_sources_round_trip():
    from trainer.config_reference import to_toml

    assert RunConfig().rewards == RewardsConfig() and RunConfig().rewards.sources == ()
    cfg = config_from_dict(RunConfig, {"rewards": {"normalize": "batch", "sources": [
        {"kind": "model", "url": "http://127.0.0.1:9", "weight": 0.5},
        {"kind": "judge", "template": "{prompt} {response}", "parser": "yes_no", "max_score": 3.0},
        {"kind": "rule", "name": "arithmetic"}]}}, "")
    import tomllib

    assert config_from_dict(RunConfig, tomllib.loads(to_toml(cfg)), "") == cfg


def test_the_cli_checks_sources_before_any_work(tmp_path, rm_folder):
    with pytest.raises(ConfigError, match=r"\[rewards\] sources\[0\] \(kind = 'model'\): reward model .*no config"):
        load_run_config(DEMO, [f'rewards.sources=[{{kind = "model", path = "{tmp_path}/none"}}]'], mode="demo")
    with pytest.raises(ConfigError, match=r"sources\[1\] \(kind = 'rule'\): reward 'nope'"):
        load_run_config(DEMO, [f'rewards.sources=[{{kind = "model", path = "{rm_folder}"}}, '
                               f'{{kind = "rule", name = "nope"}}]'], mode="demo")
    with pytest.raises(ConfigError, match="dynamic_filters = \\['check_reward_nonzero_std'\\] read each group's"):
        load_run_config(DEMO, [f'rewards.sources=[{{kind = "model", path = "{rm_folder}"}}]',
                               'rl.rollout.dynamic_filters=["check_reward_nonzero_std"]'], mode="demo")
    cfg = load_run_config(DEMO, [f'rewards.sources=[{{kind = "model", path = "{rm_folder}"}}]'], mode="demo")
    assert cfg.rewards.sources[0].path == str(rm_folder)


# ----------------------------------------------------------------------------------------------- one system
def verdict_rule(sample):
    """A user rule that gives its own verdict: what the [data].reward shorthand must pass through as it is."""
    n = len(sample.response)
    return {"reward": n / 7.0, "correct": n % 2 == 0}


@pytest.mark.parametrize("spec", ["arithmetic", verdict_rule, None])
def test_data_reward_is_shorthand_for_one_rule_source_with_the_old_wiring(spec):
    """[data].reward alone is one rule source whose result is the reward as it is: on random samples, the rollout's
    reward function scores exactly what the former wiring (with_timeout(load_reward_fn(spec))) scored, an
    environment's own reward is kept, and there is no batch pass (score_batch and scored_batches return what they
    are given)."""
    from trainer.rewards.rules import load_reward_fn, no_reward, with_timeout
    from trainer.rewards.sources import RuleSource, as_reward_sources, scored_batches

    rewards = as_reward_sources(spec, timeout_s=5.0)
    assert rewards.shorthand and not rewards.scores_batches and len(rewards.sources) == 1
    assert isinstance(rewards.sources[0], RuleSource) and rewards.recipe.default_rule is spec
    old = with_timeout(load_reward_fn(no_reward if spec is None else spec), 5.0)
    rng = random.Random(7)
    words = ["".join(rng.choice("0123456789+= ") for _ in range(rng.randint(0, 9))) for _ in range(24)]
    samples = finished_samples([f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" for _ in words], words,
                               answers=[str(rng.randint(0, 18)) for _ in words])
    got = [trio.run(acompute_reward, s, rewards.rollout_reward()) for s in samples]
    want = [trio.run(acompute_reward, s, old) for s in samples]
    strip = ("reward_traceback",)  # the traceback's frames name the wrapper that ran it
    assert [dataclasses.replace(s, metadata={k: v for k, v in s.metadata.items() if k not in strip}) for s in got] \
        == [dataclasses.replace(s, metadata={k: v for k, v in s.metadata.items() if k not in strip}) for s in want]
    assert all("reward_sources" not in s.metadata for s in got)  # no per-source bookkeeping for the shorthand
    own = dataclasses.replace(samples[0], reward=0.25)  # an environment's own reward
    batch = RolloutBatch(samples=(own,), metadata={"reward_failed": 0})
    assert score_batch(batch, rewards) is batch
    batches = iter([batch])
    assert scored_batches(batches, rewards) is batches


def test_a_new_source_kind_is_one_config_class_and_one_registry_entry():
    """A kind added from outside the library (a config class registered in trainer.config, its entry registered in
    trainer.rewards.sources) is read from TOML, checked, built, scored per batch and combined like the
    built-in kinds, with no other change; its foreign keys are refused like theirs."""
    from trainer.config import REWARD_SOURCE_CONFIGS, RewardSourceConfig, reward_source_kind
    from trainer.rewards.sources import SOURCE_KINDS, check_reward_sources, describe_rewards, source_kind

    @dataclasses.dataclass(frozen=True)
    class LengthSourceConfig(RewardSourceConfig):
        kind: str = "length"  # the kind these keys belong to
        per_char: float = 1.0  # the score of each character of the response

    @dataclasses.dataclass(frozen=True)
    class LengthSource:
        label: str
        weight: float
        per_char: float
        kind = "length"
        per_sample = False

        async def score_sample(self, sample):
            raise TypeError("per batch")

        def score_batch(self, samples, todo):
            for i in todo:
                s = samples[i]
                meta = {**s.metadata, "reward_sources": {**s.metadata.get("reward_sources", {}),
                                                         self.label: self.per_char * len(s.response)}}
                samples[i] = dataclasses.replace(s, metadata=meta)
            return {"length/scored": len(todo)}

    reward_source_kind(LengthSourceConfig)
    try:
        source_kind(LengthSourceConfig, LengthSource, check=lambda c, default: None, where=lambda c, default: "chars",
                    build=lambda c, label, i, ctx: LengthSource(label=label, weight=c.weight, per_char=c.per_char))
        cfg = config_from_dict(RunConfig, {"rewards": {"sources": [
            {"kind": "rule", "name": "arithmetic"}, {"kind": "length", "per_char": 0.5, "weight": -2.0}]}}, "")
        assert isinstance(cfg.rewards.sources[1], LengthSourceConfig)
        check_reward_sources(cfg.rewards, default_rule=None)
        assert describe_rewards(cfg.rewards, None).startswith("rl reward: 1 x arithmetic (rule: arithmetic) + "
                                                              "-2 x length1 (length: chars)")
        rewards = build_reward_sources(cfg.rewards, default_rule=None, engines=[], tokenizer=TOK)
        rng = random.Random(3)
        words = ["".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6))) for _ in range(10)]
        samples = finished_samples([f"{i}+{i}=" for i in range(10)], words, answers=[str(2 * i) for i in range(10)])
        scored = [trio.run(acompute_reward, s, rewards.rollout_reward()) for s in samples]
        batch = score_batch(RolloutBatch(samples=tuple(scored), metadata={"reward_failed": 0}), rewards)
        for s in batch.samples:
            want = arithmetic_reward(s) - 2.0 * 0.5 * len(s.response)
            assert abs(s.reward - want) <= 1e-12
        assert batch.metadata["reward_metrics"]["length/scored"] == 10
        with pytest.raises(ConfigError, match="name: a key of 'rule' sources, and this one is kind = 'length'"):
            config_from_dict(RunConfig, {"rewards": {"sources": [{"kind": "length", "name": "x"}]}}, "")
    finally:
        REWARD_SOURCE_CONFIGS.pop("length", None)
        SOURCE_KINDS.pop("length", None)


def test_a_config_file_written_with_every_key_of_every_kind_still_loads():
    """A run's config.toml written when one class held every kind's keys lists them all, at their defaults: those
    load as the source's own class; a foreign key set to anything else is refused."""
    from trainer.config import JudgeSourceConfig

    old = {"kind": "rule", "weight": 2.0, "name": "arithmetic", "timeout_s": 120.0, "batch_size": 16, "chat": True,
           "parser": "score", "max_new_tokens": 64}
    judge = {"kind": "judge", "template": "{response}", "batch_size": 16, "chat": True, "timeout_s": 5.0}
    cfg = config_from_dict(RunConfig, {"rewards": {"sources": [old, judge]}}, "")
    assert cfg.rewards.sources == (RuleSourceConfig(weight=2.0, name="arithmetic"),
                                   JudgeSourceConfig(template="{response}", timeout_s=5.0))
    with pytest.raises(ConfigError, match="batch_size: a key of 'model' sources, and this one is kind = 'rule'"):
        config_from_dict(RunConfig, {"rewards": {"sources": [{**old, "batch_size": 8}]}}, "")


# ----------------------------------------------------------------------------------------------- RL
class NoSync:
    """Stands in for the weight-sync sender: the engine keeps its own random weights (the plumbing is under test)."""

    weight_version = 0
    last_sync_bytes = 0  # what the RL loop logs as sync/bytes

    def sync(self, weight_version: int) -> None:
        self.weight_version = weight_version


@pytest.mark.parametrize("async_rollout", [False, True])
def test_a_short_rl_run_trains_on_a_reward_model_and_logs_its_mean(judge_engine, rm_folder, tmp_path, async_rollout):
    """The model scores each batch in the rollout worker (in async mode: while the previous step trains)."""
    from engines.tiny import tiny_model_config
    from kernels import use_backend
    from trainer.backend.steps import build_components, trainer_config_from
    from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
    from trainer.data.buffer import DataBuffer, load_jsonl
    from trainer.rl import run_rl_training
    from trainer.rollout.dumps import RolloutDumps, read_rollouts

    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-3), num_steps=2, token_budget=256, micro_batch_buckets=64,
                           loss={"loss_agg": "token-mean"}, output_dir=str(tmp_path / "rl"),
                           async_rollout=async_rollout,
                           rollout=RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=2, max_new_tokens=5,
                                                 seed=1))
    tcfg = trainer_config_from(cfg, compile=False)
    rewards = build_reward_sources(RewardsConfig(sources=[{"kind": "model", "path": str(rm_folder)}]),
                                   default_rule=None, engines=[judge_engine], tokenizer=TOK)
    threads = []  # where each batch was scored

    def scored_here(samples, score=rewards.sources[0].scorer):
        threads.append(threading.current_thread().name)
        return score(samples)

    rewards = dataclasses.replace(rewards, sources=(dataclasses.replace(rewards.sources[0], scorer=scored_here),))
    with use_backend("torch"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comp = build_components(tiny_model_config("llama"), tcfg)
        buffer = DataBuffer(load_jsonl(str(ROOT / "data/arithmetic_train.jsonl")), seed=0)
        _, state, history = run_rl_training(None, buffer, cfg, engines=[judge_engine], sender=NoSync(),
                                            tokenizer=TOK, reward_fn=rewards, trainer_config=tcfg,
                                            components=comp, dumps=RolloutDumps(every=1, folder=tmp_path / "dumps"))
    assert state.step == 2 and len(history) == 2
    # Async: in the rollout worker, while the previous step trains; synchronous: in the loop's own thread.
    assert all(t.startswith("rollout") == async_rollout for t in threads) and len(threads) == 2
    for step, metrics in enumerate(history, start=1):
        _, batch = read_rollouts(tmp_path / "dumps" / f"step_{step:06d}.jsonl")
        want = plain_scores(rm_folder, [s.prompt for s in batch.samples],
                            [strip_special_markers(s.response) for s in batch.samples])
        assert len(want) == 6 and math.isfinite(metrics["loss"])
        assert abs(metrics["reward/model0_mean"] - float(np.mean(want))) <= 1e-5
        assert abs(metrics["reward_mean"] - float(np.mean(want))) <= 1e-5  # weight 1, no normalisation
        assert metrics["reward/model0_failed"] == 0.0
        for s, w in zip(batch.samples, want):
            assert abs(s.reward - w) <= 1e-5


def test_the_recipe_script_writes_a_reward_model_the_sources_load(tmp_path):
    """examples/train_reward_model.py as a user runs it (a fresh process, a few steps): its folder loads as a model
    source and its figures are written."""
    import json

    out = tmp_path / "rm"
    proc = subprocess.run([sys.executable, str(ROOT / "examples/train_reward_model.py"), "--out", str(out),
                           "--steps", "3", "--lm-steps", "2", "--batch", "8"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads((out / "rm_metrics.json").read_text())
    assert figures["held_out"]["n"] == 200 * 7 and set(figures["held_out"]["wrong_answers_by_kind"]) == {
        "near", "tens", "swap", "drop", "repeat", "other"}
    rewards = model_rewards(out, path=str(out))
    [s] = score_batch(RolloutBatch(samples=tuple(finished_samples(["2+2="], ["4"]))), rewards).samples
    assert s.status == Status.COMPLETED and math.isfinite(s.reward)
