"""The KL reference of a full run: a frozen copy of the policy in the compute dtype (trainer.backend.steps.frozen_copy).

Under FSDP2 mixed precision the policy's blocks compute with its fp32 masters cast to the compute dtype, so a copy
stored in that dtype gives the same log-probs bit for bit, at half the bytes in bf16 (issue 42: 30 GB for a 7B)."""

import numpy as np
import pytest
import torch

from engines.tiny import tiny_model_config
from trainer.backend.steps import (
    build_components,
    compute_logprobs,
    forward_backward,
    frozen_copy,
    optim_step,
    trainer_config_from,
)
from trainer.batching.micro_batches import build_micro_batches
from trainer.config import BackendConfig, OptimConfig, RLTrainingConfig
from trainer.types import Sample, TrainingState


def _samples(vocab: int, seed: int) -> tuple[list[Sample], list[float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(6):
        p, r = int(rng.integers(3, 12)), int(rng.integers(2, 10))
        out.append(Sample(prompt="", tokens=rng.integers(3, vocab, p + r).tolist(), response_length=r))
    return out, rng.standard_normal(6).tolist()


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_reference_is_a_frozen_compute_dtype_copy_with_the_same_logprobs(param_dtype):
    torch.manual_seed(0)
    rl = RLTrainingConfig(token_budget=256, micro_batch_buckets=64, optim=OptimConfig(lr=1e-2))
    tcfg = trainer_config_from(rl, BackendConfig(compile=False, param_dtype=param_dtype))
    policy = build_components(tiny_model_config("qwen2"), tcfg)
    samples, adv = _samples(policy.model.config.vocab_size, seed=1)
    mbs = build_micro_batches(samples, token_budget=256, bucket_size=64, advantages=adv)
    before = compute_logprobs(policy, mbs)

    ref = frozen_copy(policy, tcfg)
    dtype = getattr(torch, param_dtype)
    assert {p.dtype for p in ref.root.parameters()} == {dtype}
    assert {p.dtype for p in policy.root.parameters()} == {torch.float32}  # the masters stay fp32
    assert not any(p.requires_grad for p in ref.root.parameters()) and ref.optimizer is None
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.root.parameters())
    pol_bytes = sum(p.numel() * p.element_size() for p in policy.root.parameters())
    assert ref_bytes * (4 // dtype.itemsize) == pol_bytes
    for a, b in zip(compute_logprobs(ref, mbs), before, strict=True):
        assert torch.equal(a, b)  # bit for bit: the policy's blocks already computed in `dtype`

    fut = forward_backward(policy, mbs)
    optim_step(policy, TrainingState(), num_tokens=fut.num_tokens)[0].result()
    after = compute_logprobs(policy, mbs)
    assert max((a - b).abs().max().item() for a, b in zip(after, before, strict=True)) > 1e-4  # the policy moved
    for a, b in zip(compute_logprobs(ref, mbs), before, strict=True):
        assert torch.equal(a, b)  # the reference did not


def test_copies_in_memory_never_build_the_model_in_full_on_the_host(monkeypatch):
    """The KL reference, a critic from the policy and a LoRA phase after a full one are copies of a model in memory
    (load_hf_model(trunk=False), issue 42 item 10): none builds and random-initialises the whole model on the host
    first (30 GB and minutes for a 7B, on every rank). Each still holds the source's weights, and starts fresh only
    what it adds: the critic's value head and the LoRA adapters, as a fresh build would draw them."""
    import trainer.backend.models as models
    from trainer.backend.lora import adapter_init, hf_name, is_adapter
    from trainer.backend.models import value_head_init

    rl = RLTrainingConfig(token_budget=256, micro_batch_buckets=64, optim=OptimConfig(lr=1e-2))
    tcfg = trainer_config_from(rl, BackendConfig(compile=False))
    policy = build_components(tiny_model_config("qwen2"), tcfg)

    def full(model) -> dict[str, torch.Tensor]:  # every tensor whole (FSDP2 holds DTensor shards)
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()}

    source = full(policy.model)

    def full_build(*args, **kwargs):
        raise AssertionError("a copy in memory built the whole model on the host")

    monkeypatch.setattr(models, "_full_state_dict", full_build)
    reference = frozen_copy(policy, tcfg)
    for k, v in full(reference.model).items():
        assert torch.equal(v, source[k].to(v.dtype)), k

    critic_cfg = trainer_config_from(RLTrainingConfig(advantage_estimator="gae", token_budget=256,
                                                      micro_batch_buckets=64), BackendConfig(compile=False))
    critic = build_components(policy.root, critic_cfg.for_critic())
    state = full(critic.model)
    head = value_head_init(policy.model.config, critic_cfg.seed, torch.float32)
    assert head and all(torch.equal(state[k], v) for k, v in head.items())
    for k, v in source.items():
        assert torch.equal(state[k], v), k

    lora_cfg = trainer_config_from(RLTrainingConfig(token_budget=256, micro_batch_buckets=64, lora={"rank": 4}),
                                   BackendConfig(compile=False))
    adapted = build_components(policy.root, lora_cfg)
    state = full(adapted.model)
    fresh = adapter_init(adapted.model, lora_cfg.seed)
    assert fresh and all(torch.equal(state[k], v) for k, v in fresh.items())
    for k, v in state.items():
        if not is_adapter(k):
            assert torch.equal(v, source[hf_name(k)]), k
