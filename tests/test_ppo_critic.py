"""PPO with a value model ([rl] advantage_estimator = "gae", trainer.backend.critic): the step's per-token targets
against the float64 GAE loop per sample, the value loss and its gradient through the step function against a float64
reference, the critic's checkpoint round trip bit for bit, a short RL run with the in-process engine, and the config
errors.

The tiny model is random; values are whatever its fresh head says, which is all the comparisons need.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from device_support import cpu_child_env
from engine_support import digit_fraction

import trainer.backend.local as local_backend_module
import trainer.rl as rl
from engines.local import LocalEngine
from engines.tiny import build_tokenizer, tiny_model_config
from kernels import use_backend
from kernels.gae import whiten
from kernels.reference import gae_reference, value_loss_reference
from trainer.backend.checkpoint import load_checkpoint, save_checkpoint
from trainer.backend.critic import attach_gae, build_critic, token_rewards
from trainer.backend.models import has_value_head
from trainer.backend.parallel import blocks_compiled
from trainer.backend.steps import (
    build_components,
    compute_values,
    forward_backward,
    init_distributed,
    trainer_config_from,
)
from trainer.batching.micro_batches import build_micro_batches
from trainer.config import ConfigError, CriticConfig, OptimConfig, RLTrainingConfig, RunConfig, config_from_dict
from trainer.config_reference import check_key_path, to_toml
from trainer.data.buffer import DataBuffer, load_jsonl
from trainer.types import RolloutBatch, Sample, Status, TrainingState
from trainer.weight_sync import WeightSyncSender
from trainer.weight_sync.common import named_weights

TOK = build_tokenizer()


@pytest.fixture(autouse=True)
def torch_path():
    with use_backend("torch"):
        yield


def _config(out, **kw) -> RLTrainingConfig:
    base = dict(advantage_estimator="gae", optim=OptimConfig(lr=1e-3, min_lr_ratio=1.0), num_steps=10, token_budget=64,
                micro_batch_buckets=16, output_dir=str(out), loss={"loss_agg": "token-mean"},
                rollout={"max_new_tokens": 16, "n_samples_per_prompt": 3})
    base.update(kw)
    return RLTrainingConfig(**base)


def _samples() -> list[Sample]:
    """Three prompts of three samples (the shared-prompt layout shares each prompt), responses of 2..12 tokens;
    sample 1 is a multi-turn episode with a tool output (mask 0) inside its response, sample 4 one with a tool output
    right before its last token, sample 7 FAILED (no reward: left out)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(9):
        group = i // 3
        prompt = torch.randint(3, 200, (3 + 2 * group,), generator=torch.Generator().manual_seed(group)).tolist()
        r = 2 + (5 * i) % 11
        mask = [1] * r
        if i == 1:
            r, mask = 12, [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1]
        if i == 4:
            r, mask = 6, [1, 1, 1, 0, 0, 1]
        resp = torch.randint(3, 200, (r,), generator=g).tolist()
        failed = i == 7
        out.append(Sample(prompt=f"p{group}", tokens=prompt + resp, response_length=r, loss_mask=mask,
                          reward=None if failed else float(torch.rand((), generator=g)), group_index=group,
                          status=Status.FAILED if failed else Status.COMPLETED,
                          metadata={"reward_error": "boom"} if failed else {}))
    return out


def _response_rows(mb, k: int, s: Sample) -> list[int]:
    """The loss rows of sample k of a micro-batch that predict its response tokens 0 .. R-1 (prompt non-empty):
    plain layout, the row of prompt token P-1 onwards; shared-prompt layout, its loss rows from the first."""
    start = int(mb.segments[k]) + (0 if mb.trees is not None else s.prompt_length - 1)
    return list(range(start, start + s.response_length))


def _plain_values(critic, s: Sample) -> torch.Tensor:
    """[R] float64: the critic's values of s's response tokens from a plain unpacked forward of s alone (the
    hidden state at position P-1+r predicts response token r)."""
    ids = torch.tensor([s.tokens])
    with torch.no_grad():
        h = critic.root(lambda lm: lm.model(input_ids=ids).last_hidden_state[0])  # [L, H]
        head = critic.model.value_head
        w, b = _full(head.weight).double(), _full(head.bias).double()
    return (h.double() @ w.T + b).squeeze(-1)[s.prompt_length - 1:-1]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter's (or gradient's) whole value: FSDP2 keeps DTensor shards, a plain tensor between the root's
    forward and its reshard."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reference(s: Sample, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.tensor(s.effective_loss_mask, dtype=torch.bool)
    rewards = torch.zeros(s.response_length, dtype=torch.float64)
    rewards[int(mask.nonzero().max())] = s.reward
    adv, ret = gae_reference(rewards[None], values[None], mask[None], gamma=gamma, lam=lam)
    return adv[0], ret[0]


class Captured:
    """Wraps trainer.backend.local.forward_backward: keeps the micro-batches each call trains on."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, list]] = []

    def __call__(self, components, micro_batches, *args, **kw):
        self.calls.append((components, list(micro_batches)))
        return forward_backward(components, micro_batches, *args, **kw)


# ----------------------------------------------------------------------------------------------- GAE in the step
@pytest.mark.parametrize("share_prompts", [False, True], ids=["plain", "shared_prompts"])
@pytest.mark.parametrize("whiten_advantages", [False, True], ids=["raw", "whitened"])
def test_the_steps_advantages_and_returns_equal_the_reference_per_sample(tmp_path, monkeypatch, share_prompts,
                                                                         whiten_advantages):
    gamma, lam = 0.99, 0.95
    cfg = _config(tmp_path, gamma=gamma, lam=lam, whiten_advantages=whiten_advantages)
    tcfg = trainer_config_from(cfg, compile=False, share_prompts=share_prompts)
    comp = build_components(tiny_model_config("llama"), tcfg)
    critic = build_critic(comp, tcfg)
    samples = _samples()
    kept = [i for i, s in enumerate(samples) if s.status != Status.FAILED]
    ref_values = {i: _plain_values(critic, samples[i]) for i in kept}  # before the update
    captured = Captured()
    monkeypatch.setattr(local_backend_module, "forward_backward", captured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the FAILED sample's warning
        metrics, _ = rl.train_on_batch(rl.local_backend(comp, cfg, tcfg, pad_id=0, critic=critic), TrainingState(),
                                       RolloutBatch(samples), cfg)
    (pol, mbs), (crit, crit_mbs) = captured.calls
    assert pol is comp and crit is critic and crit_mbs == mbs  # both models train on the same targets
    assert len(mbs) > 1, "the token budget should split the batch into several packed micro-batches"
    assert all((mb.trees is not None) == share_prompts for mb in mbs)
    trained = [samples[i] for i in kept]  # the trainer's sample indices are into the kept samples
    got, ref = {}, {}
    for mb in mbs:
        for k, j in enumerate(mb.sample_index):
            s, rows = trained[j], _response_rows(mb, k, trained[j])
            got[j] = (mb.old_values[rows].double(), mb.advantages[rows].double(), mb.returns[rows].double(),
                      mb.loss_mask[rows])
            ref[j] = (ref_values[kept[j]], *_reference(s, ref_values[kept[j]], gamma, lam))
    assert sorted(got) == list(range(len(trained)))  # every kept sample once; the FAILED one nowhere
    for j, s in enumerate(trained):
        values, adv, ret, mask = got[j]
        ref_v, ref_adv, ref_ret = ref[j]
        assert mask.tolist() == list(map(float, s.effective_loss_mask))
        torch.testing.assert_close(values, ref_v, atol=1e-5, rtol=1e-5)  # packing and the shift are exact
        torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=1e-5)
        if not whiten_advantages:
            torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
        assert not adv[mask == 0].any() and not ret[mask == 0].any()  # environment tokens: no advantage
    if whiten_advantages:  # over the step's trained tokens, all micro-batches at once
        raw = torch.cat([ref[j][1] for j in range(len(trained))])
        mask = torch.cat([got[j][3] for j in range(len(trained))])
        expected = whiten(raw.float(), mask).double()
        torch.testing.assert_close(torch.cat([got[j][1] for j in range(len(trained))]), expected, atol=1e-5,
                                   rtol=1e-5)
    # The step's statistics are those of the reference targets (raw advantages, values before the update).
    all_ret = torch.cat([ref[j][2] for j in range(len(trained))])
    all_adv = torch.cat([ref[j][1] for j in range(len(trained))])
    keep = torch.cat([got[j][3] for j in range(len(trained))]).bool()
    assert metrics["critic/returns_mean"] == pytest.approx(float(all_ret[keep].mean()), abs=1e-5)
    assert metrics["critic/advantages_mean"] == pytest.approx(float(all_adv[keep].mean()), abs=1e-5)
    assert metrics["critic/advantages_std"] == pytest.approx(float(all_adv[keep].std()), abs=1e-5)
    all_v = torch.cat([ref[j][0] for j in range(len(trained))])[keep]
    ev = 1 - (all_ret[keep] - all_v).var(unbiased=False) / all_ret[keep].var(unbiased=False)
    assert metrics["critic/explained_variance"] == pytest.approx(float(ev), abs=1e-4)


def test_the_critic_is_built_like_the_policy_with_its_own_weights_and_optimiser(tmp_path):
    cfg = _config(tmp_path, critic={"optim": {"lr": 7e-4}})
    tcfg = trainer_config_from(cfg, compile=True, compile_backend="aot_eager")
    policy = build_components(tiny_model_config("llama"), tcfg)
    critic = build_critic(policy, tcfg)
    assert all(blocks_compiled(b) for b in critic.model.model.layers)  # compiled as the policy is
    assert critic.mesh is policy.mesh and critic.config.loss == "value" and not has_value_head(policy.model)
    assert critic.optimizer.param_groups[0]["lr"] == 7e-4 and policy.optimizer.param_groups[0]["lr"] == 1e-3
    theirs = dict(policy.root.named_parameters())
    for name, p in critic.root.named_parameters():  # the policy's start weights, in parameters of its own
        if "value_head" not in name:
            assert p is not theirs[name] and torch.equal(_full(p), _full(theirs[name])), name
    assert not critic.model.lm_head.weight.requires_grad  # unused by the value loss: no optimiser state
    assert build_critic(policy, trainer_config_from(_config(tmp_path, critic={"kind": "head"}))) is None


# ----------------------------------------------------------------------------------------------- value loss
@pytest.mark.parametrize("clip", [None, 0.05], ids=["unclipped", "clipped"])
def test_value_loss_and_its_gradient_through_the_step_function_equal_the_float64_reference(tmp_path, clip):
    cfg = _config(tmp_path, critic=CriticConfig(value_clip=clip))  # None: unclipped (inf in a TOML file)
    tcfg = trainer_config_from(cfg, compile=False)
    comp = build_components(tiny_model_config("llama"), tcfg)
    critic = build_critic(comp, tcfg)
    samples = [s for s in _samples() if s.status != Status.FAILED]
    mbs = build_micro_batches(samples, token_budget=cfg.token_budget, bucket_size=cfg.micro_batch_buckets)
    assert len(mbs) > 1
    values = compute_values(critic, mbs)
    # Old values away from the current ones (the clip decides some tokens), returns anywhere.
    g = torch.Generator().manual_seed(3)
    rewards = [float(torch.randn((), generator=g)) for _ in samples]
    mbs, _ = attach_gae(mbs, values, [token_rewards(mb, rewards) for mb in mbs], gamma=1.0, lam=0.95,
                        whiten_advantages=False)
    mbs = [dataclasses.replace(mb, old_values=mb.old_values + 0.1 * torch.randn(mb.old_values.shape, generator=g))
           for mb in mbs]
    fut = forward_backward(critic, mbs)
    got = fut.result()
    head = critic.model.value_head
    grad_w, grad_b = _full(head.weight.grad).double(), _full(head.bias.grad).double()
    # The reference: per-token hidden states of each sample alone (float64), the head as float64 leaves.
    w = _full(head.weight).detach().double().requires_grad_(True)
    b = _full(head.bias).detach().double().requires_grad_(True)
    v_all, old_all, ret_all, mask_all = [], [], [], []
    for mb in mbs:
        for k, j in enumerate(mb.sample_index):
            s = samples[j]
            rows = _response_rows(mb, k, s)
            with torch.no_grad():
                ids = torch.tensor([s.tokens])
                h = critic.root(lambda lm, ids=ids: lm.model(input_ids=ids).last_hidden_state[0]).double()
            v_all.append((h[s.prompt_length - 1:-1] @ w.T + b).squeeze(-1))
            old_all.append(mb.old_values[rows].double())
            ret_all.append(mb.returns[rows].double())
            mask_all.append(mb.loss_mask[rows])
    num_tokens = mbs[0].num_tokens
    ref = value_loss_reference(torch.cat(v_all)[None], torch.cat(old_all)[None], torch.cat(ret_all)[None],
                               torch.cat(mask_all)[None], clip=clip, num_tokens=num_tokens)
    ref.backward()
    assert got["loss"] == pytest.approx(ref.item(), rel=1e-5)
    assert got["critic/value_loss"] == got["loss"]
    if clip is not None:
        assert 0 < got["critic/value_clip_frac"] < 1  # the clip decides some tokens, not all
    for mine, theirs in ((grad_w, w.grad), (grad_b, b.grad)):
        assert float((mine - theirs).norm() / theirs.norm()) < 1e-4


# ----------------------------------------------------------------------------------------------- checkpoint
def _flat_optim(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            for _, v in sorted(opt.state.get(p, {}).items()):
                out.append(_full(v))
    return out


def test_the_critic_checkpoint_round_trip_is_bit_exact(tmp_path):
    cfg = _config(tmp_path, critic={"optim": {"lr": 3e-3, "weight_decay": 0.01}})
    tcfg = trainer_config_from(cfg, compile=False)
    batch = RolloutBatch([s for s in _samples() if s.status != Status.FAILED])

    def fresh():
        comp = build_components(tiny_model_config("llama"), tcfg)
        return comp, build_critic(comp, tcfg)

    comp, critic = fresh()
    state = TrainingState()
    for _ in range(2):
        _, state = rl.train_on_batch(rl.local_backend(comp, cfg, tcfg, pad_id=0, critic=critic), state, batch, cfg)
    save_checkpoint(comp, state, critic=critic)
    comp2, critic2 = fresh()
    state2, _ = load_checkpoint(comp2, tmp_path, critic=critic2)
    assert state2 == state
    for a, b in ((critic, critic2), (comp, comp2)):
        pa, pb = dict(a.root.named_parameters()), dict(b.root.named_parameters())
        assert pa.keys() == pb.keys() and any("value_head" in k for k in pa) == (a is critic)
        for name in pa:
            assert torch.equal(_full(pa[name]), _full(pb[name])), name
        sa, sb = _flat_optim(a.optimizer), _flat_optim(b.optimizer)
        assert len(sa) == len(sb) > 0 and all(torch.equal(x, y) for x, y in zip(sa, sb))
        assert a.scheduler.state_dict() == b.scheduler.state_dict()
    # The next step from the checkpoint is the same step: the same value loss, to the bit.
    m1, _ = rl.train_on_batch(rl.local_backend(comp, cfg, tcfg, pad_id=0, critic=critic), state, batch, cfg)
    m2, _ = rl.train_on_batch(rl.local_backend(comp2, cfg, tcfg, pad_id=0, critic=critic2), state2, batch, cfg)
    for key in ("critic/value_loss", "critic/grad_norm", "critic/explained_variance", "loss", "grad_norm"):
        assert m1[key] == m2[key], key
    # A checkpoint without a critic does not resume a run with one (nor the reverse).
    plain = _config(tmp_path / "plain", advantage_estimator="grpo")
    plain_comp = build_components(tiny_model_config("llama"), trainer_config_from(plain, compile=False))
    save_checkpoint(plain_comp, TrainingState())
    with pytest.raises(ValueError, match="advantage_estimator"):
        load_checkpoint(comp2, tmp_path / "plain", critic=critic2)


# ----------------------------------------------------------------------------------------------- a short run
@pytest.fixture(scope="module")
def local():
    eng = LocalEngine("tiny", seed=1)
    yield eng
    eng.close()


def _run(engine, cfg):
    tcfg = trainer_config_from(cfg, compile=False)
    comp = build_components(tiny_model_config("llama"), tcfg)
    buffer = DataBuffer(load_jsonl("data/arithmetic_train.jsonl"), seed=0)
    sender = WeightSyncSender(comp.model, [engine], timeout_s=60)
    sender.init_group()
    try:
        return rl.run_rl_training(None, buffer, cfg, engines=[engine], sender=sender, tokenizer=TOK,
                                  reward_fn=digit_fraction, trainer_config=tcfg, components=comp)
    finally:
        sender.close()


CRITIC_METRICS = ("critic/value_loss", "critic/value_clip_frac", "critic/explained_variance", "critic/value_mean",
                  "critic/returns_mean", "critic/advantages_mean", "critic/advantages_std")


def test_a_gae_run_logs_the_critic_and_its_explained_variance_moves(local, tmp_path):
    rollout = {"rollout_batch_size": 4, "n_samples_per_prompt": 2, "max_new_tokens": 6, "seed": 5,
               "apply_chat_template": False}
    cfg = _config(tmp_path, num_steps=10, token_budget=256, micro_batch_buckets=64, rollout=rollout,
                  optim=OptimConfig(lr=1e-2, min_lr_ratio=1.0), critic={"optim": {"lr": 1e-3, "min_lr_ratio": 1.0}})
    comp, state, history = _run(local, cfg)
    assert state.step == 10
    for m in history:
        assert all(k in m for k in (*CRITIC_METRICS, "critic/grad_norm", "critic/lr")), sorted(m)
    # The fresh head's values miss the returns (explained variance < 0); within a few steps the critic has learnt at
    # least their level (about 0 and above; per-prefix prediction takes longer on a random tiny model).
    ev = [m["critic/explained_variance"] for m in history]
    assert ev[0] < -0.2 and sum(ev[-3:]) / 3 > ev[0] + 0.3, f"the critic did not learn the returns: {ev}"
    # The checkpoint of the run holds the critic beside the policy.
    saved = next((tmp_path / "checkpoints").iterdir())
    assert "critic_scheduler" in (saved / "state.json").read_text()


def test_a_value_head_on_the_policy_trains_and_stays_out_of_the_weight_sync(local, tmp_path):
    rollout = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 4, "seed": 5,
               "apply_chat_template": False}
    cfg = _config(tmp_path, num_steps=3, token_budget=128, micro_batch_buckets=32, rollout=rollout,
                  critic={"kind": "head"})
    comp, state, history = _run(local, cfg)
    assert state.step == 3 and has_value_head(comp.model)
    assert all(k in m for m in history for k in CRITIC_METRICS)
    assert "critic/grad_norm" not in history[0]  # one optimiser: the policy's
    assert not any("value_head" in n for n, _ in named_weights(comp.model))  # the engine never sees the head
    # A policy built from a root without a head gets its own copy with one (the root is left as it was).
    plain = build_components(tiny_model_config("llama"), trainer_config_from(_config(tmp_path, advantage_estimator=
                                                                                     "grpo"), compile=False))
    headed = build_components(plain.root, trainer_config_from(cfg, compile=False))
    assert headed.root is not plain.root and has_value_head(headed.model) and not has_value_head(plain.model)


# ----------------------------------------------------------------------------------------------- config
def _run_config(rl: dict) -> RunConfig:
    return config_from_dict(RunConfig, {"rl": rl}, "")


def test_the_gae_config_and_its_errors():
    cfg = _run_config({"advantage_estimator": "gae", "rollout": {"n_samples_per_prompt": 1}})
    assert cfg.rl.critic == CriticConfig() and (cfg.rl.gamma, cfg.rl.lam, cfg.rl.whiten_advantages) == (1.0, 0.95, True)
    cfg = _run_config({"advantage_estimator": "gae", "critic": {"value_clip": float("inf"), "optim": {"lr": 2e-5}}})
    assert cfg.rl.critic.clip is None and cfg.rl.critic.optim.lr == 2e-5
    assert "[rl.critic.optim]" in to_toml(cfg) and "value_clip = inf" in to_toml(cfg)
    check_key_path("rl.critic.optim.lr")  # --set reaches the critic's optimiser
    assert _run_config({}).rl.critic is None
    bad = [
        ({"critic": {"kind": "model"}}, "critic: .rl.critic. configures the value model of advantage_estimator"),
        ({"gamma": 0.99}, "gamma: is read by advantage_estimator = \"gae\" only"),
        ({"advantage_estimator": "gae", "lam": 1.5}, "lam: must be in"),
        ({"advantage_estimator": "gae", "critic": {"kind": "value"}}, "kind: 'value'"),
        ({"advantage_estimator": "gae", "critic": {"kind": "head", "path": "x"}}, r"\[rl.critic\] path"),
        ({"advantage_estimator": "gae", "critic": {"kind": "head", "optim": {"lr": 1e-5}}}, r"\[rl.critic\] optim"),
        ({"advantage_estimator": "gae", "critic": {"value_clip": 0.0}}, "value_clip: must be > 0"),
        ({"advantage_estimator": "gae", "critic": {"optim": {"learning_rate": 1}}}, r"\[rl.critic.optim\]"),
        ({"advantage_estimator": "grpo", "rollout": {"n_samples_per_prompt": 1}}, "'gae'"),
    ]
    for table, message in bad:
        with pytest.raises(ConfigError, match=message):
            _run_config(table)


# ----------------------------------------------------------------------------------------------- two ranks
@pytest.mark.distributed
def test_two_ranks_whiten_over_the_whole_step_and_match_one_process(tmp_path):
    """2 gloo ranks, each with its share of the samples: the whitening and the critic's statistics are over the
    step's tokens of both ranks (all_reduce sums), so the metrics and the trained policy and critic equal those of
    one process that holds every sample."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    worker = root / "tests" / "trainer_worker.py"
    sys.path.insert(0, str(worker.parent))
    import trainer_worker as w

    subprocess.run([sys.executable, str(worker), "gae", str(tmp_path / "g2.pt"), "2"], check=True, timeout=300,
                   env=cpu_child_env(), cwd=root)
    two = torch.load(tmp_path / "g2.pt")
    _, tcfg = w.gae_config()
    # the one process on the CPU as well, in float32 like the gloo ranks (on a CUDA machine the default is the GPU)
    policy = build_components(tiny_model_config(), tcfg, mesh=init_distributed("cpu"))
    critic = build_critic(policy, tcfg)
    one = w.gae_steps(policy, critic, range(2))
    assert one[0]["critic/advantages_std"] > 0 and one[1]["critic/value_loss"] != one[0]["critic/value_loss"]
    for a, b in zip(one, two["metrics"]):
        for key in ("loss", "grad_norm", *CRITIC_METRICS, "critic/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    # Parameters after two AdamW steps at lr 3e-3: Adam's normalised step turns the ranks' other float summation
    # order on near-zero gradients into differences of ~1e-5 (under 1 % of one step), not more.
    for name, comp in (("policy", policy), ("critic", critic)):
        for k, v in w.full_params(comp).items():
            assert (v - two["params"][name][k]).abs().max().item() < 1e-4, (name, k)
