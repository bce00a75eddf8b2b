"""token_logprobs / linear_token_logprobs against the float64 reference, both paths (torch and Triton).

The Triton path runs through the interpreter on CPU (conftest sets TRITON_INTERPRET=1), so sizes stay small;
the large vocabularies (50257, 151936) get a couple of rows each.
"""

from __future__ import annotations

import pytest
import torch
from triton_compile import compile_in_subprocess

import kernels.linear_logprobs as linear_mod
from kernels import linear_token_logprobs, token_logprobs, use_backend
from kernels.reference import linear_token_logprobs_ref, token_logprobs_ref

F64 = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(shape, V, dtype, gen, p_mask=0.3, p_ignore=0.1):
    """Random logits [*shape, V] (scale ~3, so softmaxes are neither flat nor one-hot), labels, a mask."""
    logits = (torch.randn(*shape, V, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, V, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < p_ignore] = -100
    mask = torch.rand(shape, generator=gen) >= p_mask
    return logits, labels, mask


def _grad_tol(dtype):
    return 1e-4 if dtype == torch.float32 else 1e-2


CASES = [
    # (leading shape, V, dtype, temperature, return_entropy)
    ((37,), 7, torch.float32, 1.0, True),
    ((37,), 1271, torch.float32, 0.7, True),
    ((3, 11), 1271, torch.bfloat16, 1.3, True),
    ((2, 3, 5), 1271, torch.float32, 1.0, False),
    ((2, 9), 7, torch.bfloat16, 0.6, False),
    ((5,), 1271, torch.float16, 0.9, True),
    ((4,), 50257, torch.float32, 0.9, True),
    ((2,), 151936, torch.bfloat16, 1.0, True),
]


@pytest.mark.parametrize("shape,V,dtype,temperature,with_ent", CASES)
def test_token_logprobs_matches_float64_reference(backend, shape, V, dtype, temperature, with_ent):
    gen = torch.Generator().manual_seed(hash((shape, V, str(dtype), backend)) % 2**31)
    logits, labels, mask = _inputs(shape, V, dtype, gen)
    x = logits.clone().requires_grad_(True)
    out = token_logprobs(x, labels, temperature=temperature, mask=mask, return_entropy=with_ent)
    # The reference sees the same (possibly bf16) values, upcast to float64.
    xr = logits.to(F64).requires_grad_(True)
    ref = token_logprobs_ref(xr, labels, temperature=temperature, mask=mask, return_entropy=with_ent, dtype=F64)
    outs, refs = (out, ref) if with_ent else ((out,), (ref,))
    for o, r in zip(outs, refs):
        assert o.dtype == torch.float32 and o.shape == labels.shape
        torch.testing.assert_close(o.double(), r, atol=1e-5, rtol=0)
    # Masked and ignored positions are exactly 0.
    dropped = ~mask | (labels == -100)
    assert (outs[0][dropped] == 0).all()
    grads = [torch.randn(shape, generator=gen, dtype=F64) for _ in outs]
    sum(((o.double() * g).sum() for o, g in zip(outs, grads))).backward()
    sum(((r * g).sum() for r, g in zip(refs, grads))).backward()
    assert x.grad.dtype == dtype
    assert _rel(x.grad, xr.grad) < _grad_tol(dtype)
    assert (x.grad[dropped] == 0).all()


def test_token_logprobs_inplace_backward_overwrites_logits(backend):
    gen = torch.Generator().manual_seed(7)
    logits, labels, mask = _inputs((19,), 1271, torch.float32, gen)
    g1, g2 = torch.randn(19, generator=gen), torch.randn(19, generator=gen)
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_(True)
        lp, ent = token_logprobs(x, labels, mask=mask, temperature=0.8, return_entropy=True, inplace_backward=inplace)
        (lp * g1 + ent * g2).sum().backward()
        grads.append(x.grad.clone())
        if inplace:
            # The buffer itself now holds the gradient: no [T, V] allocation in the backward.
            assert torch.equal(x.detach(), x.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-6)


def test_token_logprobs_gradient_through_entropy_only(backend):
    gen = torch.Generator().manual_seed(11)
    logits, labels, mask = _inputs((13,), 1271, torch.float32, gen)
    x = logits.clone().requires_grad_(True)
    _, ent = token_logprobs(x, labels, mask=mask, return_entropy=True)
    g = torch.randn(13, generator=gen)
    (ent * g).sum().backward()
    xr = logits.to(F64).requires_grad_(True)
    _, ent_r = token_logprobs_ref(xr, labels, mask=mask, return_entropy=True, dtype=F64)
    (ent_r * g.double()).sum().backward()
    assert _rel(x.grad, xr.grad) < 1e-4


def test_token_logprobs_both_paths_agree_on_extreme_logits():
    # Large offsets, a wide spread and -inf entries (a banned token): the online max must keep everything
    # finite and precise (a naive exp or z_label - lse in fp32 would lose digits here).
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 1271, generator=gen) * 30 + 300
    logits[:, 5] = float("-inf")
    labels = torch.randint(6, 1271, (9,), generator=gen)
    ref = token_logprobs_ref(logits.to(F64), labels, return_entropy=True, dtype=F64)
    for be in ("torch", "triton"):
        with use_backend(be):
            lp, ent = token_logprobs(logits, labels, return_entropy=True)
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
        torch.testing.assert_close(lp.double(), ref[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), ref[1], atol=1e-5, rtol=0)
        # Backward: finite, exactly 0 on the banned column, equal to the reference where -inf is replaced
        # by a finite value whose probability is 0 in float64 (the reference's own gradient is NaN there).
        x = logits.clone().requires_grad_(True)
        g1, g2 = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
        with use_backend(be):
            lp, ent = token_logprobs(x, labels, return_entropy=True)
        (lp * g1 + ent * g2).sum().backward()
        xr = logits.to(F64).nan_to_num(neginf=-1e5).requires_grad_(True)
        lpr, entr = token_logprobs_ref(xr, labels, return_entropy=True, dtype=F64)
        (lpr * g1.double() + entr * g2.double()).sum().backward()
        assert torch.isfinite(x.grad).all() and (x.grad[:, 5] == 0).all()
        assert _rel(x.grad, xr.grad) < 1e-4


# ---------------------------------------------------------------------------------------------------------
# linear_token_logprobs
# ---------------------------------------------------------------------------------------------------------


def _linear_inputs(T, H, V, dtype, gen):
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * H**-0.5 * 3).to(dtype)
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[torch.rand(T, generator=gen) < 0.1] = -100
    mask = torch.rand(T, generator=gen) >= 0.3
    return hidden, weight, labels, mask


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(None, None), (7, 500)])
def test_linear_equals_token_logprobs_on_materialised_logits(backend, monkeypatch, chunk_tokens, chunk_vocab):
    if chunk_vocab is not None:
        # Several vocabulary slices on CPU, whatever the thread count.
        monkeypatch.setattr(linear_mod, "_CPU_CHUNK_VOCAB", chunk_vocab)
        monkeypatch.setattr(linear_mod, "_CPU_CHUNK_VOCAB_MT", chunk_vocab)
    gen = torch.Generator().manual_seed(21 + (chunk_tokens or 0))
    T, H, V = 45, 32, 1271
    hidden, weight, labels, mask = _linear_inputs(T, H, V, torch.float32, gen)
    g1, g2 = torch.randn(T, generator=gen), torch.randn(T, generator=gen)

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = linear_token_logprobs(
        h, w, labels, temperature=0.8, mask=mask, return_entropy=True, chunk_tokens=chunk_tokens
    )
    (lp * g1 + ent * g2).sum().backward()

    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp2, ent2 = token_logprobs(h2 @ w2.t(), labels, temperature=0.8, mask=mask, return_entropy=True)
    (lp2 * g1 + ent2 * g2).sum().backward()

    torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent2, atol=1e-5, rtol=0)
    assert _rel(h.grad, h2.grad) < 1e-4 and _rel(w.grad, w2.grad) < 1e-4
    dropped = ~mask | (labels == -100)
    assert (lp[dropped] == 0).all() and (h.grad[dropped] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_token_logprobs_matches_float64_reference(backend, dtype):
    gen = torch.Generator().manual_seed(5 if dtype == torch.float32 else 6)
    T, H, V = 33, 48, 1271
    hidden, weight, labels, mask = _linear_inputs(T, H, V, dtype, gen)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = linear_token_logprobs(h, w, labels, temperature=1.2, mask=mask, return_entropy=True, chunk_tokens=8)
    g1, g2 = torch.randn(T, generator=gen, dtype=F64), torch.randn(T, generator=gen, dtype=F64)
    ((lp.double() * g1) + (ent.double() * g2)).sum().backward()

    hr, wr = hidden.to(F64).requires_grad_(True), weight.to(F64).requires_grad_(True)
    if backend == "triton" and dtype != torch.float32:
        # The Triton path runs the lm_head GEMM in the input dtype (as cuBLAS does): the reference sees the
        # same bf16-rounded logits, upcast.
        logits = (hidden @ weight.t()).to(F64)
        logits.requires_grad_(True)
        lpr, entr = token_logprobs_ref(logits, labels, temperature=1.2, mask=mask, return_entropy=True, dtype=F64)
        ((lpr * g1) + (entr * g2)).sum().backward()
        ref_dh, ref_dw = logits.grad @ weight.to(F64), logits.grad.t() @ hidden.to(F64)
    else:
        # The torch path computes the GEMM in fp32 from the (upcast) inputs.
        lpr, entr = linear_token_logprobs_ref(
            hr, wr, labels, temperature=1.2, mask=mask, return_entropy=True, dtype=F64
        )
        ((lpr * g1) + (entr * g2)).sum().backward()
        ref_dh, ref_dw = hr.grad, wr.grad
    torch.testing.assert_close(lp.double(), lpr, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), entr, atol=1e-5, rtol=0)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    assert _rel(h.grad, ref_dh) < _grad_tol(dtype)
    assert _rel(w.grad, ref_dw) < _grad_tol(dtype)


def test_linear_token_logprobs_all_masked_gives_zeros_and_zero_grads(backend):
    gen = torch.Generator().manual_seed(9)
    hidden, weight, labels, _ = _linear_inputs(6, 8, 97, torch.float32, gen)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp = linear_token_logprobs(h, w, labels, mask=torch.zeros(6, dtype=torch.bool))
    (lp * torch.randn(6, generator=gen)).sum().backward()
    assert (lp == 0).all() and (h.grad == 0).all() and (w.grad == 0).all()


def test_linear_token_logprobs_frozen_weight(backend):
    # A frozen lm_head (LoRA): no weight gradient is computed, the hidden gradient still matches.
    gen = torch.Generator().manual_seed(13)
    hidden, weight, labels, mask = _linear_inputs(17, 16, 211, torch.float32, gen)
    h = hidden.clone().requires_grad_(True)
    lp = linear_token_logprobs(h, weight, labels, mask=mask, chunk_tokens=5)
    g = torch.randn(17, generator=gen)
    (lp * g).sum().backward()
    hr = hidden.to(F64).requires_grad_(True)
    (linear_token_logprobs_ref(hr, weight.to(F64), labels, mask=mask, dtype=F64) * g.double()).sum().backward()
    assert weight.grad is None
    assert _rel(h.grad, hr.grad) < 1e-4


# ---------------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument, never a wrong answer or an out-of-bounds read
# ---------------------------------------------------------------------------------------------------------


def test_token_logprobs_bad_input():
    x = torch.randn(4, 10)
    lab = torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="int64"):
        token_logprobs(x, lab.int())
    with pytest.raises(ValueError, match="labels shape"):
        token_logprobs(x, lab[:3])
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        token_logprobs(x.long(), lab)
    with pytest.raises(ValueError, match="outside"):
        token_logprobs(x, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="outside"):
        token_logprobs(x, torch.tensor([0, -5, 1, 2]))
    with pytest.raises(ValueError, match="non-empty"):
        token_logprobs(torch.randn(0, 10), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        token_logprobs(torch.randn(10, 4).t(), lab)
    with pytest.raises(ValueError, match="contiguous"):
        token_logprobs(torch.randn(2, 5, 10)[:, :4], torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="mask shape"):
        token_logprobs(x, lab, mask=torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(x, lab, temperature=0.0)
    # An out-of-range label is fine where it is masked or equal to ignore_index.
    lp = token_logprobs(x, torch.tensor([0, 99, -100, 2]), mask=torch.tensor([1, 0, 1, 1]))
    assert lp[1] == 0 and lp[2] == 0


def test_linear_token_logprobs_bad_input():
    h, w, lab = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="weight dtype"):
        linear_token_logprobs(h, w.double(), lab)
    with pytest.raises(ValueError, match=r"hidden \[T, H\]"):
        linear_token_logprobs(h, torch.randn(10, 7), lab)
    with pytest.raises(ValueError, match="contiguous"):
        linear_token_logprobs(torch.randn(8, 4).t(), w, lab)
    with pytest.raises(ValueError, match="labels must be int64"):
        linear_token_logprobs(h, w, lab[:2])
    with pytest.raises(ValueError, match="outside"):
        linear_token_logprobs(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="empty"):
        linear_token_logprobs(torch.randn(0, 8), w, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_token_logprobs(h, w, lab, chunk_tokens=0)


@pytest.mark.gpu
def test_cuda_paths_match_reference():
    gen = torch.Generator().manual_seed(17)
    logits, labels, mask = _inputs((64,), 151936, torch.bfloat16, gen)
    x = logits.cuda().requires_grad_(True)
    lp, ent = token_logprobs(x, labels.cuda(), mask=mask.cuda(), temperature=0.9, return_entropy=True)
    ref = token_logprobs_ref(logits.to(F64), labels, mask=mask, temperature=0.9, return_entropy=True, dtype=F64)
    torch.testing.assert_close(lp.cpu().double(), ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.cpu().double(), ref[1], atol=1e-5, rtol=0)
    hidden, weight, labels, mask = _linear_inputs(300, 64, 50257, torch.float32, gen)
    out = linear_token_logprobs(hidden.cuda(), weight.cuda(), labels.cuda(), mask=mask.cuda(), chunk_tokens=128)
    ref = linear_token_logprobs_ref(hidden, weight, labels, mask=mask, dtype=F64)
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=0)


_COMPILE_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.logprobs import _token_logprobs_bwd_kernel, _token_logprobs_fwd_kernel

common = {"lab_ptr": "*i64", "keep_ptr": "*i1", "V": "i32", "stride_row": "i32", "inv_t": "fp32",
          "HAS_ENT": "constexpr", "BLOCK_V": "constexpr"}
for dt in ("bf16", "fp32"):
    for ent in (True, False):
        consts = {"HAS_ENT": ent, "BLOCK_V": 8192}
        fwd = {"x_ptr": f"*{dt}", "logp_ptr": "*fp32", "ent_ptr": "*fp32", "lse_ptr": "*fp32", **common}
        bwd = {"x_ptr": f"*{dt}", "dx_ptr": f"*{dt}", "lse_ptr": "*fp32", "ent_ptr": "*fp32", "glogp_ptr": "*fp32",
               "gent_ptr": "*fp32", "stride_drow": "i32", **common}
        for fn, sig in ((_token_logprobs_fwd_kernel, fwd), (_token_logprobs_bwd_kernel, bwd)):
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    compile_in_subprocess(_COMPILE_CHILD)
