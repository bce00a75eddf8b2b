"""Issue 25: evaluation during training (pass@k against its definition), tracking backends fed by real runs,
rollout dumps, replay without engines, generation without a trainer, and the progress line.

The runs go through `python -m trainer` on the tiny preset with a dense reward (engine_support.digit_fraction)
so that rewards, advantages and correctness vary; the evaluation counts an answer correct at reward >= 0.25.
"""

import itertools
import json
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from device_support import cpu_child_env

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------- pass@k
def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> Fraction:
    """pass@k by its definition: of all ways to pick k of the n answers, the fraction holding a correct one."""
    answers = [1] * c + [0] * (n - c)
    picks = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(answers[i] for i in p) for p in picks), len(picks))


def test_pass_at_k_is_the_unbiased_estimator():
    from trainer.evaluation import pass_at_k

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        c, k = rng.randint(0, n), rng.randint(1, n)
        assert abs(pass_at_k(n, c, k) - float(_pass_at_k_by_enumeration(n, c, k))) < 1e-12, (n, c, k)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0 and pass_at_k(5, 2, 1) == pytest.approx(0.4)


def test_the_reported_ks_are_powers_of_two_and_k():
    from trainer.evaluation import pass_ks

    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1] and pass_ks(0) == []


def test_sampled_evaluation_figures_follow_from_the_scored_answers():
    """evaluate's accuracy, pass@j, avg@k and reward means, recomputed here from the answers its reward function
    scored (greedy ones first, then each prompt's k sampled ones) with the enumerated pass@k; the same evaluation
    again gives the same figures, and another eval seed other sampled answers but the same greedy ones."""
    from engines.local import LocalEngine
    from engines.tiny import build_tokenizer
    from trainer.data.buffer import load_jsonl
    from trainer.evaluation import evaluate

    prompts = load_jsonl(ROOT / "data" / "arithmetic_test.jsonl")[:6]
    k, threshold = 4, 1.0
    engine = LocalEngine("tiny", seed=0)
    try:
        def run(seed: int) -> tuple[dict, list]:
            seen = []

            def reward(sample):
                r = float(sum(sample.tokens[sample.prompt_length:]) % 3 == 0)  # right about a third of the time
                seen.append((sample.prompt, sample.response, r))
                return r

            got = evaluate([engine], prompts, tokenizer=build_tokenizer(), reward_fn=reward, max_new_tokens=8,
                           max_reward=threshold, k=k, temperature=1.0, seed=seed)
            return got, seen

        got, seen = run(seed=3)
        again, seen_again = run(seed=3)
        other, seen_other = run(seed=4)
    finally:
        engine.close()
    n = len(prompts)
    assert len(seen) == n + n * k and [p for p, _, _ in seen[:n]] == [p.prompt for p in prompts]
    greedy, sampled = [r for _, _, r in seen[:n]], [[r for _, _, r in seen[n + i * k:n + (i + 1) * k]]
                                                    for i in range(n)]
    assert got["accuracy"] == pytest.approx(sum(r >= threshold for r in greedy) / n, abs=1e-12)
    assert got["reward_mean"] == pytest.approx(sum(greedy) / n, abs=1e-12)
    right = [sum(r >= threshold for r in g) for g in sampled]
    assert 0 < sum(right) < n * k, "the test needs a mix of right and wrong sampled answers"
    for j in (1, 2, 4):
        want = sum(float(_pass_at_k_by_enumeration(k, c, j)) for c in right) / n
        assert got[f"pass@{j}"] == pytest.approx(want, abs=1e-12)
    assert got["avg@4"] == pytest.approx(sum(right) / (n * k), abs=1e-12) == pytest.approx(got["pass@1"], abs=1e-12)
    assert got["reward_mean@4"] == pytest.approx(sum(map(sum, sampled)) / (n * k), abs=1e-12)
    assert again == got and seen_again == seen  # seeded: an evaluation is the same whenever it runs
    assert seen_other[:n] == seen[:n] and seen_other[n:] != seen[n:]  # greedy fixed; the eval seed moves samples
    assert {resp for _, resp, _ in seen[n:]} - {resp for _, resp, _ in seen[:n]}, "sampled answers equal greedy ones"


# ----------------------------------------------------------------------------------------------- real runs
def _cli(args: list[str], out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = cpu_child_env([str(TESTS)], HOME=str(out.parent), **env_extra)
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


RUN = ["--set", "rl.num_steps=4", "--set", "rl.rollout.rollout_batch_size=4", "--set", "rl.rollout.dynamic_filters=[]",
       "--set", "eval.limit=8", "--set", "eval.max_reward=0.25", "--set", "rl.save_every=1", "--set", "rl.keep_last=4",
       "--set", "data.reward=\"engine_support:digit_fraction\""]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same short GRPO run twice: plain, and with evaluation every 2 steps (greedy + pass@4), TensorBoard and
    W&B (offline) logging, every step's rollouts written out."""
    base = tmp_path_factory.mktemp("eval_runs")
    plain, watched = base / "plain", base / "watched"
    _cli(["rl", "--config", "configs/demo.toml", "--set", f"output_dir=\"{plain}\"", *RUN], plain)
    proc = _cli(["rl", "--config", "configs/demo.toml", "--set", f"output_dir=\"{watched}\"", *RUN,
                 "--set", "eval.every=2", "--set", "eval.k=4",
                 "--set", "logging.backends=[\"jsonl\",\"tensorboard\",\"wandb\"]",
                 "--set", "logging.rollouts_every=1"],
                watched, WANDB_MODE="offline")
    return plain, watched, proc


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]


def _training_part(row: dict) -> dict:
    """A step's figures but timings, evaluation, and the engine-vs-trainer mismatch: the embedded engine's log-probs
    move in the last bits with which rows share a decode batch (timing), between two plain runs too."""
    return {k: v for k, v in row.items() if not (k.startswith(("eval/", "time", "mismatch/")) or k.endswith("seconds")
                                                 or k == "train_tokens_per_s")}


def test_evaluation_during_training_does_not_change_the_training_stream(runs):
    plain, watched, _ = runs
    a, b = [r for r in _rows(plain) if "loss" in r], [r for r in _rows(watched) if "loss" in r]
    assert len(a) == len(b) == 4
    assert any(r["reward_mean"] > 0 for r in a) and any(r["grad_norm"] > 0 for r in a)  # the runs really train
    for x, y in zip(a, b):
        assert _training_part(x) == _training_part(y)  # every training figure, to the last bit
        assert abs(x["mismatch/logprob_abs_diff_max"] - y["mismatch/logprob_abs_diff_max"]) < 1e-5


def test_eval_figures_reach_every_backend_at_every_nth_step(runs):
    from tracking_support import read_wandb_records, wandb_history, wandb_run_file

    from trainer.tracking import read_tensorboard_scalars

    _, watched, _ = runs
    rows = _rows(watched)
    evals = {r["step"]: r for r in rows if "eval/eval/accuracy" in r}
    assert sorted(evals) == [0, 2, 4]  # before RL, every 2nd step, the last
    assert {"eval/eval/pass@1", "eval/eval/pass@2", "eval/eval/pass@4", "eval/eval/avg@4"} <= set(evals[2])
    tb = read_tensorboard_scalars(watched / "tensorboard" / "rl")
    assert [s for s, _ in tb["eval/eval/pass@4"]] == [0, 2, 4] and [s for s, _ in tb["loss"]] == [1, 2, 3, 4]
    for step, value in tb["eval/eval/accuracy"]:
        assert value == pytest.approx(evals[step]["eval/eval/accuracy"], rel=1e-6)
    for step, value in tb["reward_mean"]:
        assert value == pytest.approx(rows[step]["reward_mean"], rel=1e-6)
    history = wandb_history(read_wandb_records(wandb_run_file(watched)))
    logged = {h["_step"]: h for h in history if "eval/eval/avg@4" in h}
    assert sorted(logged) == [0, 2, 4]
    assert all(logged[s]["eval/eval/avg@4"] == evals[s]["eval/eval/avg@4"] for s in logged)
    summary = json.loads((watched / "summary.json").read_text())
    last, best = summary["eval"]["eval"]["last"], summary["eval"]["eval"]["best"]
    assert last["step"] == 4 and last["pass@4"] == evals[4]["eval/eval/pass@4"]
    assert best["accuracy"] == max(r["eval/eval/accuracy"] for r in evals.values())
    assert summary["accuracy_before_rl"] == evals[0]["eval/eval/accuracy"]
    assert summary["accuracy_after_rl"] == evals[4]["eval/eval/accuracy"]


def test_rollout_dumps_hold_what_the_step_trained_on(runs):
    from trainer.rl import compute_advantages
    from trainer.rollout.dumps import read_rollouts, rollout_files

    _, watched, _ = runs
    files = rollout_files(watched / "rl" / "rollouts")
    assert [f.name for f in files] == [f"step_{s:06d}.jsonl" for s in (1, 2, 3, 4)]
    rows = _rows(watched)
    for f in files:
        step, batch = read_rollouts(f)
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        assert [x["advantage"] for x in lines] == compute_advantages(batch.samples, "grpo")
        assert sum(x["reward"] for x in lines) / len(lines) == pytest.approx(rows[step]["reward_mean"], abs=1e-12)
        assert all(x["prompt"] and x["completion_tokens"] == len(x["tokens"]) - x["prompt_tokens"] for x in lines)
        assert all(x["weight_version"] == step - 1 and x["status"] in ("completed", "truncated") for x in lines)
        # fp32 engine vs fp32 trainer: the design's engine-vs-trainer tolerance
        assert max(x["logprob_mismatch"] for x in lines) < 1e-4
        assert len({x["group"] for x in lines}) == 4  # 4 prompts a step, their samples grouped
    from tracking_support import read_tensorboard_text

    tables = read_tensorboard_text(watched / "tensorboard" / "rl")["rollouts/samples"]
    assert [s for s, _ in tables] == [1, 2, 3, 4]
    header = tables[0][1].splitlines()[0]
    assert header.startswith("| step | group | reward | advantage |") and len(tables[0][1].splitlines()) == 2 + 3


def test_replay_from_a_checkpoint_reproduces_the_steps_loss_and_grad_norm(runs, tmp_path):
    """Training on the dumps of steps 3 and 4 from the step-2 checkpoint, with no engine, gives the losses and
    gradient norms the run logged; from the start, every step."""
    _, watched, _ = runs
    logged = {r["step"]: r for r in _rows(watched) if "loss" in r}
    config = watched / "config.toml"
    _cli(["replay", "--config", str(config), "--rollouts", str(watched / "rl" / "rollouts"), "--checkpoint",
          str(watched / "rl" / "checkpoints" / "step_00000002")], watched)
    replayed = [json.loads(line) for line in (watched / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == [3, 4]
    for r in replayed:
        assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-6, abs=1e-9)
        assert r["grad_norm"] == pytest.approx(logged[r["step"]]["grad_norm"], rel=1e-6)
        assert r["original/loss"] == logged[r["step"]]["loss"]
    proc = _cli(["replay", "--config", str(config)], watched)  # default: the run's own rollouts, from the start
    replayed = [json.loads(line) for line in (watched / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == [1, 2, 3, 4] and "replay step 4" in proc.stdout
    for r in replayed:
        assert r["grad_norm"] == pytest.approx(logged[r["step"]]["grad_norm"], rel=1e-6)


def test_generate_without_a_trainer_draws_the_runs_first_batch(runs, tmp_path):
    """`generate` with the run's config writes scored rollouts; its step 1 is the training run's step 1 (the same
    data order, seeds and starting weights), token for token."""
    from trainer.rollout.dumps import read_rollouts

    _, watched, _ = runs
    out = tmp_path / "gen"
    _cli(["generate", "--config", str(watched / "config.toml"), "--set", f"output_dir=\"{out}\"",
          "--set", "rl.num_steps=2"], out)
    step, gen = read_rollouts(out / "rollouts" / "step_000001.jsonl")
    _, trained = read_rollouts(watched / "rl" / "rollouts" / "step_000001.jsonl")
    assert step == 1 and [s.tokens for s in gen.samples] == [s.tokens for s in trained.samples]
    assert [s.reward for s in gen.samples] == [s.reward for s in trained.samples]
    assert (out / "rollouts" / "step_000002.jsonl").is_file()


def test_the_progress_line_off_a_terminal_is_one_line_a_step(runs):
    _, _, proc = runs
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rl: step ")]
    assert [line.split()[2] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert "eval_acc=" not in lines[0] and "eval_acc=" in lines[1]  # the last eval figure, once there is one
    assert all("reward=" in line and "(gen/train/sync)" in line for line in lines)
    assert "\r" not in proc.stderr


def test_a_missing_tracking_package_is_a_config_error(monkeypatch, capsys):
    import trainer.tracking as tracking
    from trainer.cli import main

    real = tracking.find_spec
    monkeypatch.setattr(tracking, "find_spec", lambda name, *a: None if name == "wandb" else real(name))
    assert main(["rl", "--config", str(ROOT / "configs" / "demo.toml"),
                 "--set", "logging.backends=[\"jsonl\",\"wandb\"]"]) == 2
    err = capsys.readouterr().err
    assert "wandb" in err and "pip install" in err


def test_eval_every_must_fall_on_weight_syncs():
    from trainer.cli import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"\[eval\] every = 3.*sync_every = 2"):
        load_run_config(ROOT / "configs" / "demo.toml", ["eval.every=3", "rl.sync_every=2"])
    assert load_run_config(ROOT / "configs" / "demo.toml", ["eval.every=4", "rl.sync_every=2"]).eval.every == 4


def test_evaluation_spreads_its_prompts_over_the_whole_fleet():
    """Issue 41 item 7: evaluation generates on every engine of the fleet (prompt i on engine i mod n), not on the
    first alone; with engines serving the same weights its figures are the single engine's (each prompt's answers
    are seeded by the eval seed and the prompt's position, not by the engine)."""
    from engines.local import LocalEngine
    from engines.tiny import build_tokenizer
    from trainer.data.buffer import load_jsonl
    from trainer.evaluation import evaluate

    class Counted:
        """One fleet member: the shared engine, with the prompts it was asked counted."""

        def __init__(self, engine):
            self.engine, self.asked = engine, 0

        def __getattr__(self, name):
            return getattr(self.engine, name)

        async def generate(self, prompts, params, *, rids=None):
            self.asked += len(prompts)
            return await self.engine.generate(prompts, params, rids=rids)

    prompts = load_jsonl(ROOT / "data" / "arithmetic_test.jsonl")[:5]
    engine = LocalEngine("tiny", seed=0)
    try:
        def reward(sample):
            return float(sum(sample.tokens[sample.prompt_length:]) % 3 == 0)

        kw = dict(tokenizer=build_tokenizer(), reward_fn=reward, max_new_tokens=6, k=2, temperature=1.0, seed=5)
        alone = Counted(engine)
        single = evaluate([alone], prompts, **kw)
        fleet = [Counted(engine), Counted(engine)]
        spread = evaluate(fleet, prompts, **kw)
    finally:
        engine.close()
    assert spread == single
    assert alone.asked == 5 + 5  # greedy: one row a prompt; sampled: one request of k rows a prompt
    assert [e.asked for e in fleet] == [3 + 3, 2 + 2]  # prompts 0, 2, 4 and 1, 3
