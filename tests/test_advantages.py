"""Closed-form and edge-case tests for group-relative advantages."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from gspo.advantages import SCALES, group_advantages

F64 = torch.float64
ATOL = 1e-12

REWARDS = [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 1.0], [0.5, -1.5, 2.0, 0.25]]


def _ref(rows, scale, eps):
    flat = [x for r in rows for x in r]
    out = []
    for r in rows:
        m = sum(r) / len(r)
        if scale == "maxrl":  # the group's mean reward; a mean <= 0 (a negative reward present): A = 0
            out.append([(x - m) / (m + eps) if m > 0 else 0.0 for x in r])
            continue
        if scale == "none":
            d = 1.0
        elif scale == "group":
            d = statistics.pstdev(r) + eps
        else:
            d = statistics.pstdev(flat) + eps
        out.append([(x - m) / d for x in r])
    return out


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("eps", [1e-6, 0.0, 0.5])
def test_closed_form_values(scale, eps):
    """(r - group mean) / (population std + eps) with per-group, whole-batch or no scaling."""
    got = group_advantages(torch.tensor(REWARDS, dtype=F64), scale, eps)
    want = torch.tensor(_ref(REWARDS, scale, eps), dtype=F64)
    assert torch.allclose(got, want, atol=ATOL, rtol=0)


def test_hand_values_group_scale():
    """[1,2,3,4]: std sqrt(1.25) -> A = (-1.5,-.5,.5,1.5)/sqrt(1.25); [0,0,1,1] -> (-1,-1,1,1)."""
    got = group_advantages(torch.tensor(REWARDS[:2], dtype=F64), "group", eps=0.0)
    s = math.sqrt(1.25)
    want = torch.tensor([[-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], [-1.0, -1.0, 1.0, 1.0]], dtype=F64)
    assert torch.allclose(got, want, atol=ATOL, rtol=0)


def test_default_scale_and_eps():
    """Defaults are scale='group', eps=1e-6."""
    r = torch.tensor(REWARDS, dtype=F64)
    assert torch.equal(group_advantages(r), group_advantages(r, "group", 1e-6))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_rewards_give_exactly_zero(scale, eps, dtype):
    """A group of identical rewards gets A == 0 exactly (no rounding residue, no NaN), also G=1."""
    for value in [0.0, 0.1, 0.3, 0.7, 1 / 3, 2.2, -5.0, 1e6]:
        for G in [1, 3, 7, 11, 16]:
            r = torch.full((2, G), value, dtype=dtype)
            r[1] = 1.0
            out = group_advantages(r, scale, eps)
            assert torch.equal(out, torch.zeros_like(out)), (value, G)


@pytest.mark.parametrize("scale", SCALES)
def test_equal_group_zero_next_to_informative_group(scale):
    """An all-equal group is exactly 0 while another group in the batch still gets its values."""
    r = torch.tensor([[0.1] * 7, [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]], dtype=torch.float32)
    out = group_advantages(r, scale, 0.0)
    assert torch.equal(out[0], torch.zeros(7))
    assert (out[1] != 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_no_nan(scale, eps):
    """No NaN/inf for binary, equal, G=1 and tiny-spread groups, even with eps=0."""
    cases = [
        torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
        torch.tensor([[3.0], [4.0]]),
        torch.tensor([[1.0, 1.0 + 1e-15, 1.0]], dtype=F64),
        torch.tensor([[0.0, 1e-300]], dtype=F64),
    ]
    for r in cases:
        assert torch.isfinite(group_advantages(r, scale, eps)).all()


def test_shape_and_scale_errors():
    """Non-2-D rewards and unknown scales raise ValueError."""
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(()))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 3), scale="std")


def test_dtypes():
    """float64 stays float64; float32 stays float32; integer/half rewards become float32."""
    assert group_advantages(torch.tensor(REWARDS, dtype=F64)).dtype == F64
    assert group_advantages(torch.tensor(REWARDS, dtype=torch.float32)).dtype == torch.float32
    assert group_advantages(torch.tensor([[0, 1, 1]])).dtype == torch.float32
    assert group_advantages(torch.tensor([[0, 1, 1]], dtype=torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("scale", SCALES)
def test_zero_mean_per_group(scale):
    """Every group's advantages sum to 0 (to rounding), including groups far from the origin."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(6, 8, generator=g, dtype=F64)
    r[3] = r[3] * 1e-9 + 1e6  # large offset, tiny spread
    out = group_advantages(r, scale)
    scale_ = out.abs().amax(dim=1).clamp(min=1)
    assert (out.sum(dim=1).abs() <= 1e-12 * scale_).all()


def test_group_scale_unit_std_and_affine_invariance():
    """With eps=0 each non-constant group has population std 1 and A(a r + b) == A(r) for a > 0."""
    g = torch.Generator().manual_seed(1)
    r = torch.randn(5, 6, generator=g, dtype=F64)
    out = group_advantages(r, "group", 0.0)
    assert torch.allclose(out.std(dim=1, correction=0), torch.ones(5, dtype=F64), atol=ATOL, rtol=0)
    for scale in ("group", "batch"):
        a = group_advantages(r, scale, 0.0)
        b = group_advantages(3.5 * r - 7.0, scale, 0.0)
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_batch_scale_uses_whole_batch_std():
    """'batch' divides per-group centered rewards by the population std of all rewards."""
    r = torch.tensor([[0.0, 2.0], [10.0, 14.0]], dtype=F64)
    std = statistics.pstdev([0.0, 2.0, 10.0, 14.0])
    want = torch.tensor([[-1.0, 1.0], [-2.0, 2.0]], dtype=F64) / std
    assert torch.allclose(group_advantages(r, "batch", 0.0), want, atol=ATOL, rtol=0)


def test_input_not_modified_and_empty_ok():
    """The rewards tensor is not modified in place; empty batches return an empty tensor."""
    r = torch.tensor(REWARDS, dtype=F64)
    r0 = r.clone()
    group_advantages(r, "batch")
    assert torch.equal(r, r0)
    assert group_advantages(torch.zeros(0, 4)).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", SCALES)
def test_power_of_two_rescaling_is_exact_up_to_the_float_limits(scale, dtype):
    """A(2^k r) == A(r) bit for bit ("group"/"batch", eps=0) and == 2^k A(r) ("none"), for k up to
    the top of the float range (sums of rewards near finfo.max must not overflow to inf/NaN)."""
    r = torch.tensor(REWARDS, dtype=dtype)  # |r| <= 4 = 2^2
    max_exp, min_exp = (128, -126) if dtype == torch.float32 else (1024, -1022)  # finfo.max < 2^max_exp
    top = max_exp - 3  # 4 * 2^top < finfo.max, but a sum of 4 such values overflows
    bottom = min_exp + 2  # 0.25 * 2^bottom is still a normal float
    base = group_advantages(r, scale, 0.0)
    for k in (bottom, -20, 20, top):
        f = 2.0**k
        got = group_advantages(r * f, scale, 0.0)
        assert torch.isfinite(got).all(), k
        want = base * f if scale == "none" else base
        assert torch.equal(got, want), k


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_extreme_magnitudes_hand_values(scale):
    """Rewards near finfo.max or subnormal still give the exact normalized values (eps=0)."""
    F32 = torch.float32
    big = group_advantages(torch.tensor([[1.7e308, 1.0e308]], dtype=F64), scale, 0.0)
    assert torch.allclose(big, torch.tensor([[1.0, -1.0]], dtype=F64), atol=ATOL, rtol=0)
    big32 = group_advantages(torch.tensor([[3e38, 3e38, 1e38]], dtype=F32), scale, 0.0)
    want32 = torch.tensor([[2**-0.5, 2**-0.5, -(2**0.5)]], dtype=F32)
    assert torch.allclose(big32, want32, atol=1e-6, rtol=0)
    tiny = group_advantages(torch.tensor([[0.0, 5e-324], [1e-310, -3e-310]], dtype=F64), "group", 0.0)
    assert torch.equal(tiny, torch.tensor([[-1.0, 1.0], [1.0, -1.0]], dtype=F64))


@pytest.mark.parametrize("scale", SCALES)
def test_eps_dominates_tiny_spreads(scale):
    """With eps=1e-6 a spread of 1e-300 gives ~1e-294-sized advantages, never NaN or inf (eps / tiny
    unit overflows to inf there, which must give 0, not NaN)."""
    r = torch.tensor([[0.0, 5e-324], [1e-300, -1e-300], [0.0, 1.0]], dtype=F64)
    out = group_advantages(r, scale, 1e-6)
    assert torch.isfinite(out).all()
    assert (out[:2].abs() <= 1e-293).all()
    if scale == "group":
        assert torch.allclose(out[1], torch.tensor([1e-294, -1e-294], dtype=F64), atol=0, rtol=1e-9)
        assert torch.allclose(out[2], torch.tensor([-1.0, 1.0], dtype=F64) / (1 + 2e-6), atol=ATOL, rtol=0)
