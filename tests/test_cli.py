"""The command line: config loading and errors, and one real `sft+rl` run through `python -m trainer`."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device_support import cpu_child_env

from engines.tiny import build_tokenizer
from trainer.cli import ConfigError, load_run_config, main, parse_overrides, phase_configs, sft_examples
from trainer.config import RunConfig, config_from_dict

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_parse_as_toml_values():
    over = parse_overrides(["rl.optim.lr=3e-4", "rl.rollout.dynamic_filters=[\"check_min_reward\"]", "name=abc",
                            "sft.num_steps=7"])
    assert over == {"rl": {"optim": {"lr": 3e-4}, "rollout": {"dynamic_filters": ["check_min_reward"]}}, "name": "abc",
                    "sft": {"num_steps": 7}}
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["rl.lr"])


def test_demo_config_builds_valid_configs():
    cfg = load_run_config(ROOT / "configs" / "demo.toml", ["rl.num_steps=3", "output_dir=\"runs/x\""])
    rl, sft = cfg.rl, cfg.sft
    assert rl.num_steps == 3 and rl.output_dir == "runs/x/rl" and sft.output_dir == "runs/x/sft"
    assert rl.loss.kl_coef == 0.001 and rl.loss.log_entropy and rl.loss.rollout_correction == "none"
    assert sft.optim.lr == 3e-3 and rl.optim.lr == 3e-4 and rl.optim.betas == (0.9, 0.98)
    phases = phase_configs(cfg)  # the derived configs, built in one place
    assert phases.rl_trainer.policy_loss is phases.rl.loss and phases.rl_trainer.optim is phases.rl.optim
    assert phases.rl_trainer.temperature == phases.rl.rollout.temperature and phases.sft_trainer.loss == "nll"
    hot = load_run_config(ROOT / "configs" / "demo.toml", ["rl.rollout.temperature=0.7", "rl.async_rollout=true"])
    assert phase_configs(hot).rl_trainer.temperature == 0.7  # one temperature: the rollout's
    assert phase_configs(hot).rl.loss.rollout_correction == "tis"  # async: off-policy by construction
    assert rl.rollout.apply_chat_template is True  # [data].format = "chat" reaches the rollouts
    plain = load_run_config(ROOT / "configs" / "demo.toml", ["data.format=\"plain\""])
    assert plain.rl.rollout.apply_chat_template is False


def test_every_shipped_config_loads_with_what_its_header_promises():
    """Each file in configs/ (the README's recipes) parses and validates as a whole: a key renamed in the config tree
    fails here, not in a user's first run of a recipe no test starts. Each keeps the feature its header names."""
    cfgs = {p.stem: load_run_config(p) for p in sorted((ROOT / "configs").glob("*.toml"))}
    assert {"demo", "gae_demo", "lora_demo", "rm_demo", "agent_demo", "agent_demo_notools", "openai_agent_demo",
            "qwen05b_shape"} <= set(cfgs)
    for stem, cfg in cfgs.items():
        assert cfg.name == stem and cfg.output_dir == f"runs/{stem}", (stem, cfg.name, cfg.output_dir)
    assert cfgs["gae_demo"].rl.advantage_estimator == "gae" and cfgs["gae_demo"].rl.critic.kind == "model"
    assert cfgs["demo"].rl.advantage_estimator == "grpo" and cfgs["demo"].rl.critic is None
    assert cfgs["lora_demo"].rl.lora.rank == 16 and cfgs["lora_demo"].sft.lora is None and cfgs["demo"].rl.lora is None
    assert [s.kind for s in cfgs["rm_demo"].rewards.sources] == ["model", "rule"]
    assert cfgs["agent_demo"].rl.rollout.tools == ("examples.tasks.agent_task:calculator",)
    assert not cfgs["agent_demo_notools"].rl.rollout.tools
    assert cfgs["openai_agent_demo"].rl.rollout.agent == "examples/openai_agent.py:solve"


def test_the_run_seed_reaches_every_seeded_part_unless_a_section_sets_its_own():
    demo = ROOT / "configs" / "demo.toml"
    zero, one = load_run_config(demo, ["seed=0"]), load_run_config(demo, ["seed=1"])
    assert (zero.sft.seed, zero.rl.seed, zero.rl.rollout.seed) == (0, 0, 0)
    assert (one.sft.seed, one.rl.seed, one.rl.rollout.seed) == (1, 1, 1)  # trainers and rollout sampling
    assert phase_configs(one).rl_trainer.seed == phase_configs(one).sft_trainer.seed == 1
    assert phase_configs(one).rl_trainer.fingerprint() != phase_configs(zero).rl_trainer.fingerprint()
    own = load_run_config(demo, ["seed=1", "rl.rollout.seed=5", "sft.seed=2"])
    assert (own.seed, own.sft.seed, own.rl.seed, own.rl.rollout.seed) == (1, 2, 1, 5)
    rl_own = load_run_config(demo, ["seed=1", "rl.seed=4"])
    assert (rl_own.rl.seed, rl_own.rl.rollout.seed, rl_own.sft.seed) == (4, 4, 1)  # [rl] passes its seed down


def _sampled_tokens(seed: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The tokens of one rollout batch through the in-process engine, with the [rl.rollout] config of the demo run
    at `--set seed=<seed>` (the engine's own seed and the data order fixed, one request at a time)."""
    import trio

    from engines.local import LocalEngine
    from engines.tiny import build_tokenizer
    from trainer.data.buffer import DataBuffer, load_jsonl
    from trainer.rollout.manager import AsyncRolloutManager

    cfg = load_run_config(ROOT / "configs" / "demo.toml", [f"seed={seed}", "rl.rollout.rollout_batch_size=2",
                                                           "rl.rollout.n_samples_per_prompt=2",
                                                           "rl.rollout.max_new_tokens=8"])
    engine = LocalEngine("tiny", seed=0)
    try:
        manager = AsyncRolloutManager([engine], cfg.rl.rollout, tokenizer=build_tokenizer(),
                                      reward_fn=lambda sample: 0.0, deterministic=True)
        buffer = DataBuffer(load_jsonl(ROOT / "data" / "arithmetic_train.jsonl"), seed=0)

        async def one_batch():
            async with manager:
                return await manager.generate_batch(buffer)

        batch = trio.run(one_batch)
    finally:
        engine.close()
    return sorted((s.tokens[:s.prompt_length], s.tokens[s.prompt_length:]) for s in batch.samples)


def test_set_seed_changes_the_sampled_tokens():
    """`--set seed=1` reaches the rollout sampling: the same prompts sample other tokens; the same seed, the same."""
    zero, one = _sampled_tokens(0), _sampled_tokens(1)
    assert len(zero) == len(one) == 4
    assert [prompt for prompt, _ in zero] == [prompt for prompt, _ in one]  # the same prompts (data order)
    assert [response for _, response in zero] != [response for _, response in one]
    assert _sampled_tokens(0) == zero


def test_plain_sft_examples_train_on_answer_and_eos_only():
    from engines.tiny import build_tokenizer
    from trainer.data.buffer import Prompt

    tok = build_tokenizer()
    (s,) = sft_examples([Prompt(prompt="12+7=", answer="19", metadata={}, index=0)], tok, "plain")
    assert tok.decode(s.tokens[:s.prompt_length]) == "12+7="
    assert list(s.tokens[s.prompt_length:]) == tok("19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    (c,) = sft_examples([Prompt(prompt="12+7=", answer="19", metadata={}, index=0)], tok, "chat")
    assert c == [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]


@pytest.mark.parametrize("override, message", [
    ("rl.lrr=1", "'lrr'"),
    ("rl.clip_low=0.1", r"rl\.clip_low moved to \[rl\.loss\] clip_low"),
    ("rl.lr=0.1", r"rl\.lr moved to \[rl\.optim\] lr"),
    ("sft.warmup_steps=3", r"sft\.warmup_steps moved to \[sft\.optim\] warmup_steps"),
    ("trainer.temperature=0.7", r"moved to \[rl\.rollout\] temperature"),
    ("rl.loss.clip_low=1.5", "clip_low"),
    ("rl.loss.objective=\"dpo\"", "objective"),
    ("engines.embedded=1", r"engines\.embedded moved to \[engines\] fleet"),
    ("engines.urls=[\"http://h:1\"]", r"engines\.urls moved to \[engines\] fleet"),
    ("rl.rollout.nope=1", "'nope'"),
    ("engines.port=1", "port"),
    ("engines.threads=1.5", r"engines\.threads = 1\.5: expected an integer"),
    ("bogus=1", "bogus"),
    ("data.format=\"xml\"", "format"),
])
def test_unknown_or_bad_keys_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(ROOT / "configs" / "demo.toml", [override])


def test_main_reports_bad_config_without_a_traceback(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[rl]\nnum_stepz = 3\n")
    assert main(["rl", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "num_stepz" in err and "Traceback" not in err
    assert main(["rl", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_missing_relative_config_names_the_directory_it_was_looked_for_in(capsys, tmp_path, monkeypatch):
    """`python -m trainer demo` outside the checkout: the error says where configs/demo.toml was looked for."""
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert f"--config configs/demo.toml: no such file in {tmp_path};" in err and "checkout's root" in err, err
    assert "Traceback" not in err


def test_whole_config_is_validated_before_any_work(capsys, monkeypatch):
    """A bad RL loss value fails at load time, before SFT trains; so do missing files and reward functions."""
    import trainer.cli as cli

    ran = []
    monkeypatch.setattr(cli, "run", lambda *a, **k: ran.append(a))
    demo = str(ROOT / "configs" / "demo.toml")
    for override, message in [("rl.loss.clip_low=1.5", "clip_low"), ("data.eval=\"nope.jsonl\"", "nope.jsonl"),
                              ("data.reward=\"trainer.rewards.rules:nope\"", "nope"),
                              ("trainer.compile_backend=\"tvm\"", "compile_backend")]:
        assert main(["sft+rl", "--config", demo, "--set", override]) == 2, override
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert ran == []  # nothing started


def test_no_demo_defaults_stand_in_for_the_reward_or_the_tokenizer(tmp_path):
    """A run that scores samples names its reward; a model folder brings its own tokenizer. Neither silently
    becomes the demo's (the arithmetic reward, the project's character tokenizer)."""
    from engines.embedded.presets import build_tiny_model

    text = (ROOT / "configs" / "demo.toml").read_text()
    demo = tmp_path / "demo.toml"
    demo.write_text(text.replace('reward = "trainer.rewards.rules:arithmetic_reward"', ""))
    data = str(ROOT / "data" / "arithmetic_train.jsonl")
    over = [f"data.train={json.dumps(data)}", f"data.eval={json.dumps(data)}"]
    for mode in ("rl", "sft"):  # RL scores its rollouts; SFT with an eval set scores the evaluation
        with pytest.raises(ConfigError, match=rf"\[data\]\.reward: mode '{mode}' scores samples"):
            load_run_config(demo, over, mode=mode)
    no_eval = tmp_path / "no_eval.toml"
    no_eval.write_text(demo.read_text().replace('eval = "data/arithmetic_test.jsonl"', ""))
    assert load_run_config(no_eval, over[:1], mode="sft").data.reward is None  # SFT alone scores nothing
    folder = tmp_path / "model"
    build_tiny_model(0, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1).save_pretrained(folder)
    cfg_over = [*over, 'data.reward="arithmetic"', f"model.path={json.dumps(str(folder))}"]
    with pytest.raises(ConfigError, match=r"\[model\]\.path = .*has no tokenizer"):
        load_run_config(demo, cfg_over, mode="rl")
    build_tokenizer().save_pretrained(folder)
    assert load_run_config(demo, cfg_over, mode="rl").model.path == str(folder)


def test_only_configuration_errors_exit_2(monkeypatch):
    """A failure during the run (here a ValueError deep in training) keeps its traceback and is not exit code 2."""
    import trainer.cli as cli

    def boom(*a, **k):
        raise ValueError("a bug in training, not in the config")

    monkeypatch.setattr(cli, "run", boom)
    with pytest.raises(ValueError, match="a bug in training"):
        main(["sft+rl", "--config", str(ROOT / "configs" / "demo.toml")])


def test_sft_plus_rl_end_to_end_through_the_cli(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "sft+rl", "--config", "configs/demo.toml",
           "--set", f"output_dir=\"{out}\"", "--set", "sft.num_steps=4", "--set", "sft.batch_size=16",
           "--set", "rl.num_steps=2",
           "--set", "rl.rollout.rollout_batch_size=4", "--set", "rl.rollout.dynamic_filters=[]",
           "--set", "eval.limit=16", "--set", "logging.profile_steps=[2, 3]"]
    env = cpu_child_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_steps"] == 4 and summary["rl_steps"] == 2
    for key in ("accuracy_before_sft", "accuracy_after_sft", "accuracy_after_rl"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["accuracy_before_sft"] == 0.0  # a random model does not add numbers
    assert (out / "rl.png").stat().st_size > 10_000 and (out / "sft.png").is_file()
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # step 0: the evaluation of the SFT weights RL starts from
    assert rows[0]["eval/eval/accuracy"] == summary["accuracy_after_sft"] and "loss" not in rows[0]
    assert rows[2]["eval/eval/accuracy"] == summary["accuracy_after_rl"]
    assert "| after RL |" in proc.stdout
    # [logging] profile_steps: SFT's steps 2 and 3 traced; RL's step 2 (its last), each step's ranges in the table
    sft_table = (out / "sft" / "profile" / "steps_2-3.txt").read_text()
    rl_table = (out / "rl" / "profile" / "steps_2-3.txt").read_text()
    assert sft_table.startswith("steps [2, 3] of [2, 3]") and "sft.train" in sft_table
    assert rl_table.startswith("steps [2] of [2, 3]") and all(r in rl_table for r in ("rl.generate", "rl.train",
                                                                                        "rl.sync"))
    with gzip.open(out / "rl" / "profile" / "steps_2-3.trace.json.gz", "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    # the sync's ranges on both sides (the trainer hands buckets out, the in-process engine's thread loads them), and
    # the ops of more than one thread (profile_all_threads: the engine's model thread too)
    assert {"sync.hand_out", "sync.load_bucket"} <= {e["name"] for e in events}
    assert len({e["tid"] for e in events if e["name"].startswith("aten::")}) >= 2
    # Run again without --resume: it starts over instead of appending to the previous run's metrics.
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting over" in again.stdout
    assert len((out / "rl" / "metrics.jsonl").read_text().splitlines()) == 3


TORCHRUN_SETS = ("sft.num_steps=10", "rl.num_steps=2", "rl.rollout.rollout_batch_size=4",
                 "rl.rollout.dynamic_filters=[]", "eval.limit=8", "rl.verify_sync=true", "engines.in_process=false")


def _torchrun_sft_rl(out: Path, env: dict[str, str], *sets: str) -> list[dict]:
    """`torchrun --nproc-per-node 2 -m trainer sft+rl` on the demo config with TORCHRUN_SETS and `sets`: checks what
    every such run shows, returns its RL metrics rows."""
    from engines.embedded.launch import free_port

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    sets = (f"output_dir=\"{out}\"", *TORCHRUN_SETS, *sets)
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "trainer", "sft+rl", "--config",
           "configs/demo.toml", *(a for s in sets for a in ("--set", s))]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sft_steps"] == 10 and summary["rl_steps"] == 2
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 logs once per step (step 0: the first evaluation)
    assert proc.stdout.count("| after RL |") == 1
    return rows


def _demo_verify_tolerance(device_type: str) -> float:
    """verify_sync's tolerance for the demo run on `device_type`, from the dtypes both sides compute in there: the
    trainer's ([trainer] param_dtype's default) and the engine's (engines.embedded.presets.load_engine_model's)."""
    from trainer.backend.parallel import compute_dtype
    from trainer.weight_sync import verify_tolerance

    engine = torch.bfloat16 if device_type == "cuda" else torch.float32
    return verify_tolerance(compute_dtype(device_type, load_run_config(ROOT / "configs" / "demo.toml").trainer), engine)


@pytest.mark.distributed
def test_torchrun_two_ranks_share_rollouts_and_sync_from_rank0(tmp_path):
    """2 gloo ranks on the CPU, on every machine (the run sees no GPU): rank 0 starts the engine and drives
    rollouts; both ranks train their FSDP2 shards; after each sync the engine equals the trainer to float32's
    tolerance."""
    rows = _torchrun_sft_rl(tmp_path / "run", cpu_child_env())
    tol = _demo_verify_tolerance("cpu")
    assert tol == 1e-5 and all(r["verify_sync_max_abs_diff"] <= tol for r in rows[1:])


@pytest.mark.gpu
@pytest.mark.distributed
def test_torchrun_two_nccl_ranks_sync_within_the_bf16_tolerance(tmp_path):
    """The same run on two GPUs: NCCL ranks computing in bf16 (CUDA's default), the engine the run starts placed on
    cuda:0 beside rank 0 (two ranks take both GPUs of a two-GPU machine, and the run refuses to guess), and the sync
    verified to bf16's tolerance on both sides."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (one NCCL rank each); gpu-check's distributed stage runs it")
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}  # the GPUs stay visible
    rows = _torchrun_sft_rl(tmp_path / "run", env, 'engines.fleet=[{kind = "embedded", device = "cuda:0"}]')
    tol = _demo_verify_tolerance("cuda")
    assert tol == 5e-2 and all(r["verify_sync_max_abs_diff"] <= tol for r in rows[1:])


ASYNC_PROCESS = ("--set", "rl.async_rollout=true", "--set", "engines.in_process=false",
                 "--set", "rl.rollout_worker=\"process\"")


@pytest.mark.parametrize("extra", [(), ASYNC_PROCESS], ids=["sync", "async-rollout-process"])
def test_sigint_writes_a_checkpoint_and_resume_finishes_the_run(tmp_path, extra):
    """A real Ctrl-C (SIGINT) mid-GRPO: exit code 130 with a checkpoint; `--resume` then completes the run. Also
    with async generation from a rollout process (which ignores SIGINT: the trainer checkpoints, then closes it)."""
    import signal
    import time

    out = tmp_path / "run"
    args = ["rl", "--config", "configs/demo.toml", "--set", f"output_dir=\"{out}\"", "--set", "rl.num_steps=40",
            "--set", "rl.rollout.rollout_batch_size=2", "--set", "rl.rollout.n_samples_per_prompt=2",
            "--set", "eval.limit=4", *extra,
            # The random model never ends a sample within 6 tokens and scores 0: a run that stops itself after 3
            # such steps (trainer.rl.check_finishing), which this test's Ctrl-C and resume must outlast.
            "--set", "rl.rollout.max_truncated_steps=0"]
    env = cpu_child_env()
    # The run gets Ctrl-C's default disposition whatever pytest was started with: a shell that starts a background
    # job without job control (`make test &` in a script) ignores SIGINT for it, and exec keeps that.
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = out / "rl" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:  # the step-0 evaluation and 2 steps
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "--resume" in err
    saved = sorted((out / "rl" / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "state.json").is_file()
    done_before = int(saved[-1].name.split("_")[1])
    assert 2 <= done_before < 40
    again = subprocess.run([sys.executable, "-m", "trainer", *args, "--resume"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps[-1] == 40 and steps.count(done_before + 1) >= 1
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 40


def test_trainer_threads_leave_the_embedded_engines_their_cores(monkeypatch):
    from trainer.run import cores_left_to_trainer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    original = torch.get_num_threads()
    torch.set_num_threads(5)  # a value none of the cases below computes
    before = 5

    def run_config(table):
        return config_from_dict(RunConfig, table, "")

    overlapped = {"async_rollout": True}
    one = [{"kind": "embedded"}]  # one engine process the run starts
    with cores_left_to_trainer(run_config({"engines": {"fleet": one, "threads": 1}, "rl": overlapped})):
        assert torch.get_num_threads() == 3  # 4 cores - 1 engine x 1 thread
    assert torch.get_num_threads() == before
    with cores_left_to_trainer(run_config({"engines": {"fleet": one * 3, "threads": 2}, "rl": overlapped})):
        assert torch.get_num_threads() == 1  # never below one
    synchronous = {"async_rollout": False}
    with cores_left_to_trainer(run_config({"engines": {"fleet": one, "threads": 1}, "rl": synchronous})):
        assert torch.get_num_threads() == before  # synchronous: the engines are idle while the trainer steps
    with cores_left_to_trainer(run_config({"engines": {"fleet": [{"url": "http://elsewhere:1"}]}, "rl": overlapped})):
        assert torch.get_num_threads() == before  # engines on other machines take no core here
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with cores_left_to_trainer(run_config({"engines": {"fleet": one, "threads": 1}, "rl": overlapped})):
        assert torch.get_num_threads() == before  # the user's explicit choice wins
    torch.set_num_threads(original)
