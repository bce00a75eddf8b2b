"""bench/bench_rl_vs_trl.py: the TRL side mirrors our GRPO settings, and one toy step of each side runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from engines.embedded.presets import build_tiny_model
from engines.tiny import build_tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_rl_vs_trl as bench  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="TRL is not installed: pip install -e '.[trl]' (or '.[dev]')")
TOY = bench.BenchConfig(steps=1, prompts_per_step=4, group_size=4, max_new_tokens=4, eval_limit=8)


@needs_trl
def test_trl_args_mirror_our_loss_and_optimiser(tmp_path):
    from trainer.cli import phase_configs

    cfg = bench.run_config(bench.BenchConfig(lr=5e-4, beta=0.02, group_size=6, max_new_tokens=5), tmp_path)
    rl = phase_configs(cfg).rl
    args = bench.trl_args(bench.BenchConfig(), cfg, tmp_path / "trl")
    assert (rl.optim.lr, rl.loss.kl_coef, rl.rollout.n_samples_per_prompt, rl.rollout.max_new_tokens) == \
        (5e-4, 0.02, 6, 5)
    # Without --lr both sides take the config's [rl.optim] lr (the demo's recipe).
    demo_lr = phase_configs(bench.run_config(bench.BenchConfig(), tmp_path)).rl.optim.lr
    assert bench.trl_args(bench.BenchConfig(), bench.run_config(bench.BenchConfig(), tmp_path),
                          tmp_path / "trl").learning_rate == demo_lr == 3e-4
    assert (args.learning_rate, args.beta, args.epsilon, args.epsilon_high) == \
        (rl.optim.lr, rl.loss.kl_coef, rl.loss.clip_low, rl.loss.clip_high)
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay, args.max_grad_norm) == \
        (*rl.optim.betas, rl.optim.eps, rl.optim.weight_decay, rl.optim.max_grad_norm)
    assert (args.loss_type, args.scale_rewards, args.importance_sampling_level, args.num_iterations) == \
        ("grpo", "group", "token", 1)
    assert getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type) == "constant"
    assert not args.bf16 and args.top_k == 0
    # A loss the TRL side cannot mirror is refused by name.
    bad = bench.run_config(bench.BenchConfig(), tmp_path)
    bad = dataclasses.replace(bad, rl=dataclasses.replace(bad.rl, loss=dataclasses.replace(bad.rl.loss,
                                                                                          loss_agg="token-mean")))
    with pytest.raises(ValueError, match="loss.loss_agg"):
        bench.trl_args(bench.BenchConfig(), bad, tmp_path / "trl")


def test_trl_reward_adapter_scores_like_our_reward():
    fn = bench.trl_reward_fn("trainer.rewards.rules:arithmetic_reward")
    completions = [[{"role": "assistant", "content": "38"}], [{"role": "assistant", "content": "37"}],
                   [{"role": "assistant", "content": "x"}], "12"]
    assert fn(["24+14="] * 4, completions, answer=["38", "38", "38", "12"]) == [1.0, 0.0, 0.0, 1.0]


def test_loop_figures():
    got = bench.loop_figures([2.0, 1.0, 3.0], [10, 10, 10])
    assert got == {"samples_per_s": 5.0, "s_per_step": 2.0, "loop_s": 6.0, "samples": 30}


def test_bench_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="group_size"):
        bench.BenchConfig(group_size=1)
    with pytest.raises(ValueError, match="steps"):
        bench.BenchConfig(steps=0)


def test_model_option_points_both_sides_at_one_folder(tmp_path):
    from trainer.cli import ConfigError, prepare_model_folder

    folder = tmp_path / "sft_export"
    ref = build_tiny_model(3, arch="qwen2", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    ref.save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)  # a model folder carries its tokenizer
    cfg = bench.run_config(bench.BenchConfig(model=str(folder)), tmp_path / "run")
    assert prepare_model_folder(cfg) == folder.resolve()
    with pytest.raises(ConfigError, match=r"demo.toml: \[model\]\.path = .*no_such_folder"):
        bench.run_config(bench.BenchConfig(model=str(tmp_path / "no_such_folder")), tmp_path / "run")


def test_ours_one_toy_step(tmp_path):
    res = bench.run_ours(TOY, tmp_path, async_rollout=False)
    assert res["steps"] == 1 and res["samples"] == 16 and len(res["reward_per_step"]) == 1
    assert res["samples_per_s"] > 0 and res["s_per_step"] > 0
    assert 0.0 <= res["accuracy"] <= 1.0 and 0.0 <= res["accuracy_initial"] <= 1.0
    assert len(res["generate_s_per_step"]) == len(res["train_s_per_step"]) == 1


@needs_trl
def test_trl_one_toy_step_same_initial_model_as_ours(tmp_path):
    from transformers import AutoModelForCausalLM

    res = bench.run_trl(TOY, tmp_path)
    assert res["steps"] == 1 and res["samples"] == 16 and res["samples_per_s"] > 0
    assert len(res["reward_per_step"]) == 1 and 0.0 <= res["reward_per_step"][0] <= 1.0
    assert 0.0 <= res["accuracy"] <= 1.0
    # The TRL side started from the demo's seeded initial model, bit for bit.
    m = bench.run_config(TOY, tmp_path).model
    ref = build_tiny_model(0, arch=m.arch, hidden_size=m.hidden_size, num_layers=m.num_layers,
                           num_heads=m.num_heads, num_kv_heads=m.num_kv_heads)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "init_model")
    for (name, a), b in zip(ref.state_dict().items(), loaded.state_dict().values()):
        assert (a == b).all(), name


def test_peak_rss_counts_the_whole_process_tree_and_timeouts_kill(tmp_path):
    import os
    import subprocess

    from _proc import run_with_peak_rss

    # A child that holds 300 MB and starts a grandchild that holds 200 MB, both alive together for a second.
    hold = "import time; b = bytearray({n} * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {hold.format(n=200)!r}]); "
            f"exec({hold.format(n=300)!r}); p.wait()")
    rc, peak = run_with_peak_rss([sys.executable, "-c", code], log=tmp_path / "log", timeout_s=60, cwd=tmp_path,
                                 env=dict(os.environ))
    assert rc == 0 and 500 * 2**20 <= peak < 700 * 2**20
    with pytest.raises(subprocess.TimeoutExpired):
        run_with_peak_rss([sys.executable, "-c", "import time; time.sleep(30)"], log=tmp_path / "log2",
                          timeout_s=0.5, cwd=tmp_path, env=dict(os.environ))


def test_seeds_aggregate_over_every_loop_and_average_accuracy():
    runs = [{"samples_per_s": 100.0, "s_per_step": 1.0, "loop_s": 10.0, "samples": 1000, "wall_s": 20.0,
             "peak_rss_mb": 500.0, "accuracy": 0.2, "accuracy_initial": 0.1},
            {"samples_per_s": 25.0, "s_per_step": 3.0, "loop_s": 40.0, "samples": 1000, "wall_s": 50.0,
             "peak_rss_mb": 700.0, "accuracy": 0.4, "accuracy_initial": 0.1,
             "reward_per_step": [0.0, 0.1, 0.2, 0.4, 0.5]}]
    got = bench.aggregate(runs)
    # The second half of each run's training rewards (steps 3-5 of 5 here); a run without them has none.
    assert runs[1]["reward_mean_second_half"] == pytest.approx(1.1 / 3) and runs[0]["reward_mean_second_half"] is None
    assert got["reward_second_half_per_seed"] == [None, runs[1]["reward_mean_second_half"]]
    assert got["reward_mean_second_half"] == pytest.approx(1.1 / 3)  # the mean of the runs that have one
    assert got["samples_per_s"] == 40.0 and got["loop_s"] == 50.0  # 2000 samples over 50 s, not mean(100, 25)
    assert got["accuracy"] == pytest.approx(0.3) and got["accuracy_per_seed"] == [0.2, 0.4]
    assert got["peak_rss_mb"] == 700.0 and got["s_per_step"] == 2.0 and got["per_seed"] == runs
    assert bench.aggregate(runs[:1]) is runs[0]


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0) & {0, 1}) < 2, reason="needs cores 0 and 1")
def test_the_disaggregated_async_side_pins_engine_and_trainer_to_their_cores(tmp_path):
    """ours-async-disaggregated through its worker subprocess: the trainer ran on core 1 (the engine, started by
    the run with cpus = [0], on core 0: tests/test_staleness.py checks an engine's pinning), two steps ahead."""
    bc = dataclasses.replace(TOY, steps=3, max_staleness=2)
    res = bench.measure("ours-async-disaggregated", bc, tmp_path)
    assert res["steps"] == 3 and res["samples"] == 3 * 16 and res["trainer_cpus"] == [1]
    assert res["max_staleness"] == 2 and 0.0 <= res["staleness_mean"] <= 2.0
    cfg = bench.run_config(bc, tmp_path / "cfg", async_rollout=True, in_process=False, disaggregated=True)
    assert [s.cpus for s in cfg.engines.fleet] == [(0,)] and cfg.trainer.cpus == (1,) and cfg.rl.generation_ahead == 2
