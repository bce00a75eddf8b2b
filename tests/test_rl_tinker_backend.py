"""`[trainer] backend = "tinker"`: this project's RL loop trains through a Tinker-API server (issue 39 item 5).

The rollout machinery, the rewards and the advantages run here; the optimisation runs on `python -m trainer serve`
(one real server process on loopback for the module, a tiny float32 model), reached through the official `tinker`
SDK (trainer.backend.remote); the rollouts sample the server's current weights through the "tinker" engine kind
(engines/tinker.py), switched to each new sampler by TinkerSync.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import warnings

import pytest
import torch
from engine_support import digit_fraction

from engines.registry import EngineSpec, build_engine
from engines.tiny import build_tokenizer
from kernels import use_backend
from trainer.backend.local import to_datums
from trainer.backend.protocol import LoraSpec
from trainer.backend.remote import TinkerBackend, TinkerPolicy, TinkerSync, connect
from trainer.backend.steps import build_components, trainer_config_from
from trainer.cli import load_run_config
from trainer.config import ConfigError, OptimConfig, RLTrainingConfig, RolloutConfig, RunConfig, config_from_dict
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.rl import local_backend, run_rl_training, train_on_batch
from trainer.serve.app import start_subprocess
from trainer.types import RolloutBatch, Sample, Status, TrainingState

KEY = "tml-loop-key"
TOK = build_tokenizer()
RANK, SEED = 4, 3


@pytest.fixture(autouse=True)
def torch_path():
    with use_backend("torch"):
        yield


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base_url, tiny model folder) of a server on a free loopback port; stopped by SIGINT (exit 0)."""
    from engines.embedded.presets import build_tiny_model

    tmp = tmp_path_factory.mktemp("tinker_rl")
    folder = tmp / "tiny"
    build_tiny_model(0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1).save_pretrained(folder)
    TOK.save_pretrained(folder)
    config = tmp / "serve.toml"
    config.write_text(f'[serve]\nport = 0\noutput_dir = "{tmp / "out"}"\nmax_clients = 16\n'
                      f'models = [{{name = "{folder}", path = "{folder}"}}]\n')
    proc, url = start_subprocess(config, env={**os.environ, "RLKERNELS_API_KEY": KEY})
    yield url, folder
    while OPENED:  # the tests' SDK sessions end before the server does (else their heartbeats outlive it)
        OPENED.pop().close()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 0, f"server exit {proc.returncode}:\n{''.join(proc.tail)}"


def _config(tmp_path, **kw) -> RLTrainingConfig:
    rollout = dict(rollout_batch_size=4, n_samples_per_prompt=4, max_new_tokens=6, temperature=1.0, seed=5,
                   apply_chat_template=False)
    base = dict(optim=OptimConfig(lr=2e-2, warmup_steps=0, min_lr_ratio=1.0, eps=1e-8), num_steps=6,
                token_budget=256, micro_batch_buckets=64, loss={"loss_agg": kw.pop("loss_agg", "token-mean")},
                output_dir=str(tmp_path), rollout=RolloutConfig(**rollout), seed=SEED,
                lora={"rank": RANK, "alpha": 32.0})
    base.update(kw)
    return RLTrainingConfig(**base)


OPENED: list[TinkerBackend] = []  # the module's SDK sessions, closed when the server fixture ends


def _remote(url, folder, cfg) -> TinkerPolicy:
    spec = LoraSpec(rank=RANK, seed=SEED, alpha=32.0, train_unembed=False)
    OPENED.append(TinkerBackend(url, str(folder), spec, api_key=KEY))
    return TinkerPolicy(OPENED[-1], cfg)


def _samples(seed: int) -> list[Sample]:
    """Two groups of four samples (a shared prompt each, random responses and rewards)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(2):
        prompt = torch.randint(6, 90, (5,), generator=g).tolist()
        for i in range(4):
            n = 3 + i
            response = torch.randint(6, 90, (n,), generator=g).tolist()
            mask = (1,) * (n - 1) + (int(i % 2),)  # a masked last token on some
            out.append(Sample(prompt="", tokens=(*prompt, *response), response_length=n, loss_mask=mask,
                              reward=float(torch.rand((), generator=g)), group_index=group, index=i,
                              status=Status.COMPLETED))
    return out


def _with_logprobs(backend, samples):
    """The samples with rollout_logprobs = the backend's own log-probs of their responses (a sampler in sync)."""
    datums, _ = to_datums(samples, [0.0] * len(samples))
    outs = backend.forward(datums, "cross_entropy").result().outputs  # every target scored
    return [dataclasses.replace(s, rollout_logprobs=tuple(o["logprobs"][s.prompt_length - 1:].tolist()))
            for s, o in zip(samples, outs)]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_one_step_through_the_server_equals_the_local_lora_step(server, tmp_path, loss_agg):
    """The same samples trained one step through backend = "tinker" and through the local LoRA backend: the same
    loss and gradient norm, and afterwards the same log-probs (the same adapter update), moved off the start."""
    url, folder = server
    cfg = _config(tmp_path, loss_agg=loss_agg)
    tcfg = trainer_config_from(cfg, compile=False)
    local = local_backend(build_components(str(folder), tcfg), cfg, tcfg, pad_id=TOK.pad_token_id)
    remote = _remote(url, folder, cfg)
    samples = _with_logprobs(local, _samples(0))
    datums, extra = to_datums(samples, [0.0] * len(samples))
    plp = {"prompt_lengths": extra["prompt_lengths"]}

    def trained(backend) -> torch.Tensor:  # the log-probs of every trained target token, concatenated
        outs = backend.forward(datums, "cross_entropy", plp).result().outputs
        return torch.cat([o["logprobs"][d.loss_inputs["weights"] > 0] for o, d in zip(outs, datums)])

    before = trained(remote)
    assert (before - trained(local)).abs().max() <= 1e-5  # the same base model on both sides
    batch = RolloutBatch(samples=tuple(samples))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m_local, s_local = train_on_batch(local, TrainingState(), batch, cfg)
        m_remote, s_remote = train_on_batch(remote, TrainingState(), batch, cfg)
    assert s_local == s_remote
    assert m_remote["loss"] == pytest.approx(m_local["loss"], abs=1e-6)
    assert m_remote["grad_norm"] == pytest.approx(m_local["grad_norm"], rel=1e-4) and m_local["grad_norm"] > 0
    assert m_remote["lr"] == m_local["lr"]
    # the objective's metrics, computed from the server's log-probs by the same layer (kernels.objective)
    shared = [k for k in m_local if k.startswith("mismatch/") or k in ("approx_kl", "ratio_mean", "clip_frac_low")]
    assert "mismatch/logprob_abs_diff_max" in shared and set(shared) <= set(m_remote)
    for key in shared:
        assert m_remote[key] == pytest.approx(m_local[key], abs=1e-5), key
    after_l, after_r = trained(local), trained(remote)
    moved = float((after_l - before).abs().max())
    assert moved > 1e-3
    assert float((after_l - after_r).abs().max()) <= 1e-3 * moved


def test_a_short_rl_run_trains_through_the_server(server, tmp_path):
    """The RL loop end to end with the optimisation on the server: rollouts from the tinker engine (each sync a new
    sampler, versioned), metrics logged every step, and the update goes where GRPO sends it: the responses that
    scored rise in log-prob against those that did not (a random tiny model's digit reward is too sparse for the
    reward itself to climb in a few LoRA steps)."""
    url, folder = server
    cfg = _config(tmp_path, num_steps=6)
    remote = _remote(url, folder, cfg)
    engine = build_engine(EngineSpec(kind="tinker", url=url, api_key=KEY), model_folder=folder)
    sender = TinkerSync(remote.remote, [engine])
    scored = []

    def reward(sample):
        scored.append((sample, digit_fraction(sample)))
        return scored[-1][1]

    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comp, state, history = run_rl_training(None, buffer, cfg, engines=[engine], sender=sender, tokenizer=TOK,
                                               reward_fn=reward, backend=remote)
    assert comp is None and state.step == 6
    assert [m["weight_version"] for m in history] == list(range(1, 7))
    assert engine.version == 6  # the sampler of the last update
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 7))
    assert all(x["grad_norm"] > 0 and x["lr"] == cfg.optim.lr and "reward_mean" in x for x in lines)
    # the sampler is the trained weights: its log-probs equal the server's forward to float32 noise
    assert all(x["mismatch/logprob_abs_diff_max"] < 1e-4 for x in lines)

    start = _remote(url, folder, cfg)  # a fresh client of the same seed: the starting weights

    def mean_logprob(backend, samples):
        datums, _ = to_datums(samples, [0.0] * len(samples))
        outs = backend.forward(datums, "cross_entropy").result().outputs
        return float(torch.cat([o["logprobs"][s.prompt_length - 1:] for o, s in zip(outs, samples)]).mean())

    good = [s for s, r in scored if r > 0]
    bad = [s for s, r in scored if r == 0]
    assert good and bad
    gain_good = mean_logprob(remote, good) - mean_logprob(start, good)
    gain_bad = mean_logprob(remote, bad) - mean_logprob(start, bad)
    assert gain_good > gain_bad + 1e-3, (gain_good, gain_bad)


def _run_config(tmp_path, trainer: dict, rl: dict | None = None) -> RunConfig:
    table = {"output_dir": str(tmp_path), "trainer": {"backend": "tinker", **trainer},
             "rl": {"lora": {"rank": 4}, **(rl or {})}}
    return config_from_dict(RunConfig, table)


@pytest.mark.parametrize("rl,key", [
    ({"lora": None}, r"\[rl.lora\]"),
    ({"advantage_estimator": "gae", "critic": {"kind": "head"}}, "advantage_estimator"),
    ({"loss": {"kl_coef": 0.1}}, "kl_coef"),
    ({"loss": {"objective": "gspo"}}, "objective"),
    ({"lora": {"rank": 4, "train_unembed": True}}, "train_unembed"),
])
def test_options_the_server_cannot_do_are_refused_naming_the_key(tmp_path, rl, key):
    with pytest.raises(ConfigError, match=key):
        _run_config(tmp_path, {"base_url": "http://127.0.0.1:1"}, rl)


def test_bad_server_settings_are_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("RLKERNELS_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="base_url"):
        _run_config(tmp_path, {})
    with pytest.raises(ConfigError, match="base_url"):
        _run_config(tmp_path, {"base_url": "127.0.0.1:8000"})
    far = _run_config(tmp_path, {"base_url": "http://10.1.2.3:8000"})
    with pytest.raises(ValueError, match=r"api_key.*RLKERNELS_API_KEY"):
        connect(far.trainer, far.rl, model="m")
    near = _run_config(tmp_path, {"base_url": "http://127.0.0.1:9", "api_key": "k"})  # nothing listens there
    with pytest.raises(ConnectionError, match=r"\[trainer\] base_url = 'http://127.0.0.1:9'"):
        connect(near.trainer, near.rl, model="m")


def test_the_cli_runs_rl_through_the_server(server, tmp_path):
    """`python -m trainer rl` with [trainer] backend = "tinker": the default fleet becomes one "tinker" engine at
    base_url, the run trains on the server, writes its metrics, a remote checkpoint index and the summary; `sft+rl`
    is refused before any work, naming the key."""
    from trainer.cli import main

    url, folder = server
    config = tmp_path / "remote.toml"
    config.write_text(f'''output_dir = "{tmp_path / 'run'}"
[model]
path = "{folder}"
[data]
train = "data/arithmetic_train.jsonl"
reward = "trainer.rewards.rules:arithmetic_reward"
format = "plain"
[rl]
num_steps = 3
token_budget = 512
micro_batch_buckets = 64
[rl.lora]
rank = 4
[rl.rollout]
rollout_batch_size = 4
n_samples_per_prompt = 4
max_new_tokens = 4
[trainer]
backend = "tinker"
base_url = "{url}"
api_key = "{KEY}"
''')
    cfg = load_run_config(config)
    assert [(s.kind, s.url) for s in cfg.engines.fleet] == [("tinker", url)]
    assert main(["rl", "--config", str(config)]) == 0
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["weight_version"] == r["step"] for r in rows)
    saved = [json.loads(x) for x in (run / "rl" / "remote_checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["state"]["step"] == 3 and saved[-1]["path"].startswith("tinker://")
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == 3
    # --resume: the server loads its step-3 checkpoint (weights and Adam moments) and the run goes on from there
    assert main(["rl", "--config", str(config), "--resume", "--set", "rl.num_steps=5"]) == 0
    rows = [json.loads(x) for x in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["weight_version"] == 5
    assert main(["sft+rl", "--config", str(config)]) == 2


def test_a_fleet_of_other_kinds_is_refused_with_the_tinker_backend(tmp_path):
    table = {"output_dir": str(tmp_path), "trainer": {"backend": "tinker", "base_url": "http://127.0.0.1:1"},
             "rl": {"lora": {"rank": 4}}, "engines": {"fleet": [{"kind": "vllm", "url": "http://127.0.0.1:2"}]}}
    with pytest.raises(ValueError, match=r"\[engines\] fleet: kinds \['vllm'\]"):
        config_from_dict(RunConfig, table)
