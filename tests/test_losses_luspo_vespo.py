"""Math tests for LUSPO and VESPO: plain-Python float64 references (lists + math, no torch), hand-computed
numbers, analytic gradients against autograd at 1e-12, and the identities with GSPO / CISPO where they
hold. The properties every loss shares run over them in tests/test_losses.py (VARIANTS)."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import call
from test_losses import ATOL, F64, GSPO_LR, _batch, _grad, _token_batch

from gspo.losses import VESPO_MIN_LOG_W


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().to(F64).tolist()


def _toks(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m == 1]


def _close(a: torch.Tensor, b: list[list[float]]) -> bool:
    return torch.allclose(a, torch.tensor(b, dtype=F64), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# references


def ref_luspo(logp, old, adv, mask, el=2e-3, eh=2.5e-3, n=None):
    """(value, gradient): -(1/N) sum_i |y_i| min(s_i A_i, clip(s_i) A_i); d/d logp_it = -(1/N) A_i s_i
    where the unclipped branch is the min (0 where the clip binds)."""
    L, Ol, M = _rows(logp), _rows(old), _rows(mask)
    N = len(L) if n is None else n
    total, grad = 0.0, [[0.0] * len(L[0]) for _ in L]
    for i, a in enumerate(adv.tolist()):
        toks = _toks(M[i])
        if not toks:
            continue
        s = math.exp(sum(L[i][t] - Ol[i][t] for t in toks) / len(toks))
        clipped = min(max(s, 1 - el), 1 + eh)
        total += len(toks) * min(s * a, clipped * a)
        if s * a <= clipped * a:  # the unclipped term is the min: it carries the gradient
            for t in toks:
                grad[i][t] = -a * s / N
    return -total / N, grad


def ref_vespo(logp, old, adv, mask, k=(2.0, 3.0), lam=(3.0, 2.0), n=None, agg="token_mean"):
    """(value, gradient) of VESPO: phi_i = W^k e^(lam (1 - W)), W = exp(clamp(sum_t clamp(l_it))),
    (k, lam) = [0] for A >= 0, [1] for A < 0; value -(1/N) sum_it phi_i A_i (or per-sequence mean);
    d/d logp_it = -(1/N) phi_i A_i (/ |y_i| for seq_mean_token_mean)."""
    L, Ol, M = _rows(logp), _rows(old), _rows(mask)
    n_tok = sum(len(_toks(r)) for r in M)
    N = (n_tok if agg == "token_mean" else len(L)) if n is None else n
    total, grad = 0.0, [[0.0] * len(L[0]) for _ in L]
    for i, a in enumerate(adv.tolist()):
        toks = _toks(M[i])
        if not toks:
            continue
        log_w = sum(min(max(L[i][t] - Ol[i][t], -20.0), 20.0) for t in toks)
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        kk, ll = (k[0], lam[0]) if a >= 0 else (k[1], lam[1])
        phi = math.exp(ll + kk * log_w - ll * math.exp(log_w))
        per_tok = 1.0 if agg == "token_mean" else 1.0 / len(toks)
        total += phi * a * len(toks) * per_tok
        for t in toks:
            grad[i][t] = -phi * a * per_tok / N
    return -total / N, grad


# ----------------------------------------------------------------------------------------------
# LUSPO


def test_luspo_value_and_gradient_hand_computed():
    """Rows of 3 and 1 tokens, s = e^0.1 (A = 2, unclipped with eps 0.2) and s = e^-0.5 (A = -1,
    below 1 - 0.2: clipped, no gradient): value -(3 * 2 e^0.1 + 1 * -1 * 0.8) / 2; each token of row 0
    gets -A s / B = -e^0.1, its length cancelled."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 5.0, 5.0]], dtype=F64)
    delta = torch.tensor([[0.0, 0.1, 0.2], [-0.5, 9.0, 9.0]], dtype=F64)
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    loss, m = call("luspo", logp, old, adv, mask, 0.2, 0.27)
    s0 = math.exp(0.1)
    assert abs(loss.item() - (-(3 * 2 * s0 + 1 * -1 * 0.8) / 2)) < ATOL
    assert _close(_grad(loss, logp), [[-s0, -s0, -s0], [0.0, 0.0, 0.0]])
    assert (
        abs(m["clip_frac_seq_low"].item() - 0.5) < ATOL and abs(m["clip_frac_tok_low"].item() - 0.25) < ATOL
    )


@pytest.mark.parametrize("eps", [(2e-3, 2.5e-3), (3e-4, 4e-4), (0.2, 0.27)])
@pytest.mark.parametrize("n", [None, 7.0])
def test_luspo_value_and_gradient_match_reference(eps, n):
    """luspo_loss equals the float64 reference in value and in the analytic gradient, every clip region."""
    for logp, old, adv, mask in (
        _batch(GSPO_LR),
        _batch([1e-3, -2e-3, 3e-3, 0.0, -1e-3]),
        _token_batch(seed=2),
    ):
        loss, _ = call("luspo", logp, old, adv, mask, *eps, normalizer=n)
        want, want_g = ref_luspo(logp, old, adv, mask, *eps, n=n)
        assert abs(loss.item() - want) < ATOL
        assert _close(_grad(loss, logp), want_g)


def test_luspo_is_gspo_times_each_length():
    """LUSPO's gradient of row i is |y_i| times GSPO's, its metrics GSPO's: only the weighting differs."""
    logp, old, adv, mask = _batch(GSPO_LR)
    lu, mu = call("luspo", logp, old, adv, mask, 3e-4, 4e-4)
    gs, mg = call("gspo", logp, old, adv, mask, 3e-4, 4e-4)
    assert torch.allclose(_grad(lu, logp), mask.sum(-1, keepdim=True) * _grad(gs, logp), atol=ATOL, rtol=0)
    assert (
        abs(lu.item() - call("gspo", logp, old, adv, mask, 3e-4, 4e-4, weight=mask.sum(-1))[0].item()) < ATOL
    )
    assert all(torch.equal(mu[k], mg[k]) for k in mg)


def test_luspo_every_token_weighs_the_same_whatever_its_length():
    """On-policy (s = 1, no clip) every response token of every row gets -A_i / B: lengths 1..5 alike
    (GSPO gives -A_i / (B |y_i|): the length bias LUSPO removes)."""
    logp, old, adv, mask = _batch([0.0] * 5, spread=0.0)
    g = _grad(call("luspo", logp, old.clone(), adv, mask)[0], logp)
    want = -adv[:, None] / 5 * mask
    assert torch.allclose(g, want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# VESPO


def test_vespo_kernel_hand_computed():
    """phi(1) = 1; phi(W) = W^k e^(lambda (1 - W)) at W = 0.5 and 2 with the defaults (A >= 0: k 2, lambda 3;
    A < 0: k 3, lambda 2); token_mean value and gradient -phi A / N on every token."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.4, -0.3], [-2.0, 0.0, 0.0]], dtype=F64)
    lw = [math.log(0.5), math.log(2.0), 0.0]  # each row's sum of token log-ratios
    delta = torch.tensor([[lw[0] / 2, lw[0] / 2, 0.0], [lw[1] / 3] * 3, [0.0, 0.0, 0.0]], dtype=F64)
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.0], dtype=F64)  # A = 0 takes the _pos pair: phi(1) = 1 anyway
    loss, m = call("vespo", logp, old, adv, mask)
    phi = [0.25 * math.exp(1.5), 8.0 * math.exp(-2.0), 1.0]
    assert abs(loss.item() - (-(2 * phi[0] * 1.0 + 3 * phi[1] * -2.0) / 6)) < ATOL
    assert _close(_grad(loss, logp), [[-phi[0] / 6] * 2 + [0.0], [2 * phi[1] / 6] * 3, [0.0] * 3])
    assert abs(m["gate_seq_mean"].item() - sum(phi) / 3) < ATOL
    assert abs(m["gate_tok_mean"].item() - (2 * phi[0] + 3 * phi[1] + phi[2]) / 6) < ATOL
    assert abs(m["gate_min"].item() - min(phi)) < ATOL
    assert abs(m["ratio_mean"].item() - (0.5 + 2.0 + 1.0) / 3) < ATOL


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("shape", [((2.0, 3.0), (3.0, 2.0)), ((0.5, 1.0), (4.0, 0.7))])
@pytest.mark.parametrize("n", [None, 9.0])
def test_vespo_value_and_gradient_match_reference(agg, shape, n):
    """vespo_loss equals the float64 reference (value: sum phi A / N; gradient -phi A / N per token),
    also where a row's log W is clamped (scale 3: sums beyond log 1e-8 and 20 on 5 tokens)."""
    (k_pos, k_neg), (l_pos, l_neg) = shape
    for scale in (0.3, 1.0, 9.0):
        logp, old, adv, mask = _token_batch(seed=6, scale=scale)
        kw = dict(k_pos=k_pos, lambda_pos=l_pos, k_neg=k_neg, lambda_neg=l_neg)
        loss, _ = call("vespo", logp, old, adv, mask, normalizer=n, aggregation=agg, **kw)
        want, want_g = ref_vespo(logp, old, adv, mask, (k_pos, k_neg), (l_pos, l_neg), n=n, agg=agg)
        assert abs(loss.item() - want) < ATOL
        assert _close(_grad(loss, logp), want_g)


def test_vespo_ratio_is_not_length_normalized():
    """W is the product of the token ratios: two rows with the same per-token ratio e^0.1 but lengths 1
    and 5 get W = e^0.1 and e^0.5 (GSPO's s_i would be e^0.1 for both)."""
    mask = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=F64)
    old = torch.full((2, 5), -1.0, dtype=F64)
    logp = (old + 0.1).requires_grad_(True)
    _, m = call("vespo", logp, old, torch.tensor([1.0, 1.0], dtype=F64), mask)
    assert (
        abs(m["ratio_min"].item() - math.exp(0.1)) < ATOL
        and abs(m["ratio_max"].item() - math.exp(0.5)) < ATOL
    )


def test_vespo_on_policy_is_cispo_on_policy_and_far_off_policy_fades():
    """On-policy phi = 1: the token-mean REINFORCE gradient (CISPO's on-policy one). A sequence at the
    log W floor (log 1e-8) or ceiling (20) gets phi ~ 0."""
    logp, old, adv, mask = _token_batch(seed=9)
    on = logp.detach().clone()
    g_v = _grad(call("vespo", logp, on, adv, mask)[0], logp)
    g_c = _grad(call("cispo", logp, on, adv, mask)[0], logp)
    assert torch.allclose(g_v, g_c, atol=ATOL, rtol=0)
    for shift in (VESPO_MIN_LOG_W - 5.0, 30.0):
        far = logp.detach() - shift / mask.sum(-1, keepdim=True)
        g = _grad(call("vespo", logp, far, adv, mask)[0], logp)
        assert g.abs().max().item() < 1e-15


def test_vespo_value_does_not_depend_on_log_prob_scale():
    """The surrogate's value is sum phi A / N, never a multiple of log pi (shifting both log-probs by
    -1e6 leaves value and gradient unchanged)."""
    logp, old, adv, mask = _token_batch(seed=10)
    l1, _ = call("vespo", logp, old, adv, mask)
    x = (logp.detach() - 1e6).requires_grad_(True)
    l2, _ = call("vespo", x, old - 1e6, adv, mask)
    assert abs(l1.item() - l2.item()) < 1e-9
    assert torch.allclose(_grad(l1, logp), _grad(l2, x), atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    "kw", [{"k_pos": -1.0}, {"k_neg": float("nan")}, {"lambda_pos": 0.0}, {"lambda_neg": -2.0}]
)
def test_vespo_rejects_a_kernel_that_does_not_decay(kw):
    logp, old, adv, mask = _token_batch(seed=11)
    with pytest.raises(ValueError, match="VESPO"):
        call("vespo", logp, old, adv, mask, **kw)
