"""Math tests for SAPO, SAPO-token, CISPO and GMPO, and for the ``weight`` argument of every loss.

Plain-Python references (lists + math, no torch) and hand-computed numbers in float64; analytic
gradients compared with autograd at 1e-12; identities with GSPO / GRPO where they hold. The fixtures
and :data:`VARIANTS` are tests/test_losses.py's; the hypothesis properties every loss shares run over
:data:`VARIANTS` in tests/test_properties.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import call, tensor_loss
from test_losses import (
    ADV,
    ATOL,
    F64,
    PER_CALL,
    SEQUENCE_LEVEL,
    VARIANTS,
    _batch,
    _grad,
    _normalizer,
    _token_batch,
)

from gspo.losses import (
    MAX_LOG_RATIO,
)

TAU_NEG, TAU_POS = 1.05, 1.0

# ----------------------------------------------------------------------------------------------
# independent references (plain python lists + math, no torch)


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().to(F64).tolist()


def _toks(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m == 1]


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def _f(r: float, tau: float) -> float:
    """SAPO's gate f(r) = (4/tau) sigmoid(tau (r - 1))."""
    return 4 / tau * _sig(tau * (r - 1))


def _g(r: float, tau: float) -> float:
    """df/dr = 4 sigmoid(x) (1 - sigmoid(x)), x = tau (r - 1)."""
    s = _sig(tau * (r - 1))
    return 4 * s * (1 - s)


def _tau(a: float, tn: float = TAU_NEG, tp: float = TAU_POS) -> float:
    return tp if a > 0 else tn


def _seq_ratio(lp, o, toks) -> float:
    return math.exp(sum(lp[t] - o[t] for t in toks) / len(toks))


def _adv_rows(adv: torch.Tensor, T: int) -> list[list[float]]:
    return _rows(adv if adv.dim() == 2 else adv[:, None].expand(-1, T))


def _weights(w, B, T):
    if w is None:
        return [[1.0] * T for _ in range(B)]
    return _rows(w if w.dim() == 2 else w[:, None].expand(-1, T))


def ref_sapo(logp, old, adv, mask, tn=TAU_NEG, tp=TAU_POS, n=None, w=None):
    """Value and gradient [B][T] of sequence-level SAPO."""
    L, Ol, M, A = _rows(logp), _rows(old), _rows(mask), adv.tolist()
    B, T = len(L), len(L[0])
    W = _weights(w, B, T)
    N = B if n is None else n
    total, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        toks = _toks(M[i])
        if not toks:
            continue
        s, tau = _seq_ratio(L[i], Ol[i], toks), _tau(A[i], tn, tp)
        total += W[i][0] * _f(s, tau) * A[i]
        for t in toks:
            grad[i][t] = -W[i][0] * A[i] * _g(s, tau) * s / len(toks) / N
    return -total / N, grad


def ref_sapo_token(logp, old, adv, mask, tn=TAU_NEG, tp=TAU_POS, n=None, agg="seq_mean_token_mean", w=None):
    L, Ol, M = _rows(logp), _rows(old), _rows(mask)
    B, T = len(L), len(L[0])
    A, W = _adv_rows(adv, T), _weights(w, B, T)
    n_tok = sum(len(_toks(m)) for m in M)
    N = (B if agg == "seq_mean_token_mean" else max(n_tok, 1)) if n is None else n
    total, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        toks = _toks(M[i])
        per = len(toks) if agg == "seq_mean_token_mean" else 1
        for t in toks:
            r, tau = math.exp(L[i][t] - Ol[i][t]), _tau(A[i][t], tn, tp)
            total += W[i][t] * _f(r, tau) * A[i][t] / per
            grad[i][t] = -W[i][t] * A[i][t] * _g(r, tau) * r / per / N
    return -total / N, grad


def ref_cispo(logp, old, adv, mask, el=1.0, eh=0.28, n=None, agg="token_mean", w=None):
    """Value sum sg(clip(r)) A / N (the clipped-IS estimate), gradient -(1/N) clip(r) A per token."""
    L, Ol, M = _rows(logp), _rows(old), _rows(mask)
    B, T = len(L), len(L[0])
    A, W = _adv_rows(adv, T), _weights(w, B, T)
    n_tok = sum(len(_toks(m)) for m in M)
    N = (B if agg == "seq_mean_token_mean" else max(n_tok, 1)) if n is None else n
    total, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        toks = _toks(M[i])
        per = len(toks) if agg == "seq_mean_token_mean" else 1
        for t in toks:
            wh = min(max(math.exp(L[i][t] - Ol[i][t]), 1 - el), 1 + eh)
            total += W[i][t] * wh * A[i][t] / per
            grad[i][t] = -W[i][t] * wh * A[i][t] / per / N
    return -total / N, grad


def ref_gmpo(logp, old, adv, mask, el=0.4, eh=0.4, n=None, w=None):
    L, Ol, M, A = _rows(logp), _rows(old), _rows(mask), adv.tolist()
    B, T = len(L), len(L[0])
    W = _weights(w, B, T)
    N = B if n is None else n
    total, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        toks = _toks(M[i])
        if not toks:
            continue
        cs, free = [], []
        for t in toks:
            lr = L[i][t] - Ol[i][t]
            if A[i] > 0 and lr > eh:
                cs.append(eh)
            elif A[i] < 0 and lr < -el:
                cs.append(-el)
            else:
                cs.append(lr)
                free.append(t)
        S = math.exp(sum(cs) / len(toks))
        total += W[i][0] * A[i] * S
        for t in free:
            grad[i][t] = -W[i][0] * A[i] * S / len(toks) / N
    return -total / N, grad


def _close(g, want):
    return torch.allclose(g, torch.tensor(want, dtype=F64), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# SAPO: closed-form values and gradients


def test_sapo_value_and_gradient_hand_computed():
    """B=2 by hand: s=e^.2 with A=1 (tau_pos=1), s=e^-.3 with A=-2 (tau_neg=1.05)."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 4.0]], dtype=F64)
    delta = torch.tensor([[0.25, 0.15, 0.2], [-0.35, -0.25, 9.0]], dtype=F64)  # means 0.2, -0.3
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    loss, m = call("sapo", logp, old, adv, mask)
    s0, s1 = math.exp(0.2), math.exp(-0.3)
    x0, x1 = 1.0 * (s0 - 1), 1.05 * (s1 - 1)
    f0 = 4 / (1 + math.exp(-x0))
    f1 = 4 / 1.05 / (1 + math.exp(-x1))
    assert abs(loss.item() - (-(f0 * 1.0 + f1 * -2.0) / 2)) < ATOL
    g0 = 4 * math.exp(-x0) / (1 + math.exp(-x0)) ** 2
    g1 = 4 * math.exp(-x1) / (1 + math.exp(-x1)) ** 2
    want = [[-1.0 * g0 * s0 / 3 / 2] * 3, [2.0 * g1 * s1 / 2 / 2] * 2 + [0.0]]
    assert _close(_grad(loss, logp), want)
    assert abs(m["gate_seq_mean"].item() - (g0 + g1) / 2) < ATOL
    assert abs(m["gate_tok_mean"].item() - (3 * g0 + 2 * g1) / 5) < ATOL
    assert abs(m["gate_min"].item() - min(g0, g1)) < ATOL
    assert abs(m["ratio_mean"].item() - (s0 + s1) / 2) < ATOL
    assert abs(m["ratio_min"].item() - s1) < ATOL and abs(m["ratio_max"].item() - s0) < ATOL


@pytest.mark.parametrize("taus", [(TAU_NEG, TAU_POS), (2.0, 0.5), (0.3, 3.0)])
@pytest.mark.parametrize("n", [None, 7.0])
def test_sapo_value_and_gradient_match_reference(taus, n):
    """sapo_loss equals the plain-python reference (value, d loss / d logp) for several temperatures."""
    logp, old, adv, mask = _batch([0.1, 0.6, -0.4, 0.3, -1.5], spread=0.3)
    loss, _ = call("sapo", logp, old, adv, mask, *taus, normalizer=n)
    want, want_g = ref_sapo(logp, old, adv, mask, *taus, n=n)
    assert abs(loss.item() - want) < ATOL
    assert _close(_grad(loss, logp), want_g)


def test_sapo_token_value_and_gradient_hand_computed():
    """One row, three tokens r = 1.5 (A=1), 0.8 (A=-1), 1 (A=2): per-token gate, token mean."""
    mask = torch.tensor([[1, 1, 1, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=F64)
    r = [1.5, 0.8, 1.0]
    logp = (old + torch.tensor([[math.log(x) for x in r] + [3.0]], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=F64)
    loss, m = call("sapo_token", logp, old, adv, mask)
    f = [4 * _sig(0.5), 4 / 1.05 * _sig(1.05 * -0.2), 4 * 0.5]
    assert abs(loss.item() - (-(f[0] * 1 - f[1] + f[2] * 2) / 3)) < ATOL
    g = [4 * _sig(0.5) * _sig(-0.5), 4 * _sig(-0.21) * _sig(0.21), 1.0]
    want = [[-1 * g[0] * 1.5 / 3, 1 * g[1] * 0.8 / 3, -2 * g[2] * 1.0 / 3, 0.0]]
    assert _close(_grad(loss, logp), want)
    assert abs(m["gate_tok_mean"].item() - sum(g) / 3) < ATOL
    assert abs(m["gate_seq_mean"].item() - sum(g) / 3) < ATOL
    assert abs(m["gate_min"].item() - min(g)) < ATOL
    assert abs(m["ratio_mean"].item() - sum(r) / 3) < ATOL
    assert abs(m["seq_ratio_mean"].item() - (1.5 * 0.8) ** (1 / 3)) < ATOL
    tm, _ = call("sapo_token", logp, old, adv, mask, aggregation="token_mean", normalizer=6.0)
    assert abs(tm.item() - (-(f[0] * 1 - f[1] + f[2] * 2) / 6)) < ATOL


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_sapo_token_value_and_gradient_match_reference(aggregation, per_token_adv):
    """sapo_token_loss equals the reference for [B] and [B, T] advantages, both aggregations."""
    logp, old, adv, mask = _token_batch(seed=1, scale=1.5)
    if per_token_adv:
        adv = torch.randn(5, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    loss, _ = call("sapo_token", logp, old, adv, mask, aggregation=aggregation)
    want, want_g = ref_sapo_token(logp, old, adv, mask, agg=aggregation)
    assert abs(loss.item() - want) < ATOL
    assert _close(_grad(loss, logp), want_g)


def test_sapo_gate_gradient_precise_far_from_ratio_one():
    """float64, r = 31 (x = 30, gate ~ 4e-13): the gradient keeps its relative precision (no
    1 - sigmoid cancellation); r = 1e-6 (x ~ -1, the lowest x can go is -tau) is exact too."""
    mask = torch.ones(2, 1, dtype=F64)
    old = torch.zeros(2, 1, dtype=F64)
    logp = torch.tensor([[math.log(31.0)], [math.log(1e-6)]], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0], dtype=F64)
    loss, _ = call("sapo_token", logp, old, adv, mask)
    g = _grad(loss, logp)
    x0, x1 = 30.0, 1e-6 - 1
    want0 = -4 * math.exp(-x0) / (1 + math.exp(-x0)) ** 2 * 31.0 / 2
    want1 = -4 * _sig(x1) * _sig(-x1) * 1e-6 / 2
    assert abs(g[0, 0].item() / want0 - 1) < 1e-12 and abs(g[1, 0].item() / want1 - 1) < 1e-12
    assert abs(loss.item() - (-(4 * _sig(x0) + 4 * _sig(x1)) / 2)) < ATOL


def test_sapo_rejects_nonpositive_temperatures():
    """Temperatures (eps_low/eps_high) must be > 0 (unknown aggregations: tests/test_losses.py)."""
    logp, old, adv, mask = _batch([0.0] * 5)
    for fn in (tensor_loss("sapo"), tensor_loss("sapo_token")):
        for taus in [(0.0, 1.0), (1.0, -1.0), (float("nan"), 1.0)]:
            with pytest.raises(ValueError):
                fn(logp, old, adv, mask, *taus)


# ----------------------------------------------------------------------------------------------
# CISPO


def test_cispo_value_and_gradient_hand_computed():
    """r = 0.5, 1, 1.5 (A=1), r = 2 (A=-2): weights 0.5, 1, 1.28, 1.28; no token loses its gradient."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 1.0, 2.0]], dtype=F64)
    r = torch.tensor([[0.5, 1.0, 1.5], [2.0, 7.0, 7.0]], dtype=F64)
    logp = (old + r.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    loss, m = call("cispo", logp, old, adv, mask)  # token_mean: / 4 tokens
    assert abs(loss.item() - (-(0.5 + 1.0 + 1.28 - 2 * 1.28) / 4)) < ATOL
    assert _close(_grad(loss, logp), [[-0.5 / 4, -1.0 / 4, -1.28 / 4], [2 * 1.28 / 4, 0.0, 0.0]])
    want_m = {
        "clip_frac_tok_low": 0.0,
        "clip_frac_tok_high": 2 / 4,
        "clip_frac_seq_high": (1 / 3 + 1) / 2,
        "clip_frac_seq_low": 0.0,
        "ratio_mean": (0.5 + 1.0 + 1.5 + 2.0) / 4,
        "ratio_min": 0.5,
        "ratio_max": 2.0,
        "seq_ratio_mean": ((0.5 * 1.5) ** (1 / 3) + 2.0) / 2,
    }
    for k, v in want_m.items():
        assert abs(m[k].item() - v) < ATOL, k
    # lower clip 1 - 0.2: r = 0.5 is raised to 0.8 (and counted), its gradient kept
    loss2, m2 = call("cispo", logp, old, adv, mask, 0.2, 0.28, aggregation="seq_mean_token_mean")
    assert abs(loss2.item() - (-((0.8 + 1.0 + 1.28) / 3 - 2 * 1.28) / 2)) < ATOL
    assert _close(_grad(loss2, logp), [[-0.8 / 6, -1.0 / 6, -1.28 / 6], [2 * 1.28 / 2, 0.0, 0.0]])
    assert abs(m2["clip_frac_tok_low"].item() - 1 / 4) < ATOL


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("eps", [(1.0, 0.28), (0.2, 0.27), (5.0, 3.0)])
def test_cispo_value_and_gradient_match_reference(aggregation, eps):
    """cispo_loss equals the reference (clipped-IS value, d loss/d logp = -(1/N) clip(r) A)."""
    logp, old, _, mask = _token_batch(seed=3, scale=0.8)
    adv = torch.randn(5, 5, generator=torch.Generator().manual_seed(4), dtype=F64)
    for n in (None, 11.0):
        loss, _ = call("cispo", logp, old, adv, mask, *eps, normalizer=n, aggregation=aggregation)
        want, want_g = ref_cispo(logp, old, adv, mask, *eps, n=n, agg=aggregation)
        assert abs(loss.item() - want) < ATOL
        assert _close(_grad(loss, logp), want_g)


def test_cispo_value_does_not_depend_on_log_prob_scale():
    """Shifting logp and old_logp together (same ratios) leaves CISPO's value and gradient unchanged
    (the surrogate's value is sum clip(r) A / N, not a multiple of log pi)."""
    logp, old, adv, mask = _token_batch(seed=5)
    l1, _ = call("cispo", logp, old, adv, mask)
    x = (logp.detach() - 1e6).requires_grad_(True)
    l2, _ = call("cispo", x, old - 1e6, adv, mask)
    assert abs(l1.item() - l2.item()) < 1e-9
    assert torch.allclose(_grad(l1, logp), _grad(l2, x), atol=1e-9, rtol=0)


# ----------------------------------------------------------------------------------------------
# GMPO


def test_gmpo_value_and_gradient_hand_computed():
    """A=1: l = .5, .1, -.6 -> c = .4 (clipped), .1, -.6; A=-1: l = -.5, .2 -> c = -.4 (clipped), .2."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 1.0]], dtype=F64)
    lr = torch.tensor([[0.5, 0.1, -0.6], [-0.5, 0.2, 30.0]], dtype=F64)
    logp = (old + lr).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, m = call("gmpo", logp, old, adv, mask)
    S0, S1 = math.exp((0.4 + 0.1 - 0.6) / 3), math.exp((-0.4 + 0.2) / 2)
    assert abs(loss.item() - (-(S0 - S1) / 2)) < ATOL
    assert _close(_grad(loss, logp), [[0.0, -S0 / 3 / 2, -S0 / 3 / 2], [0.0, S1 / 2 / 2, 0.0]])
    want_m = {
        "clip_frac_tok_high": 1 / 5,
        "clip_frac_tok_low": 1 / 5,
        "clip_frac_tok": 2 / 5,
        "clip_frac_seq_high": (1 / 3) / 2,
        "clip_frac_seq_low": (1 / 2) / 2,
        "ratio_min": math.exp(-0.6),
        "ratio_max": math.exp(0.5),
        "seq_ratio_mean": (math.exp(0.0) + math.exp(-0.15)) / 2,
    }
    for k, v in want_m.items():
        assert abs(m[k].item() - v) < ATOL, k


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3), (0.0, 0.0)])
@pytest.mark.parametrize("n", [None, 9.0])
def test_gmpo_value_and_gradient_match_reference(eps, n):
    """gmpo_loss equals the log-space reference, clipped tokens get no gradient."""
    logp, old, adv, mask = _token_batch(seed=6, scale=0.7)
    loss, _ = call("gmpo", logp, old, adv, mask, *eps, normalizer=n)
    want, want_g = ref_gmpo(logp, old, adv, mask, *eps, n=n)
    assert abs(loss.item() - want) < ATOL
    assert _close(_grad(loss, logp), want_g)


def test_gmpo_equals_paper_product_form():
    """GMPO's value is (prod_t |min(r A, clip(r, e^-el, e^eh) A)|)^(1/|y|) sgn(A), per the paper."""
    logp, old, adv, mask = _token_batch(seed=7, scale=0.7)
    L, Ol, M, A = _rows(logp), _rows(old), _rows(mask), adv.tolist()
    total = 0.0
    for i in range(5):
        toks = _toks(M[i])
        prod = 1.0
        for t in toks:
            r = math.exp(L[i][t] - Ol[i][t])
            prod *= abs(min(r * A[i], min(max(r, math.exp(-0.4)), math.exp(0.4)) * A[i]))
        total += prod ** (1 / len(toks)) * math.copysign(1.0, A[i])
    loss, _ = call("gmpo", logp, old, adv, mask)
    assert abs(loss.item() - (-total / 5)) < ATOL


# ----------------------------------------------------------------------------------------------
# identities with GSPO / GRPO


@pytest.mark.parametrize("taus", [(TAU_NEG, TAU_POS), (3.0, 0.2)])
def test_sapo_on_policy_gradient_equals_gspo(taus):
    """logp == old_logp: SAPO's gradient is GSPO's (-A_i/|y_i|/B), its value -(1/B) sum (2/tau_i) A_i."""
    logp, _, adv, mask = _batch([0.0] * 5)
    old = logp.detach().clone()
    ls, m = call("sapo", logp, old, adv, mask, *taus)
    lg, _ = call("gspo", logp, old, adv, mask)
    gs = _grad(ls, logp)
    assert torch.allclose(gs, _grad(lg, logp), atol=ATOL, rtol=0)
    assert torch.allclose(gs, -(adv[:, None] / mask.sum(-1, keepdim=True) / 5) * mask, atol=ATOL, rtol=0)
    want = -sum(2 / _tau(a, *taus) * a for a in ADV) / 5
    assert abs(ls.item() - want) < ATOL
    assert m["gate_min"].item() == 1.0 and m["approx_kl"].item() == 0.0


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_sapo_token_on_policy_gradient_equals_grpo(aggregation):
    """logp == old_logp: SAPO-token's gradient is GRPO's (plain token policy gradient), per-token A."""
    logp, _, _, mask = _batch([0.0] * 5)
    old = logp.detach().clone()
    adv = torch.randn(5, 5, generator=torch.Generator().manual_seed(9), dtype=F64)
    ls, _ = call("sapo_token", logp, old, adv, mask, aggregation=aggregation)
    lr, _ = call("grpo", logp, old, adv, mask, aggregation=aggregation)
    assert torch.allclose(_grad(ls, logp), _grad(lr, logp), atol=ATOL, rtol=0)


@pytest.mark.parametrize("taus", [(TAU_NEG, TAU_POS), (2.0, 0.5)])
def test_sapo_token_equals_sapo_when_token_ratios_are_equal(taus):
    """Equal token log-ratios within each row (r_it = s_i): SAPO-token == SAPO in value and gradient."""
    logp, old, adv, mask = _batch([0.3, -0.2, 1.1, -0.7, 0.05], spread=0.0)
    l1, m1 = call("sapo", logp, old, adv, mask, *taus)
    l2, m2 = call("sapo_token", logp, old, adv, mask, *taus)
    assert abs(l1.item() - l2.item()) < ATOL
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)
    for k in ("gate_tok_mean", "gate_seq_mean", "gate_min", "ratio_mean", "approx_kl"):
        assert abs(m1[k].item() - m2[k if k != "ratio_mean" else "seq_ratio_mean"].item()) < ATOL, k


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_cispo_on_policy_equals_token_mean_reinforce(aggregation):
    """logp == old_logp: CISPO's value and gradient are GRPO's (REINFORCE, -A_it / N_tok per token)."""
    logp, _, _, mask = _batch([0.0] * 5)
    old = logp.detach().clone()
    adv = torch.randn(5, 5, generator=torch.Generator().manual_seed(10), dtype=F64)
    lc, _ = call("cispo", logp, old, adv, mask, aggregation=aggregation)
    lr, _ = call("grpo", logp, old, adv, mask, aggregation=aggregation)
    assert abs(lc.item() - lr.item()) < ATOL
    gc = _grad(lc, logp)
    assert torch.allclose(gc, _grad(lr, logp), atol=ATOL, rtol=0)
    if aggregation == "token_mean":
        assert torch.allclose(gc, -adv * mask / mask.sum(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_cispo_equals_grpo_without_clipping(aggregation):
    """No clip active (wide ranges): CISPO == GRPO in value and gradient (A r grad log pi)."""
    logp, old, adv, mask = _token_batch(seed=11, scale=0.8)
    lc, _ = call("cispo", logp, old, adv, mask, 1.0, 100.0, aggregation=aggregation)
    lr, _ = call("grpo", logp, old, adv, mask, 1.0, 100.0, aggregation=aggregation)
    assert abs(lc.item() - lr.item()) < ATOL
    assert torch.allclose(_grad(lc, logp), _grad(lr, logp), atol=ATOL, rtol=0)


def test_gmpo_on_policy_equals_gspo():
    """logp == old_logp: GMPO's value and gradient are GSPO's."""
    logp, _, adv, mask = _batch([0.0] * 5)
    old = logp.detach().clone()
    l1, _ = call("gmpo", logp, old, adv, mask)
    l2, _ = call("gspo", logp, old, adv, mask)
    assert abs(l1.item() - l2.item()) < ATOL and abs(l1.item() + sum(ADV) / 5) < ATOL
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)


def test_gmpo_equals_gspo_without_clipping():
    """No clip active: the geometric mean of token ratios is s_i, so GMPO == GSPO (value, gradient)."""
    logp, old, adv, mask = _batch([0.3, -0.5, 0.8, -0.2, 0.1], spread=0.4)
    l1, _ = call("gmpo", logp, old, adv, mask, 50.0, 50.0)
    l2, _ = call("gspo", logp, old, adv, mask, 1.0, 1e9)
    assert abs(l1.item() - l2.item()) < ATOL
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)


@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.1, 0.3)])
def test_gmpo_equals_grpo_on_single_token_sequences(eps):
    """|y_i| = 1: GMPO is GRPO with the clip range (e^-eps_low, e^eps_high)."""
    g = torch.Generator().manual_seed(12)
    old = -torch.rand(6, 1, generator=g, dtype=F64)
    logp = (old + torch.tensor([[-0.9], [-0.2], [0.05], [0.2], [0.6], [-0.05]], dtype=F64)).requires_grad_(
        True
    )
    mask = torch.ones(6, 1, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, 0.0], dtype=F64)
    el, eh = eps
    l1, m1 = call("gmpo", logp, old, adv, mask, el, eh)
    l2, m2 = call("grpo", logp, old, adv, mask, 1 - math.exp(-el), math.exp(eh) - 1)
    assert abs(l1.item() - l2.item()) < ATOL
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)
    for k in m2:
        assert abs(m1[k].item() - m2[k].item()) < ATOL, k


# ----------------------------------------------------------------------------------------------
# weight: a stop-gradient multiplier per sequence (or token)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_weight_multiplies_each_sequence_exactly(name):
    """weight w_B: value == sum_i w_i (row i's term), gradient row i == w_i * unweighted gradient row i;
    ones == unweighted; the weight gets no gradient. (Row i's term alone, for the per-call selections:
    the row-by-row form of tests/test_losses_trust.py::test_weight_applies_after_the_selection.)"""
    fn = VARIANTS[name]
    logp, old, adv, mask = _token_batch(seed=13, scale=0.5)
    w = torch.tensor([0.5, 2.0, 0.0, 1.3, 0.7], dtype=F64, requires_grad=True)
    n = _normalizer(name, mask)
    base, m0 = fn(logp, old, adv, mask, normalizer=n)
    g0 = _grad(base, logp)
    lw, mw = fn(logp, old, adv, mask, normalizer=n, weight=w)
    assert torch.allclose(_grad(lw, logp), w.detach()[:, None] * g0, atol=ATOL, rtol=0)
    if name not in PER_CALL:  # a row alone is another call, with its own selection
        rows = [
            fn(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], normalizer=n)[0]
            for i in range(5)
        ]
        assert abs(lw.item() - sum(w[i].item() * rows[i].item() for i in range(5))) < ATOL
    assert not lw.requires_grad or w.grad is None
    lo, _ = fn(logp, old, adv, mask, normalizer=n, weight=torch.ones(5, dtype=F64))
    assert lo.item() == base.item()
    for k in m0:  # metrics ignore the weight
        assert torch.equal(m0[k], mw[k]), k


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - SEQUENCE_LEVEL))
def test_token_weight_multiplies_each_token_exactly(name):
    """Token-aggregating losses: a [B, T] weight scales each token's gradient, denominators unchanged."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _token_batch(seed=14, scale=0.5)
    if name == "gspo_token":
        logp, old, adv, mask = _batch([1e-4, 2e-4, -1e-4, 0.0, 1e-4], spread=1e-4)
    w = torch.rand(5, 5, generator=torch.Generator().manual_seed(15), dtype=F64) * 2
    w_pad = torch.where(mask.bool(), w, torch.full_like(w, float("nan")))  # padding weight ignored
    g0 = _grad(fn(logp, old, adv, mask)[0], logp)
    lw, _ = fn(logp, old, adv, mask, weight=w_pad)
    assert torch.allclose(_grad(lw, logp), w * mask * g0, atol=ATOL, rtol=0)
    assert torch.isfinite(lw)


@pytest.mark.parametrize("name", sorted(SEQUENCE_LEVEL))
def test_sequence_level_losses_reject_token_weights(name):
    """[B, T] or wrongly sized weights raise ValueError for sequence-level losses (all raise on bad B)."""
    logp, old, adv, mask = _batch([0.0] * 5)
    with pytest.raises(ValueError):
        VARIANTS[name](logp, old, adv, mask, weight=torch.ones(5, 5, dtype=F64))
    for other in VARIANTS.values():
        with pytest.raises(ValueError):
            other(logp, old, adv, mask, weight=torch.ones(4, dtype=F64))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_zero_one_weight_equals_masking_the_rows(name):
    """weight = 0/1 per sequence gives the same loss and gradient as zeroing those rows' masks
    (dropped rows still count in the normalizer)."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _token_batch(seed=16, scale=0.5)
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=F64)
    n = _normalizer(name, mask)
    l1, _ = fn(logp, old, adv, mask, normalizer=n, weight=keep)
    l2, _ = fn(logp, old, adv, mask * keep[:, None], normalizer=n)
    assert abs(l1.item() - l2.item()) < ATOL
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_weight_nan_on_empty_row_does_not_leak(name):
    """A NaN/inf weight on a row without response tokens leaves loss and gradient finite and unchanged."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _token_batch(seed=17)
    mask = mask.clone()
    mask[2] = 0
    w = torch.tensor([1.0, 1.0, float("nan"), 1.0, 1.0], dtype=F64)
    l1, _ = fn(logp, old, adv, mask)
    l2, _ = fn(logp, old, adv, mask, weight=w)
    g2 = _grad(l2, logp)
    assert abs(l1.item() - l2.item()) < ATOL and torch.isfinite(g2).all()


# ----------------------------------------------------------------------------------------------
# clip fractions


def test_gmpo_and_cispo_clip_fractions_match_reference_counts():
    """Token clip fractions equal a plain count of the documented conditions on a random batch."""
    logp, old, adv, mask = _token_batch(seed=26, scale=0.9)
    L, Ol, M, A = _rows(logp), _rows(old), _rows(mask), adv.tolist()
    toks = [(i, t, L[i][t] - Ol[i][t]) for i in range(5) for t in _toks(M[i])]
    _, mg = call("gmpo", logp, old, adv, mask, 0.3, 0.2)
    hi = sum(1 for i, _, lr in toks if A[i] > 0 and lr > 0.2)
    lo = sum(1 for i, _, lr in toks if A[i] < 0 and lr < -0.3)
    assert abs(mg["clip_frac_tok_high"].item() - hi / len(toks)) < ATOL
    assert abs(mg["clip_frac_tok_low"].item() - lo / len(toks)) < ATOL
    _, mc = call("cispo", logp, old, adv, mask, 0.3, 0.2)
    hi = sum(1 for _, _, lr in toks if math.exp(lr) > 1.2)
    lo = sum(1 for _, _, lr in toks if math.exp(lr) < 0.7)
    assert abs(mc["clip_frac_tok_high"].item() - hi / len(toks)) < ATOL
    assert abs(mc["clip_frac_tok_low"].item() - lo / len(toks)) < ATOL


def test_max_log_ratio_clamp_matches_gspo_for_sapo_and_gmpo():
    """Beyond MAX_LOG_RATIO the sequence ratio is clamped (no gradient), as in GSPO."""
    big = MAX_LOG_RATIO + 5
    logp, old, adv, mask = _batch([big, -big, 0.0, big, -big], [-1.0, 1.0, 1.0, 1.0, -1.0])
    for fn in (tensor_loss("sapo"), lambda *a: call("gmpo", *a, 50.0, 50.0)):
        loss, _ = fn(logp, old, adv, mask)
        g = _grad(loss, logp)
        assert torch.isfinite(loss) and torch.all(g[[0, 1, 3, 4]] == 0) and torch.any(g[2] != 0)
