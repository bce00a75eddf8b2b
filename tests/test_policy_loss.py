"""policy_loss / linear_policy_loss against the float64 reference (kernels/reference.py), both paths.

Sizes stay tiny (a few dozen tokens, V = 1271 or 7, one case with a multi-tile vocabulary) so the Triton path
runs through the interpreter in seconds. Old/ref/rollout log-probs are drawn around the true log-probs so that
ratios fall on both sides of the clip range and every branch (clip low/high, dual clip, TIS cap, the clamps of
the log-ratio and of k3) is taken by some tokens. The loss has no kernel of its own: the log-prob kernels it runs
are compiled for sm_90 in tests/test_logprobs.py; GSPO, CISPO and the corrections are in tests/test_objectives.py.
"""

import dataclasses
import math

import pytest
import torch

from kernels import LossInputs, PolicyLossConfig, linear_policy_loss, policy_loss, use_backend
from kernels.reference import policy_loss_ref

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
FULL = dict(kl_coef=0.1, entropy_coef=0.01, clip_ratio_c=1.6, rollout_correction="tis", tis_cap=1.5, max_seq_len=9)
TEMPERATURE = 0.7  # the rollout temperature of the FULL cases (a keyword of the losses, not a config field)


def make_case(layout, vocab, seed, *, n_seqs=3, max_len=7, dtype=torch.float32, temperature=1.0):
    """Random logits + per-token inputs; returns (logits, kwargs for the loss without config, labels/mask)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "padded":
        shape, cu = (n_seqs, max_len), None
    else:
        lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=g)
        lengths[1] = 0  # an empty sequence must not break anything
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        shape = (int(cu[-1]),)
    logits = (torch.randn(*shape, vocab, generator=g) * 2.5).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    mask = (torch.rand(shape, generator=g) < 0.75).to(torch.int64)
    ignored = torch.rand(shape, generator=g) < 0.1
    labels = torch.where(ignored, -100, labels)  # -100 counts as masked even where mask is 1
    with torch.no_grad():
        logp_all = torch.log_softmax(logits.double() / temperature, -1)
        true = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    noise = lambda s: torch.randn(shape, generator=g, dtype=torch.float64) * s  # noqa: E731
    old = true + noise(0.6)
    inputs = dict(
        labels=labels,
        advantages=torch.randn(shape, generator=g),
        mask=mask,
        old_logprobs=old.float(),
        ref_logprobs=(true + noise(0.5)).float(),
        rollout_logprobs=(old + noise(0.4)).float(),
        cu_seqlens=cu,
    )
    return logits, inputs


def assert_matches(ours, ref, *, loss_rtol=1e-5, grad_rtol=1e-4, metric_atol=1e-5):
    loss, metrics, grad = ours
    rloss, rmetrics, rgrad = ref
    torch.testing.assert_close(loss.double(), rloss, rtol=loss_rtol, atol=loss_rtol * 1e-1)
    metrics = dict(metrics)
    errors = metrics.pop("input_errors")  # the device-side validation flags: 0 for valid inputs
    assert errors.dtype == torch.int32 and errors.dim() == 0 and int(errors) == 0
    assert set(metrics) == set(rmetrics)
    for name, value in metrics.items():
        assert value.dim() == 0 and value.device == loss.device
        torch.testing.assert_close(value.double(), rmetrics[name].double(), rtol=metric_atol, atol=metric_atol,
                                   msg=lambda m, name=name: f"metric {name}: {m}")
    rel = (grad.double() - rgrad).norm() / rgrad.norm().clamp(min=1e-30)
    assert rel < grad_rtol, f"gradient relative error {rel:.3g}"
    assert rgrad.norm() > 0  # the case exercises a real gradient


_INPUT_FIELDS = {f.name for f in dataclasses.fields(LossInputs)}


def split_inputs(inputs):
    """(kernels.LossInputs of the per-token entries of `inputs`, the losses' other keywords, e.g. temperature)."""
    return (LossInputs(**{k: v for k, v in inputs.items() if k in _INPUT_FIELDS}),
            {k: v for k, v in inputs.items() if k not in _INPUT_FIELDS})


def check(logits, inputs, config, seed, temperature=1.0, **extra):
    upstream = torch.randn((), generator=torch.Generator().manual_seed(seed + 1000)).double()
    inp, kw = split_inputs({**inputs, **extra})
    x = logits.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, inp, config=config, temperature=temperature, **kw)
    (loss * upstream.float()).backward()
    xr = logits.detach().double().requires_grad_(True)
    rloss, rmetrics = policy_loss_ref(xr, inp, config=config, temperature=temperature, **kw)
    (rloss * upstream).backward()
    return (loss.detach(), metrics, x.grad), (rloss.detach(), rmetrics, xr.grad)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_every_loss_agg_with_all_options(backend, layout, loss_agg):
    seed = LOSS_AGGS.index(loss_agg) * 2 + (layout == "packed")
    config = PolicyLossConfig(loss_agg=loss_agg, **FULL)
    logits, inputs = make_case(layout, 1271, seed, temperature=TEMPERATURE)
    assert_matches(*check(logits, inputs, config, seed, TEMPERATURE))


OPTION_CASES = {
    "on-policy": (dict(), dict(old_logprobs=None, ref_logprobs=None, rollout_logprobs=None)),
    "off-policy": (dict(), dict(ref_logprobs=None, rollout_logprobs=None)),
    "asymmetric-clip": (dict(clip_low=0.1, clip_high=0.28), dict(ref_logprobs=None, rollout_logprobs=None)),
    "dual-clip": (dict(clip_ratio_c=1.5), dict(ref_logprobs=None, rollout_logprobs=None)),
    "tis-capped": (dict(rollout_correction="tis", tis_cap=1.2), dict(ref_logprobs=None)),
    "tis-uncapped": (dict(rollout_correction="tis", tis_cap=math.inf), dict(ref_logprobs=None)),
    "tis-on-policy": (dict(rollout_correction="tis", tis_cap=2.0), dict(old_logprobs=None, ref_logprobs=None)),
    "mis": (dict(rollout_correction="mis", tis_cap=1.3), dict(ref_logprobs=None)),
    "mismatch-metrics-only": (dict(), dict(ref_logprobs=None)),
    "entropy": (dict(entropy_coef=0.05), dict(ref_logprobs=None, rollout_logprobs=None)),
    "log-entropy-only": (dict(log_entropy=True), dict(ref_logprobs=None, rollout_logprobs=None)),
    "temperature": (dict(entropy_coef=0.02), dict()),
    "k1": (dict(kl_coef=0.2, kl_type="k1"), dict()),
    "k2": (dict(kl_coef=0.2, kl_type="k2"), dict()),
    "k3": (dict(kl_coef=0.2, kl_type="k3"), dict()),
    "kl-metric-only": (dict(kl_coef=0.0), dict()),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_each_option(backend, case):
    cfg_kw, overrides = OPTION_CASES[case]
    seed = sorted(OPTION_CASES).index(case) + 17
    config = PolicyLossConfig(loss_agg="seq-mean-token-mean", **cfg_kw)
    temperature = 1.7 if case == "temperature" else 1.0
    logits, inputs = make_case("padded", 1271, seed, temperature=temperature)
    inputs.update(overrides)
    ours, ref = check(logits, inputs, config, seed, temperature)
    assert_matches(ours, ref)
    if case in ("tis-capped", "mis"):  # the cap binds on some tokens and not on others
        assert 0 < float(ref[1]["mismatch/tis_clip_frac"]) < 1
    if case == "dual-clip":  # the seed puts tokens in every branch: clipped low, clipped high, dual-clipped
        assert min(float(ref[1][k]) for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac")) > 0


def test_clamped_branches(backend):
    # Log-ratios beyond ±20 (gradient cut by the clamp) and k3 values above 10 (clamped, no gradient).
    config = PolicyLossConfig(loss_agg="token-mean", kl_coef=0.3, kl_type="k3", clip_ratio_c=3.0)
    logits, inputs = make_case("packed", 7, 5, n_seqs=4, max_len=8)
    n = inputs["labels"].shape[0]
    g = torch.Generator().manual_seed(6)
    far = torch.tensor([-25.0, 25.0, 0.0])[torch.randint(0, 3, (n,), generator=g)]
    kl_far = torch.tensor([-12.0, 4.0, 0.0])[torch.randint(0, 3, (n,), generator=g)]
    inputs["old_logprobs"] = inputs["old_logprobs"] + far
    inputs["ref_logprobs"] = inputs["ref_logprobs"] + kl_far
    inputs["rollout_logprobs"] = None
    ours, ref = check(logits, inputs, config, 6)
    assert_matches(ours, ref, metric_atol=1e-4)  # approx_kl of |log r| = 20 tokens is ~5e8: relative 1e-4


def test_large_vocabulary_multi_tile(backend):
    # V = 50257 spans several vocabulary tiles in the Triton kernels; keep T tiny for the interpreter.
    config = PolicyLossConfig(loss_agg="token-mean", entropy_coef=0.01, kl_coef=0.1)
    logits, inputs = make_case("padded", 50257, 9, n_seqs=1, max_len=3)
    inputs["mask"] = torch.ones_like(inputs["mask"])
    inputs["labels"] = inputs["labels"].clamp(min=0)
    assert_matches(*check(logits, inputs, config, 9))


def test_bf16_logits(backend):
    # bf16 inputs, fp32 math: compared with the reference on the same bf16 values upcast (design.md).
    config = PolicyLossConfig(loss_agg="seq-mean-token-mean", **{k: v for k, v in FULL.items() if k != "max_seq_len"})
    logits, inputs = make_case("padded", 1271, 11, dtype=torch.bfloat16, temperature=TEMPERATURE)
    (loss, metrics, grad), ref = check(logits, inputs, config, 11, TEMPERATURE)
    assert grad.dtype == torch.bfloat16
    assert_matches((loss, metrics, grad), ref, loss_rtol=1e-4, grad_rtol=1e-2)


def test_masked_and_ignored_tokens_get_zero_gradient(backend):
    config = PolicyLossConfig(loss_agg="token-mean", entropy_coef=0.1)
    logits, inputs = make_case("padded", 7, 12)
    inp, kw = split_inputs(inputs)
    logits[inputs["mask"] == 0] = float("nan")  # garbage at padding must not leak
    x = logits.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, inp, config=config, **kw)
    loss.backward()
    dropped = (inputs["mask"] == 0) | (inputs["labels"] == -100)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.equal(x.grad[dropped], torch.zeros_like(x.grad[dropped]))
    assert x.grad[~dropped].abs().sum() > 0


def test_banned_tokens_with_minus_inf_logits(backend):
    # Samplers mask banned tokens with −inf: they have p = 0 and must give exact zeros, not NaN.
    config = PolicyLossConfig(loss_agg="token-mean", kl_coef=0.1, clip_ratio_c=3.0)
    logits, inputs = make_case("padded", 1271, 13)
    banned = torch.rand(logits.shape, generator=torch.Generator().manual_seed(14)) < 0.3
    banned &= torch.arange(1271) != inputs["labels"].clamp(min=0).unsqueeze(-1)  # never the sampled token
    logits = logits.masked_fill(banned, float("-inf"))
    (loss, metrics, grad), ref = check(logits, inputs, config, 13)
    assert torch.equal(grad[banned], torch.zeros_like(grad[banned]))
    assert_matches((loss, metrics, grad), ref)


def _split_rows(inputs, rows):
    return {k: (v[rows] if isinstance(v, torch.Tensor) and k != "cu_seqlens" else v) for k, v in inputs.items()}


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_micro_batches_and_ranks_sum_to_full_batch(backend, loss_agg):
    # 8 sequences = 2 simulated ranks x 2 micro-batches of 2 sequences (unequal token counts). With the global
    # num_tokens / num_seqs, the summed losses, metrics and gradients equal the full batch's.
    config = PolicyLossConfig(loss_agg=loss_agg, **FULL)
    logits, inputs = make_case("padded", 7, 21 + LOSS_AGGS.index(loss_agg), n_seqs=8, max_len=6,
                               temperature=TEMPERATURE)
    inputs["cu_seqlens"] = None
    inp, kw = split_inputs(inputs)
    kw["temperature"] = TEMPERATURE
    x = logits.clone().requires_grad_(True)
    full_loss, full_metrics = policy_loss(x, inp, config=config, **kw)
    full_loss.backward()

    keep = (inputs["mask"] != 0) & (inputs["labels"] != -100)
    n_tokens, n_seqs = keep.sum(), 8  # what an all-reduce of the local counts would give
    total_loss = torch.zeros(())
    total_metrics = {k: torch.zeros(()) for k in full_metrics}
    grads = torch.zeros_like(logits)
    for rank in range(2):
        for micro in range(2):
            rows = slice(rank * 4 + micro * 2, rank * 4 + micro * 2 + 2)
            part = _split_rows(inputs, rows)
            pinp, pkw = split_inputs({**part, "num_tokens": n_tokens, "num_seqs": n_seqs})
            xp = logits[rows].clone().requires_grad_(True)
            loss, metrics = policy_loss(xp, pinp, config=config, temperature=TEMPERATURE, **pkw)
            loss.backward()
            total_loss += loss.detach()
            for k in metrics:  # the reduction rule of the metrics: `_max` by max, the flags by or, others by sum
                if k.endswith("_max"):
                    total_metrics[k] = torch.maximum(total_metrics[k], metrics[k])
                elif k == "input_errors":
                    total_metrics[k] = total_metrics[k].int() | metrics[k]
                else:
                    total_metrics[k] += metrics[k]
            grads[rows] = xp.grad
    assert "mismatch/logprob_abs_diff_max" in full_metrics
    torch.testing.assert_close(total_loss, full_loss.detach(), rtol=1e-5, atol=1e-7)
    for k in full_metrics:
        torch.testing.assert_close(total_metrics[k], full_metrics[k], rtol=1e-5, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(grads, x.grad, rtol=1e-5, atol=1e-8)


def test_local_normalisation_differs_from_global():
    # The failure the global counts prevent: per-micro-batch token-mean does not sum to the full-batch loss.
    config = PolicyLossConfig(loss_agg="token-mean")
    logits, inputs = make_case("padded", 7, 30, n_seqs=4, max_len=6)
    inputs["mask"][:2, 1:] = 0  # very unequal micro-batches
    inputs["cu_seqlens"] = None
    inp, kw = split_inputs(inputs)
    with use_backend("torch"):
        full, _ = policy_loss(logits, inp, config=config, **kw)
        parts = []
        for rows in (slice(0, 2), slice(2, 4)):
            pinp, pkw = split_inputs(_split_rows(inputs, rows))
            parts.append(policy_loss(logits[rows], pinp, config=config, **pkw)[0])
    # Averaging per-micro-batch means (what plain gradient accumulation does) is not the full-batch mean.
    assert not torch.allclose((parts[0] + parts[1]) / 2, full, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------
# linear_policy_loss == policy_loss on materialised logits
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("entropy_coef", [0.0, 0.02])
def test_linear_equals_policy_loss_on_logits(backend, layout, entropy_coef):
    g = torch.Generator().manual_seed(40 + (layout == "packed") * 2 + (entropy_coef > 0))
    config = PolicyLossConfig(loss_agg="seq-mean-token-mean", **{**FULL, "entropy_coef": entropy_coef})
    _, inputs = make_case(layout, 1271, 41, n_seqs=4, max_len=6)
    shape = inputs["labels"].shape
    hidden = torch.randn(*shape, 24, generator=g)
    weight = torch.randn(1271, 24, generator=g) * 0.4
    inp, kw = split_inputs(inputs)
    kw["temperature"] = TEMPERATURE
    upstream = float(torch.randn((), generator=g))

    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, metrics = linear_policy_loss(h1, w1, inp, config=config, chunk_tokens=5, **kw)  # several chunks
    (loss * upstream).backward()

    h2, w2 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    rloss, rmetrics = policy_loss_ref(h2 @ w2.t(), inp, config=config, **kw)
    (rloss * upstream).backward()

    torch.testing.assert_close(loss.double(), rloss, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(rmetrics) | {"input_errors"} and int(metrics["input_errors"]) == 0
    for name in rmetrics:
        torch.testing.assert_close(metrics[name].double(), rmetrics[name], rtol=1e-5, atol=1e-5)
    for ours, ref in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert ours.dtype == torch.float32
        assert (ours.double() - ref).norm() / ref.norm() < 1e-4

    # Same numbers as policy_loss on the materialised fp32 logits.
    h3, w3 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss3, metrics3 = policy_loss((h3 @ w3.t()).contiguous(), inp, config=config, **kw)
    (loss3 * upstream).backward()
    torch.testing.assert_close(loss, loss3.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h3.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w1.grad, w3.grad, rtol=1e-4, atol=1e-6)


def test_linear_bf16(backend):
    # bf16 hidden and lm_head, fp32 softmax math: against the reference on the bf16 values upcast (design.md).
    config = PolicyLossConfig(loss_agg="seq-mean-token-sum", **{k: v for k, v in FULL.items() if k != "max_seq_len"})
    _, inputs = make_case("packed", 1271, 45, n_seqs=3, max_len=6)
    g = torch.Generator().manual_seed(46)
    hidden = torch.randn(inputs["labels"].shape[0], 32, generator=g).bfloat16()
    weight = (torch.randn(1271, 32, generator=g) * 0.3).bfloat16()
    inp, kw = split_inputs(inputs)
    kw["temperature"] = TEMPERATURE
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = linear_policy_loss(h1, w1, inp, config=config, chunk_tokens=4, **kw)
    loss.backward()
    h2, w2 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    rloss, _ = policy_loss_ref(h2 @ w2.t(), inp, config=config, **kw)
    rloss.backward()
    # The bf16 GEMM output (Triton path) is rounded to bf16 before the fp32 softmax: loss within bf16 precision.
    torch.testing.assert_close(loss.double(), rloss, rtol=2e-2, atol=1e-3)
    for ours, ref in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert ours.dtype == torch.bfloat16
        assert (ours.double() - ref).norm() / ref.norm() < 3e-2


def test_linear_frozen_head_and_no_grad(backend):
    config = PolicyLossConfig(loss_agg="token-mean", kl_coef=0.05)
    _, inputs = make_case("packed", 7, 50, n_seqs=3, max_len=5)
    g = torch.Generator().manual_seed(51)
    hidden = torch.randn(inputs["labels"].shape[0], 8, generator=g)
    weight = torch.randn(7, 8, generator=g)
    inp, kw = split_inputs(inputs)
    h = hidden.clone().requires_grad_(True)
    loss, _ = linear_policy_loss(h, weight, inp, config=config, **kw)  # lm_head frozen (LoRA)
    loss.backward()
    h2, w2 = hidden.double().requires_grad_(True), weight.double()
    rloss, _ = policy_loss_ref(h2 @ w2.t(), inp, config=config, **kw)
    rloss.backward()
    assert (h.grad.double() - h2.grad).norm() / h2.grad.norm() < 1e-4
    with torch.no_grad():
        loss_ng, _ = linear_policy_loss(hidden, weight, inp, config=config, **kw)
    torch.testing.assert_close(loss_ng, loss.detach())
    assert not loss_ng.requires_grad


# ---------------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument
# ---------------------------------------------------------------------------------------------------------


def test_config_errors():
    with pytest.raises(ValueError, match="loss_agg"):
        PolicyLossConfig(loss_agg="mean")
    with pytest.raises(ValueError, match="kl_type"):
        PolicyLossConfig(kl_type="k4")
    with pytest.raises(ValueError, match="max_seq_len"):
        PolicyLossConfig(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyLossConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyLossConfig(tis_cap=None)
    with pytest.raises(ValueError, match="objective"):
        PolicyLossConfig(objective="grpo")
    with pytest.raises(ValueError, match="rollout_correction"):
        PolicyLossConfig(rollout_correction="is")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(objective="cispo", clip_ratio_c=3.0)
    with pytest.raises(TypeError, match="temperature"):
        PolicyLossConfig(temperature=0.7)  # a keyword of the losses now, never a config field
    assert dataclasses.replace(PolicyLossConfig(), loss_agg="token-mean").loss_agg == "token-mean"


def _bad(inputs, **changes):
    out = dict(inputs)
    out.update(changes)
    return out


@pytest.mark.parametrize("fn", ["policy_loss", "linear_policy_loss"])
def test_bad_inputs_name_the_argument(fn):
    config = PolicyLossConfig(loss_agg="seq-mean-token-mean", kl_coef=0.1)
    logits, inputs = make_case("packed", 7, 60, n_seqs=3, max_len=5)
    inputs["mask"] = torch.ones_like(inputs["mask"])
    inputs["labels"] = inputs["labels"].clamp(min=0)
    n = inputs["labels"].shape[0]
    hidden, weight = torch.randn(n, 4), torch.randn(7, 4)

    def call(kw, cfg=config):
        inp, rest = split_inputs(kw)
        with use_backend("torch"):
            if fn == "policy_loss":
                return policy_loss(logits, inp, config=cfg, **rest)
            return linear_policy_loss(hidden, weight, inp, config=cfg, **rest)

    adv = inputs["advantages"].clone()
    adv[0] = float("nan")
    with pytest.raises(ValueError, match="advantages"):
        call(_bad(inputs, advantages=adv))
    with pytest.raises(ValueError, match="mask shape"):
        call(_bad(inputs, mask=inputs["mask"][:-1]))
    cu = inputs["cu_seqlens"].clone()
    cu[1] = cu[2] + 1  # sequence 1 is empty: cu[1] == cu[2] before, so this makes the offsets decrease
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(_bad(inputs, cu_seqlens=cu))
    cu = inputs["cu_seqlens"].clone()
    cu[-1] -= 1
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(_bad(inputs, cu_seqlens=cu))
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(_bad(inputs, cu_seqlens=None))
    with pytest.raises(ValueError, match="ref_logprobs"):
        call(_bad(inputs, ref_logprobs=None))
    labels = inputs["labels"].clone()
    labels[0] = 7
    with pytest.raises(ValueError, match="labels"):
        call(_bad(inputs, labels=labels))
    with pytest.raises(ValueError, match="old_logprobs"):
        call(_bad(inputs, old_logprobs=inputs["old_logprobs"][:-1]))
    with pytest.raises(ValueError, match="num_seqs"):
        call(inputs | {"num_seqs": -1})
    with pytest.raises(ValueError, match="temperature"):
        call(inputs | {"temperature": 0.0})
    with pytest.raises(ValueError, match="rollout_logprobs"):
        call(_bad(inputs, rollout_logprobs=None), dataclasses.replace(config, rollout_correction="tis"))


def test_bad_logits_and_hidden():
    config = PolicyLossConfig(loss_agg="token-mean")
    logits, inputs = make_case("padded", 7, 61)
    inp, kw = split_inputs(inputs)
    with pytest.raises(ValueError, match="contiguous"):
        policy_loss(logits.transpose(0, 1).contiguous().transpose(0, 1), inp, config=config, **kw)
    with pytest.raises(ValueError, match="logits shape"):
        policy_loss(logits[:, :-1], inp, config=config, **kw)
    with pytest.raises(ValueError, match="dtype"):
        policy_loss(logits.double(), inp, config=config, **kw)
    with pytest.raises(ValueError, match="weight"):
        linear_policy_loss(torch.randn(3, 7, 4), torch.randn(7, 5), inp, config=config, **kw)
