"""[trainer] attention: the packed training attention by name (trainer.backend.attention.choose_attn_implementation).

- Every implementation with a packed path that trains on the CPU trains the same step: packed_sdpa (the CPU default)
  and a dense mask through sdpa or eager; plain packed rows and the shared-prompt trees alike, the loss and every
  gradient equal to the default's (fp32, 1e-5 relative). (FlexAttention has no CPU backward in torch: its packed
  layouts are proven forward-only in tests/test_packed_attention.py and tests/test_flex_tree_tiles.py, its training
  by the `gpu` tests.)
- "auto" keeps the per-device choice; flash-attn or FlexAttention asked for where they cannot train, or a name
  without a packed path, is an error naming the fix, before any model is built.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_local_backend import _samples  # three groups of four: shared prompts, masks, engine log-probs

import trainer.backend.attention as attention
from engines.tiny import tiny_model_config
from kernels import use_backend
from trainer.backend.attention import (
    PACKED_SDPA,
    choose_attn_implementation,
    flash_attn_available,
    native_gqa,
    sdpa_gqa,
)
from trainer.backend.steps import build_components, forward_backward, trainer_config_from
from trainer.batching.micro_batches import build_micro_batches
from trainer.batching.shared_prompt import build_shared_micro_batches
from trainer.config import BackendConfig, OptimConfig, RLTrainingConfig, RolloutConfig

IMPLEMENTATIONS = (PACKED_SDPA, "sdpa", "eager")


def _step(attention: str, share: bool, **backend) -> tuple[dict, dict[str, torch.Tensor], str]:
    """One forward_backward of the same micro-batches: (metrics, gradients by name, the model's implementation);
    `backend`: other [trainer] settings."""
    cfg = RLTrainingConfig(optim=OptimConfig(lr=1e-2), token_budget=32, micro_batch_buckets=8,
                           loss={"loss_agg": "seq-mean-token-mean", "rollout_correction": "tis"},
                           rollout=RolloutConfig(apply_chat_template=False, max_new_tokens=16))
    tcfg = trainer_config_from(cfg, compile=False, share_prompts=share, attention=attention, **backend)
    samples = _samples(3)
    advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(4)).tolist()
    comp = build_components(tiny_model_config("llama"), tcfg)
    build = build_shared_micro_batches if share else build_micro_batches
    mbs = build(samples, token_budget=32, bucket_size=8, advantages=advantages, pad_id=0)
    assert len(mbs) > 1 and all((mb.trees is not None) == share for mb in mbs)
    metrics = forward_backward(comp, mbs, tcfg).result()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu().clone()
             for n, p in comp.model.named_parameters() if p.grad is not None}
    return metrics, grads, comp.model.config._attn_implementation


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared_prompts"])
def test_every_packed_implementation_trains_the_same_step(share):
    with use_backend("torch"):
        runs = {impl: _step(impl, share) for impl in ("auto", *IMPLEMENTATIONS)}
    assert runs["auto"][2] == PACKED_SDPA  # the CPU's choice
    want_metrics, want_grads, _ = runs[PACKED_SDPA]
    assert len(want_grads) > 10
    for impl in IMPLEMENTATIONS:
        metrics, grads, used = runs[impl]
        assert used == impl
        assert metrics.keys() == want_metrics.keys()
        assert abs(metrics["loss"] - want_metrics["loss"]) <= 1e-5 * max(1.0, abs(want_metrics["loss"])), impl
        assert grads.keys() == want_grads.keys()
        for name, g in grads.items():
            ref = want_grads[name]
            assert (g - ref).norm() <= 1e-5 * max(ref.norm(), 1e-6), (impl, name, (g - ref).norm(), ref.norm())


@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared_prompts"])
def test_packed_sdpa_repeats_the_kv_heads_where_sdpa_would_not_fuse_gqa(share, monkeypatch):
    """Where SDPA has no fused grouped-query kernel (CUDA with a mask, or float32: enable_gqa falls back to the math
    kernel's O(L^2) float32 scores), packed_sdpa repeats each KV head for its query heads instead: the same step
    (loss and every gradient to 1e-6 relative) as the CPU's native GQA, every SDPA call then with as many KV heads
    as query heads and enable_gqa off. The CPU stands in for CUDA by answering native_gqa as CUDA would with a mask
    (trees pass their block mask; plain rows are causal, no mask: float32 here, also not fused on CUDA)."""
    with use_backend("torch"):
        native = _step(PACKED_SDPA, share)
        calls = []
        sdpa = F.scaled_dot_product_attention

        def recorded(q, k, v, *args, enable_gqa=False, **kwargs):
            calls.append((q.shape[1], k.shape[1], enable_gqa))
            return sdpa(q, k, v, *args, enable_gqa=enable_gqa, **kwargs)

        monkeypatch.setattr(attention, "native_gqa", lambda *a: False)
        monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
        repeated = _step(PACKED_SDPA, share)
    assert calls and all(h == hkv == 4 and not gqa for h, hkv, gqa in calls), calls[:4]
    assert abs(repeated[0]["loss"] - native[0]["loss"]) <= 1e-6 * max(1.0, abs(native[0]["loss"]))
    for name, g in repeated[1].items():
        ref = native[1][name]
        assert (g - ref).norm() <= 1e-6 * max(ref.norm(), 1e-6), (name, (g - ref).norm(), ref.norm())


def test_native_gqa_is_asked_only_of_fused_kernels(monkeypatch):
    """native_gqa: the CPU's kernels always; CUDA's flash kernel only in half precision, unmasked, head dim <= 256."""

    assert native_gqa("cpu", torch.float32, True, 64) and native_gqa("cpu", torch.bfloat16, False, 512)
    assert native_gqa("cuda", torch.bfloat16, False, 128) and native_gqa("cuda", torch.float16, False, 256)
    assert not native_gqa("cuda", torch.bfloat16, True, 128)  # a mask: the math kernel
    assert not native_gqa("cuda", torch.float32, False, 64)  # no flash kernel in float32
    assert not native_gqa("cuda", torch.bfloat16, False, 512)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 5, 8, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    assert sdpa_gqa(q, k, v, None)[2] is True and sdpa_gqa(q, q, q, None)[2] is False
    mask = torch.rand(5, 5, generator=g) < 0.6
    mask.fill_diagonal_(True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    # as CUDA would answer with a mask: the KV heads repeated in transformers' order (query head h reads KV head
    # h // 3), the same attention
    monkeypatch.setattr(attention, "native_gqa", lambda *a: False)
    k2, v2, gqa = sdpa_gqa(q, k, v, mask)
    assert not gqa and k2.shape == v2.shape == (2, 6, 5, 8)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask), want, atol=1e-12, rtol=0)


def test_names_that_cannot_train_here_are_errors_naming_the_fix():
    with pytest.raises(ValueError, match=r"attention: expected one of auto, packed_sdpa, .*got 'flash'"):
        BackendConfig(attention="flash")
    assert choose_attn_implementation("cpu", torch.float32, "auto")[0] == PACKED_SDPA
    assert choose_attn_implementation("cuda", torch.float32, "flex_attention") == ("flex_attention",
                                                                                   "[trainer] attention")
    with pytest.raises(ValueError, match="no FlexAttention backward on the CPU"):
        choose_attn_implementation("cpu", torch.float32, "flex_attention")
    want = "is not installed" if not flash_attn_available() else "runs on CUDA only"
    with pytest.raises(ValueError, match=rf"attention = 'flash_attention_2': flash-attn {want}.*attention = \"auto\""):
        choose_attn_implementation("cpu", torch.bfloat16, "flash_attention_2")
    with pytest.raises(ValueError, match="flash_attention_2"):  # before any model exists: at build time
        build_components(tiny_model_config("llama"),
                         trainer_config_from(RLTrainingConfig(), compile=False, attention="flash_attention_2"))


@pytest.mark.gpu
def test_packed_sdpa_on_cuda_never_needs_sdpas_math_kernel():
    """On CUDA, with SDPA's math kernel ruled out (only flash and memory-efficient allowed: SDPA raises when neither
    takes a call), packed_sdpa trains a step in float32 and in bf16, plain and shared-prompt layouts: native_gqa sends
    enable_gqa only where a fused kernel takes it, and repeats the KV heads elsewhere."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert torch.cuda.is_available()
    for dtype in ("float32", "bfloat16"):
        for share in (False, True):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                metrics, grads, used = _step(PACKED_SDPA, share, param_dtype=dtype)
            assert used == PACKED_SDPA and torch.isfinite(torch.tensor(metrics["loss"]))
            assert all(bool(torch.isfinite(g).all()) for g in grads.values()), (dtype, share)


@pytest.mark.gpu
def test_packed_sdpa_trains_flex_attentions_step_on_cuda():
    """On CUDA ([trainer] attention = "packed_sdpa": torch's own SDPA kernels, no FlexAttention compile) the step
    equals FlexAttention's (the CUDA default without flash-attn), fp32, plain and shared-prompt layouts."""
    assert torch.cuda.is_available()
    for share in (False, True):
        runs = {impl: _step(impl, share, param_dtype="float32") for impl in (PACKED_SDPA, "flex_attention")}
        (m_a, g_a, used_a), (m_b, g_b, used_b) = runs[PACKED_SDPA], runs["flex_attention"]
        assert (used_a, used_b) == (PACKED_SDPA, "flex_attention")
        assert abs(m_a["loss"] - m_b["loss"]) <= 1e-4 * max(1.0, abs(m_b["loss"]))
        for name, g in g_a.items():
            ref = g_b[name]
            assert (g - ref).norm() <= 1e-3 * max(ref.norm(), 1e-6), (share, name)
