"""CUDA-only branches proven on CPU: the fp32 lm_head-gradient GEMM, NCCL device binding, the foreach clip.

Each CUDA branch is reached on CPU by forcing its switch and faking the one call the CPU cannot make; the test
then checks the call the branch builds and the numbers it gives against the CPU path or a float64 reference.
"""

import pytest
import torch
import torch.distributed as dist
from test_policy_loss import FULL, TEMPERATURE, make_case, split_inputs

import kernels.linear_logprobs as llp
import trainer.backend.steps as core
from kernels import PolicyLossConfig, linear_policy_loss, linear_token_logprobs, use_backend

BF16, F64 = torch.bfloat16, torch.float64


def _fake_fp32_addmm(calls: list, real_addmm):
    """torch.addmm that also runs the out_dtype=float32 form on CPU: fp32 products summed into fp32 `out`, as the
    CUDA kernel does (bf16/fp16 inputs, fp32 accumulation); every out_dtype call is recorded."""

    def addmm(inp, a, b, **kw):
        if "out_dtype" not in kw:
            return real_addmm(inp, a, b, **kw)
        calls.append(dict(inp=inp, a_dtype=a.dtype, b_dtype=b.dtype, **kw))
        out = kw["out"]
        assert kw["out_dtype"] == torch.float32 and out.dtype == torch.float32 and out is inp
        return out.add_(a.float() @ b.float())

    return addmm


def test_fp32_addmm_probe_reports_what_runs():
    # The probe's answer on this machine's backend equals whether the call actually runs.
    acc, a = torch.zeros(3, 5), torch.randn(3, 4, dtype=BF16)
    b = torch.randn(4, 5, dtype=BF16)
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        runs = True
    except (RuntimeError, TypeError):
        runs = False
    assert llp.fp32_addmm_supported("cpu", BF16) is runs


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_addmm_acc_on_cpu_is_the_previous_code(dtype, monkeypatch):
    # Where the backend has no fp32-output addmm (CPU), the helper is exactly the code it replaced.
    monkeypatch.setitem(llp._FP32_ADDMM, ("cpu", dtype), False)
    g = torch.Generator().manual_seed(1)
    acc0 = torch.randn(37, 19, generator=g)
    a, b = torch.randn(37, 11, generator=g).to(dtype), torch.randn(11, 19, generator=g).to(dtype)
    got = llp.addmm_acc_(acc0.clone(), a, b)
    old = acc0.clone().addmm_(a, b) if dtype == torch.float32 else acc0.clone().add_(a @ b)
    assert torch.equal(got, old)
    # Accumulator in the inputs' dtype (linear_policy_loss's bf16 fallback): the in-place GEMM, as before.
    acc_b = acc0.to(dtype)
    assert torch.equal(llp.addmm_acc_(acc_b.clone(), a, b), acc_b.clone().addmm_(a, b))


def test_addmm_acc_where_supported_makes_one_fp32_gemm(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch, "addmm", _fake_fp32_addmm(calls, torch.addmm))
    monkeypatch.setitem(llp._FP32_ADDMM, ("cpu", BF16), True)
    g = torch.Generator().manual_seed(2)
    acc = torch.randn(29, 13, generator=g)
    a, b = torch.randn(29, 7, generator=g).to(BF16), torch.randn(7, 13, generator=g).to(BF16)
    ref = acc.double() + a.double() @ b.double()
    out = llp.addmm_acc_(acc, a, b)
    assert out is acc and len(calls) == 1 and calls[0]["a_dtype"] == calls[0]["b_dtype"] == BF16
    torch.testing.assert_close(acc.double(), ref, rtol=1e-6, atol=1e-6)  # no bf16 rounding of the product


def _forced_fp32_addmm(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(torch, "addmm", _fake_fp32_addmm(calls, torch.addmm))
    monkeypatch.setitem(llp._FP32_ADDMM, ("cpu", BF16), True)
    return calls


def test_linear_token_logprobs_weight_grad_accumulates_in_fp32(monkeypatch):
    # The Triton path (interpreter here) with the CUDA switch on: one fp32-output GEMM per token chunk into one
    # fp32 [V, H] accumulator, cast once to bf16; the gradient equals a float64 reference on the same bf16 logits.
    g = torch.Generator().manual_seed(3)
    T, H, V, chunk = 29, 16, 301, 8
    hidden, weight = torch.randn(T, H, generator=g).to(BF16), (torch.randn(V, H, generator=g) * 0.3).to(BF16)
    labels = torch.randint(0, V, (T,), generator=g)
    up = torch.randn(T, generator=g, dtype=F64)
    calls = _forced_fp32_addmm(monkeypatch)
    w = weight.clone().requires_grad_(True)
    with use_backend("triton"):
        lp = linear_token_logprobs(hidden, w, labels, chunk_tokens=chunk)
        (lp.double() * up).sum().backward()
    assert len(calls) == -(-T // chunk)
    assert all(c["inp"].shape == (V, H) and c["inp"] is calls[0]["inp"] for c in calls)  # one accumulator
    assert w.grad.dtype == BF16

    logits = (hidden @ weight.t()).to(F64).requires_grad_(True)  # the bf16 GEMM the kernel path runs
    (torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0] * up).sum().backward()
    ref = logits.grad.t() @ hidden.to(F64)
    assert (w.grad.double() - ref).norm() / ref.norm() < 4e-3  # one bf16 rounding of the final gradient


def test_linear_policy_loss_weight_grad_accumulates_in_fp32(monkeypatch):
    config = PolicyLossConfig(loss_agg="seq-mean-token-mean", **FULL)
    _, inputs = make_case("packed", 301, 7, n_seqs=4, max_len=6)
    inp, kw = split_inputs(inputs)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(*inputs["labels"].shape, 16, generator=g).to(BF16)
    weight = (torch.randn(301, 16, generator=g) * 0.3).to(BF16)

    def run():
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with use_backend("triton"):
            loss, _ = linear_policy_loss(h, w, inp, config=config, temperature=TEMPERATURE, chunk_tokens=5, **kw)
        (loss * 1.7).backward()
        return loss.detach(), h.grad, w.grad

    monkeypatch.setitem(llp._FP32_ADDMM, ("cpu", BF16), False)
    loss_bf16, gh_bf16, gw_bf16 = run()  # today's CPU path: the accumulator in bf16
    calls = _forced_fp32_addmm(monkeypatch)
    loss, gh, gw = run()
    n_rows = inputs["labels"].numel()
    assert len(calls) == -(-n_rows // 5) and all(c["inp"] is calls[0]["inp"] for c in calls)
    assert calls[0]["inp"].dtype == torch.float32 and gw.dtype == BF16 and gh.dtype == BF16
    assert torch.equal(loss, loss_bf16) and torch.equal(gh, gh_bf16)  # only the weight gradient's sum changes
    torch.testing.assert_close(gw.float(), gw_bf16.float(), rtol=0.05, atol=2e-3)


@pytest.mark.gpu  # make gpu-check runs `-m gpu`: a plain skipif would leave this out of it
def test_cuda_fp32_addmm_is_supported_and_exact():
    assert llp.fp32_addmm_supported("cuda", BF16)
    g = torch.Generator(device="cuda").manual_seed(5)
    acc = torch.randn(4096, 256, device="cuda", generator=g)
    a = torch.randn(4096, 512, device="cuda", generator=g).to(BF16)
    b = torch.randn(512, 256, device="cuda", generator=g).to(BF16)
    ref = acc.double() + a.double() @ b.double()
    llp.addmm_acc_(acc, a, b)
    assert (acc.double() - ref).abs().max() < 1e-3


# ---------------------------------------------------------------------------------------------------------
# trainer.backend.steps: NCCL bound to the rank's device, foreach gradient clipping
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("torchrun", [False, True])
def test_init_distributed_sets_the_device_then_binds_the_group(monkeypatch, torchrun):
    events: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: events.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(core, "init_device_mesh", lambda dev, shape: events.append(("mesh", dev, shape)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    for name in ("RANK", "WORLD_SIZE"):
        if torchrun:
            monkeypatch.setenv(name, "1" if name == "RANK" else "2")
        else:
            monkeypatch.delenv(name, raising=False)
    core.init_distributed("cuda")
    dev = torch.device("cuda", 1)
    assert events[0] == ("set_device", dev)
    kind, backend, kw = events[1]
    assert kind == "init" and backend == "cuda:nccl,cpu:gloo" and kw["device_id"] == dev
    assert ("store" in kw) is not torchrun
    assert events[2] == ("mesh", "cuda", (2,))


def test_init_distributed_on_cpu_passes_no_device(monkeypatch):
    events: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: events.append(("init", backend, kw)))
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(core, "init_device_mesh", lambda dev, shape: None)
    monkeypatch.delenv("RANK", raising=False)
    core.init_distributed("cpu")
    assert len(events) == 1 and events[0][1] == "gloo" and "device_id" not in events[0][2]


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_foreach_clip_equals_the_loop(max_norm):
    # The CUDA default (foreach) against the CPU loop and a float64 norm, mixed fp32/bf16 gradients.
    g = torch.Generator().manual_seed(6)
    shapes = [(17, 9), (9,), (3, 4, 5), (1,)]
    dtypes = [torch.float32, BF16, torch.float32, BF16]
    grads = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]

    def params():
        out = []
        for x in grads:
            p = torch.nn.Parameter(torch.zeros_like(x))
            p.grad = x.clone()
            out.append(p)
        return out

    p_loop, p_each = params(), params()
    n_loop = core.clip_grad_norm(p_loop, max_norm, mesh=None, foreach=False)
    n_each = core.clip_grad_norm(p_each, max_norm, mesh=None, foreach=True)
    ref = torch.linalg.vector_norm(torch.stack([x.double().norm() for x in grads]))
    torch.testing.assert_close(n_each.double(), ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(n_each, n_loop, rtol=1e-6, atol=0)
    for a, b in zip(p_each, p_loop):
        assert a.grad.dtype == b.grad.dtype
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6 if a.dtype == torch.float32 else 1e-2, atol=0)
    if max_norm > 0:
        scale = min(1.0, max_norm / (float(ref) + 1e-6))
        for a, x in zip(p_each, grads):
            torch.testing.assert_close(a.grad.double(), x.double() * scale, rtol=1e-2 if x.dtype == BF16 else 1e-5,
                                       atol=0)
