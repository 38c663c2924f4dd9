"""Math tests for the policy-gradient losses of :mod:`gspo.losses`.

Here: the fixtures and :data:`VARIANTS` (every registered loss, each aggregation), the closed forms of
GSPO, GSPO-token and GRPO against independent plain-Python references, and the properties every loss
shares (invariances, normalizer, empty rows, numerics, metric keys, gradcheck, registry), parametrized
over all of them. SAPO, CISPO, GMPO closed forms and the ``weight`` argument:
tests/test_losses_sapo_cispo_gmpo.py; LUSPO and VESPO: tests/test_losses_luspo_vespo.py; DPPO, Clip-Cov
and KL-Cov: tests/test_losses_trust.py. The losses are called on plain tensors through
:func:`loss_helpers.call`.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from loss_helpers import call, tensor_loss

from gspo.losses import (
    LOSSES,
    MAX_LOG_RATIO,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    gmpo_loss,
    grpo_loss,
    grpo_seq_mask_loss,
    gspo_loss,
    gspo_token_loss,
    kl_cov_loss,
    luspo_loss,
    sapo_loss,
    sapo_token_loss,
    vespo_loss,
)

F64 = torch.float64
ATOL = 1e-12

# ----------------------------------------------------------------------------------------------
# independent references (plain python lists + math, no torch)


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().to(F64).tolist()


def ref_gspo(logp, old, adv, mask, el=3e-4, eh=4e-4, n=None):
    logp, old, mask = _rows(logp), _rows(old), _rows(mask)
    adv = adv.tolist()
    total = 0.0
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t] == 1]
        if not toks:
            continue
        s = math.exp(sum(logp[i][t] - old[i][t] for t in toks) / len(toks))
        total += min(s * adv[i], _clip(s, 1 - el, 1 + eh) * adv[i])
    return -total / (len(logp) if n is None else n)


def ref_gspo_token(logp, old, adv_BT, mask, el=3e-4, eh=4e-4, n=None):
    logp, old, mask, adv = _rows(logp), _rows(old), _rows(mask), _rows(adv_BT)
    total = 0.0
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t] == 1]
        if not toks:
            continue
        s = math.exp(sum(logp[i][t] - old[i][t] for t in toks) / len(toks))
        total += sum(min(s * adv[i][t], _clip(s, 1 - el, 1 + eh) * adv[i][t]) for t in toks) / len(toks)
    return -total / (len(logp) if n is None else n)


def ref_grpo(logp, old, adv_BT, mask, el=0.2, eh=0.27, n=None, aggregation="seq_mean_token_mean"):
    logp, old, mask, adv = _rows(logp), _rows(old), _rows(mask), _rows(adv_BT)
    seq_sum, tok_sum, n_tok = 0.0, 0.0, 0
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t] == 1]
        objs = []
        for t in toks:
            w = math.exp(logp[i][t] - old[i][t])
            objs.append(min(w * adv[i][t], _clip(w, 1 - el, 1 + eh) * adv[i][t]))
        tok_sum += sum(objs)
        n_tok += len(toks)
        if toks:
            seq_sum += sum(objs) / len(toks)
    if aggregation == "seq_mean_token_mean":
        return -seq_sum / (len(logp) if n is None else n)
    return -tok_sum / (max(n_tok, 1) if n is None else n)


def ref_grpo_seq_mask(logp, old, adv_B, mask, el=3e-4, eh=4e-4, n=None, aggregation="seq_mean_token_mean"):
    """GRPO's unclipped token ratios; a sequence dropped whole where GSPO's clip zeroes its gradient."""
    logp, old, mask, adv = _rows(logp), _rows(old), _rows(mask), _rows(adv_B)
    seq_sum, tok_sum, n_tok = 0.0, 0.0, 0
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t] == 1]
        n_tok += len(toks)
        if not toks:
            continue
        s = math.exp(sum(logp[i][t] - old[i][t] for t in toks) / len(toks))
        dropped = (s > 1 + eh and adv[i] > 0) or (s < 1 - el and adv[i] < 0)
        objs = [0.0 if dropped else math.exp(logp[i][t] - old[i][t]) * adv[i] for t in toks]
        tok_sum += sum(objs)
        seq_sum += sum(objs) / len(toks)
    if aggregation == "seq_mean_token_mean":
        return -seq_sum / (len(logp) if n is None else n)
    return -tok_sum / (max(n_tok, 1) if n is None else n)


# ----------------------------------------------------------------------------------------------
# fixtures

MASK = torch.tensor(
    [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=F64
)
ADV = [0.7, 1.3, -0.9, -1.1, 0.4]


def _batch(seq_log_ratios, adv=ADV, mask=MASK, seed=0, spread=0.05):
    """logp/old_logp with the given mean log-ratio per row (token log-ratios vary around it)."""
    g = torch.Generator().manual_seed(seed)
    B, T = mask.shape
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.1
    noise = (torch.rand(B, T, generator=g, dtype=F64) - 0.5) * spread
    n = mask.sum(-1, keepdim=True).clamp(min=1)
    noise = (noise - (noise * mask).sum(-1, keepdim=True) / n) * mask  # zero masked mean per row
    delta = torch.tensor(seq_log_ratios, dtype=F64)[:, None] + noise
    logp = torch.where(mask.bool(), old + delta, torch.full_like(old, -7.0))
    return logp.requires_grad_(True), old, torch.tensor(adv, dtype=F64), mask


def _token_batch(seed=0, scale=0.6):
    """Token log-ratios spread over [-scale, scale] (both sides of every clip range used here)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 5, generator=g, dtype=F64) * 2 - 0.1
    delta = (torch.rand(5, 5, generator=g, dtype=F64) * 2 - 1) * scale
    logp = (old + delta).requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=F64), MASK


# GSPO default eps: [1-3e-4, 1+4e-4]. rows: in range | high clip (A>0) | low clip (A<0) |
# above range, A<0 (unclipped) | below range, A>0 (unclipped)
GSPO_LR = [1e-4, 5e-3, -4e-3, 2e-2, -3e-2]
GSPO_ADV = ADV
GSPO_CLIPPED = [False, True, True, False, False]


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def _k3(deltas):
    return sum(math.expm1(d) - d for d in deltas) / len(deltas)


# every registered loss, each aggregation: name -> function of (logp, old_logp, advantages, mask, ...)
VARIANTS = {
    "gspo": tensor_loss("gspo"),
    "gspo_token": tensor_loss("gspo_token"),
    "grpo": tensor_loss("grpo"),
    "grpo_tm": tensor_loss("grpo", aggregation="token_mean"),
    "grpo_seq_mask": tensor_loss("grpo_seq_mask"),
    "grpo_seq_mask_tm": tensor_loss("grpo_seq_mask", aggregation="token_mean"),
    "sapo": tensor_loss("sapo"),
    "sapo_token": tensor_loss("sapo_token"),
    "sapo_token_tm": tensor_loss("sapo_token", aggregation="token_mean"),
    "cispo": tensor_loss("cispo"),  # token_mean by default
    "cispo_smtm": tensor_loss("cispo", aggregation="seq_mean_token_mean"),
    "gmpo": tensor_loss("gmpo"),
    "luspo": tensor_loss("luspo"),
    "vespo": tensor_loss("vespo"),  # token_mean by default
    "vespo_smtm": tensor_loss("vespo", aggregation="seq_mean_token_mean"),
    # tests/test_losses_trust.py; all four token_mean by default
    "dppo_tv": tensor_loss("dppo_tv"),
    "dppo_tv_smtm": tensor_loss("dppo_tv", aggregation="seq_mean_token_mean"),
    "dppo_kl": tensor_loss("dppo_kl"),
    "dppo_kl_smtm": tensor_loss("dppo_kl", aggregation="seq_mean_token_mean"),
    "clip_cov": tensor_loss("clip_cov"),
    "clip_cov_smtm": tensor_loss("clip_cov", aggregation="seq_mean_token_mean"),
    "kl_cov": tensor_loss("kl_cov"),
    "kl_cov_smtm": tensor_loss("kl_cov", aggregation="seq_mean_token_mean"),
}
TOKEN_NORMALIZED = {
    "grpo_tm",
    "grpo_seq_mask_tm",
    "sapo_token_tm",
    "cispo",
    "vespo",
    "dppo_tv",
    "dppo_kl",
    "clip_cov",
    "kl_cov",
}  # the normalizer counts tokens
# the losses whose selection is of the tokens of one call (a micro-batch on one rank, as verl's):
# a call's loss is not the sum of its rows' (or halves') losses, so the properties that split a
# batch hold for them only with the selection fixed (tests/test_losses_trust.py::test_selection_is_per_call)
PER_CALL = {"clip_cov", "clip_cov_smtm", "kl_cov", "kl_cov_smtm"}
SEQUENCE_LEVEL = {"gspo", "sapo", "gmpo", "luspo"}  # advantages and weight are [B]
SEQUENCE_ADVANTAGES = SEQUENCE_LEVEL | {
    "vespo",
    "vespo_smtm",
    "grpo_seq_mask",
    "grpo_seq_mask_tm",
}  # advantages [B], weight [B] or [B, T]
TOKEN_RATIO = {
    "grpo",
    "grpo_tm",
    "grpo_seq_mask",
    "grpo_seq_mask_tm",
    "sapo_token",
    "sapo_token_tm",
    "cispo",
    "cispo_smtm",
    "gmpo",
    "dppo_tv",
    "dppo_tv_smtm",
    "dppo_kl",
    "dppo_kl_smtm",
    *PER_CALL,
}


def _normalizer(name, mask):
    """The default normalizer of ``name`` on ``mask`` (tokens or sequences)."""
    return mask.sum() if name in TOKEN_NORMALIZED else mask.shape[0]


# ----------------------------------------------------------------------------------------------
# closed-form values


def test_gspo_value_matches_reference_all_clip_regions():
    """gspo_loss equals the plain-python min/clip sequence objective in every clip region (default eps)."""
    logp, old, adv, mask = _batch(GSPO_LR, GSPO_ADV)
    loss, _ = call("gspo", logp, old, adv, mask)
    assert loss.dtype == F64 and loss.dim() == 0
    assert abs(loss.item() - ref_gspo(logp, old, adv, mask)) < ATOL


@pytest.mark.parametrize("eps", [(0.2, 0.27), (0.05, 0.01), (0.0, 0.0)])
def test_gspo_value_matches_reference_other_eps(eps):
    """gspo_loss equals the reference for non-default eps, including eps=0 (pure clipping)."""
    logp, old, adv, mask = _batch([0.3, -0.3, 0.02, -0.1, 0.25], [1.0, -2.0, 0.5, 1.5, -0.3], seed=1)
    loss, _ = call("gspo", logp, old, adv, mask, *eps)
    assert abs(loss.item() - ref_gspo(logp, old, adv, mask, *eps)) < ATOL


def test_gspo_value_small_padded_b3_t4():
    """B=3, T=4 with padding: hand-built values equal the reference, and N defaults to B."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, 0, 0], [-0.5, -0.5, -0.5, -0.5], [-3.0, -1.0, -2.0, 9.0]], dtype=F64)
    delta = torch.tensor([[0.1, -0.1, 5.0, 5.0], [0.2, 0.2, 0.2, 0.2], [-0.3, -0.3, -0.3, 5.0]], dtype=F64)
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([2.0, 1.0, -1.0], dtype=F64)
    el, eh = 0.1, 0.15
    loss, _ = call("gspo", logp, old, adv, mask, el, eh)
    # row0: s=1 -> 2; row1: s=e^.2=1.2214>1.15, A>0 -> 1.15; row2: s=e^-.3=.7408<.9, A<0 -> -.9
    expected = -(2.0 * 1.0 + 1.15 * 1.0 + 0.9 * -1.0) / 3
    assert abs(loss.item() - expected) < ATOL
    assert abs(loss.item() - ref_gspo(logp, old, adv, mask, el, eh)) < ATOL


def test_gspo_token_value_matches_reference_per_token_advantages():
    """gspo_token_loss with per-token advantages equals the per-token min/clip with ratio s_i."""
    logp, old, _, mask = _batch(GSPO_LR, GSPO_ADV)
    g = torch.Generator().manual_seed(3)
    adv_BT = torch.randn(5, 5, generator=g, dtype=F64)
    for eps in [(3e-4, 4e-4), (0.01, 0.02)]:
        loss, _ = call("gspo_token", logp, old, adv_BT, mask, *eps)
        assert abs(loss.item() - ref_gspo_token(logp, old, adv_BT, mask, *eps)) < ATOL


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_grpo_value_matches_reference(aggregation):
    """grpo_loss equals the per-token min/clip reference for both aggregations, all clip regions."""
    mask = MASK
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(5, 5, generator=g, dtype=F64) * 2
    # token log-ratios spanning below 1-0.2, inside, and above 1+0.27
    delta = torch.tensor([-0.5, -0.1, 0.0, 0.1, 0.4])[torch.randint(0, 5, (5, 5), generator=g)].to(F64)
    logp = (old + delta).requires_grad_(True)
    adv_BT = torch.randn(5, 5, generator=g, dtype=F64)
    for adv in (adv_BT, adv_BT[:, 0]):
        loss, _ = call("grpo", logp, old, adv, mask, aggregation=aggregation)
        adv_ref = adv if adv.dim() == 2 else adv[:, None].expand(5, 5)
        assert abs(loss.item() - ref_grpo(logp, old, adv_ref, mask, aggregation=aggregation)) < ATOL


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_grpo_seq_mask_value_and_gradient_match_reference(aggregation):
    """grpo_seq_mask equals its plain-python reference in every mask region (s_i inside GSPO's range,
    above it with A > 0 and with A < 0, below it with either sign), and a dropped sequence gets no
    gradient while a kept one gets GRPO's unclipped one: -A_i w_it / (|y_i| B) per token."""
    logp, old, adv, mask = _batch([1e-4, 5e-3, -4e-3, 2e-2, -3e-2], [0.7, 1.3, -0.9, -1.1, 0.4], spread=0.2)
    loss, m = call("grpo_seq_mask", logp, old, adv, mask, aggregation=aggregation)
    assert abs(loss.item() - ref_grpo_seq_mask(logp, old, adv, mask, aggregation=aggregation)) < ATOL
    # rows 1 (s > 1 + eps, A > 0) and 2 (s < 1 - eps, A < 0) are dropped; 3 (above, A < 0) and 4
    # (below, A > 0) are kept: the mask is GSPO's, one-sided as its clip
    g = _grad(loss, logp)
    assert (g[1] == 0).all() and (g[2] == 0).all() and (g[[0, 3, 4]] != 0).any(-1).all()
    w = torch.exp(logp - old).detach()
    denom = mask.sum(-1, keepdim=True) * 5 if aggregation == "seq_mean_token_mean" else mask.sum()
    want = -(adv[:, None] * w / denom) * mask
    want[[1, 2]] = 0.0
    torch.testing.assert_close(g, want, atol=1e-12, rtol=0)
    assert abs(m["clip_frac_seq"].item() - 2 / 5) < ATOL


def test_grpo_seq_mask_without_a_range_is_grpo_without_a_clip():
    """With a range no sequence leaves, nothing is dropped: the loss is GRPO's with a clip no token
    reaches (value and gradient, both aggregations)."""
    logp, old, adv, mask = _batch([0.3, -0.3, 0.1, -0.2, 0.05], [0.7, 1.3, -0.9, -1.1, 0.4], spread=0.5)
    for agg in ("seq_mean_token_mean", "token_mean"):
        a, _ = call("grpo_seq_mask", logp, old, adv, mask, 1.0, 1e9, aggregation=agg)
        b, _ = call("grpo", logp, old, adv, mask, 1.0, 1e9, aggregation=agg)
        assert abs(a.item() - b.item()) < ATOL
        torch.testing.assert_close(_grad(a, logp), _grad(b, logp), atol=1e-12, rtol=0)


def test_grpo_seq_mask_takes_each_bound_on_its_own_side():
    """Issue 57 gap 4: with eps_low 0.1 and eps_high 0.3, a sequence ratio of 0.8 (between 1 - 0.3
    and 1 - 0.1) with A < 0 is dropped, and 1.2 (between 1 + 0.1 and 1 + 0.3) with A > 0 is kept;
    with the bounds swapped it would be the other way round. Rows 2 and 3 sit on the side their
    advantage does not push to (kept), row 4 inside the range."""
    ratios = [math.log(0.8), math.log(1.2), math.log(0.8), math.log(1.2), 0.0]
    logp, old, adv, mask = _batch(ratios, [-1.0, 1.0, 1.0, -1.0, 0.5], spread=0.2)
    for agg in ("seq_mean_token_mean", "token_mean"):
        loss, m = call("grpo_seq_mask", logp, old, adv, mask, 0.1, 0.3, aggregation=agg)
        ref = ref_grpo_seq_mask(logp, old, adv, mask, el=0.1, eh=0.3, aggregation=agg)
        assert abs(loss.item() - ref) < ATOL
        g = _grad(loss, logp)
        assert (g[0] == 0).all() and (g[1:] != 0).any(-1).all(), g
        assert abs(m["clip_frac_seq"].item() - 1 / 5) < ATOL


def test_grpo_token_mean_divides_by_total_tokens():
    """DAPO token_mean: B=2 rows of 1 and 3 tokens, on-policy, equals -(sum of token A)/4."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=F64)
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    adv = torch.tensor([4.0, 1.0], dtype=F64)
    loss, _ = call("grpo", logp, logp.detach(), adv, mask, aggregation="token_mean")
    assert abs(loss.item() - (-(4.0 + 3 * 1.0) / 4)) < ATOL
    loss2, _ = call("grpo", logp, logp.detach(), adv, mask)
    assert abs(loss2.item() - (-(4.0 + 1.0) / 2)) < ATOL


def test_grpo_value_hand_computed_b3_t4_both_aggregations():
    """B=3, T=4 GRPO by hand: both clip sides, A<0, garbage padding; seq-mean vs token-mean."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=F64)
    w = torch.tensor([[1.1, 1.5, 9.0, 0.01], [0.5, 1.0, 1.2, 2.0], [0.9, 0.7, 1.3, 50.0]], dtype=F64)
    old = torch.tensor(
        [[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.7, -0.9, -1.1], [-2.0, -0.1, -0.3, -5.0]], dtype=F64
    )
    logp = (old + w.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    # row0 (A=1):  1.1 | 1.5 -> clip 1.27                        sum 2.37,  mean 1.185
    # row1 (A=-2): 0.5 -> clip .8*-2=-1.6 | -2 | -2.4 | 2.0 unclipped -4 (A<0 keeps the high side)
    #              sum -10.0, mean -2.5
    # row2 (A=.5): .45 | .7 -> .35 (A>0 keeps the low side) | 1.3 -> clip .635   sum 1.435
    rows = [(2.37, 2), (-10.0, 4), (1.435, 3)]
    want_seq = -sum(t / n for t, n in rows) / 3
    want_tok = -sum(t for t, _ in rows) / 9
    got_seq, _ = call("grpo", logp, old, adv, mask)
    got_tok, _ = call("grpo", logp, old, adv, mask, aggregation="token_mean")
    assert abs(got_seq.item() - want_seq) < ATOL
    assert abs(got_tok.item() - want_tok) < ATOL
    # per-token gradient: -(A w / |y_i|) / B where unclipped, else 0
    g = _grad(got_seq, logp)
    want_g = torch.tensor(
        [[-1.1 / 2, 0, 0, 0], [0, 2.0 / 4, 2.4 / 4, 4.0 / 4], [-0.45 / 3, -0.35 / 3, 0, 0]], dtype=F64
    )
    assert torch.allclose(g, want_g / 3, atol=ATOL, rtol=0)


def test_gspo_token_value_and_gradient_hand_computed():
    """GSPO-token by hand (eps .1/.2): per-token A picks clip side per token; grad -(A_it s_i/|y_i|)/B."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]], dtype=F64)
    delta = torch.tensor(
        [
            [math.log(1.5) + 0.1, math.log(1.5) - 0.1, math.log(1.5)],
            [math.log(0.8) + 0.05, math.log(0.8) - 0.05, 3.0],
        ],
        dtype=F64,
    )
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0], [-1.0, 0.5, 7.0]], dtype=F64)
    loss, m = call("gspo_token", logp, old, adv, mask, 0.1, 0.2)
    # row0 s=1.5: A=1 -> 1.2 (clipped) | A=-1 -> -1.5 | A=2 -> 2.4 (clipped)   mean 0.7
    # row1 s=0.8: A=-1 -> -0.9 (clipped) | A=.5 -> .4                         mean -0.25
    assert abs(loss.item() - (-(0.7 - 0.25) / 2)) < ATOL
    want_g = torch.tensor([[0.0, 1.5 / 3, 0.0], [0.0, -0.5 * 0.8 / 2, 0.0]], dtype=F64) / 2
    assert torch.allclose(_grad(loss, logp), want_g, atol=ATOL, rtol=0)
    assert abs(m["clip_frac_tok_high"].item() - 2 / 5) < ATOL
    assert abs(m["clip_frac_tok_low"].item() - 1 / 5) < ATOL
    assert abs(m["ratio_mean"].item() - (1.5 + 0.8) / 2) < ATOL


# ----------------------------------------------------------------------------------------------
# analytic gradients


def test_gspo_gradient_closed_form():
    """d loss/d logp_it = -(1/N) A_i s_i/|y_i| on response tokens, 0 on padding and clipped rows."""
    logp, old, adv, mask = _batch(GSPO_LR, GSPO_ADV)
    for n in (None, 7.0):
        loss, _ = call("gspo", logp, old, adv, mask, normalizer=n)
        g = _grad(loss, logp)
        N = 5 if n is None else n
        for i in range(5):
            toks = mask[i].bool()
            s = math.exp(((logp[i] - old[i])[toks]).sum().item() / toks.sum().item())
            want = 0.0 if GSPO_CLIPPED[i] else -adv[i].item() * s / toks.sum().item() / N
            assert torch.allclose(g[i][toks], torch.full_like(g[i][toks], want), atol=ATOL, rtol=0)
            assert torch.all(g[i][~toks] == 0)


def test_gspo_clip_region_rows_are_exactly_the_expected_ones():
    """The fixture's rows are really in the intended regions (guards the gradient test itself)."""
    logp, old, adv, mask = _batch(GSPO_LR, GSPO_ADV)
    _, m = call("gspo", logp, old, adv, mask)
    assert m["clip_frac_seq_high"].item() == pytest.approx(1 / 5, abs=ATOL)
    assert m["clip_frac_seq_low"].item() == pytest.approx(1 / 5, abs=ATOL)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_grpo_gradient_closed_form(aggregation):
    """GRPO: d loss/d logp_it = -(1/N) A_i w_it/|y_i| (or /N_tok) unclipped, 0 clipped or padded."""
    g_ = torch.Generator().manual_seed(5)
    old = -torch.rand(5, 5, generator=g_, dtype=F64) * 2
    delta = torch.tensor([-0.5, -0.1, 0.05, 0.1, 0.4])[torch.randint(0, 5, (5, 5), generator=g_)].to(F64)
    logp = (old + delta).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 3.0], dtype=F64)
    loss, _ = call("grpo", logp, old, adv, MASK, aggregation=aggregation)
    g = _grad(loss, logp)
    n_tok = MASK.sum().item()
    for i in range(5):
        n_i = MASK[i].sum().item()
        for t in range(5):
            if MASK[i, t] == 0:
                assert g[i, t].item() == 0.0
                continue
            w = math.exp(delta[i, t].item())
            a = adv[i].item()
            clipped = (w < 0.8 and a < 0) or (w > 1.27 and a > 0)
            norm = 5 * n_i if aggregation == "seq_mean_token_mean" else n_tok
            want = 0.0 if clipped else -a * w / norm
            assert abs(g[i, t].item() - want) < ATOL


def test_gspo_token_gradient_closed_form_per_token_advantages():
    """GSPO-token: d loss/d logp_it = -(1/N) A_it s_i/|y_i| unless token (s_i, A_it) is clipped."""
    logp, old, _, mask = _batch([2e-3, -2e-3, 1e-4, 0.0, 3e-3], [0, 0, 0, 0, 0])
    adv_BT = torch.tensor([[1, -1, 2, 0, 0]] * 5, dtype=F64)
    loss, _ = call("gspo_token", logp, old, adv_BT, mask)
    g = _grad(loss, logp)
    for i in range(5):
        toks = mask[i].bool()
        n_i = toks.sum().item()
        s = math.exp(((logp[i] - old[i])[toks]).sum().item() / n_i)
        for t in range(5):
            a = adv_BT[i, t].item()
            clipped = (s < 1 - 3e-4 and a < 0) or (s > 1 + 4e-4 and a > 0)
            want = 0.0 if (not toks[t] or clipped) else -a * s / n_i / 5
            assert abs(g[i, t].item() - want) < ATOL


# ----------------------------------------------------------------------------------------------
# identities between the losses


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.27)])
@pytest.mark.parametrize("explicit_bt", [False, True])
def test_gspo_token_equals_gspo_for_constant_advantages(eps, explicit_bt):
    """GSPO-token == GSPO in value and gradient when A_it = A_i ([B] broadcast and explicit [B,T])."""
    logp, old, adv, mask = _batch(GSPO_LR, GSPO_ADV)
    l1, m1 = call("gspo", logp, old, adv, mask, *eps)
    a = adv[:, None].expand(5, 5).clone() if explicit_bt else adv
    l2, m2 = call("gspo_token", logp, old, a, mask, *eps)
    assert abs(l1.item() - l2.item()) < ATOL
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)
    for k in m1:
        assert torch.allclose(m1[k], m2[k], atol=ATOL), k


def test_gspo_token_equals_gspo_beyond_log_ratio_clamp():
    """GSPO-token == GSPO (value and gradient) even when |log s_i| exceeds MAX_LOG_RATIO."""
    big = MAX_LOG_RATIO + 5
    logp, old, adv, mask = _batch([big, -big, 0.0, big, -big], [-1.0, 1.0, 1.0, 1.0, -1.0])
    l1, _ = call("gspo", logp, old, adv, mask)
    l2, _ = call("gspo_token", logp, old, adv, mask)
    assert abs(l1.item() - l2.item()) < 1e-9 * abs(l1.item())
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=ATOL, rtol=0)


def test_gspo_token_matches_gspo_exactly_in_float32_with_large_log_probs():
    """float32, |logp| ~ 1e3 (ulp 6e-5): GSPO-token's per-token ratio is exactly s_i, not s_i rounded
    at the scale of |logp|, so value and clip metrics equal GSPO's bit for bit (also at clip edges)."""
    T = 4  # mean of 4 equal float32 values is exact, so the two values are comparable with ==
    lr = torch.tensor([1e-4, 3.8e-4, 4.2e-4, -2.8e-4, -3.2e-4, 0.0, 2e-3, -2e-3])
    # one token per row at ~ -1000, three at O(1) magnitude, so s_i is finer than ulp(1000)
    old = torch.tensor([-1000.0, -0.3, -0.7, -1.3]).repeat(8, 1) - torch.arange(8.0)[:, None] * 0.37
    noise = torch.tensor([0.0, 3.1e-5, -1.7e-5, -1.4e-5])
    logp = (old + lr[:, None] + noise).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0])
    mask = torch.ones(8, T)
    l1, m1 = call("gspo", logp, old, adv, mask)
    l2, m2 = call("gspo_token", logp, old, adv, mask)
    assert l1.dtype == l2.dtype == torch.float32 and l1.item() == l2.item()
    for k in m1:
        assert torch.equal(m1[k], m2[k]), k
    assert torch.allclose(_grad(l1, logp), _grad(l2, logp), atol=0, rtol=1e-6)
    # the float32 result also agrees with the float64 computation on the same float32 inputs
    l64, _ = call("gspo", logp.detach().double(), old.double(), adv.double(), mask.double())
    assert abs(l1.item() - l64.item()) < 1e-6


def test_on_policy_gspo_gradient_equals_grpo_gradient():
    """With logp == old_logp, GSPO and GRPO (seq_mean_token_mean) agree in value and gradient."""
    logp, _, adv, mask = _batch([0.0] * 5, GSPO_ADV)
    old = logp.detach().clone()
    lg, mg = call("gspo", logp, old, adv, mask)
    lr, mr = call("grpo", logp, old, adv, mask)
    assert abs(lg.item() - lr.item()) < ATOL
    assert abs(lg.item() - (-adv.sum().item() / 5)) < ATOL
    gg, gr = _grad(lg, logp), _grad(lr, logp)
    assert torch.allclose(gg, gr, atol=ATOL, rtol=0)
    want = -(adv[:, None] / mask.sum(-1, keepdim=True) / 5) * mask
    assert torch.allclose(gg, want, atol=ATOL, rtol=0)
    assert mg["approx_kl"].item() == 0.0 and mr["approx_kl"].item() == 0.0


def test_gspo_not_length_weighted():
    """A long and a short sequence with equal per-token log-ratio and advantage contribute equally."""
    mask = torch.tensor([[1] * 8, [1, 1] + [0] * 6], dtype=F64)
    old = torch.linspace(-3, -0.1, 16, dtype=F64).view(2, 8)
    for d in (1e-4, 2e-3, -2e-3):
        logp = (old + d).requires_grad_(True)
        for a in (1.5, -0.5):
            adv = torch.tensor([a, a], dtype=F64)
            loss, _ = call("gspo", logp, old, adv, mask)
            long_only, _ = call("gspo", logp[:1], old[:1], adv[:1], mask[:1])
            short_only, _ = call("gspo", logp[1:], old[1:], adv[1:], mask[1:])
            assert abs(long_only.item() - short_only.item()) < ATOL
            assert abs(loss.item() - long_only.item()) < ATOL
            g = _grad(loss, logp)  # each sequence's total gradient mass is the same
            assert abs(g[0].sum().item() - g[1].sum().item()) < ATOL


# ----------------------------------------------------------------------------------------------
# metrics of GSPO, GSPO-token and GRPO


def test_gspo_metrics_hand_computed():
    """GSPO clip fractions (seq/token, low/high), ratio stats and k3 approx_kl match hand values."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=F64)
    lr = [1e-4, 5e-3, -4e-3, 2e-2, 0.7]  # in range | high clip | low clip | above, A<0 | empty row
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0], dtype=F64)
    old = torch.full((5, 4), -2.0, dtype=F64)
    logp = (old + torch.tensor(lr, dtype=F64)[:, None] * mask).requires_grad_(True)
    _, m = call("gspo", logp, old, adv, mask)
    want = {
        "clip_frac_seq_low": 1 / 4,
        "clip_frac_seq_high": 1 / 4,
        "clip_frac_seq": 2 / 4,
        "clip_frac_tok_low": 4 / 10,
        "clip_frac_tok_high": 2 / 10,
        "clip_frac_tok": 6 / 10,
        "ratio_mean": sum(math.exp(x) for x in lr[:4]) / 4,
        "ratio_min": math.exp(-4e-3),
        "ratio_max": math.exp(2e-2),
        "approx_kl": _k3([1e-4] * 3 + [5e-3] * 2 + [-4e-3] * 4 + [2e-2]),
    }
    for k, v in want.items():
        assert abs(m[k].item() - v) < ATOL, k
    _, mt = call("gspo_token", logp, old, adv, mask)
    for k, v in want.items():
        assert abs(mt[k].item() - v) < ATOL, k


def test_gspo_token_metrics_majority_rule_for_per_token_advantages():
    """GSPO-token: token clip fractions count tokens; a sequence is clipped when most tokens are."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=F64)
    old = torch.zeros(2, 4, dtype=F64)
    logp = (torch.tensor([[0.01], [0.01]], dtype=F64) * mask).requires_grad_(True)  # s > 1 + eps_high
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0], [1.0, -1.0, -1.0, 0.0]], dtype=F64)
    _, m = call("gspo_token", logp, old, adv, mask)
    assert m["clip_frac_tok_high"].item() == pytest.approx(3 / 7, abs=ATOL)
    assert m["clip_frac_tok_low"].item() == 0.0
    assert m["clip_frac_seq_high"].item() == pytest.approx(1 / 2, abs=ATOL)
    assert m["clip_frac_seq_low"].item() == 0.0


def test_grpo_metrics_hand_computed():
    """GRPO token clip fractions, per-sequence averaged fractions, token/sequence ratio stats, k3."""
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=F64)
    d = torch.tensor([[-0.5, 0.0, 0.5, 0.0], [0.5, -0.5, 0.0, 0.0], [0.0] * 4], dtype=F64)
    old = torch.full((3, 4), -1.0, dtype=F64)
    logp = (old + d).requires_grad_(True)
    adv = torch.tensor([[-1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0] * 4], dtype=F64)
    # row0: t0 w=e^-.5 A<0 low; t2 w=e^.5 A>0 high. row1: t0 high; t1 w=e^-.5 A>0 unclipped.
    _, m = call("grpo", logp, old, adv, mask)
    toks = [-0.5, 0.0, 0.5, 0.5, -0.5]
    want = {
        "clip_frac_tok_low": 1 / 5,
        "clip_frac_tok_high": 2 / 5,
        "clip_frac_tok": 3 / 5,
        "clip_frac_seq_low": (1 / 3 + 0) / 2,
        "clip_frac_seq_high": (1 / 3 + 1 / 2) / 2,
        "clip_frac_seq": (2 / 3 + 1 / 2) / 2,
        "ratio_mean": sum(math.exp(x) for x in toks) / 5,
        "ratio_min": math.exp(-0.5),
        "ratio_max": math.exp(0.5),
        "seq_ratio_mean": (1.0 + 1.0) / 2,
        "seq_ratio_min": 1.0,
        "seq_ratio_max": 1.0,
        "approx_kl": _k3(toks),
    }
    for k, v in want.items():
        assert abs(m[k].item() - v) < ATOL, k


def test_empty_row_contributes_zero_but_counts_in_default_normalizer():
    """A row with no response tokens adds 0 to the GSPO objective while N stays B."""
    logp, old, adv, mask = _batch(GSPO_LR, GSPO_ADV)
    mask = mask.clone()
    mask[2] = 0
    loss, _ = call("gspo", logp, old, adv, mask)
    assert abs(loss.item() - ref_gspo(logp, old, adv, mask)) < ATOL
    keep = torch.tensor([0, 1, 3, 4])
    sub, _ = call("gspo", logp[keep], old[keep], adv[keep], mask[keep], normalizer=5)
    assert abs(loss.item() - sub.item()) < ATOL


# ----------------------------------------------------------------------------------------------
# every loss: properties the module docstring promises, parametrized over VARIANTS


def _case(kind: str, seed: int):
    """``"seq"``: rows around given sequence log-ratios, logp = -7 on padding; ``"tok"``: token
    log-ratios spread over [-0.6, 0.6] (both sides of every clip range)."""
    return _batch([0.01, -0.2, 0.3, 2e-3, -1e-3]) if kind == "seq" else _token_batch(seed=seed)


KINDS = ["seq", "tok"]


def test_variants_cover_every_registered_loss():
    """VARIANTS (what the tests below run) holds every loss of the registry."""
    assert {fn.args[0] for fn in VARIANTS.values()} == set(LOSSES)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_permutation_invariance(name, kind):
    """Permuting the batch leaves loss and metrics unchanged and permutes the gradient rows."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _case(kind, seed=21)
    perm = torch.tensor([3, 0, 4, 1, 2])
    l1, m1 = fn(logp, old, adv, mask)
    x2 = logp.detach()[perm].requires_grad_(True)
    l2, m2 = fn(x2, old[perm], adv[perm], mask[perm])
    assert abs(l1.item() - l2.item()) < ATOL
    assert torch.allclose(_grad(l1, logp)[perm], _grad(l2, x2), atol=ATOL, rtol=0)
    for k in m1:
        assert torch.allclose(m1[k], m2[k], atol=ATOL), k


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_padding_invariance_with_garbage(name, kind):
    """Extra padded columns and NaN/+-inf/1e30 at masked positions (logp, old_logp, advantages) change
    nothing: loss, gradient, metrics."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _case(kind, seed=18)
    l1, m1 = fn(logp, old, adv, mask)
    g1 = _grad(l1, logp)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30], dtype=F64)
    B, T, pad = 5, 5, 3
    mask2 = torch.cat([mask, torch.zeros(B, pad, dtype=F64)], 1)
    fill = garbage[torch.arange(B * (T + pad)) % 5].view(B, T + pad)
    fill_old = garbage[(torch.arange(B * (T + pad)) + 2) % 5].view(B, T + pad)
    keep = mask2.bool()
    x = torch.where(keep, torch.cat([logp.detach(), fill[:, :pad]], 1), fill).requires_grad_(True)
    old2 = torch.where(keep, torch.cat([old, fill[:, :pad]], 1), fill_old)
    advs = [adv]
    if name not in SEQUENCE_ADVANTAGES:  # [B, T] advantages with garbage on padding
        advs.append(torch.where(keep, adv[:, None].expand(B, T + pad), garbage[0]))
    for adv2 in advs:
        l2, m2 = fn(x, old2, adv2, mask2)
        g2 = _grad(l2, x)
        assert torch.isfinite(l2) and abs(l1.item() - l2.item()) < ATOL
        assert torch.isfinite(g2).all() and torch.all(g2[~keep] == 0)
        assert torch.allclose(g1, g2[:, :T], atol=ATOL, rtol=0)
        assert torch.allclose(g1, g2[:, :T] * mask, atol=ATOL, rtol=0)
        for k in m1:
            assert torch.isfinite(m2[k]) and torch.allclose(m1[k], m2[k], atol=ATOL), k


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(set(VARIANTS) - PER_CALL))
def test_normalizer_gradient_accumulation_equivalence(name, kind):
    """Two half-batches with the global normalizer sum to the full-batch loss and gradient (not for
    the per-call selections, :data:`PER_CALL`)."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _case(kind, seed=19)
    full, _ = fn(logp, old, adv, mask)
    g_full = _grad(full, logp)
    n = _normalizer(name, mask)
    for norm in (n, torch.as_tensor(float(n), dtype=F64)):
        x = logp.detach().clone().requires_grad_(True)
        a, _ = fn(x[:2], old[:2], adv[:2], mask[:2], normalizer=norm)
        b, _ = fn(x[2:], old[2:], adv[2:], mask[2:], normalizer=norm)
        assert abs((a + b).item() - full.item()) < ATOL
        (a + b).backward()
        assert torch.allclose(x.grad, g_full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_empty_row_contributes_zero_and_nan_advantage_there_is_harmless(name, kind):
    """A row without response tokens adds 0 (normalizer unchanged) even with a NaN advantage: the
    loss equals the one with a finite advantage there, and the one of the other rows alone."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _case(kind, seed=20)
    for row in (2, 4):
        mask_r = mask.clone()
        mask_r[row] = 0
        adv_nan = adv.clone()
        adv_nan[row] = float("nan")
        clean, _ = fn(logp, old, adv, mask_r)
        loss, _ = fn(logp, old, adv_nan, mask_r)
        g = _grad(loss, logp)
        assert torch.isfinite(g).all() and torch.all(g[row] == 0)
        assert abs(clean.item() - loss.item()) < ATOL
        keep = torch.tensor([i for i in range(5) if i != row])
        n = _normalizer(name, mask_r)
        sub, _ = fn(logp[keep], old[keep], adv[keep], mask_r[keep], normalizer=n)
        assert abs(loss.item() - sub.item()) < ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_extreme_log_ratios_finite(name, dtype):
    """Log-ratios of +-1e4 and old_logp = -1e30 give a finite loss, gradients and metrics."""
    fn = VARIANTS[name]
    mask = MASK.to(dtype)
    old = torch.full((5, 5), -1.0, dtype=dtype)
    old[0] = -1e30
    old[3, 1] = -1e30
    logp = torch.full((5, 5), -1.0, dtype=dtype)
    logp[1] = -1e4
    logp[2] = 1e4
    logp[4, 0] = -1e4
    logp.requires_grad_(True)
    for sign in (1.0, -1.0):
        loss, m = fn(logp, old, sign * torch.tensor(ADV, dtype=dtype), mask)
        g = _grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_float32_log_ratio_overflow_stays_finite(name):
    """Finite float32 inputs whose difference overflows (3e38 - -3e38 = inf, and -inf in the same row)
    give a finite loss, no gradient on the overflowing tokens (except CISPO and VESPO, whose tokens all
    keep a gradient, with a bounded weight), and leave the other rows untouched."""
    fn = VARIANTS[name]
    logp = torch.tensor([[3e38, -3e38, -1.0, -1.0], [-1.0, -1.1, -0.9, -1.0]], requires_grad=True)
    old = torch.tensor([[-3e38, 3e38, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(2, 4)
    adv = torch.tensor([1.0, -1.0])
    loss, m = fn(logp, old, adv, mask)
    g = _grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in m.values())
    if not name.startswith(("cispo", "vespo", "dppo")):  # REINFORCE forms: every token keeps its gradient
        assert torch.all(g[0, :2] == 0)  # (DPPO: token 1's probability fell to 0 with A > 0, kept)
    if name in PER_CALL:  # the other row alone is another call, with its own selection
        return
    n = 8 if name in TOKEN_NORMALIZED else 2
    x1 = logp.detach()[1:].clone().requires_grad_(True)
    l1, _ = fn(x1, old[1:], adv[1:], mask[1:], normalizer=n)
    assert torch.allclose(g[1:], _grad(l1, x1), atol=1e-7, rtol=0)
    if name.startswith("gspo"):
        # +-inf tokens cancel in the (clamped) mean: s_0 = 1, so the finite tokens still get -A/|y|/B
        assert torch.allclose(g[0, 2:], torch.full((2,), -1.0 / 4 / 2), atol=1e-7, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_half_precision_inputs_are_computed_in_float32(name, dtype):
    """bf16/fp16 log-probs give exactly the float32 result on the same (rounded) values: token counts
    above 256 and ratios at the 1e-4 clip scale are not rounded to half precision."""
    fn = VARIANTS[name]
    for seed in (7, 22):
        g = torch.Generator().manual_seed(seed)
        B, T = 3, 300
        mask = torch.ones(B, T)
        mask[1, 257:] = 0
        mask[2, 100:] = 0
        old = (-torch.rand(B, T, generator=g) * 4).to(dtype)
        logp = (old.float() + torch.randn(B, T, generator=g) * 0.01 + 1e-4).to(dtype)
        adv = torch.tensor([1.0, -0.5, 0.8])
        x = logp.clone().requires_grad_(True)
        loss, m = fn(x, old, adv, mask)
        x32 = logp.float().requires_grad_(True)
        loss32, m32 = fn(x32, old.float(), adv, mask)
        assert loss.dtype == torch.float32 and loss.item() == loss32.item()
        gx, g32 = _grad(loss, x), _grad(loss32, x32)
        assert gx.dtype == dtype and torch.equal(gx, g32.to(dtype))
        for k in m32:
            assert m[k].dtype == torch.float32 and torch.equal(m[k], m32[k]), k


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_approx_kl_zero_on_policy_and_k3_off_policy(name, kind):
    """approx_kl is exactly 0 on-policy and equals mean_t (e^d - 1 - d) > 0 off-policy."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _case(kind, seed=24)
    _, m0 = fn(logp, logp.detach(), adv, mask)
    assert m0["approx_kl"].item() == 0.0
    _, m = fn(logp, old, adv, mask)
    d = (logp.detach() - old)[mask.bool()].tolist()
    assert abs(m["approx_kl"].item() - _k3(d)) < ATOL
    assert m["approx_kl"].item() > 0


CLIP_KEYS = {f"clip_frac_{u}{s}" for u in ("seq", "tok") for s in ("", "_low", "_high")}
RATIO_KEYS = {"ratio_mean", "ratio_min", "ratio_max", "approx_kl"}
SEQ_RATIO_KEYS = {"seq_ratio_mean", "seq_ratio_min", "seq_ratio_max"}
GATE_KEYS = {"gate_seq_mean", "gate_tok_mean", "gate_min"}
UNUSED_TOKEN_RATIO_KEYS = {"tok_ratio_min", "tok_ratio_max"}
COV_KEYS = {"cov_frac_tok", "cov_threshold"}
EXPECTED_KEYS = {
    "gspo": CLIP_KEYS | RATIO_KEYS | UNUSED_TOKEN_RATIO_KEYS,
    "gspo_token": CLIP_KEYS | RATIO_KEYS | UNUSED_TOKEN_RATIO_KEYS,
    "sapo": GATE_KEYS | RATIO_KEYS,
    "luspo": CLIP_KEYS | RATIO_KEYS | UNUSED_TOKEN_RATIO_KEYS,
    "vespo": GATE_KEYS | RATIO_KEYS | UNUSED_TOKEN_RATIO_KEYS,
    "vespo_smtm": GATE_KEYS | RATIO_KEYS | UNUSED_TOKEN_RATIO_KEYS,
    **{
        n: CLIP_KEYS | RATIO_KEYS | SEQ_RATIO_KEYS
        for n in ("grpo", "grpo_tm", "grpo_seq_mask", "grpo_seq_mask_tm", "cispo", "cispo_smtm", "gmpo")
    },
    **{n: GATE_KEYS | RATIO_KEYS | SEQ_RATIO_KEYS for n in ("sapo_token", "sapo_token_tm")},
    **{
        n: CLIP_KEYS | RATIO_KEYS | SEQ_RATIO_KEYS
        for n in ("dppo_tv", "dppo_tv_smtm", "dppo_kl", "dppo_kl_smtm")
    },
    **{n: CLIP_KEYS | RATIO_KEYS | SEQ_RATIO_KEYS | COV_KEYS for n in ("clip_cov", "clip_cov_smtm")},
    **{n: RATIO_KEYS | SEQ_RATIO_KEYS | COV_KEYS for n in ("kl_cov", "kl_cov_smtm")},
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("empty_rows", ["none", "one", "all"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_metrics_keys_scalar_and_nan_free(name, empty_rows, kind):
    """Exactly the documented keys; detached finite 0-dim tensors, also with one or all rows empty
    (then the loss and its gradient are 0, ratio means 0 and min/max 1)."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _case(kind, seed=23)
    mask = mask.clone()
    if empty_rows == "one":
        mask[1] = 0
    elif empty_rows == "all":
        mask.zero_()
    loss, m = fn(logp, old, adv, mask)
    g = _grad(loss, logp)
    assert loss.dim() == 0 and torch.isfinite(loss) and torch.isfinite(g).all()
    assert set(m) == EXPECTED_KEYS[name]
    for k, v in m.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad and torch.isfinite(v), k
    if empty_rows == "all":
        assert loss.item() == 0.0 and torch.all(g == 0)
        assert m["ratio_mean"].item() == 0.0
        assert m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
        if "gate_min" in m:
            assert m["gate_min"].item() == 1.0 and m["gate_tok_mean"].item() == 0.0


@pytest.mark.parametrize("name", sorted(TOKEN_RATIO))
def test_token_ratio_losses_report_token_and_sequence_ratios(name):
    """ratio_* are over tokens and seq_ratio_* over sequences (the key rule of the module docstring)."""
    logp, old, adv, mask = _token_batch(seed=25)
    _, m = VARIANTS[name](logp, old, adv, mask)
    d = (logp.detach() - old)[mask.bool()]
    assert abs(m["ratio_mean"].item() - d.exp().mean().item()) < ATOL
    assert abs(m["ratio_max"].item() - d.exp().max().item()) < ATOL
    s = [math.exp(((logp[i] - old[i])[mask[i].bool()]).mean().item()) for i in range(5)]
    assert abs(m["seq_ratio_mean"].item() - sum(s) / 5) < ATOL
    assert abs(m["seq_ratio_min"].item() - min(s)) < ATOL


@pytest.mark.parametrize("fn", [tensor_loss("gspo"), tensor_loss("gspo_token")])
def test_sequence_ratio_losses_report_the_token_ratio_extremes_they_do_not_use(fn):
    """tok_ratio_min / max are the extremes of exp(logp - old_logp) over response tokens only."""
    logp, old, adv, mask = _token_batch(seed=26)
    _, m = fn(logp, old, adv, mask)
    d = (logp.detach() - old)[mask.bool()]
    assert abs(m["tok_ratio_max"].item() - d.exp().max().item()) < ATOL
    assert abs(m["tok_ratio_min"].item() - d.exp().min().item()) < ATOL
    assert (
        m["tok_ratio_min"].item() < m["ratio_min"].item() <= m["ratio_max"].item() < m["tok_ratio_max"].item()
    )


@pytest.mark.parametrize("fn", [tensor_loss("grpo"), tensor_loss("sapo_token"), tensor_loss("cispo")])
def test_rejects_unknown_aggregation(fn):
    """The losses that take an aggregation raise ValueError for an unknown name."""
    logp, old, adv, mask = _batch(GSPO_LR)
    with pytest.raises(ValueError):
        fn(logp, old, adv, mask, aggregation="sum")


def _gradcheck_case(name):
    """(logp, loss of logp) away from clip boundaries, for each loss whose gradient is its value's."""
    if name in ("gspo", "gspo_token", "luspo", "grpo_seq_mask", "grpo_seq_mask_tm"):
        logp, old, adv, mask = _batch(GSPO_LR, spread=1e-3)
        # gspo_token with constant A_it = A_i: with varying A_it the stop-gradient surrogate is, by
        # design, not the derivative of the loss value (covered by the per-token closed-form test)
        adv = adv if name != "gspo_token" else adv[:, None].expand(5, 5)
        return logp, lambda x: VARIANTS[name](x, old, adv, mask, 3e-4, 4e-4)[0]
    if name in ("grpo", "grpo_tm"):
        logp, old, adv, mask = _batch([0.05, 0.5, -0.5, 0.4, -0.4], spread=0.02)
        return logp, lambda x: VARIANTS[name](x, old, adv, mask, 0.2, 0.27)[0]
    logp, old, adv, mask = _token_batch(seed=8, scale=0.3 if name == "gmpo" else 1.0)
    return logp, lambda x: VARIANTS[name](x, old, adv, mask)[0]


# CISPO's, VESPO's and DPPO's stop-gradient surrogates are by design not the derivative of their value
SURROGATES = {
    "cispo",
    "cispo_smtm",
    "vespo",
    "vespo_smtm",
    "dppo_tv",
    "dppo_tv_smtm",
    "dppo_kl",
    "dppo_kl_smtm",
}


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - SURROGATES))
def test_gradcheck(name):
    """torch.autograd.gradcheck passes in float64 away from clip boundaries."""
    logp, f = _gradcheck_case(name)
    x = logp.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,), eps=1e-7, atol=1e-9, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# registry


def test_losses_registry_entries_and_default_eps():
    """LOSSES holds each loss once: its function, the papers' parameters (SAPO: its temperatures,
    VESPO: its kernel, no clip range), its default aggregation and the kind of its own ratio."""
    assert list(LOSSES) == [
        "gspo", "gspo_token", "grpo", "grpo_seq_mask", "sapo", "sapo_token", "cispo", "gmpo", "luspo",
        "vespo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov",
    ]  # fmt: skip
    want = {
        "gspo": (gspo_loss, {"eps_low": 3e-4, "eps_high": 4e-4}, None, False),
        "gspo_token": (gspo_token_loss, {"eps_low": 3e-4, "eps_high": 4e-4}, None, False),
        "grpo": (grpo_loss, {"eps_low": 0.2, "eps_high": 0.27}, "seq_mean_token_mean", True),
        "grpo_seq_mask": (
            grpo_seq_mask_loss,
            {"eps_low": 3e-4, "eps_high": 4e-4},
            "seq_mean_token_mean",
            True,
        ),
        "sapo": (sapo_loss, {"tau_neg": 1.05, "tau_pos": 1.0}, None, False),
        "sapo_token": (sapo_token_loss, {"tau_neg": 1.05, "tau_pos": 1.0}, "seq_mean_token_mean", True),
        "cispo": (cispo_loss, {"eps_low": 1.0, "eps_high": 0.28}, "token_mean", True),
        "gmpo": (gmpo_loss, {"eps_low": 0.4, "eps_high": 0.4}, None, True),
        "luspo": (luspo_loss, {"eps_low": 2e-3, "eps_high": 2.5e-3}, None, False),
        "vespo": (
            vespo_loss,
            {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
            "token_mean",
            False,
        ),
        "dppo_tv": (
            dppo_tv_loss,
            {"delta_low": 0.15, "delta_high": 0.15, "max_weight": 20.0},
            "token_mean",
            True,
        ),
        "dppo_kl": (
            dppo_kl_loss,
            {"delta_low": 0.05, "delta_high": 0.05, "max_weight": 20.0},
            "token_mean",
            True,
        ),
        "clip_cov": (
            clip_cov_loss,
            {"eps_low": 0.2, "eps_high": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
            "token_mean",
            True,
        ),
        "kl_cov": (kl_cov_loss, {"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1}, "token_mean", True),
    }
    for name, (fn, params, aggregation, token_ratio) in want.items():
        spec = LOSSES[name]
        assert (spec.fn, dict(spec.params), spec.aggregation, spec.token_ratio) == (
            fn,
            params,
            aggregation,
            token_ratio,
        ), name
        # the function takes the loss inputs and exactly the spec's keywords, none with a default
        sig = inspect.signature(fn).parameters
        assert list(sig)[0] == "inp" and set(list(sig)[1:]) == set(spec.resolve())
        assert all(p.default is inspect.Parameter.empty for p in sig.values())
    assert LOSSES["sapo"].eps == LOSSES["sapo_token"].eps == ()  # temperatures: the config's sapo_tau_*
    assert LOSSES["vespo"].eps == LOSSES["kl_cov"].eps == ()  # no clip range
    assert LOSSES["dppo_tv"].eps == LOSSES["dppo_kl"].eps == ("delta_low", "delta_high")  # DPPO's thresholds
    with pytest.raises(ValueError, match="takes no aggregation"):
        LOSSES["gspo"].resolve("token_mean")
    with pytest.raises(TypeError, match="takes no parameter"):
        LOSSES["sapo"].resolve(eps_low=0.1)
