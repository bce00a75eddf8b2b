"""Nothing lost, round 2 (issue 44): everything a run file or `--set` names is checked before the run touches its
output folder, and a reward is never made up.

- A user-named function, module or filter of [rl.rollout] (env, tools, rollout_fn, tool_parser, dynamic_filters)
  that does not load is `error:` + exit 2 before the fresh start: the previous run's files stay byte for byte.
- `--set` values are checked against their keys' types: a scalar for an array key is a one-element array, a wrong
  type is an error that names --set (not the config file).
- An environment (or rollout_fn) that returns rewards replaces [data].reward; an episode that gets a reward from
  neither is FAILED, never scored 0.
- The fresh start removes everything the phases it runs wrote (and the run-wide summary, preset and start model),
  and keeps the rest; a file the config names inside what it removes ([model] checkpoint = "<output_dir>/rl", a
  critic, a data file) is `error:` + exit 2 before anything is removed, and so is a missing critic or checkpoint.

The previous run's folder is made by hand: the fresh start only looks at what is in it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import trio
from episode_support import arithmetic_buffer

from engines.protocol import Completion
from engines.tiny import IM_END, SPECIAL_TOKENS, build_tokenizer
from trainer.cli import ConfigError, load_run_config, main
from trainer.config import RolloutConfig
from trainer.data.buffer import Prompt
from trainer.rl import compute_advantages, trained_samples
from trainer.types import Status

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.toml"
TOK = build_tokenizer()
IM_END_ID = SPECIAL_TOKENS.index(IM_END)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # the demo config's data paths are relative to the repository


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_run(out: Path) -> dict[str, bytes]:
    """What a finished `rl` run leaves in its output folder (the files the fresh start would remove or overwrite)."""
    (out / "rl" / "checkpoints" / "step_00000002").mkdir(parents=True)
    (out / "rl" / "checkpoints" / "step_00000002" / "state.json").write_text('{"step": 2}\n')
    (out / "rl" / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    (out / "rl.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (out / "summary.json").write_text('{"rl_steps": 2}\n')
    (out / "config.toml").write_text("# the resolved config of `rl`\n")
    return files_of(out)


@pytest.mark.parametrize("override, named", [
    ('rl.rollout.env="no_such_module.py:Guess"', "[rl.rollout] env 'no_such_module.py:Guess': cannot import"),
    ("rl.rollout.tools=no_such_module:calc", "[rl.rollout] tools: 'no_such_module:calc': cannot import"),
    ('rl.rollout.rollout_fn="no_such_module:agent"', "[rl.rollout] rollout_fn 'no_such_module:agent': cannot import"),
    ('rl.rollout.rollout_fn="trainer.rewards.rules:arithmetic_reward"', "must take (client, row)"),
    ('rl.rollout.dynamic_filters=["check_reward_nonzero_stdd"]',
     "[rl.rollout] dynamic_filters: unknown filter 'check_reward_nonzero_stdd'"),
    ('rl.rollout.dynamic_filters=["no_such_module:keep"]', "dynamic_filters: 'no_such_module:keep': cannot import"),
    ('rl.rollout.tool_parser="no_such_module:parse"', "tool_parser (built-in: ['hermes']) 'no_such_module:parse'"),
], ids=["env", "tools", "rollout_fn", "rollout_fn-signature", "filter", "filter-module", "tool_parser"])
def test_a_typo_in_a_rollout_function_leaves_the_previous_run_as_it_was(tmp_path, capsys, monkeypatch, override,
                                                                        named):
    import trainer.cli as cli
    import trainer.run as run_module

    def started(*a, **k):  # past the fresh start: the check came too late (and the test stays cheap)
        raise AssertionError("the run started")

    monkeypatch.setattr(cli, "prepare_model_folder", started)  # export, generate, replay
    monkeypatch.setattr(run_module, "prepare_model_folder", started)  # the training modes
    out = tmp_path / "run"
    before = finished_run(out)
    rc = main(["rl", "--config", str(DEMO), "--set", f"output_dir={json.dumps(str(out))}", "--set", override])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and named in err and "Traceback" not in err, err
    assert files_of(out) == before


def test_set_gives_a_scalar_to_an_array_key_as_a_one_element_array():
    cfg = load_run_config(DEMO, ["logging.backends=jsonl", "rl.rollout.stop_token_ids=5", "rl.rollout.tools=mod:fn",
                                 "trainer.cpus=0"])
    assert cfg.logging.backends == ("jsonl",)  # was ('j', 's', 'o', 'n', 'l')
    assert cfg.rl.rollout.stop_token_ids == (5,)  # was a TypeError from tuple(5)
    assert cfg.rl.rollout.tools == ("mod:fn",)  # was ('m', 'o', 'd', ...)
    assert cfg.trainer.cpus == (0,)
    with pytest.raises(ConfigError, match=r"\[rl\.rollout\] tools: 'mod:fn': cannot import 'mod'"):
        load_run_config(DEMO, ["rl.rollout.tools=mod:fn"], mode="rl")  # named whole, before any engine starts


@pytest.mark.parametrize("override, message", [
    ("rl.num_steps=abc", "--set rl.num_steps = 'abc': expected an integer"),
    ('rl.rollout.stop_token_ids=["a"]', "--set rl.rollout.stop_token_ids[0] = 'a': expected an integer"),
    ("rl.optim.betas=0.9", "--set rl.optim.betas = [0.9]: expected an array of 2 values"),
    ("logging.backends=[1]", "--set logging.backends[0] = 1: expected a string"),
])
def test_a_set_type_error_names_set_not_the_config_file(capsys, override, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(DEMO, [override])
    assert str(e.value) == f"{message} (the value given with --set, not the config file's)"
    assert main(["rl", "--config", str(DEMO), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and str(DEMO) not in err


@pytest.mark.parametrize("line, message", [
    ("stop_token_ids = 5", "rl.rollout.stop_token_ids = 5: expected an array, e.g. stop_token_ids = [5]"),
    ('dynamic_filters = "check_min_reward"', "rl.rollout.dynamic_filters = 'check_min_reward': expected an array, "
                                             'e.g. dynamic_filters = ["check_min_reward"]'),
])
def test_a_scalar_for_an_array_key_in_the_file_is_named(tmp_path, line, message):
    path = tmp_path / "run.toml"
    path.write_text(DEMO.read_text().replace("dynamic_filters = []", line))
    with pytest.raises(ConfigError) as e:
        load_run_config(path)
    assert str(e.value) == f"{path}: {message}"


# ----------------------------------------------------------------------------------------------- [data].reward
GUESS_ENV = '''
class Guess:
    """Rewards the answer itself: no reward function needed."""

    def reset(self, prompt, metadata):
        self.answer = str(metadata["answer"])
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        return {"messages": [], "reward": float(message["content"].strip() == self.answer), "done": True}
'''

TOOL = '''
def calc(expression: str) -> str:
    """Evaluate an expression.

    Args:
        expression: the expression
    """
    return expression
'''


@pytest.fixture
def no_reward_config(tmp_path) -> Path:
    """The demo config without its [data].reward, and a user's environment and tool in tmp_path."""
    (tmp_path / "guess_env.py").write_text(GUESS_ENV)
    (tmp_path / "tool.py").write_text(TOOL)
    path = tmp_path / "no_reward.toml"
    path.write_text(DEMO.read_text().replace('reward = "trainer.rewards.rules:arithmetic_reward"', ""))
    return path


def test_an_environment_that_gives_rewards_needs_no_reward_function(no_reward_config, tmp_path):
    env = f"rl.rollout.env={json.dumps(str(tmp_path / 'guess_env.py') + ':Guess')}"
    eval_set = f"eval.sets=[{{name = \"more\", path = {json.dumps(str(ROOT / 'data/arithmetic_test.jsonl'))}}}]"
    for mode in ("rl", "sft+rl", "sft"):  # the RL rollouts, and the evaluation (it runs the same episodes)
        cfg = load_run_config(no_reward_config, [env, eval_set], mode=mode)
        assert cfg.data.reward is None and cfg.rl.rollout.env.endswith("guess_env.py:Guess")


def test_without_a_reward_the_error_names_the_environment_alternative(no_reward_config, tmp_path):
    alternative = "or give [rl.rollout] env (or rollout_fn) that returns each episode's reward"
    with pytest.raises(ConfigError) as e:
        load_run_config(no_reward_config, [], mode="rl")
    assert "[data].reward: mode 'rl' scores samples" in str(e.value) and alternative in str(e.value)
    # The tool environment gives no reward: tools still need a reward function, and the error says why.
    tools = f"rl.rollout.tools={json.dumps(str(tmp_path / 'tool.py') + ':calc')}"
    with pytest.raises(ConfigError) as e:
        load_run_config(no_reward_config, [tools], mode="rl")
    assert alternative in str(e.value) and "tools' episodes get none from the tool environment" in str(e.value)
    no_eval = tmp_path / "no_eval.toml"  # SFT alone, with an [[eval.sets]] entry that nothing scores
    no_eval.write_text(no_reward_config.read_text().replace('eval = "data/arithmetic_test.jsonl"', ""))
    with pytest.raises(ConfigError) as e:
        load_run_config(no_eval, ['eval.sets=[{name = "more", path = "data/arithmetic_test.jsonl"}]'], mode="sft")
    assert "[[eval.sets]] 'more': no reward; set its reward or [data].reward; " + alternative in str(e.value)


class Echo:
    """An engine stand-in that answers every turn with "7" and the end-of-turn token (finish "stop"), except on
    "2+3=", where its turn is cut by the length limit (finish "length")."""

    url = "echo://"

    async def generate(self, prompts, params, *, rids=None):
        out = []
        for p in prompts:
            cut = "2+3=" in TOK.decode(list(p))
            ids = TOK.encode("77") if cut else TOK.encode("7") + [IM_END_ID]
            out.append([Completion(ids, [-0.5] * len(ids), "length" if cut else "stop", 0, list(p))] * params.n)
        return out

    async def abort(self, rids=None):
        pass

    async def aclose(self):  # engines.protocol.InferenceEngine: nothing pooled
        pass


class RewardsZeroOnly:
    """Gives a reward to the episodes of prompts that start with "0" only; the others end with reward None."""

    def reset(self, prompt, metadata):
        self.prompt = prompt
        return [{"role": "user", "content": prompt}]

    def step(self, message):
        return {"messages": [], "reward": 1.0 if self.prompt.startswith("0") else None, "done": True}


def test_evaluation_without_a_reward_function_fails_the_episodes_given_none():
    from trainer.evaluation import evaluate

    prompts = [Prompt("0+1=", "1"), Prompt("1+2=", "3"), Prompt("2+3=", "5")]  # rewarded, given none, cut
    got = evaluate([Echo()], prompts, tokenizer=TOK, reward_fn=None, max_new_tokens=4,
                   rollout=RolloutConfig(env=RewardsZeroOnly, max_turns=1))
    assert got == {"reward_mean": 1 / 3, "accuracy": 1 / 3, "n": 3, "failed": 2}


def test_the_rl_rollouts_fail_an_episode_given_no_reward_instead_of_scoring_0(monkeypatch):
    """run_rl_training without a reward function (the environment gives them): its rollout manager fails the
    episodes whose environment returned no reward, and those cut by a limit before the environment judged them;
    they are out of the loss and of their group's baseline."""
    import trainer.rollout.manager as manager_module
    from engines.tiny import tiny_model_config
    from trainer.backend.steps import trainer_config_from
    from trainer.config import RLTrainingConfig
    from trainer.rl import run_rl_training

    built = {}

    class Captured(manager_module.AsyncRolloutManager):
        def __init__(self, *a, **kw):
            built["reward_fn"] = kw["reward_fn"]
            raise InterruptedError("captured")  # the manager the loop would use: enough to see its reward

    monkeypatch.setattr(manager_module, "AsyncRolloutManager", Captured)
    rollout = RolloutConfig(rollout_batch_size=3, n_samples_per_prompt=2, max_new_tokens=4, env=RewardsZeroOnly,
                            max_turns=1)
    cfg = RLTrainingConfig(num_steps=1, token_budget=128, micro_batch_buckets=32, rollout=rollout)
    with pytest.raises(InterruptedError, match="captured"):
        run_rl_training(tiny_model_config("llama"), arithmetic_buffer(3), cfg, engines=[Echo()], sender=None,
                        tokenizer=TOK, reward_fn=None, trainer_config=trainer_config_from(cfg, compile=False))
    monkeypatch.undo()
    manager = manager_module.AsyncRolloutManager([Echo()], rollout, tokenizer=TOK, reward_fn=built["reward_fn"],
                                                 check_health=False)

    async def one_batch():
        async with manager:
            return await manager.generate_batch(arithmetic_buffer(3))

    samples = trio.run(one_batch).samples
    by_prompt = {p: [s for s in samples if s.prompt == p] for p in ("0+1=", "1+2=", "2+3=")}
    assert [(s.status, s.reward) for s in by_prompt["0+1="]] == [(Status.COMPLETED, 1.0)] * 2
    for s in by_prompt["1+2="]:  # was COMPLETED with reward None, trained as 0
        assert s.status == Status.FAILED and s.metadata["reward_error"].startswith(
            "LookupError: no reward for this sample: its environment or rollout_fn gave none")
    for s in by_prompt["2+3="]:  # was TRUNCATED with reward None, trained as 0
        assert s.status == Status.FAILED and s.metadata["reward_error"].startswith(
            "LookupError: no reward for this sample: its episode was cut (by 'length') before the environment")
    with pytest.warns(UserWarning, match="4 of 6 samples FAILED.*no reward for this sample"):
        keep, metrics = trained_samples(samples, "grpo")
    assert [samples[i].prompt for i in keep] == ["0+1=", "0+1="] and metrics["rollout/failed_fraction"] == 4 / 6
    assert [a for s, a in zip(samples, compute_advantages(samples, "grpo")) if s.prompt != "0+1="] == [0.0] * 4


# ----------------------------------------------------------------------------------------------- the fresh start
class Started(Exception):
    """Raised where the run goes on after its fresh start: the tests stop there."""


def every_output(out: Path) -> dict[str, bytes]:
    """A folder holding every kind of file a run and the other modes write (trainer.run_folder's list)."""
    finished_run(out)
    for name in ("sft/checkpoints/step_00000004/state.json", "sft/metrics.jsonl", "rl/rollouts/step_000001.jsonl",
                 "tensorboard/sft/events.out.tfevents.1", "tensorboard/rl/events.out.tfevents.2",
                 "init_model/config.json", "start_model/model.safetensors", "wandb/offline-run-1/run.wandb",
                 "export/config.json", "rollouts/step_000001.jsonl", "replay/metrics.jsonl"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"{name}\n")
    (out / "sft.png").write_bytes(b"\x89PNG\r\n\x1a\nsft")
    return files_of(out)


@pytest.mark.parametrize("mode, removed, message", [
    ("rl", ("rl/", "rl.png", "tensorboard/rl/"), "rl/, rl.png, tensorboard/rl/"),
    ("sft", ("sft/", "sft.png", "tensorboard/sft/"), "sft/, sft.png, tensorboard/sft/"),
    ("sft+rl", ("sft/", "sft.png", "tensorboard/sft/", "rl/", "rl.png", "tensorboard/rl/"),
     "sft/, sft.png, tensorboard/sft/, rl/, rl.png, tensorboard/rl/"),
])
def test_a_fresh_start_removes_everything_the_phases_it_runs_wrote(tmp_path, capsys, monkeypatch, mode, removed,
                                                                   message):
    """Was: rl/ (or sft/) only, so a run that then failed left the previous run's plot, summary and TensorBoard
    events beside an empty phase folder, and a changed seed still trained the previous preset's weights."""
    import trainer.backend.steps as steps
    import trainer.cli as cli
    import trainer.run as run_module

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(steps, "init_distributed", lambda *a, **k: type("Mesh", (), {"get_rank": lambda self: 0})())
    monkeypatch.setattr(cli, "prepare_model_folder", started)  # export, generate, replay
    monkeypatch.setattr(run_module, "prepare_model_folder", started)  # the training modes
    out = tmp_path / "run"
    before = every_output(out)
    with pytest.raises(Started):
        main([mode, "--config", str(DEMO), "--set", f"output_dir={json.dumps(str(out))}"])
    gone = (*removed, "summary.json", "init_model/", "start_model/")
    kept = {k: v for k, v in before.items() if not k.startswith(gone) and k != "config.toml"}
    after = files_of(out)
    assert after.pop("config.toml").startswith(f"# the resolved config of `{mode}`".encode())  # this run's
    assert after == kept and {"wandb/offline-run-1/run.wandb", "export/config.json", "rollouts/step_000001.jsonl",
                              "replay/metrics.jsonl"} <= set(after)
    assert (f"starting over in {out}: removed the previous run's {message}, summary.json, init_model/, start_model/ "
            f"(pass --resume to continue a run instead)") in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- inputs it would remove
def in_run(out: Path, name: str, content: str = "x\n") -> Path:
    path = out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    return path


def set_path(key: str, path: Path | str) -> tuple[str, str]:
    """(--set argument, the path the error names) for a key that takes a path."""
    return f"{key}={json.dumps(str(path))}", str(path)


def reward_model_at(path: Path) -> tuple[str, str]:
    return f'rewards.sources=[{{kind = "model", path = {json.dumps(str(path))}}}]', str(path)


@pytest.mark.parametrize("mode, key, given", [
    ("rl", "[model] checkpoint", lambda out: set_path("model.checkpoint", out / "rl")),
    ("rl", "[model] checkpoint", lambda out: set_path("model.checkpoint", out / "rl/checkpoints/step_00000002")),
    ("rl", "[model] checkpoint", lambda out: set_path("model.checkpoint", out / "rl/../rl")),
    ("demo", "[model] checkpoint", lambda out: set_path("model.checkpoint", in_run(
        out, "sft/checkpoints/step_00000004/state.json", '{"step": 4}\n').parents[2])),
    ("rl", "[model] path", lambda out: set_path("model.path", in_run(out, "init_model/config.json").parent)),
    ("rl", "[rl.critic] path", lambda out: set_path("rl.critic.path", in_run(out, "rl/critic/config.json").parent)),
    ("rl", "[data].train", lambda out: set_path("data.train", in_run(
        out, "rl/train.jsonl", (ROOT / "data/arithmetic_train.jsonl").read_text()))),
    ("rl", "[rewards] sources[0] path", lambda out: reward_model_at(in_run(out, "start_model/config.json").parent)),
    ("rl", "[rl.rollout] env", lambda out: (
        f"rl.rollout.env={json.dumps(str(in_run(out, 'rl/env.py', GUESS_ENV)) + ':Guess')}", str(out / "rl/env.py"))),
], ids=["checkpoint-phase-folder", "checkpoint-step", "checkpoint-dotdot", "checkpoint-sft-of-demo", "model-init",
        "critic", "data", "reward-model", "env-file"])
def test_an_input_inside_what_the_fresh_start_removes_is_refused_before_it_is_removed(tmp_path, capsys, monkeypatch,
                                                                                      mode, key, given):
    """Was: the fresh start deleted it, then the run failed to load it (a user's checkpoint gone for good)."""
    import trainer.run as run_module

    def started(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(run_module, "fresh_start", started)
    out = tmp_path / "run"
    finished_run(out)
    override, named = given(out)
    sets = [f"output_dir={json.dumps(str(out))}", override]
    if key == "[rl.critic] path":
        sets.append('rl.advantage_estimator="gae"')
    before = files_of(out)
    rc = main([mode, "--config", str(DEMO)] + [a for s in sets for a in ("--set", s)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {DEMO}: {key} = {named!r} lies in {out}/"), err
    assert "which a run without --resume removes before it starts" in err and "pass --resume" in err
    assert "set output_dir to another folder" in err and "Traceback" not in err
    assert files_of(out) == before


def test_with_resume_nothing_is_removed_so_a_checkpoint_inside_the_run_is_fine(tmp_path):
    out = tmp_path / "run"
    finished_run(out)
    over = [f"output_dir={json.dumps(str(out))}", f"model.checkpoint={json.dumps(str(out / 'rl'))}"]
    assert load_run_config(DEMO, over, mode="rl", resume=True).model.checkpoint == str(out / "rl")
    assert load_run_config(DEMO, over, mode="sft").model.checkpoint == str(out / "rl")  # sft keeps rl/
    with pytest.raises(ConfigError, match=r"\[model\] checkpoint = .* lies in "):
        load_run_config(DEMO, over, mode="rl")


# ----------------------------------------------------------------------------------------------- folders it loads
def test_a_missing_relative_model_path_names_the_directory_it_is_read_from(tmp_path, monkeypatch):
    """A relative [model].path is read from the current directory (not the config's): a run started elsewhere is
    told where it looked. A folder that exists without config.json keeps its own error."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"\[model\]\.path = models/sft: no such file or folder in "
                                          rf"{re.escape(str(tmp_path))} \(relative paths are read from there\)"):
        load_run_config(DEMO, ['model.path="models/sft"'], mode="rl")
    (tmp_path / "models" / "sft").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"\[model\]\.path = models/sft: not a Hugging Face model folder"):
        load_run_config(DEMO, ['model.path="models/sft"'], mode="rl")


@pytest.mark.parametrize("key, make, message", [
    ("rl.critic.path", lambda tmp: tmp / "no_such_critic", "not a Hugging Face model folder (no config.json)"),
    ("rl.critic.path", lambda tmp: in_run(tmp, "config_only/config.json", json.dumps(
        {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 64, "vocab_size": 100})).parent, "no weights (*.safetensors) in the model folder"),
    ("model.checkpoint", lambda tmp: tmp / "no_such_checkpoint", "does not exist (give a step_NNNNNNNN folder"),
], ids=["critic-missing", "critic-no-weights", "checkpoint-missing"])
def test_a_missing_critic_or_checkpoint_is_an_error_before_the_fresh_start(tmp_path, capsys, monkeypatch, key, make,
                                                                           message):
    """Was: found by the load after the fresh start had removed the previous run (the critic's only when the RL
    phase began, after SFT in a demo run)."""
    import trainer.cli as cli
    import trainer.run as run_module

    def started(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(cli, "prepare_model_folder", started)  # export, generate, replay
    monkeypatch.setattr(run_module, "prepare_model_folder", started)  # the training modes
    out = tmp_path / "run"
    before = finished_run(out)
    folder = make(tmp_path)
    sets = [f"output_dir={json.dumps(str(out))}", f"{key}={json.dumps(str(folder))}"]
    if key.startswith("rl.critic"):
        sets.append('rl.advantage_estimator="gae"')
    rc = main(["rl", "--config", str(DEMO)] + [a for s in sets for a in ("--set", s)])
    err = capsys.readouterr().err
    named = {"rl.critic.path": f"[rl.critic] path = {str(folder)!r}: ", "model.checkpoint": "[model] checkpoint "}
    assert rc == 2 and err.startswith(f"error: {DEMO}: {named[key]}") and message in err, err
    assert files_of(out) == before


@pytest.mark.parametrize("override,message", [
    ("rl.rollout.temperature=inf", r"\[rl.rollout\] temperature: must be > 0 and finite, got inf"),
    ("eval.temperature=inf", r"\[eval\] temperature: must be > 0 and finite"),
    ("rl.optim.lr=inf", r"\[rl.optim\] lr: must be finite, got inf"),
    ("rl.loss.kl_coef=inf", r"kl_coef=inf: must be a finite number"),
    ("rl.loss.entropy_coef=-inf", r"entropy_coef=-inf: must be a finite number"),
    ("rl.loss.kl_coef=nan", r"--set rl.loss.kl_coef = nan: a finite number is expected"),
])
def test_non_finite_numbers_are_refused_where_no_key_means_them(override, message):
    """The probe's finds: temperature = inf ran a whole run (exit 0), lr / kl_coef = inf or nan were accepted. NaN is
    refused for every key; inf where it means nothing (it stays valid for [rl.critic] value_clip: unclipped)."""
    with pytest.raises(ConfigError, match=message):
        load_run_config(DEMO, [override])


def test_a_reward_that_cannot_take_a_sample_is_refused_before_any_work(tmp_path):
    """The probe: `def f(prompt, completion)` (TRL's reward shape) passed the preflight, the previous run was
    removed, and every sample then failed. Its signature is checked (nothing is called); one argument binds."""
    (tmp_path / "rw.py").write_text("def trl_style(prompts, completions):\n    return 1.0\n\n"
                                    "def ours(sample, scale=1.0):\n    return scale\n\n"
                                    "async def ours_async(sample):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"reward '.*rw.py:trl_style': it must take one argument, the finished "
                                          r"Sample \(missing a required argument: 'completions'\)"):
        load_run_config(DEMO, [f'data.reward="{tmp_path}/rw.py:trl_style"'], mode="rl")
    for fn in ("ours", "ours_async"):
        assert load_run_config(DEMO, [f'data.reward="{tmp_path}/rw.py:{fn}"'], mode="rl").data.reward.endswith(fn)


def test_cores_that_this_process_cannot_run_on_are_refused_before_any_work():
    """The probe: `[trainer] cpus = [99]` or an engine's `cpus = [99]` was an OSError traceback (the engine's one
    after the previous run's outputs were removed)."""
    import os

    gone = max(os.sched_getaffinity(0)) + 64
    with pytest.raises(ConfigError, match=rf"\[trainer\] cpus = \[{gone}\]: core\(s\) \[{gone}\] are not among"):
        load_run_config(DEMO, [f"trainer.cpus=[{gone}]"])
    with pytest.raises(ConfigError, match=rf"\[engines\] fleet\[0\] cpus = \[0, {gone}\]: core\(s\) \[{gone}\]"):
        load_run_config(DEMO, ["engines.in_process=false", f'engines.fleet=[{{kind="embedded", cpus=[0, {gone}]}}]'])
    mine = min(os.sched_getaffinity(0))
    assert load_run_config(DEMO, [f"trainer.cpus=[{mine}]"]).trainer.cpus == (mine,)


def test_a_run_config_built_in_python_goes_through_the_same_preflight(tmp_path):
    """Was: trainer.cli's checks ran only for a config loaded by the CLI; a RunConfig built in Python and given to
    run() started the run (fresh start, model folder, engines) and failed later, or trained on a typo's default.
    Now run() takes the same check_run_config path: the error names the key, and nothing is written."""
    import dataclasses

    from trainer.config import RunConfig, config_from_dict
    from trainer.run import run

    cfg = load_run_config(ROOT / "configs" / "demo.toml", [f'output_dir="{tmp_path / "run"}"'])
    bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ConfigError, match=r"\[data\]\.train: .*nope\.jsonl.*no such file"):
        run("rl", bad)
    assert not (tmp_path / "run").exists()  # refused before the fresh start, the model folder or any engine
    built = config_from_dict(RunConfig, {"rl": {"rollout": {"rollout_fn": "no_such_module:fn"}},
                                         "data": {"train": cfg.data.train, "reward": "arithmetic"},
                                         "output_dir": str(tmp_path / "run2")}, "")
    with pytest.raises(ConfigError, match="no_such_module"):
        run("rl", built)
    assert not (tmp_path / "run2").exists()
