"""GAE, whitening and the clipped value loss (kernels/gae.py) against the float64 loops of kernels/reference.py, on
fresh seeded inputs: padded ragged batches, packed rows, environment-token holes inside responses, (γ, λ) sweeps."""

import pytest
import torch

from kernels.gae import explained_variance, gae, gae_packed, value_loss, whiten
from kernels.packing import cu_seqlens_from_lengths
from kernels.reference import gae_reference, value_loss_reference

GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (1.0, 0.95), (0.9, 0.0), (0.0, 0.7), (0.7, 1.0)]


def random_mask(g: torch.Generator, lengths: list[int], width: int, *, holes: bool) -> torch.Tensor:
    """[B, width] bool: row b trains tokens 0 .. lengths[b]-1 (padding after), and with `holes` some rows have
    environment-token runs (mask 0) in the middle of the response, one of them a run right before the end."""
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    if holes:
        for b, n in enumerate(lengths):
            if n >= 6 and b % 2 == 0:  # a tool output of 1..3 tokens somewhere inside the response
                start = int(torch.randint(1, n - 4, (), generator=g))
                mask[b, start:start + int(torch.randint(1, 4, (), generator=g))] = False
        b = max(range(len(lengths)), key=lambda i: lengths[i])
        mask[b, lengths[b] - 3:lengths[b] - 1] = False  # a trailing tool output before the last trained token
    return mask


def random_batch(seed: int, lengths: list[int], *, holes: bool, width: int | None = None):
    """Padded float32 rewards, values, mask [B, width]. Rewards: a sequence reward on the last trained token plus a
    per-token KL-like penalty everywhere; garbage (large, NaN) off the mask, which must never be read."""
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    mask = random_mask(g, lengths, width, holes=holes)
    rewards = -0.05 * torch.rand(len(lengths), width, generator=g)
    for b in range(len(lengths)):
        last = int(mask[b].nonzero().max())
        rewards[b, last] += float(torch.randn((), generator=g))
    values = torch.randn(len(lengths), width, generator=g)
    rewards = torch.where(mask, rewards, 1e4)
    values = torch.where(mask, values, float("nan"))
    return rewards, values, mask


def assert_close(got: torch.Tensor, ref: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------- padded
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_padded_ragged_with_environment_holes(seed, gamma, lam):
    rewards, values, mask = random_batch(seed, [1, 7, 13, 4, 29, 16, 2], holes=True)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma=gamma, lam=lam)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)
    assert not adv[~mask].any() and not ret[~mask].any()  # environment tokens and padding: 0
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()  # NaN values off the mask never read


@pytest.mark.parametrize("seed", [2, 3])
def test_gae_bf16_inputs_use_float32_math(seed):
    rewards, values, mask = random_batch(seed, [5, 11, 3], holes=True)
    rewards, values = rewards.bfloat16(), values.bfloat16()
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma=0.99, lam=0.95)  # on the same bf16 values
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def test_gae_conventions_by_hand():
    """One row: trained, tool output (2 tokens), trained, trained, padding. γ = 0.5, λ = 1.
    The tool output is skipped: token 0 bootstraps from token 3's value; the last trained token from 0."""
    r = torch.tensor([[0.0, 9.0, 9.0, 0.0, 1.0, 5.0]])
    v = torch.tensor([[0.2, 7.0, 7.0, 0.4, 0.6, 3.0]])
    m = torch.tensor([[1, 0, 0, 1, 1, 0]])
    adv, ret = gae(r, v, m, gamma=0.5, lam=1.0)
    a4 = 1.0 - 0.6  # δ = r + γ·0 − V: terminal
    a3 = (0.0 + 0.5 * 0.6 - 0.4) + 0.5 * a4
    a0 = (0.0 + 0.5 * 0.4 - 0.2) + 0.5 * a3  # across the tool output, γ counts trained tokens only
    torch.testing.assert_close(adv, torch.tensor([[a0, 0, 0, a3, a4, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.2, 0, 0, a3 + 0.4, a4 + 0.6, 0]]))
    # γ = λ = 1: every trained token's return is the sum of the rewards on trained tokens from it on.
    _, ret1 = gae(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret1, torch.tensor([[1.0, 0, 0, 1.0, 1.0, 0]]))


# ----------------------------------------------------------------------------------------------- packed
def packed_batch(seed: int, lengths: list[int], tail: int = 0):
    """The padded batch of `random_batch` concatenated into one row of sum(lengths) + tail tokens."""
    rewards, values, mask = random_batch(seed, lengths, holes=True)
    keep = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]

    def flat(x, fill):
        return torch.cat([x[keep], torch.full((tail,), fill, dtype=x.dtype)])

    return flat(rewards, 3.0), flat(values, 2.0), flat(mask, True), cu_seqlens_from_lengths(lengths)


@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_gae_packed_matches_reference(gamma, lam, cu_dtype):
    lengths = [6, 1, 17, 9, 3, 12]
    rewards, values, mask, cu = packed_batch(4, lengths, tail=5)  # a bucketed tail whose mask is 1: still 0 out
    adv, ret = gae_packed(rewards, values, mask, cu.to(cu_dtype), gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma=gamma, lam=lam, cu_seqlens=cu)
    assert adv.shape == ret.shape == rewards.shape
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)
    assert not adv[-5:].any() and not ret[-5:].any()
    # The same as the padded path on the same sequences.
    p_rewards, p_values, p_mask = random_batch(4, lengths, holes=True)
    p_adv, _ = gae(p_rewards, p_values, p_mask, gamma=gamma, lam=lam)
    keep = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    torch.testing.assert_close(adv[:-5], p_adv[keep])


def test_gae_packed_never_crosses_a_sequence_boundary():
    """Changing a later sequence's values and rewards leaves every earlier sequence's advantages bit-identical;
    and a sequence whose last token is trained bootstraps from 0, not from the next sequence's first value."""
    lengths = [5, 8, 4, 7]
    g = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(sum(lengths), generator=g), torch.randn(sum(lengths), generator=g)
    mask, cu = torch.ones(sum(lengths), dtype=torch.bool), cu_seqlens_from_lengths(lengths)
    adv, ret = gae_packed(rewards, values, mask, cu, gamma=0.99, lam=0.95)
    for s in range(1, len(lengths)):
        start = int(cu[s])
        values2, rewards2 = values.clone(), rewards.clone()
        values2[start:] += 100.0
        rewards2[start:] -= 50.0
        adv2, ret2 = gae_packed(rewards2, values2, mask, cu, gamma=0.99, lam=0.95)
        assert torch.equal(adv2[:start], adv[:start]) and torch.equal(ret2[:start], ret[:start])
        assert not torch.equal(adv2[start:], adv[start:])
    end = int(cu[1]) - 1
    torch.testing.assert_close(adv[end], rewards[end] - values[end])


def test_gae_input_errors_name_the_fix():
    r, v, m = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="values has shape"):
        gae(r, v[:, :2], m, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        gae(r, v, m, gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match="must be \\[B, T\\]"):
        gae(r.flatten(), v.flatten(), m.flatten(), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 9 > 6"):
        gae_packed(r.flatten(), v.flatten(), m.flatten(), torch.tensor([0, 4, 9]), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="every sequence length must be > 0"):
        gae_packed(r.flatten(), v.flatten(), m.flatten(), torch.tensor([0, 4, 4, 6]), gamma=1.0, lam=1.0)


# ----------------------------------------------------------------------------------------------- whitening
def test_whiten_masked_mean_and_std():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 9, generator=g) * 3 + 2
    mask = torch.rand(4, 9, generator=g) > 0.3
    kept = x[mask].double()
    want = torch.zeros(4, 9, dtype=torch.float64)
    want[mask] = (kept - kept.mean()) / kept.std()  # unbiased std
    torch.testing.assert_close(whiten(x, mask).double(), want, atol=1e-5, rtol=1e-5)
    scaled = whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(scaled[mask].double(), (kept - kept.mean()) / kept.std() + kept.mean(),
                               atol=1e-5, rtol=1e-5)
    assert not whiten(x, mask)[~mask].any()


# ----------------------------------------------------------------------------------------------- value loss
def value_inputs(seed: int, shape: tuple[int, ...], clip: float | None):
    """values, old_values, returns, mask; with a clip, values drift from old_values by up to ±3 clip so that the
    clip is active on some tokens and not on others."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g)
    drift = (torch.rand(shape, generator=g) * 2 - 1) * 3 * (clip or 0.2)
    values = old + drift
    returns = old + torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.25
    values = torch.where(mask, values, float("nan"))  # garbage off the mask must reach neither loss nor gradient
    return values, old, returns, mask


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("clip", [None, 0.2, 0.5])
@pytest.mark.parametrize("shape,agg", [((5, 23), "token-mean"), ((5, 23), "seq-mean-token-mean"),
                                       ((97,), "token-mean")])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_and_gradient_match_float64_reference(seed, shape, agg, clip):
    values, old, returns, mask = value_inputs(seed, shape, clip)
    v32 = values.clone().requires_grad_(True)
    loss, metrics = value_loss(v32, old, returns, mask, clip=clip, agg=agg)
    upstream = float(torch.empty(()).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(seed)))
    (upstream * loss).backward()  # a random upstream gradient, not 1
    v64 = values.double().requires_grad_(True)
    ref = value_loss_reference(v64, old.double(), returns.double(), mask, clip=clip, agg=agg)
    (upstream * ref).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    grad_ref = torch.nan_to_num(v64.grad)  # the reference never reads masked slots: their gradient is 0 (or None)
    assert torch.isfinite(v32.grad).all() and not v32.grad[~mask].any()
    assert rel_err(v32.grad, grad_ref) <= 1e-4
    # Metrics: the clip fraction is the share of tokens where the clipped branch is the larger one.
    if clip is None:
        assert float(metrics["critic/value_clip_frac"]) == 0.0
    else:
        v, o, r = values.double()[mask], old.double()[mask], returns.double()[mask]
        clipped = (o + (v - o).clamp(-clip, clip) - r) ** 2 > (v - r) ** 2
        assert 0 < int(clipped.sum()) < clipped.numel()  # the clip is active on some tokens, not all
        assert abs(float(metrics["critic/value_clip_frac"]) - float(clipped.double().mean())) <= 1e-6
    assert abs(float(metrics["critic/value_mean"]) - float(values.double()[mask].mean())) <= 1e-5


def test_value_loss_clip_changes_the_gradient_exactly_where_active():
    """A token whose clipped branch wins gets no gradient (the clipped value is constant in v); the others get
    (v − R) / n."""
    values, old, returns, mask = value_inputs(7, (64,), 0.2)
    mask[:] = True
    values = old + (values - old).nan_to_num()
    v = values.clone().requires_grad_(True)
    value_loss(v, old, returns, mask, clip=0.2)[0].backward()
    clipped_wins = (old + (values - old).clamp(-0.2, 0.2) - returns) ** 2 > (values - returns) ** 2
    assert clipped_wins.any() and (~clipped_wins).any()
    want = torch.where(clipped_wins, 0.0, (values - returns) / 64)
    torch.testing.assert_close(v.grad, want)


def test_value_loss_global_token_count_sums_across_micro_batches():
    values, old, returns, mask = value_inputs(8, (6, 15), 0.3)
    whole, m_whole = value_loss(values, old, returns, mask, clip=0.3)
    n = mask.sum()
    parts = [value_loss(values[i:i + 2], old[i:i + 2], returns[i:i + 2], mask[i:i + 2], clip=0.3, num_tokens=n)
             for i in range(0, 6, 2)]
    torch.testing.assert_close(sum(p[0] for p in parts), whole)
    torch.testing.assert_close(sum(p[1]["critic/value_clip_frac"] for p in parts), m_whole["critic/value_clip_frac"])


def test_explained_variance():
    g = torch.Generator().manual_seed(9)
    returns = torch.randn(3, 10, generator=g)
    mask = torch.rand(3, 10, generator=g) > 0.2
    assert float(explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    mean = returns[mask].mean()
    assert float(explained_variance(torch.full_like(returns, float(mean)), returns, mask)) == pytest.approx(0.0,
                                                                                                           abs=1e-6)
    noisy = returns + 0.5 * torch.randn(3, 10, generator=g)
    r, v = returns[mask].double(), noisy[mask].double()
    want = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert float(explained_variance(noisy, returns, mask)) == pytest.approx(float(want), abs=1e-5)
    assert torch.isnan(explained_variance(returns, torch.ones_like(returns), mask))  # returns do not vary


def test_value_loss_input_errors():
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns has shape"):
        value_loss(v, v, v[:, :2], v.bool(), clip=0.2)
    with pytest.raises(ValueError, match="choose one of"):
        value_loss(v, v, v, v.bool(), clip=0.2, agg="seq-sum")
    with pytest.raises(ValueError, match="needs \\[B, T\\] rows"):
        value_loss(v.flatten(), v.flatten(), v.flatten(), v.flatten().bool(), clip=0.2, agg="seq-mean-token-mean")
    with pytest.raises(ValueError, match="must be > 0"):
        value_loss(v, v, v, v.bool(), clip=0.0)
