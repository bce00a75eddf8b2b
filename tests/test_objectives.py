"""The objective layer (kernels/objective.py): GSPO, CISPO, off-policy corrections, mismatch metrics, and the
device-side validation flags, on both paths of both ops (torch, and Triton through the interpreter).

Every objective is compared with the float64 reference (kernels/reference.py) on padded and packed inputs, from
logits and from hidden states with chunks smaller than a sequence (GSPO's two-pass driver). Independent checks
do not go through the reference: GSPO equals PPO when every token of a sequence has the same log-ratio and
advantage; CISPO's logit gradient is the log-prob gradient weighted by −w·clip(r)·A, never zero where PPO's is.
"""

import dataclasses
import math

import pytest
import torch
from test_policy_loss import TEMPERATURE, assert_matches, check, make_case, split_inputs

import kernels.device
from kernels import PolicyLossConfig, linear_policy_loss, policy_loss, raise_on_input_errors, token_logprobs
from kernels.linear_logprobs import linear_token_logprobs
from kernels.reference import policy_loss_ref

OBJECTIVE_OPTIONS = {
    "gspo": dict(objective="gspo", kl_coef=0.1, entropy_coef=0.01, clip_ratio_c=1.6, rollout_correction="tis",
                 tis_cap=1.5, clip_low=0.1, clip_high=0.15),
    "cispo": dict(objective="cispo", kl_coef=0.1, kl_type="k2", entropy_coef=0.01, rollout_correction="mis",
                  tis_cap=1.6, clip_low=0.3, clip_high=0.2),
}


def _seq_constant_advantages(inputs):
    """One advantage per sequence (what GRPO produces), broadcast to its tokens."""
    adv, cu = inputs["advantages"], inputs["cu_seqlens"]
    if adv.dim() == 2:
        return adv[:, :1].expand_as(adv).contiguous()
    out = adv.clone()
    for s in range(cu.numel() - 1):
        out[cu[s]:cu[s + 1]] = adv[cu[s]] if cu[s + 1] > cu[s] else 0.0
    return out


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("objective", sorted(OBJECTIVE_OPTIONS))
@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_objective_from_logits_matches_float64_reference(backend, objective, layout, loss_agg):
    seed = 100 + sorted(OBJECTIVE_OPTIONS).index(objective) * 4 + (layout == "packed") * 2 + (loss_agg == "token-mean")
    config = PolicyLossConfig(loss_agg=loss_agg, **OBJECTIVE_OPTIONS[objective])
    logits, inputs = make_case(layout, 1271, seed, n_seqs=4, max_len=7, temperature=TEMPERATURE)
    if objective == "gspo" and seed % 2:
        inputs["advantages"] = _seq_constant_advantages(inputs)  # also per-token advantages (their mean is used)
    ours, ref = check(logits, inputs, config, seed, TEMPERATURE)
    assert_matches(ours, ref)
    assert {"mismatch/tis_weight_mean", "mismatch/tis_clip_frac", "mismatch/logprob_abs_diff_max"} <= set(ref[1])


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("objective", sorted(OBJECTIVE_OPTIONS))
def test_objective_from_hidden_matches_float64_reference(backend, objective, layout):
    # chunk_tokens=3 < every non-trivial sequence: GSPO's sequences span chunks (two passes, 4 GEMMs per chunk);
    # CISPO's per-chunk objectives must add up, their `_max` metric by max.
    seed = 140 + sorted(OBJECTIVE_OPTIONS).index(objective) * 2 + (layout == "packed")
    g = torch.Generator().manual_seed(seed)
    config = PolicyLossConfig(loss_agg="seq-mean-token-mean", **OBJECTIVE_OPTIONS[objective])
    _, inputs = make_case(layout, 211, seed, n_seqs=4, max_len=7)
    hidden = torch.randn(*inputs["labels"].shape, 16, generator=g)
    weight = torch.randn(211, 16, generator=g) * 0.5
    inp, kw = split_inputs(inputs)
    upstream = float(torch.randn((), generator=g))
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, metrics = linear_policy_loss(h1, w1, inp, config=config, chunk_tokens=3, temperature=TEMPERATURE, **kw)
    (loss * upstream).backward()
    h2, w2 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    rloss, rmetrics = policy_loss_ref(h2 @ w2.t(), inp, config=config, temperature=TEMPERATURE, **kw)
    (rloss * upstream).backward()
    torch.testing.assert_close(loss.double(), rloss, rtol=1e-5, atol=1e-6)
    assert set(metrics) == set(rmetrics) | {"input_errors"} and int(metrics["input_errors"]) == 0
    for name in rmetrics:
        torch.testing.assert_close(metrics[name].double(), rmetrics[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"metric {name}: {m}")
    for ours, ref in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert ref.norm() > 0 and (ours.double() - ref).norm() / ref.norm() < 1e-4
    with torch.no_grad():  # forward only (GSPO: pass 1 and the objective, no pass 2)
        loss_ng, metrics_ng = linear_policy_loss(hidden, weight, inp, config=config, chunk_tokens=3,
                                                 temperature=TEMPERATURE, **kw)
    torch.testing.assert_close(loss_ng, loss.detach())
    torch.testing.assert_close(metrics_ng["ratio_mean"], metrics["ratio_mean"])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gspo_equals_ppo_when_log_ratios_are_constant_per_sequence(backend, layout):
    # If logp − old and A are the same on every token of a sequence, s_i = r_t and with seq-mean-token-mean the
    # gradient GSPO spreads over a sequence (s_i / |i| per token, times the |i| tokens' weights) equals PPO's.
    logits, inputs = make_case(layout, 1271, 160 + (layout == "packed"), n_seqs=5, max_len=6)
    inputs["mask"] = torch.ones_like(inputs["mask"])  # every non-empty sequence is present in the loss
    labels = inputs["labels"] = inputs["labels"].clamp(min=0)
    with torch.no_grad():
        logp = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    # Ratios 0.61, 1.05, 1.49, 1.35, 1.02 with advantages −, −, −, +, +: clipped low, unclipped, dual-clipped,
    # clipped high, unclipped (make_case leaves sequence 1 empty when packed).
    shift = torch.tensor([-0.5, 0.05, 0.4, 0.3, 0.02])
    if labels.dim() == 2:
        seq_of_token = torch.arange(5).unsqueeze(1).expand_as(labels)
    else:
        seq_of_token = torch.searchsorted(inputs["cu_seqlens"][1:], torch.arange(labels.numel()), right=True)
    inputs["old_logprobs"] = (logp - shift[seq_of_token].double()).float()
    inputs["advantages"] = torch.tensor([-1.0, -0.7, -1.2, 0.8, 0.5])[seq_of_token]
    inputs["ref_logprobs"] = inputs["rollout_logprobs"] = None
    results = {}
    for objective in ("ppo", "gspo"):
        config = PolicyLossConfig(objective=objective, loss_agg="seq-mean-token-mean", clip_ratio_c=1.2)
        (loss, metrics, grad), _ = check(logits, inputs, config, 161)
        results[objective] = (loss, metrics, grad)
    (lp, mp, gp), (lg, mg, gg) = results["ppo"], results["gspo"]
    torch.testing.assert_close(lg, lp, rtol=1e-5, atol=1e-7)
    for name in ("clip_frac_low", "clip_frac_high", "ratio_mean", "dual_clip_frac"):
        torch.testing.assert_close(mg[name], mp[name], rtol=1e-5, atol=1e-6)
    assert min(float(mp[k]) for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac")) > 0
    assert gp.norm() > 0 and (gp - gg).norm() / gp.norm() < 1e-4


def test_cispo_gradient_is_the_weighted_logprob_gradient_and_drops_no_token(backend):
    # loss = Σ_t w_t · −sg(clip(r_t)) A_t logp_t, so ∂loss/∂logits = token_logprobs' gradient with per-token
    # coefficients −w_t clip(r_t) A_t (computed here in float64, independently of the objective layer).
    config = PolicyLossConfig(objective="cispo", loss_agg="token-mean", clip_low=0.2, clip_high=0.2)
    logits, inputs = make_case("padded", 1271, 170, n_seqs=3, max_len=8)
    inputs["ref_logprobs"] = inputs["rollout_logprobs"] = None
    inp, kw = split_inputs(inputs)
    x = logits.clone().requires_grad_(True)
    loss, _ = policy_loss(x, inp, config=config, **kw)
    loss.backward()

    keep = (inputs["mask"] != 0) & (inputs["labels"] != -100)
    xr = logits.double().requires_grad_(True)
    logp = torch.log_softmax(xr, -1).gather(-1, inputs["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp.detach() - inputs["old_logprobs"].double())
    coef = torch.where(keep, -ratio.clamp(0.8, 1.2) * inputs["advantages"].double() / keep.sum(), 0.0)
    (coef * logp).sum().backward()
    assert (x.grad.double() - xr.grad).norm() / xr.grad.norm() < 1e-4
    torch.testing.assert_close(loss.double(), (coef * torch.where(keep, logp, 0.0)).sum().detach(), rtol=1e-5,
                               atol=1e-7)

    # PPO zeroes the gradient of tokens clipped on their advantage's side; CISPO keeps every token.
    x_ppo = logits.clone().requires_grad_(True)
    policy_loss(x_ppo, inp, config=dataclasses.replace(config, objective="ppo"), **kw)[0].backward()
    adv = inputs["advantages"]
    dropped_by_ppo = keep & (((ratio > 1.2) & (adv > 0)) | ((ratio < 0.8) & (adv < 0)))
    assert dropped_by_ppo.sum() >= 2
    assert (x_ppo.grad[dropped_by_ppo] == 0).all()
    assert (x.grad[dropped_by_ppo].abs().sum(-1) > 0).all()


def test_mis_drops_tokens_and_tis_truncates(backend):
    # With no KL or entropy term, a token dropped by MIS contributes no gradient at all; TIS keeps every token.
    logits, inputs = make_case("padded", 1271, 180, n_seqs=3, max_len=8)
    inputs["ref_logprobs"] = None
    inp, kw = split_inputs(inputs)
    keep = (inputs["mask"] != 0) & (inputs["labels"] != -100)
    rho = torch.exp(inputs["old_logprobs"].double() - inputs["rollout_logprobs"].double())
    cap = 1.4
    outside = keep & ((rho > cap) | (rho < 1 / cap))
    assert 0 < outside.sum() < keep.sum()
    grads, metrics = {}, {}
    for corr in ("mis", "tis"):
        config = PolicyLossConfig(loss_agg="token-mean", rollout_correction=corr, tis_cap=cap)
        x = logits.clone().requires_grad_(True)
        loss, metrics[corr] = policy_loss(x, inp, config=config, **kw)
        loss.backward()
        grads[corr] = x.grad
    assert (grads["mis"][outside] == 0).all()
    assert (grads["tis"][outside].abs().sum(-1) > 0).any()
    n = keep.sum().double()
    torch.testing.assert_close(metrics["mis"]["mismatch/tis_clip_frac"].double(), outside.sum() / n)
    torch.testing.assert_close(metrics["tis"]["mismatch/tis_clip_frac"].double(), (keep & (rho > cap)).sum() / n)
    kept_rho = torch.where(keep & ~outside, rho, 0.0)
    torch.testing.assert_close(metrics["mis"]["mismatch/tis_weight_mean"].double(), kept_rho.sum() / n, rtol=1e-5,
                               atol=1e-6)
    assert float(metrics["tis"]["mismatch/tis_weight_mean"]) <= cap


def test_mismatch_metrics_compare_engine_with_trainer_logprobs(backend):
    # Engine (rollout) vs trainer: the old log-probs when given, else the current ones. No correction runs.
    logits, inputs = make_case("packed", 1271, 190, n_seqs=4, max_len=6)
    inp, kw = split_inputs(inputs)
    keep = (inputs["mask"] != 0) & (inputs["labels"] != -100)
    n = keep.sum().double()
    config = PolicyLossConfig(loss_agg="token-mean", kl_coef=0.1)
    with torch.no_grad():
        logp = token_logprobs(logits, inputs["labels"], mask=inputs["mask"]).double()
    for trainer in ("old", "current"):
        call_inp = dataclasses.replace(inp, old_logprobs=None) if trainer == "current" else inp
        _, metrics = policy_loss(logits, call_inp, config=config, **kw)
        side = logp if trainer == "current" else inputs["old_logprobs"].double()
        diff = torch.where(keep, side - inputs["rollout_logprobs"].double(), 0.0)
        torch.testing.assert_close(metrics["mismatch/logprob_abs_diff_mean"].double(), diff.abs().sum() / n,
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(metrics["mismatch/logprob_abs_diff_max"].double(), diff.abs().max(), rtol=1e-5,
                                   atol=1e-6)
        k3 = torch.where(keep, diff.exp() - 1 - diff, 0.0).sum() / n
        torch.testing.assert_close(metrics["mismatch/kl_k3"].double(), k3, rtol=1e-5, atol=1e-6)
        assert "mismatch/tis_weight_mean" not in metrics
    _, metrics = policy_loss(logits, dataclasses.replace(inp, rollout_logprobs=None), config=config, **kw)
    assert not any(k.startswith("mismatch/") for k in metrics)


def test_gspo_needs_sequences():
    logits, inputs = make_case("packed", 7, 195)
    inputs["cu_seqlens"] = None
    inp, kw = split_inputs(inputs)
    with pytest.raises(ValueError, match="cu_seqlens"):
        policy_loss(logits, inp, config=PolicyLossConfig(objective="gspo", loss_agg="token-mean"), **kw)


@pytest.mark.parametrize("fn", ["policy_loss", "linear_policy_loss"])
def test_all_tokens_masked_gives_zero_loss_metrics_and_gradients(backend, fn):
    logits, inputs = make_case("packed", 7, 196, n_seqs=3, max_len=5)
    inputs["mask"] = torch.zeros_like(inputs["mask"])
    inp, kw = split_inputs(inputs)
    g = torch.Generator().manual_seed(197)
    hidden, weight = torch.randn(inputs["labels"].shape[0], 4, generator=g), torch.randn(7, 4, generator=g)
    for objective in ("ppo", "gspo", "cispo"):
        config = PolicyLossConfig(objective=objective, kl_coef=0.1, rollout_correction="tis")
        if fn == "policy_loss":
            leaves = [logits.clone().requires_grad_(True)]
            loss, metrics = policy_loss(leaves[0], inp, config=config, **kw)
        else:
            leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
            loss, metrics = linear_policy_loss(*leaves, inp, config=config, chunk_tokens=4, **kw)
        loss.backward()
        assert float(loss.detach()) == 0 and all(float(v) == 0 for v in metrics.values())
        assert all((leaf.grad == 0).all() for leaf in leaves)


# ---------------------------------------------------------------------------------------------------------
# Device-side validation: what an accelerator sees (no host read), proven here by turning the CPU shortcut off
# ---------------------------------------------------------------------------------------------------------

# aten ops that would wait for the device on CUDA.
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::item"}


class _SyncOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _SYNC_OPS:
            self.seen.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def as_on_an_accelerator(monkeypatch):
    """CPU tensors treated like CUDA ones: data checks become the device flag, no masked-row compaction."""
    monkeypatch.setattr(kernels.device, "host_sync_is_free", lambda t: False)


@pytest.mark.parametrize("fn", ["policy_loss", "linear_policy_loss"])
def test_input_errors_flag_instead_of_a_host_sync(as_on_an_accelerator, fn):
    logits, inputs = make_case("packed", 7, 200, n_seqs=3, max_len=5)
    inputs["mask"] = torch.ones_like(inputs["mask"])
    inputs["labels"] = inputs["labels"].clamp(min=0)
    n = inputs["labels"].shape[0]
    g = torch.Generator().manual_seed(201)
    hidden, weight = torch.randn(n, 4, generator=g), torch.randn(7, 4, generator=g)
    config = PolicyLossConfig(objective="gspo", kl_coef=0.1, rollout_correction="tis")

    def run(**changes):
        inp, kw = split_inputs({**inputs, **changes})
        x = (logits if fn == "policy_loss" else hidden).clone().requires_grad_(True)
        recorder = _SyncOps()
        with recorder:  # Triton path (the interpreter here, compiled kernels on CUDA): the code a GPU runs
            if fn == "policy_loss":
                loss, metrics = policy_loss(x, inp, config=config, **kw)
            else:
                loss, metrics = linear_policy_loss(x, weight, inp, config=config, chunk_tokens=4, **kw)
            loss.backward()
        assert recorder.seen == [], f"host syncs on the accelerator path: {recorder.seen}"
        flags = metrics["input_errors"]
        assert flags.dtype == torch.int32 and flags.dim() == 0
        return int(flags)

    assert run() == 0
    raise_on_input_errors(torch.zeros((), dtype=torch.int32))  # 0 passes
    adv = inputs["advantages"].clone()
    adv[1] = float("nan")
    labels = inputs["labels"].clone()
    labels[0] = 7
    cu = inputs["cu_seqlens"].clone()
    cu[-1] -= 1
    assert run(advantages=adv) == 1
    assert run(labels=labels) == 2
    assert run(cu_seqlens=cu) == 4
    bits = run(advantages=adv, labels=labels, cu_seqlens=cu)
    assert bits == 7
    with pytest.raises(ValueError, match="advantages") as err:
        raise_on_input_errors(torch.tensor(bits, dtype=torch.int32))
    assert "labels" in str(err.value) and "cu_seqlens" in str(err.value)
    # A masked out-of-range label or NaN advantage is not an error.
    assert run(mask=(torch.arange(n) != 0).long(), labels=labels) == 0


def test_token_logprobs_without_host_sync_mark_bad_labels_nan(as_on_an_accelerator):
    g = torch.Generator().manual_seed(210)
    logits = torch.randn(9, 97, generator=g) * 2
    labels = torch.randint(0, 97, (9,), generator=g)
    mask = torch.ones(9, dtype=torch.bool)
    mask[4] = False
    ref = token_logprobs(logits, labels, mask=mask)
    labels[2], labels[4] = 97, -3  # row 2 kept (bad), row 4 masked (fine)
    hidden, weight = torch.randn(9, 8, generator=g), torch.randn(97, 8, generator=g)
    ref_lin = linear_token_logprobs(hidden, weight, labels.clamp(0, 96), mask=mask)
    recorder = _SyncOps()
    with recorder:
        x = logits.clone().requires_grad_(True)
        lp = token_logprobs(x, labels, mask=mask)
        lp[torch.arange(9) != 2].sum().backward()
        h = hidden.clone().requires_grad_(True)
        lp_lin = linear_token_logprobs(h, weight, labels, mask=mask, chunk_tokens=4)
        lp_lin[torch.arange(9) != 2].sum().backward()
    assert recorder.seen == []
    for out, expected in ((lp, ref), (lp_lin, ref_lin)):
        assert math.isnan(float(out[2])) and float(out[4]) == 0
        keep = torch.arange(9) != 2
        torch.testing.assert_close(out[keep], expected[keep], atol=1e-5, rtol=0)
    assert torch.isfinite(x.grad).all() and (x.grad[4] == 0).all() and (h.grad[4] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# The objective registry: one entry per objective, used by the config, the chunked driver and the reference
# ---------------------------------------------------------------------------------------------------------


def test_registry_carries_token_locality_dual_clip_and_the_reference():
    from kernels import reference
    from kernels.objective import OBJECTIVES, register_objective

    assert {name: (o.token_local, o.dual_clip) for name, o in OBJECTIVES.items()} == \
        {"ppo": (True, True), "gspo": (False, True), "cispo": (True, False)}
    assert {name: o.reference for name, o in OBJECTIVES.items()} == \
        {"ppo": reference.ppo_term_ref, "gspo": reference.gspo_term_ref, "cispo": reference.cispo_term_ref}
    for name, o in OBJECTIVES.items():
        config = PolicyLossConfig(objective=name)
        assert config.objective_spec is o and config.token_local == o.token_local
    with pytest.raises(ValueError, match="choose one of \\('ppo', 'gspo', 'cispo'\\)"):
        PolicyLossConfig(objective="grpo")
    with pytest.raises(ValueError, match="registered twice"):
        register_objective("ppo", token_local=True, dual_clip=True, reference=reference.ppo_term_ref)(lambda: None)


def test_a_new_registered_objective_runs_everywhere(backend, monkeypatch):
    # One registration makes a name usable by the config, both losses (the token-local one-pass driver) and the
    # float64 reference: here PPO's entry under a second name gives PPO's numbers.
    from kernels.objective import OBJECTIVES

    monkeypatch.setitem(OBJECTIVES, "ppo-again", OBJECTIVES["ppo"])
    logits, inputs = make_case("packed", 211, 220, n_seqs=3, max_len=6)
    results = {}
    for name in ("ppo", "ppo-again"):
        config = PolicyLossConfig(objective=name, loss_agg="seq-mean-token-mean", clip_ratio_c=1.6, kl_coef=0.1)
        ours, ref = check(logits, inputs, config, 220)
        assert_matches(ours, ref)
        results[name] = ours
    torch.testing.assert_close(results["ppo-again"][0], results["ppo"][0], rtol=0, atol=0)
