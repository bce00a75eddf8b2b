"""A LoRA run's frozen base is stored in the compute dtype (trainer.backend.models._frozen_in_compute_dtype): half
the bytes in bf16, the same losses and adapter updates bit for bit as fp32 masters under mixed precision."""

import numpy as np
import pytest
import torch

import trainer.backend.models as models
from engines.tiny import tiny_model_config
from trainer.backend.lora import is_adapter
from trainer.backend.steps import build_components, forward_backward, optim_step, trainer_config_from
from trainer.batching.micro_batches import build_micro_batches
from trainer.config import BackendConfig, LoRAConfig, OptimConfig, RLTrainingConfig
from trainer.types import Sample, TrainingState


def _steps(param_dtype: str, lora: LoRAConfig, n: int = 2):
    """(components, losses, adapter tensors after n steps) on fixed random samples."""
    torch.manual_seed(0)
    rl = RLTrainingConfig(token_budget=256, micro_batch_buckets=64, optim=OptimConfig(lr=1e-2, warmup_steps=0),
                          lora=lora)
    comp = build_components(tiny_model_config("qwen2"), trainer_config_from(rl, BackendConfig(compile=False,
                                                                                             param_dtype=param_dtype)))
    rng = np.random.default_rng(1)
    samples = [Sample(prompt="", tokens=rng.integers(3, 200, int(rng.integers(6, 20))).tolist(), response_length=4)
               for _ in range(6)]
    mbs = build_micro_batches(samples, token_budget=256, bucket_size=64, advantages=rng.standard_normal(6).tolist())
    state, losses = TrainingState(), []
    for _ in range(n):
        fut = forward_backward(comp, mbs)
        ofut, state = optim_step(comp, state, num_tokens=fut.num_tokens)
        losses.append(fut.result()["loss"])
        ofut.result()
    adapters = {k: v.full_tensor().clone() for k, v in comp.model.state_dict().items() if is_adapter(k)}
    return comp, losses, adapters


@pytest.mark.parametrize("train_unembed", [False, True])
def test_frozen_base_in_bf16_trains_the_same_adapters_as_fp32_masters(monkeypatch, train_unembed):
    lora = LoRAConfig(rank=4, alpha=8.0, train_unembed=train_unembed)
    comp, losses, adapters = _steps("bfloat16", lora)
    for name, p in comp.model.named_parameters():
        want = torch.float32 if p.requires_grad else torch.bfloat16
        assert p.dtype == want, f"{name}: {p.dtype}, expected {want}"
    assert any(not p.requires_grad for p in comp.model.parameters())
    assert comp.model.get_output_embeddings().weight.dtype == (torch.float32 if train_unembed else torch.bfloat16)

    monkeypatch.setattr(models, "_frozen_in_compute_dtype", lambda model, dtype: None)  # fp32 masters everywhere
    ref_comp, ref_losses, ref_adapters = _steps("bfloat16", lora)
    assert {p.dtype for p in ref_comp.model.parameters()} == {torch.float32}
    assert losses == ref_losses  # (an on-policy GRPO loss is -mean(A) whatever the weights: compare the updates)
    assert adapters.keys() == ref_adapters.keys() and adapters
    assert any("lora_B" in k and adapters[k].abs().max() > 0 for k in adapters)  # B moved off its zero start
    for k in adapters:
        assert torch.equal(adapters[k], ref_adapters[k]), k


def test_fp32_compute_keeps_the_base_in_fp32():
    comp, _, _ = _steps("float32", LoRAConfig(rank=4), n=1)
    assert {p.dtype for p in comp.model.parameters()} == {torch.float32}
