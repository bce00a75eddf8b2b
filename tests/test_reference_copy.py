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
