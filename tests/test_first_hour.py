"""What a newcomer hits in the first hour (issue 29): each test failed before its fix.

A run started from a checkpoint of the tiny preset; reward errors shown with their traceback and sample; accuracy
that is accuracy (not the mean reward); a config reference generated from the classes; the resolved config saved
with every run; the Python API's defaults equal to the CLI's; SFT mode evaluating; a quiet log.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from engines.tiny import build_tokenizer
from trainer.cli import evaluate, load_run_config, main, sft_examples
from trainer.config import ConfigError, RLTrainingConfig, RolloutConfig, RunConfig, config_from_dict
from trainer.config_reference import field_help, reference, sections, to_toml
from trainer.data.buffer import Prompt
from trainer.rewards.rules import compute_rewards
from trainer.types import Sample, Status

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs/demo.toml")


# ----------------------------------------------------------------------------------------------- CLI runs
# A few short steps: these tests check what a run writes and logs, not what it learns.
SFT_SET = ["sft.num_steps=4", "sft.batch_size=16", "eval.limit=8"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """`sft` with an eval set, as a user runs it (its own process, stderr to a file, not a terminal): a short SFT of
    the demo's model. Returns (output folder, stderr)."""
    out = tmp_path_factory.mktemp("first_hour")
    args = ["sft", "--config", DEMO, "--set", f'output_dir="{out / "a"}"', *(a for o in SFT_SET for a in ("--set", o))]
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


def test_sft_mode_evaluates_before_and_after(sft_run, capsys):
    out, _ = sft_run
    summary = json.loads((out / "a/summary.json").read_text())
    for stage in ("before_sft", "after_sft"):
        assert 0.0 <= summary[f"accuracy_{stage}"] <= summary[f"reward_mean_{stage}"] + 1e-12 <= 1.0 + 1e-12
    assert summary["sft_steps"] == 4


def test_a_run_saves_its_resolved_config_and_it_runs_again(sft_run):
    out, _ = sft_run
    text = (out / "a/config.toml").read_text()
    again = config_from_dict(RunConfig, tomllib.loads(text), "")
    assert again == load_run_config(DEMO, [f'output_dir="{out / "a"}"', *SFT_SET])
    assert "rollout_correction = \"none\"" in text and "apply_chat_template = true" in text  # resolved values


def test_the_log_has_no_redraws_and_no_warnings(sft_run):
    _, err = sft_run
    assert "\r" not in err  # not a terminal: plain progress lines, not tqdm redraws
    assert "sft: step 4/4 loss=" in err
    assert "Warning" not in err, err  # transformers' past_key_values FutureWarning, once per engine step


def test_the_checkpoint_key_starts_a_tiny_preset_run_in_a_new_folder(sft_run):
    """[model].checkpoint with the tiny preset used to crash with a TypeError from tiny_model_config."""
    from safetensors.torch import load_file

    from trainer.backend.checkpoint import latest_checkpoint
    from trainer.backend.export import export_checkpoint

    out, _ = sft_run
    assert main(["sft", "--config", DEMO, "--set", f'output_dir="{out / "b"}"', "--set", "sft.num_steps=1",
                 "--set", f'model.checkpoint="{out / "a/sft"}"', "--set", "eval.limit=4"]) == 0
    started = load_file(out / "b/start_model/model.safetensors")
    want = load_file(export_checkpoint(latest_checkpoint(out / "a/sft"), out / "a/init_model", out / "x")
                     / "model.safetensors")
    assert started.keys() == want.keys() and all((started[k] == want[k]).all() for k in want)


def test_the_table_names_every_evaluation_rl_mode_included(capsys):
    from trainer.cli import print_table

    print_table({"accuracy_before_rl": 0.25, "reward_mean_before_rl": 0.4, "accuracy_after_rl": 0.5,
                 "reward_mean_after_rl": 0.6, "rl_steps": 3, "wall_seconds": 9.0})
    text = capsys.readouterr().out
    assert "| before RL | 25.0 % | 0.400 |" in text and "| after RL | 50.0 % | 0.600 |" in text


# ----------------------------------------------------------------------------------------------- rewards
def _samples(n: int) -> list[Sample]:
    return [Sample(prompt=f"{i}+1=", tokens=(1, 2, 3), response=f"{i + 1}", response_length=1,
                   metadata={"answer": str(i + 1), "row": i}, status=Status.COMPLETED) for i in range(n)]


def _target_reward(sample):
    return float(sample.response == sample.metadata["target"])  # the data set's field is "answer"


def test_a_raising_reward_shows_its_traceback_and_sample_once(capsys, monkeypatch):
    import trainer.rewards.rules as rules

    # Each distinct error prints once per process: start from none printed (another test in this worker may have
    # raised the same KeyError already).
    monkeypatch.setattr(rules, "_REPORTED", set())
    scored, failed = compute_rewards(_samples(3), _target_reward)
    assert failed == 3 and all(s.status == Status.FAILED for s in scored)
    err = capsys.readouterr().err
    assert err.count("reward function failed: KeyError: 'target'") == 1  # the first of three identical errors
    assert "Traceback (most recent call last)" in err and "_target_reward" in err
    assert "prompt='0+1='" in err and "response='1'" in err and "'answer': '1'" in err


@pytest.mark.parametrize("value", ["1.0", [1.0], None, {"correct": True}, {"reward": 1.0, "correct": "yes"}])
def test_a_reward_that_is_not_a_number_fails_its_sample(value):
    (s,), failed = compute_rewards(_samples(1), lambda _: value)
    assert failed == 1 and s.status == Status.FAILED and s.reward == 0.0


def test_a_reward_may_return_its_own_verdict():
    (s,), failed = compute_rewards(_samples(1), lambda _: {"reward": 0.7, "correct": True})
    assert failed == 0 and s.reward == 0.7 and s.correct is True


class _OneEngine:
    """Greedy answers given by prompt text: the evaluation's own arithmetic is what is checked here."""

    def __init__(self, tok, answers):
        self.tok, self.answers = tok, answers

    async def generate(self, prompts, params):
        from engines.protocol import Completion

        out = []
        for ids in prompts:
            text = self.answers[self.tok.decode(ids)]
            toks = self.tok(text, add_special_tokens=False)["input_ids"]
            out.append([Completion(output_ids=toks, logprobs=[0.0] * len(toks), finish_reason="stop",
                                   weight_version=0)])
        return out


def test_accuracy_is_the_fraction_correct_not_the_mean_reward():
    tok = build_tokenizer()
    prompts = [Prompt(prompt=f"{i}+{i}=", answer=str(2 * i), metadata={}, index=i) for i in range(4)]
    answers = {p.prompt: a for p, a in zip(prompts, ["0", "2", "5", "7"])}  # two right
    engine = _OneEngine(tok, answers)

    def partial(sample):  # partial credit: 0.5 for any number, 1.0 for the right one
        return 1.0 if sample.response == sample.metadata["answer"] else 0.5

    got = evaluate([engine], prompts, tokenizer=tok, reward_fn=partial, max_new_tokens=4, chat=False)
    assert got["accuracy"] == 0.5 and got["reward_mean"] == 0.75 and got["n"] == 4
    verdict = evaluate([engine], prompts, tokenizer=tok, reward_fn=lambda s: {"reward": 0.1, "correct": True},
                       max_new_tokens=4, chat=False)
    assert verdict["accuracy"] == 1.0 and verdict["reward_mean"] == pytest.approx(0.1)


# ----------------------------------------------------------------------------------------------- config
def test_the_config_reference_is_generated_from_the_classes_and_every_key_has_help():
    assert (ROOT / "docs/config.md").read_text() == reference(), \
        "docs/config.md is stale: python -m trainer.config_reference > docs/config.md"
    missing = [f"{path}.{f.name}" for path, cls in sections() for f in dataclasses.fields(cls)
               if f.init and not field_help(cls, f.name)]
    assert not missing
    for key in ("advantage_estimator", "async_rollout", "ppo_epochs", "max_staleness", "rollout_correction"):
        assert f"| `{key}` |" in reference()


@pytest.mark.parametrize("pair, message", [
    ("rl.foo=1", "--set rl.foo: unknown key 'foo' in [rl] (from --set"),
    ("rl.lr=1e-3", "--set rl.lr: rl.lr moved to [rl.optim] lr"),
    ("rl.num_steps.x=1", "rl.num_steps is a key, not a table"),
    ("rl.num_steps=abc", "rl.num_steps = 'abc': expected an integer"),
    ("rl.num_steps=2.5", "rl.num_steps = 2.5: expected an integer"),
    ("trainer.compile=1", "trainer.compile = 1: expected true or false"),
])
def test_set_errors_name_the_key_and_where_it_came_from(pair, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(DEMO, [pair])
    assert message in str(e.value)


def test_resolved_config_round_trips_with_fleets_mixtures_and_unset_keys():
    table = {"name": "x", "seed": 3, "data": {"train": [{"path": "a.jsonl", "weight": 2.0}, {"path": "b.jsonl"}],
                                              "reward": "arithmetic", "system_prompt": 'say "hi"\n'},
             "engines": {"fleet": [{"url": "http://127.0.0.1:1", "kind": "sglang", "tp_size": 2},
                                   {"kind": "embedded"}]},
             "rl": {"async_rollout": True, "loss": {"clip_ratio_c": 3.0}}}
    cfg = config_from_dict(RunConfig, table, "")
    again = config_from_dict(RunConfig, tomllib.loads(to_toml(cfg)), "")
    assert again == cfg and again.rl.loss.rollout_correction == "tis" and again.rl.rollout.seed == 3


def test_the_objective_in_force_is_logged_with_why():
    from trainer.rl import describe_objective

    line = describe_objective(RLTrainingConfig(async_rollout=True))
    assert "rollout_correction 'tis'" in line and "async_rollout" in line
    assert "rollout_correction 'none'" in describe_objective(RLTrainingConfig())


def test_the_python_api_defaults_are_the_clis():
    from trainer.backend.steps import TrainerConfig
    from trainer.config import BackendConfig

    assert RolloutConfig().apply_chat_template is (RunConfig().data.format == "chat") is True
    assert TrainerConfig().backend == BackendConfig() == RunConfig().trainer
    assert RLTrainingConfig() == dataclasses.replace(RunConfig().rl, output_dir=RLTrainingConfig().output_dir)
    from trainer.rl import run_rl_training
    from trainer.sft import run_sft_training

    for fn, required in ((run_rl_training, ("tokenizer", "reward_fn", "engines", "sender")),
                         (run_sft_training, ("tokenizer",))):
        params = inspect.signature(fn).parameters
        assert all(params[p].default is inspect.Parameter.empty for p in required), fn.__name__


# ----------------------------------------------------------------------------------------------- SFT data
def test_the_sft_truncation_warning_counts_only_lost_trained_tokens():
    from trainer.sft import tokenize_conversation

    tok = build_tokenizer()
    (conv,) = sft_examples([Prompt(prompt="12+7=", answer="19", metadata={}, index=0)], tok, "chat")
    full = len(tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
    assert tokenize_conversation(tok, conv, max_length=full - 1)[1] is False  # only the trailing newline cut
    assert tokenize_conversation(tok, conv, max_length=full - 2)[1] is True  # <|im_end|> is trained on
