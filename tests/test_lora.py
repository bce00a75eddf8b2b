"""LoRA ([sft.lora] / [rl.lora], trainer.backend.lora): the adapters' forward and gradients against a float64
reference with merged weights W + (alpha / r) B @ A, only adapters train, FSDP2 over two gloo ranks equals one
process, exact resume from an adapters-only checkpoint, merged weights reach the engine, and the config errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from engines.tiny import tiny_model_config
from kernels import use_backend
from trainer.backend.checkpoint import CheckpointMismatch, load_checkpoint, save_checkpoint
from trainer.backend.lora import ADAPTER, adapters_disabled, hf_name, is_adapter, lora_layers
from trainer.backend.models import load_hf_model
from trainer.backend.steps import build_components, compute_logprobs, forward_backward
from trainer.batching.micro_batches import build_micro_batches
from trainer.config import ConfigError, LoRAConfig, RunConfig, config_from_dict
from trainer.types import TrainingState

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "trainer_worker.py"
sys.path.insert(0, str(WORKER.parent))
import trainer_worker as w  # noqa: E402

TARGETS = ("q_proj", "v_proj", "down_proj")  # w.lora_config's


@pytest.fixture(autouse=True)
def _torch_path():
    """In-process training runs on the production CPU path (torch), not the Triton interpreter."""
    with use_backend("torch"):
        yield


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _trainer_weights(comp) -> dict[str, torch.Tensor]:
    """{HF-model name: full float tensor} of every parameter of the trained model (LoRA names as they are)."""
    return {n: _full(p.detach()).clone() for n, p in comp.model.named_parameters()}


def _reference(weights: dict[str, torch.Tensor], scale: float):
    """A float64 plain model and its functional parameters: adapters as float64 leaves that require grad, each
    adapted weight W + scale B @ A built from them (the merged weights of the reference)."""
    plain = load_hf_model(tiny_model_config(), dtype=torch.float64)
    leaves = {n: v.double().requires_grad_() for n, v in weights.items() if is_adapter(n)}

    def params() -> dict[str, torch.Tensor]:
        out = {}
        for n, v in weights.items():
            if is_adapter(n):
                continue
            if ".base_layer.weight" in n:
                path = n.removesuffix(".base_layer.weight")
                a, b = leaves[f"{path}.lora_A.{ADAPTER}.weight"], leaves[f"{path}.lora_B.{ADAPTER}.weight"]
                out[hf_name(n)] = v.double() + scale * (b @ a)
            else:
                out[hf_name(n)] = v.double()
        return out

    return plain, leaves, params


def _ref_logprobs(plain, params, s) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log p of the response tokens of sample `s` (one sequence, full vocabulary) and its loss mask."""
    ids = torch.tensor(s.tokens)[None]
    logits = functional_call(plain, params, args=(), kwargs={"input_ids": ids}).logits[0]  # [L, V] float64
    logp = F.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]  # position j predicts j+1
    return logp[s.prompt_length - 1:], torch.tensor(s.effective_loss_mask, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_forward_and_adapter_grads_match_float64_merged_reference():
    """Per-block compile (aot_eager) + FSDP2 on one rank: log-probs (1e-5 abs), loss (1e-5 rel) and every adapter
    gradient (1e-4 relative) equal the float64 model with merged weights; the base gets no gradient."""
    comp = build_components(tiny_model_config(), w.lora_config(compile=True))
    w.randomize_adapters(comp, seed=11)  # B != 0: the first step's A gradients are not all zero
    samples = w.step_samples(3, n=7)
    mbs = build_micro_batches(samples, token_budget=w.BUDGET, bucket_size=w.BUCKET)
    assert len(mbs) >= 2
    logps = compute_logprobs(comp, mbs)
    loss = forward_backward(comp, mbs).result()["loss"]
    weights = _trainer_weights(comp)
    scale = float(next(iter(lora_layers(comp.model).values())).scaling[ADAPTER])
    assert scale == 8.0 / 4

    plain, leaves, params = _reference(weights, scale)
    p = params()
    refs = [_ref_logprobs(plain, p, s) for s in samples]
    n_tok = sum(m.sum() for _, m in refs)
    ref_loss = -sum((lp * m).sum() for lp, m in refs) / n_tok
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), (loss, ref_loss.item())
    for mb, lp in zip(mbs, logps):
        for k, i in enumerate(mb.sample_index):
            lo, hi = int(mb.row.cu_seqlens[k]), int(mb.row.cu_seqlens[k + 1])
            got = lp[lo + samples[i].prompt_length - 1: hi - 1].double()
            ref, m = refs[i]
            assert (got * m - ref.detach() * m).abs().max().item() <= 1e-5
    grads = {n: p.grad for n, p in comp.model.named_parameters() if p.grad is not None}
    assert set(grads) == set(leaves) and len(grads) == 2 * len(TARGETS) * 2  # A and B x 3 modules x 2 blocks
    for n, g in grads.items():
        assert _rel(_full(g), leaves[n].grad) <= 1e-4, n
    # The adapters off: the base model's log-probs (the KL reference of an RL run), no second copy.
    with adapters_disabled(comp.model):
        base = compute_logprobs(comp, mbs[:1])[0]
    plain_base = load_hf_model(tiny_model_config(), dtype=torch.float64)
    mb = mbs[0]
    i, k = mb.sample_index[0], 0
    lo, hi = int(mb.row.cu_seqlens[k]), int(mb.row.cu_seqlens[k + 1])
    ref, m = _ref_logprobs(plain_base, dict(plain_base.named_parameters()), samples[i])
    got = base[lo + samples[i].prompt_length - 1: hi - 1].double()
    assert (got * m - ref.detach() * m).abs().max().item() <= 1e-5
    assert (got * m - refs[i][0].detach() * m).abs().max().item() > 1e-3  # the adapters do change them
    comp.optimizer.zero_grad(set_to_none=True)


def test_only_adapters_train_and_hold_optimizer_state():
    comp = build_components(tiny_model_config(), w.lora_config())
    full = build_components(tiny_model_config(), w.config(compile=False))
    trainable = {n for n, p in comp.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    # The first forward is the base model's (B = 0), so both runs start with the same loss.
    (_, (lora_loss,)), (_, (full_loss,)) = (w.train_steps(c, TrainingState(), range(1)) for c in (comp, full))
    assert abs(lora_loss - full_loss) <= 1e-6 * abs(full_loss)

    def state_bytes(c) -> int:
        return sum(_full(t).numel() * t.element_size() for s in c.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    n_adapter = sum(p.numel() for n, p in comp.model.named_parameters() if is_adapter(n))
    n_all = sum(p.numel() for p in full.model.parameters())
    assert state_bytes(comp) == 2 * 4 * n_adapter  # exp_avg + exp_avg_sq, float32, adapters only
    assert state_bytes(full) == 2 * 4 * n_all
    assert state_bytes(comp) < 0.05 * state_bytes(full)
    base_before = {n: v for n, v in _trainer_weights(comp).items() if not is_adapter(n)}
    w.train_steps(comp, TrainingState(step=1), range(1, 3))
    after = _trainer_weights(comp)
    assert all(torch.equal(v, after[n]) for n, v in base_before.items())  # the base never moves


@pytest.mark.distributed
def test_two_gloo_ranks_match_one_process(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(WORKER), "lora", str(tmp_path / "l2.pt"), "2"], check=True, timeout=240,
                   env=env, cwd=ROOT)
    two = torch.load(tmp_path / "l2.pt")
    comp = build_components(tiny_model_config(), w.lora_config())
    w.randomize_adapters(comp)
    _, losses = w.train_steps(comp, TrainingState(), range(3))
    params = w.full_params(comp)
    merged = w.merged_weights(comp)
    assert losses[0] != losses[2]  # it trained
    for a, b in zip(losses, two["losses"]):
        assert abs(a - b) < 1e-5 * max(1.0, abs(a)), (losses, two["losses"])
    assert params.keys() == two["params"].keys()
    for k, v in params.items():
        assert (v - two["params"][k]).abs().max().item() < 1e-5, k
    # The sync's merge on FSDP shards (W and B row shards, A gathered) equals the one-process merge and the float64
    # W + (alpha / r) B @ A of the gathered parameters.
    assert merged.keys() == two["merged"].keys() and not any(is_adapter(k) or ".base_layer." in k for k in merged)
    adapted = [k for k in merged if f"lm.{k}" not in params]
    assert len(adapted) == len(TARGETS) * 2
    for k, v in merged.items():
        assert (v - two["merged"][k]).abs().max().item() < 1e-5, k
        if k in adapted:
            base = params["lm." + k.replace(".weight", ".base_layer.weight")]
            a = params["lm." + k.replace(".weight", f".lora_A.{ADAPTER}.weight")].double()
            b = params["lm." + k.replace(".weight", f".lora_B.{ADAPTER}.weight")].double()
            assert (v.double() - (base.double() + 2.0 * b @ a)).abs().max().item() < 1e-6, k


def _steps(comp, state: TrainingState, steps: range) -> tuple[TrainingState, list[tuple[float, float]]]:
    """w.train_steps, recording (loss, grad norm) of each step."""
    from trainer.backend.steps import optim_step

    out = []
    for step in steps:
        mbs = build_micro_batches(w.step_samples(step), token_budget=w.BUDGET, bucket_size=w.BUCKET)
        fut = forward_backward(comp, mbs)
        ofut, state = optim_step(comp, state, num_tokens=fut.num_tokens)
        out.append((fut.result()["loss"], ofut.result()["grad_norm"]))
    return state, out


def test_resume_is_exact_and_the_checkpoint_holds_only_adapters(tmp_path):
    import dataclasses

    from trainer.backend.safe_dcp import read_dcp_metadata

    cfg = w.lora_config().replace(output_dir=str(tmp_path / "run"))
    comp = build_components(tiny_model_config(), cfg)
    w.randomize_adapters(comp)
    state, _ = _steps(comp, TrainingState(), range(2))
    save_checkpoint(comp, state, {"next_step": state.step})
    state, expected = _steps(comp, state, range(2, 4))
    adapters_then = {n: v for n, v in _trainer_weights(comp).items() if is_adapter(n)}

    keys = set(read_dcp_metadata(tmp_path / "run" / "checkpoints" / "step_00000002" / ".metadata").state_dict_metadata)
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert len(model_keys) == 2 * len(TARGETS) * 2 and all(is_adapter(k) for k in model_keys), sorted(model_keys)
    assert not any(".base_layer." in k or "embed_tokens" in k for k in keys)  # no base tensor, no base moments

    fresh = build_components(tiny_model_config(), cfg)  # fresh adapters (B = 0), the same base
    state2, extra = load_checkpoint(fresh, tmp_path / "run")
    assert state2.step == 2 and extra == {"next_step": 2}
    state2, got = _steps(fresh, state2, range(2, 4))
    assert got == expected  # bit-exact losses and grad norms: the adapters and their AdamW moments came back
    for n, v in _trainer_weights(fresh).items():
        if is_adapter(n):
            assert torch.equal(v, adapters_then[n]), n

    # `python -m trainer export` of it needs the base its adapters sit on, which a LoRA phase records when it
    # starts (lora_base.json; this checkpoint was saved in Python): without it an error naming it, nothing written.
    from safetensors.torch import load_file

    from trainer.backend.checkpoint import export_hf
    from trainer.backend.export import export_checkpoint, record_lora_base

    load_hf_model(tiny_model_config(), seed=cfg.seed).save_pretrained(tmp_path / "base")
    with pytest.raises(FileNotFoundError, match=r"lora_base\.json"):
        export_checkpoint(tmp_path / "run", tmp_path / "base", tmp_path / "export")
    assert not (tmp_path / "export").exists()
    record_lora_base(tmp_path / "run", folder=tmp_path / "base")  # then: the merged model of the step-2 adapters
    export_checkpoint(tmp_path / "run", tmp_path / "base", tmp_path / "export")
    again = build_components(tiny_model_config(), cfg)
    load_checkpoint(again, tmp_path / "run")
    export_hf(again, tmp_path / "want")
    got, want = load_file(tmp_path / "export" / "model.safetensors"), load_file(tmp_path / "want" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.allclose(got[k], want[k], atol=1e-6) for k in got)

    # A LoRA checkpoint into a full run, and a full checkpoint into a LoRA run: named by the phase's LoRA table.
    full = build_components(tiny_model_config(), w.config(str(tmp_path / "run"), compile=False))
    with pytest.raises(CheckpointMismatch, match=r"holds LoRA adapters .*\[sft\.lora\]"):
        load_checkpoint(full, tmp_path / "run")
    save_checkpoint(dataclasses.replace(full, config=full.config.replace(output_dir=str(tmp_path / "full"))),
                    TrainingState(step=1))
    with pytest.raises(CheckpointMismatch, match=r"holds a full model .*\[sft\.lora\]"):
        load_checkpoint(fresh, tmp_path / "full")


def test_merged_weights_reach_the_engine():
    """A merged sync from a LoRA model (lora="merged", what a stock engine gets): the engine holds W + (alpha / r) B @ A
    under the plain names, a stock model."""
    from engines.embedded.presets import build_tiny_model
    from engines.local import LocalEngine
    from trainer.backend.lora import inject
    from trainer.weight_sync import WeightSyncSender, verify_sync

    seed, lora = 4, LoRAConfig(rank=3, alpha=6.0, target_modules="all-linear")
    trainer = build_tiny_model(seed)
    inject(trainer, lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            if is_adapter(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    weights = {n: p.detach().double() for n, p in trainer.named_parameters()}
    expected = {}
    for n, v in weights.items():
        if is_adapter(n):
            continue
        if n.endswith(".base_layer.weight"):
            path = n.removesuffix(".base_layer.weight")
            v = v + 2.0 * (weights[f"{path}.lora_B.{ADAPTER}.weight"] @ weights[f"{path}.lora_A.{ADAPTER}.weight"])
        expected[hf_name(n)] = v
    eng = LocalEngine("tiny", seed=seed)
    try:
        sender = WeightSyncSender(trainer, [eng], timeout_s=60, weight_version=0, lora="merged")
        sender.init_group()
        assert sender.sync() == 1
        held = dict(eng.server.model.named_parameters())
        assert set(held) == set(expected)
        for n, v in expected.items():
            assert (held[n].double() - v).abs().max().item() <= 1e-6, n
        changed = [n for n in expected if ".layers." in n and n.endswith("proj.weight")]
        assert changed and all((weights[n.replace(".weight", ".base_layer.weight")] - expected[n]).abs().max() > 1e-4
                               for n in changed)
        res = verify_sync(trainer, [eng], [[1, 20, 21, 22], [1, 7, 8, 9]], expected_version=1)
        assert res.ok and res.max_abs_diff[0] <= 1e-5, res
        sender.close()
    finally:
        eng.close()


def test_config_errors_name_the_key():
    for table, msg in [({"rank": 0}, r"\[rl\.lora\] rank: must be > 0"),
                       ({"alpha": -1.0}, r"\[rl\.lora\] alpha: must be > 0"),
                       ({"dropout": 1.0}, r"\[rl\.lora\] dropout: must be in \[0, 1\)"),
                       ({"target_modules": "q_proj"}, r"\[rl\.lora\] target_modules: expected \"all-linear\""),
                       ({"ranks": 4}, r"unknown config key\(s\) \['ranks'\] in \[rl\.lora\]")]:
        with pytest.raises(ConfigError, match=msg):
            config_from_dict(RunConfig, {"rl": {"lora": table}})
    cfg = config_from_dict(RunConfig, {"sft": {"lora": {"rank": 8, "target_modules": ["q_proj"]}}})
    assert cfg.sft.lora == LoRAConfig(rank=8, target_modules=("q_proj",)) and cfg.rl.lora is None
    # The run's saved config.toml writes the table back, and it reads again to the same config.
    import tomllib

    from trainer.config_reference import to_toml

    assert config_from_dict(RunConfig, tomllib.loads(to_toml(cfg)), "") == cfg
    # A module the model's blocks lack: named with the ones it has, before any work.
    from trainer.backend.models import check_lora_targets

    with pytest.raises(ValueError, match=r"\[rl\.lora\] target_modules: \['qkv'\] .* it has \['down_proj', "
                                         r"'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        check_lora_targets(tiny_model_config(), LoRAConfig(target_modules=["q_proj", "qkv"]), "rl.lora")
    with pytest.raises(ValueError, match="train_unembed"):
        check_lora_targets(tiny_model_config(), LoRAConfig(target_modules=["lm_head"]), "sft.lora")


def test_cli_refuses_a_missing_target_module_before_any_work(tmp_path, capsys):
    from trainer.cli import main

    out = tmp_path / "out"
    rc = main(["rl", "--config", "configs/demo.toml", "--set", f"output_dir={json.dumps(str(out))}", "--set",
               'rl.lora={rank = 4, target_modules = ["wq"]}'])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert "[rl.lora] target_modules: ['wq']" in err and "'q_proj'" in err, err
    assert not out.exists()


def even_token_reward(sample) -> float:
    """A reward with spread on a model that cannot do arithmetic yet: the share of even token ids it generated."""
    response = sample.tokens[len(sample.tokens) - sample.response_length:]
    return sum(t % 2 == 0 for t in response) / max(len(response), 1)


def test_sft_then_rl_with_lora_through_the_cli(tmp_path):
    """`python -m trainer sft+rl` with [rl.lora] on the demo config: RL trains adapters only, the in-process engine
    gets the merged weights at every step (its log-probs are the trainer's), and the loss moves."""
    from trainer.cli import load_run_config, run

    cfg = load_run_config("configs/demo.toml", [
        f"output_dir={json.dumps(str(tmp_path))}", "engines.in_process=true", "sft.num_steps=4", "rl.num_steps=3",
        "rl.rollout.rollout_batch_size=8", "rl.rollout.n_samples_per_prompt=4", "eval.limit=8",
        "rl.lora={rank = 8, alpha = 16.0}", "rl.optim.lr=1e-2", 'data.reward="test_lora:even_token_reward"',
        "rl.rollout.max_truncated_steps=0", "sft.lora={rank = 4}", "sft.optim.lr=1e-2", "rl.save_every=1",
        "rl.keep_last=3", "logging.rollouts_every=1"], mode="sft+rl")
    assert cfg.rl.lora == LoRAConfig(rank=8, alpha=16.0) and cfg.sft.lora == LoRAConfig(rank=4)
    summary = run("sft+rl", cfg)
    assert summary["rl_steps"] == 3
    sft_rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    sft_losses = [r["loss"] for r in sft_rows if "loss" in r]
    assert len(sft_losses) == 4 and sft_losses[-1] < sft_losses[0]  # SFT trained its adapters
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    # On-policy: the engine's log-probs equal the LoRA trainer's, so the adapters reached it every step: the
    # in-process engine takes them alone (adapter-only sync), so each step's sync sent the adapters' bytes.
    assert max(r["mismatch/logprob_abs_diff_max"] for r in rows) < 1e-4
    demo = load_hf_model(tiny_model_config("qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2))
    adapters = sum(8 * (m.in_features + m.out_features) * 4 for m in demo.model.layers.modules()
                   if isinstance(m, torch.nn.Linear))  # rank 8, float32, every Linear of the blocks
    assert [r["sync/bytes"] for r in rows] == [adapters] * 3
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in rows) and len({r["loss"] for r in rows}) == 3
    # RL's base is the SFT model with its adapters merged (fresh RL adapters, B = 0): the KL to it starts at 0.
    assert rows[0]["kl"] == 0 < rows[-1]["kl"]
    assert rows[-1]["reward_mean"] > rows[0]["reward_mean"]
    # RL trained adapters only: its checkpoint holds them and their AdamW state, no base tensor.
    from trainer.backend.checkpoint import latest_checkpoint
    from trainer.backend.safe_dcp import read_dcp_metadata

    keys = list(read_dcp_metadata(latest_checkpoint(tmp_path / "rl") / ".metadata").state_dict_metadata)
    tensors = [k for k in keys if not k.startswith("optim.param_groups.")]  # lr, betas, ...: numbers
    assert tensors and all(is_adapter(k) for k in tensors), [k for k in tensors if not is_adapter(k)][:5]
    # Replay (no engine) from the step-1 checkpoint: its adapters go back onto RL's base, the SFT model with SFT's
    # adapters merged, and steps 2 and 3 give the logged loss and gradient norm (on the start model's weights they
    # would not: the adapters alone are in the checkpoint).
    from trainer.cli import debug_mode

    logged = {r["step"]: r for r in rows}
    step1 = str(tmp_path / "rl" / "checkpoints" / "step_00000001")
    assert debug_mode("replay", cfg, rollouts=None, checkpoint=step1) == 0
    replayed = [json.loads(line) for line in (tmp_path / "replay" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in replayed] == [2, 3]
    for r in replayed:
        assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-5, abs=1e-8)
        assert r["grad_norm"] == pytest.approx(logged[r["step"]]["grad_norm"], rel=1e-5)


def test_train_unembed_trains_the_lm_head_and_export_writes_the_merged_model(tmp_path):
    """train_unembed: the lm_head weight itself trains (the fused kernels read it as is), its AdamW state is kept;
    `export_hf` of a LoRA run writes the merged model, which stock transformers loads with the trainer's logits."""
    from transformers import AutoModelForCausalLM

    from trainer.backend.checkpoint import export_hf
    from trainer.config import LoRAConfig as Lora

    cfg = w.config(compile=False).replace(lora=Lora(rank=4, alpha=4.0, train_unembed=True))
    comp = build_components(tiny_model_config(), cfg)
    trainable = sorted(n for n, p in comp.model.named_parameters() if p.requires_grad)
    assert "lm_head.weight" in trainable and all(is_adapter(n) or n == "lm_head.weight" for n in trainable)
    head_before = _full(comp.model.lm_head.weight.detach()).clone()
    w.randomize_adapters(comp)
    w.train_steps(comp, TrainingState(), range(2))
    assert (_full(comp.model.lm_head.weight.detach()) - head_before).abs().max() > 1e-4
    # The reference of an RL run with train_unembed is a copy (the lm_head moves): not the policy itself.
    from trainer.rl import _reference_components

    assert _reference_components(comp, cfg) is not comp

    out = export_hf(comp, tmp_path / "export")
    stock = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    ids = torch.tensor([[1, 20, 21, 22, 40, 41, 7]])
    with torch.no_grad():
        want = stock(input_ids=ids).logits
        got = comp.root(lambda lm: lm(input_ids=ids).logits)
    assert (got - want).abs().max().item() <= 1e-5


def test_a_value_head_trains_beside_the_adapters():
    """PPO with [rl.critic] kind = "head" and [rl.lora]: the fresh value head and the adapters train through the
    policy's loss, the base stays frozen, and the weights the engines get carry no value head."""
    import dataclasses

    from trainer.backend.steps import trainer_config_from
    from trainer.config import OptimConfig, RLTrainingConfig, RolloutConfig
    from trainer.rl import _reference_components, local_backend, train_on_batch
    from trainer.types import RolloutBatch
    from trainer.weight_sync.common import named_weights

    rl = RLTrainingConfig(advantage_estimator="gae", optim=OptimConfig(lr=3e-3), token_budget=w.BUDGET,
                          micro_batch_buckets=w.BUCKET, loss={"loss_agg": "token-mean", "kl_coef": 0.01},
                          rollout=RolloutConfig(apply_chat_template=False, max_new_tokens=64),
                          critic={"kind": "head"}, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    tcfg = trainer_config_from(rl, compile=False)
    comp = build_components(tiny_model_config(), tcfg)
    trainable = {n for n, p in comp.model.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert all(is_adapter(n) or n.startswith("value_head.") for n in trainable)
    ref = _reference_components(comp, tcfg)
    assert ref is comp  # no second copy of the model
    before = _trainer_weights(comp)
    state, metrics = TrainingState(), []
    for step in range(2):
        samples = [dataclasses.replace(s, reward=float((i * 7 + step) % 5) / 4)
                   for i, s in enumerate(w.step_samples(step, 12))]
        m, state = train_on_batch(local_backend(comp, rl, tcfg, pad_id=0, ref=ref), state, RolloutBatch(samples), rl)
        metrics.append(m)
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["critic/value_loss"]) for m in metrics)
    assert metrics[1]["kl"] > 0  # the reference is the frozen base (adapters off), the policy moved off it
    after = _trainer_weights(comp)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved == trainable  # every adapter (B left 0 after step 1) and the value head; no base tensor
    assert not any(n.startswith("value_head") for n, _ in named_weights(comp.model))


@pytest.mark.parametrize("train_unembed", [False, True])
def test_peft_adapter_folder_round_trip(tmp_path, train_unembed):
    """export_adapter writes a PEFT folder that PeftModel.from_pretrained loads on the stock base unchanged, giving
    the trainer's logits (float32, 1e-5); with train_unembed the trained lm_head goes in as modules_to_save."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.backend.export import export_adapter

    cfg = w.config(compile=False).replace(lora=LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear",
                                                          train_unembed=train_unembed))
    comp = build_components(tiny_model_config(), cfg)
    w.randomize_adapters(comp)
    w.train_steps(comp, TrainingState(), range(1))  # the lm_head moves too with train_unembed
    base = tmp_path / "base"
    load_hf_model(tiny_model_config(), seed=cfg.seed).save_pretrained(base)  # the weights the adapters sit on
    out = export_adapter(comp, tmp_path / "adapter", base=str(base))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and config["r"] == 4 and config["peft_type"] == "LORA"
    stock = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(stock, out).eval()
    ids = torch.tensor([[1, 20, 21, 22, 40, 41, 7, 90]])
    with torch.no_grad():
        want = comp.root(lambda lm: lm(input_ids=ids).logits)
        got = peft_model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)(input_ids=ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (plain - want).abs().max().item() > 1e-3  # the adapters (and the head) are in the folder
