"""Hypothesis property tests for the losses and group advantages."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_helpers import call, tensor_loss
from test_losses import VARIANTS

from gspo.advantages import SCALES, group_advantages

F64 = torch.float64
# derandomize: CI runs the same examples every time (a failure reproduces; no flaky runs)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)
# each example runs forward + backward
LOSS_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)
# the properties every registered loss (and aggregation) must have: as many examples as the two
# copies of these tests had together (over gspo/grpo here, over the other losses beside their math)
EVERY_LOSS_SETTINGS = settings(max_examples=55, deadline=None, derandomize=True)

LOSS_FNS = {
    "gspo": tensor_loss("gspo"),
    "gspo_token": tensor_loss("gspo_token"),
    "grpo": tensor_loss("grpo"),
    "grpo_token_mean": lambda *a, **k: call("grpo", *a, aggregation="token_mean", **k),
}


def _finite_max(dtype: torch.dtype) -> float:
    """Largest magnitude that stays finite in ``dtype`` after rounding from float64."""
    return 3.3e38 if dtype == torch.bfloat16 else torch.finfo(dtype).max


@st.composite
def batches(draw, bound=None, names=None):
    """Random [B,T] logp/old_logp (finite, up to +-bound; default the whole range of the drawn
    dtype), 0/1 mask, advantages. Values are exact in float64; callers cast to ``dtype``."""
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([torch.float32, F64, torch.bfloat16]))
    if bound is None:
        top = _finite_max(dtype)
        width = 32 if dtype == torch.float32 else 64  # bf16 values round on the cast
        fl = st.floats(-top, top, allow_nan=False, allow_infinity=False, width=width)
    else:
        fl = st.floats(-bound, bound, allow_nan=False, allow_infinity=False)
    small = st.floats(-3.0, 0.0, allow_nan=False)
    vals = st.one_of(fl, small)
    logp = torch.tensor(draw(st.lists(vals, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    old = torch.tensor(draw(st.lists(vals, min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T)), dtype=F64).view(B, T)
    adv = torch.tensor(draw(st.lists(st.floats(-1e3, 1e3), min_size=B, max_size=B)), dtype=F64)
    name = draw(st.sampled_from(sorted(names or LOSS_FNS)))
    return logp, old, mask, adv, name, dtype


@EVERY_LOSS_SETTINGS
@given(batches(names=VARIANTS))
def test_losses_finite_for_finite_inputs(b):
    """Any finite inputs over the whole float range of float32/float64/bf16 (logp - old_logp may
    overflow) and random masks give finite loss/grad/metrics, zero grad on padding."""
    logp, old, mask, adv, name, dtype = b
    x = logp.to(dtype).requires_grad_(True)
    loss, m = VARIANTS[name](x, old.to(dtype), adv.to(dtype), mask.to(dtype))
    (g,) = torch.autograd.grad(loss, x)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert loss.dtype == torch.promote_types(dtype, torch.float32) and g.dtype == dtype
    assert torch.all(g[~mask.bool()] == 0)
    assert all(v.dim() == 0 and not v.requires_grad and torch.isfinite(v) for v in m.values())


@EVERY_LOSS_SETTINGS
@given(batches(bound=50.0, names=VARIANTS), st.integers(0, 3), st.data())
def test_losses_invariant_to_padding_content(b, extra, data):
    """Rewriting masked positions (and appending padded columns) with garbage changes nothing."""
    logp, old, mask, adv, name, _ = b
    B, T = mask.shape
    fn = VARIANTS[name]
    x1 = logp.clone().requires_grad_(True)
    l1, m1 = fn(x1, old, adv, mask)
    (g1,) = torch.autograd.grad(l1, x1)

    junk = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300, -1e300, 0.0, 7.0])
    n = B * (T + extra)
    fill = torch.tensor(data.draw(st.lists(junk, min_size=n, max_size=n)), dtype=F64).view(B, T + extra)
    fill_old = torch.tensor(data.draw(st.lists(junk, min_size=n, max_size=n)), dtype=F64).view(B, T + extra)
    mask2 = torch.cat([mask, torch.zeros(B, extra, dtype=F64)], 1)
    keep = mask2.bool()
    logp2 = torch.where(keep, torch.cat([logp, fill[:, T:]], 1), fill)
    old2 = torch.where(keep, torch.cat([old, fill[:, T:]], 1), fill_old)
    x2 = logp2.requires_grad_(True)
    l2, m2 = fn(x2, old2, adv, mask2)
    (g2,) = torch.autograd.grad(l2, x2)
    assert torch.allclose(l1, l2, atol=1e-12, rtol=1e-12)
    assert torch.isfinite(g2).all() and torch.all(g2[~keep] == 0)
    assert torch.allclose(g1, g2[:, :T], atol=1e-12, rtol=1e-12)
    for k in m1:
        assert torch.allclose(m1[k], m2[k], atol=1e-12, rtol=1e-12), k


@LOSS_SETTINGS
@given(batches(bound=40.0), st.booleans(), st.sampled_from([(3e-4, 4e-4), (0.2, 0.27)]))
def test_gspo_token_equals_gspo_for_constant_advantages(b, explicit, eps):
    """GSPO-token with A_it = A_i equals GSPO in value and gradient for random batches."""
    logp, old, mask, adv, _, _ = b
    x1 = logp.clone().requires_grad_(True)
    x2 = logp.clone().requires_grad_(True)
    l1, _ = call("gspo", x1, old, adv, mask, *eps)
    a = adv[:, None].expand_as(logp).clone() if explicit else adv
    l2, _ = call("gspo_token", x2, old, a, mask, *eps)
    (g1,) = torch.autograd.grad(l1, x1)
    (g2,) = torch.autograd.grad(l2, x2)
    tol = 1e-12 * max(1.0, l1.abs().item())
    assert abs(l1.item() - l2.item()) <= tol
    assert torch.allclose(g1, g2, atol=1e-12, rtol=1e-10)


@LOSS_SETTINGS
@given(
    st.integers(1, 4),
    st.lists(st.integers(1, 6), min_size=4, max_size=4),
    st.lists(st.floats(-50.0, 0.0), min_size=24, max_size=24),
    st.lists(st.floats(-6e-4, 6e-4), min_size=24, max_size=24),
    st.lists(st.floats(-2.0, 2.0), min_size=4, max_size=4),
)
def test_gspo_token_equals_gspo_in_float32(B, lengths, old_vals, delta_vals, adv_vals):
    """float32, realistic log-probs and log-ratios straddling the default clip edges: GSPO-token's
    clip metrics equal GSPO's exactly (same s_i) and the loss agrees to float32 rounding."""
    T = 6
    old = torch.tensor((old_vals * 2)[: B * T]).view(B, T)
    delta = torch.tensor((delta_vals * 2)[: B * T]).view(B, T)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths[:B])[:, None]).float()
    x1 = (old + delta).requires_grad_(True)
    x2 = x1.detach().clone().requires_grad_(True)
    adv = torch.tensor(adv_vals[:B])
    l1, m1 = call("gspo", x1, old, adv, mask)
    l2, m2 = call("gspo_token", x2, old, adv, mask)
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k
    assert abs(l1.item() - l2.item()) <= 1e-6 * (adv.abs().sum().item() + 1e-30)
    (g1,) = torch.autograd.grad(l1, x1)
    (g2,) = torch.autograd.grad(l2, x2)
    assert torch.allclose(g1, g2, atol=1e-7, rtol=1e-5)


@st.composite
def reward_batches(draw):
    N = draw(st.integers(1, 5))
    G = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, F64]))
    # "max": the whole finite range of dtype, subnormals included; otherwise float64 values in
    # +-bound that round (finitely) on the cast to float32
    bound = draw(st.sampled_from([1.0, 1e6, 1e30, "max"]))
    width = 32 if (bound == "max" and dtype == torch.float32) else 64
    top = torch.finfo(dtype).max if bound == "max" else bound
    vals = st.one_of(
        st.floats(-top, top, allow_nan=False, allow_infinity=False, width=width),
        st.sampled_from([0.0, 1.0, 0.1]),
    )
    r = draw(st.lists(vals, min_size=N * G, max_size=N * G))
    return torch.tensor(r, dtype=dtype).view(N, G)


# the scales that divide by a spread (or nothing); maxrl divides by the mean: its own property below
SPREAD_SCALES = [s for s in SCALES if s != "maxrl"]


@SETTINGS
@given(reward_batches(), st.sampled_from(SPREAD_SCALES), st.sampled_from([1e-6, 0.0]))
def test_advantages_finite_zero_sum_and_equal_groups_zero(r, scale, eps):
    """Advantages are finite, sum to ~0 per group, and are exactly 0 for all-equal groups."""
    out = group_advantages(r, scale, eps)
    assert out.shape == r.shape and out.dtype == r.dtype
    N, G = r.shape
    if scale == "none":  # centered rewards: finite whenever representable (|r - mean| <= 2 max|r|)
        assert torch.isfinite(out).all() or r.abs().max() > torch.finfo(r.dtype).max / 2
    else:
        assert torch.isfinite(out).all()
        # population std: |r - mean| <= sqrt(G) std_group, and <= sqrt(N G) std_batch
        lim = (G if scale == "group" else N * G) ** 0.5
        assert (out.abs() <= lim * (1 + 1e-5)).all()
    finite_rows = torch.isfinite(out).all(dim=1)  # "none" may overflow near the dtype's max (allowed above)
    out_f = out[finite_rows].double()  # the check's own sum must not overflow near float32's max
    rel = 1e-12 if r.dtype == F64 else 1e-5
    mag = out_f.abs().amax(dim=1).clamp(min=1.0) if len(out_f) else out_f.sum(dim=1)
    assert (out_f.sum(dim=1).abs() <= rel * r.shape[1] * mag).all()
    equal = (r == r[:, :1]).all(dim=1)
    assert torch.all(out[equal] == 0)


@SETTINGS
@given(reward_batches(), st.sampled_from([1e-6, 0.0]))
def test_maxrl_advantages_bounded_zero_sum_and_zero_without_success(r, eps):
    """MaxRL on rewards >= 0 over the whole float range: finite, A_ij = r_ij / m_i - 1 in [-1, G - 1],
    sum ~0 per group, exactly 0 for equal groups and for all-zero groups (mean 0)."""
    r = r.abs()
    out = group_advantages(r, "maxrl", eps)
    N, G = r.shape
    assert out.shape == r.shape and out.dtype == r.dtype and torch.isfinite(out).all()
    assert (out >= -1 - 1e-6).all() and (out <= (G - 1) * (1 + 1e-6)).all()
    rel = 1e-12 if r.dtype == F64 else 1e-5
    out_f = out.double()
    mag = out_f.abs().amax(dim=1).clamp(min=1.0)
    assert (out_f.sum(dim=1).abs() <= rel * G * mag).all()
    zero_or_equal = (r == r[:, :1]).all(dim=1)
    assert torch.all(out[zero_or_equal] == 0)


@st.composite
def normal_reward_batches(draw):
    """Rewards that are 0 or of magnitude in [1e-10, 1e10], so 2^k r (|k| <= 60) stays normal."""
    N = draw(st.integers(1, 4))
    G = draw(st.integers(1, 6))
    mag = st.floats(1e-10, 1e10)
    val = st.one_of(st.just(0.0), mag, mag.map(lambda v: -v), st.sampled_from([0.0, 1.0, 0.1]))
    dtype = draw(st.sampled_from([torch.float32, F64]))
    return torch.tensor(draw(st.lists(val, min_size=N * G, max_size=N * G)), dtype=dtype).view(N, G)


@SETTINGS
@given(normal_reward_batches(), st.sampled_from(SCALES), st.integers(-60, 60))
def test_advantages_exactly_invariant_to_power_of_two_rescaling(r, scale, k):
    """With eps=0, A(2^k r) == A(r) bit for bit ("group"/"batch") and == 2^k A(r) ("none")."""
    a = group_advantages(r, scale, 0.0)
    b = group_advantages(r * 2.0**k, scale, 0.0)
    assert torch.equal(b, a * 2.0**k if scale == "none" else a)
