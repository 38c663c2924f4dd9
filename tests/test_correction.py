"""Train/inference mismatch correction: closed-form values in float64 and how they plug into the losses."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import call, tensor_loss

from gspo.correction import CORRECTIONS, mismatch_metrics, sequence_mask, sequence_tis_weights, token_mask
from gspo.loss_prologue import loss_inputs
from gspo.losses import LOSSES

F64 = torch.float64
ATOL = 1e-12
NAN, INF = float("nan"), float("inf")

# old_logp - sampler_logp per token; row 2 is empty; padding holds garbage
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=F64)
D = torch.tensor(
    [[0.1, 0.3, NAN, INF], [1.0, 0.8, 0.9, -INF], [NAN, 5.0, -5.0, 0.0], [-0.2, -0.1, 0.0, 0.1]],
    dtype=F64,
)
# row means: 0.2 | 0.9 | (empty) 0 | -0.05
SAMPLER = torch.tensor(
    [[-1.0, -2.0, -0.5, -3.0], [-0.3, -0.2, -1.1, -0.7], [-1.0, -1.0, -1.0, -1.0], [-2.0, -0.4, -0.9, -1.6]],
    dtype=F64,
)
OLD = torch.where(MASK.bool(), SAMPLER + torch.nan_to_num(D), D)  # garbage at padding in old too


def _d_BT(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """old_logp - sampler_logp per response token, detached, 0 on padding (the losses' prologue)."""
    return loss_inputs(old_logp.detach(), sampler_logp.detach(), mask.detach()).log_r_BT


def icepop_weights(old_logp, sampler_logp, mask, lo: float = 0.5, hi: float = 5.0) -> torch.Tensor:
    """IcePop's M(k) = k if lo <= k <= hi else 0, per token, 0 on padding, detached: the masked-and-
    reweighted form of the Ring-1T objective, ``grpo_loss(..., weight=M)`` (no config setting uses
    it: ``mismatch_correction token_mask`` is its mask alone; kept here to pin the loss's weight)."""
    d_BT = _d_BT(old_logp, sampler_logp, mask)
    keep_BT = token_mask(old_logp, sampler_logp, mask, lo, hi).bool()
    return torch.where(keep_BT, torch.exp(d_BT), torch.zeros_like(d_BT))


def token_tis_weights(old_logp, sampler_logp, mask, cap: float = 2.0) -> torch.Tensor:
    """Token-level truncated importance sampling, min(k_it, cap), 0 on padding, detached (cap = 2:
    Yao et al., 2025); for the token-aggregating losses' ``weight`` (no config setting uses it)."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    d_BT = _d_BT(old_logp, sampler_logp, mask)
    return torch.where(mask.detach().bool(), torch.exp(d_BT).clamp(max=cap), torch.zeros_like(d_BT))


def _sampler_with_garbage():
    return torch.where(MASK.bool(), SAMPLER, torch.tensor([NAN, INF, -INF, 1e30]).to(F64).expand(4, 4))


# ----------------------------------------------------------------------------------------------
# sequence-level truncated importance sampling


def test_sequence_tis_weights_hand_computed():
    """min(exp(mean_t d), C): e^.2 | e^.9 = 2.46 -> 2 | empty row 1 | e^-.05; C = inf gives the raw ratio."""
    w = sequence_tis_weights(OLD, _sampler_with_garbage(), MASK, cap=2.0)
    want = [math.exp(0.2), 2.0, 1.0, math.exp(-0.05)]
    assert w.shape == (4,) and w.dtype == F64
    assert torch.allclose(w, torch.tensor(want, dtype=F64), atol=ATOL, rtol=0)
    raw = sequence_tis_weights(OLD, SAMPLER, MASK, cap=math.inf)
    assert abs(raw[1].item() - math.exp(0.9)) < ATOL and raw[1].item() > 2
    assert sequence_tis_weights(OLD, SAMPLER, MASK, cap=1.1)[1].item() == 1.1  # exactly the cap


def test_sequence_tis_weights_are_detached_and_one_when_equal():
    """No gradient flows through the weights; identical log-probs give weights exactly 1."""
    old = OLD.clone().requires_grad_(True)
    w = sequence_tis_weights(old, SAMPLER, MASK, cap=2.0)
    assert not w.requires_grad
    same = sequence_tis_weights(SAMPLER, SAMPLER, MASK, cap=2.0)
    assert torch.equal(same, torch.ones(4, dtype=F64))


def test_tis_rejects_bad_cap_and_half_precision_is_computed_in_float32():
    """cap must be > 0; bf16 inputs give float32 weights equal to the float32 computation."""
    for cap in (0.0, -1.0, NAN):
        with pytest.raises(ValueError):
            sequence_tis_weights(OLD, SAMPLER, MASK, cap=cap)
        with pytest.raises(ValueError):
            token_tis_weights(OLD, SAMPLER, MASK, cap=cap)
    o, s = OLD.nan_to_num().bfloat16(), SAMPLER.bfloat16()
    w = sequence_tis_weights(o, s, MASK, cap=2.0)
    assert w.dtype == torch.float32 and torch.equal(w, sequence_tis_weights(o.float(), s.float(), MASK, 2.0))


def test_extreme_mismatch_stays_finite():
    """A token the sampler gave log-prob -inf (or -1e30) yields finite weights, masks and metrics."""
    sampler = SAMPLER.clone()
    sampler[0, 0] = -INF
    sampler[3, 2] = -1e30
    for fn in (
        lambda o, s, m: sequence_tis_weights(o, s, m, 2.0),
        lambda o, s, m: sequence_mask(o, s, m, 0.5, 2.0),
        token_mask,
        icepop_weights,
        token_tis_weights,
    ):
        out = fn(OLD, sampler, MASK)
        assert torch.isfinite(out).all()
    w = sequence_tis_weights(OLD, sampler, MASK, 2.0)
    assert w[0].item() == 2.0 and w[3].item() == 2.0
    assert sequence_mask(OLD, sampler, MASK, 0.5, 2.0)[0].item() == 0.0
    m = mismatch_metrics(OLD, sampler, MASK, tis_cap=2.0, seq_bounds=(0.5, 2.0), token_bounds=(0.5, 5.0))
    assert all(torch.isfinite(v) for v in m.values())


# ----------------------------------------------------------------------------------------------
# masks


def test_sequence_mask_hand_computed():
    """keep rho in [lo, hi]: e^.2 = 1.22, e^.9 = 2.46, empty (rho = 1), e^-.05 = 0.95."""
    keep = sequence_mask(OLD, _sampler_with_garbage(), MASK, 0.9, 1.3)
    assert keep.dtype == F64 and torch.equal(keep, torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64))
    keep = sequence_mask(OLD, SAMPLER, MASK, 0.96, 3.0)
    assert torch.equal(keep, torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64))
    keep = sequence_mask(OLD, SAMPLER, MASK, 1.01, 2.0)  # the empty row's rho = 1 is out of range
    assert torch.equal(keep, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64))
    with pytest.raises(ValueError):
        sequence_mask(OLD, SAMPLER, MASK, 1.2, 1.1)


def test_token_mask_icepop_and_token_tis_hand_computed():
    """k = e^d per token; keep k in [0.5, 5] (IcePop); M(k) = k there; min(k, 2); padding 0."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=F64)
    k = [0.3, 1.0, 6.0, 4.0, 0.5 + 1e-9, 1.0]
    sampler = torch.tensor([[-1.0, -2.0, -0.5, -0.1, -3.0, -1.0]], dtype=F64)
    old = sampler + torch.tensor([k], dtype=F64).log()
    old[0, 5] = NAN
    keep = token_mask(old, sampler, mask)
    assert torch.equal(keep, torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0, 0.0]], dtype=F64))
    m = icepop_weights(old, sampler, mask)
    assert torch.allclose(
        m, torch.tensor([[0.0, 1.0, 0.0, 4.0, 0.5 + 1e-9, 0.0]], dtype=F64), atol=ATOL, rtol=0
    )
    w = token_tis_weights(old, sampler, mask)
    assert torch.allclose(
        w, torch.tensor([[0.3, 1.0, 2.0, 2.0, 0.5 + 1e-9, 0.0]], dtype=F64), atol=ATOL, rtol=0
    )
    narrow = token_mask(old, sampler, mask, 0.9, 1.1)
    assert torch.equal(narrow, torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=F64))
    for out in (keep, m, w):
        assert not out.requires_grad and out.shape == mask.shape


# ----------------------------------------------------------------------------------------------
# metrics


def _k3(x):
    return math.expm1(x) - x


def test_mismatch_metrics_hand_computed():
    """Every key against numbers written out for the fixture (rows: d = [.1, .3] | [1, .8, .9] | empty
    | [-.2, -.1, 0, .1])."""
    toks = [0.1, 0.3, 1.0, 0.8, 0.9, -0.2, -0.1, 0.0, 0.1]
    means = [0.2, 0.9, -0.05]
    m = mismatch_metrics(
        OLD,
        _sampler_with_garbage(),
        MASK,
        tis_cap=2.0,
        seq_bounds=(0.9, 1.3),
        token_bounds=(0.95, 2.5),
        token_tis_cap=1.5,
    )
    want = {
        "mismatch_k1_tok": -sum(toks) / 9,
        "mismatch_k3_tok": sum(_k3(x) for x in toks) / 9,
        "mismatch_k1_seq": -sum(means) / 3,
        "mismatch_k3_seq": sum(_k3(x) for x in means) / 3,
        "mismatch_ratio_tok_min": math.exp(-0.2),
        "mismatch_ratio_tok_max": math.exp(1.0),
        "mismatch_ratio_seq": sum(math.exp(x) for x in means) / 3,
        "mismatch_ratio_seq_min": math.exp(-0.05),
        "mismatch_ratio_seq_max": math.exp(0.9),
        # rho = 1.22, 2.46 (> 2, truncated), 0.95
        "tis_weight_seq": (math.exp(0.2) + 2.0 + math.exp(-0.05)) / 3,
        "tis_trunc_frac_seq": 1 / 3,
        "tis_trunc_frac_tok": 3 / 9,
        # [0.9, 1.3] drops the second row (3 tokens)
        "seq_mask_frac_seq": 1 / 3,
        "seq_mask_frac_tok": 3 / 9,
        # k outside [0.95, 2.5]: e^1 = 2.72 (row 1), e^-.2 = .82 and e^-.1 = .905 (row 3)
        "tok_mask_frac_tok": 3 / 9,
        "tok_mask_frac_seq": (0 + 1 / 3 + 2 / 4) / 3,
        # k > 1.5: e^1, e^.8 = 2.23, e^.9 = 2.46 (all of row 1)
        "tok_tis_trunc_frac_tok": 3 / 9,
        "tok_tis_trunc_frac_seq": (0 + 1 + 0) / 3,
    }
    assert set(m) == set(want)
    for k, v in want.items():
        assert abs(m[k].item() - v) < ATOL, k
        assert m[k].dim() == 0 and not m[k].requires_grad


def test_mismatch_metrics_zero_without_mismatch_and_nan_free_when_empty():
    """Equal log-probs: KLs and fractions exactly 0, ratios 1. No response tokens: means 0, min/max 1."""
    opts = dict(tis_cap=2.0, seq_bounds=(0.5, 2.0), token_bounds=(0.5, 5.0), token_tis_cap=2.0)
    m = mismatch_metrics(SAMPLER, SAMPLER, MASK, **opts)
    for k, v in m.items():
        if "ratio" in k or k == "tis_weight_seq":
            assert v.item() == 1.0, k
        else:
            assert v.item() == 0.0, k
    empty = mismatch_metrics(OLD, _sampler_with_garbage(), torch.zeros(4, 4, dtype=F64), **opts)
    for k, v in empty.items():
        assert torch.isfinite(v), k
        assert v.item() == (1.0 if k.endswith(("_min", "_max")) else 0.0), k


def test_mismatch_metrics_keys_follow_the_naming_rule():
    """Only the requested groups appear; every key ends in _min/_max, _tok or _seq."""
    base = mismatch_metrics(OLD, SAMPLER, MASK)
    assert not any(k.startswith(("tis_", "seq_mask", "tok_mask", "tok_tis")) for k in base)
    full = mismatch_metrics(
        OLD, SAMPLER, MASK, tis_cap=2.0, seq_bounds=(0.5, 2.0), token_bounds=(0.5, 5.0), token_tis_cap=2.0
    )
    assert all(k.endswith(("_min", "_max", "_tok", "_seq")) for k in full)
    assert len(full) == len(base) + 9
    with_abs = mismatch_metrics(OLD, SAMPLER, MASK, abs_diff=True)  # sequence means, no _tok
    assert set(with_abs) - set(base) == {"token_abs_logp_diff", "seq_abs_logp_diff"}
    assert mismatch_metrics(OLD, SAMPLER, MASK, estimators=False) == {}


def test_abs_diff_metrics_hand_computed():
    """token_abs_logp_diff: each sequence's mean |d|, averaged over sequences; seq_abs_logp_diff: mean
    of |l_i| (rows: d = [.1, .3] | [1, .8, .9] | empty | [-.2, -.1, 0, .1])."""
    m = mismatch_metrics(OLD, _sampler_with_garbage(), MASK, estimators=False, abs_diff=True)
    assert set(m) == {"token_abs_logp_diff", "seq_abs_logp_diff"}
    assert abs(m["token_abs_logp_diff"].item() - (0.2 + 0.9 + 0.1) / 3) < ATOL
    assert abs(m["seq_abs_logp_diff"].item() - (0.2 + 0.9 + 0.05) / 3) < ATOL


def test_abs_diff_metrics_equal_the_trainers_former_formula_bitwise():
    """In float32, the abs-diff metrics are bit for bit what gspo.training.update computed inline before it
    called mismatch_metrics (so the logged numbers do not move)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 50, generator=g) > 0.3).float()
    mask[2] = 0
    sampler = -torch.rand(6, 50, generator=g) * 5
    old = sampler + torch.randn(6, 50, generator=g) * 0.05
    m = mismatch_metrics(old, sampler, mask, estimators=False, abs_diff=True)
    n_B = mask.sum(-1).clamp(min=1)
    d_BT = torch.where(mask.bool(), old - sampler, 0.0)
    n_seq = (mask.sum(-1) > 0).sum().clamp(min=1)
    assert torch.equal(m["token_abs_logp_diff"], (d_BT.abs().sum(-1) / n_B).sum() / n_seq)
    assert torch.equal(m["seq_abs_logp_diff"], (d_BT.sum(-1) / n_B).abs().sum() / n_seq)


def test_corrections_registry_matches_the_functions():
    """CORRECTIONS[name] returns the loss weight, the loss mask and the metrics of that correction:
    exactly what the functions above give (the trainer's former if/elif chain)."""
    assert list(CORRECTIONS) == ["none", "seq_tis", "seq_mask", "token_mask"]
    old, sampler = OLD, _sampler_with_garbage()
    cap, lo, hi = 1.5, 0.9, 1.3
    base = dict(estimators=True, abs_diff=True)
    want = {
        "none": (None, MASK, mismatch_metrics(old, sampler, MASK, estimators=False, abs_diff=True)),
        "seq_tis": (
            sequence_tis_weights(old, sampler, MASK, cap),
            MASK,
            mismatch_metrics(old, sampler, MASK, **base, tis_cap=cap),
        ),
        "seq_mask": (
            sequence_mask(old, sampler, MASK, lo, hi),
            MASK,
            mismatch_metrics(old, sampler, MASK, **base, seq_bounds=(lo, hi)),
        ),
        "token_mask": (
            None,
            MASK * token_mask(old, sampler, MASK, lo, hi),
            mismatch_metrics(old, sampler, MASK, **base, token_bounds=(lo, hi)),
        ),
    }
    for name, (w, m_BT, metrics) in want.items():
        got_w, got_mask, got_metrics = CORRECTIONS[name](old, sampler, MASK, cap=cap, lo=lo, hi=hi)
        assert (got_w is None) == (w is None) and (w is None or torch.equal(got_w, w)), name
        assert torch.equal(got_mask, m_BT), name
        assert got_metrics.keys() == metrics.keys(), name
        assert all(torch.equal(got_metrics[k], metrics[k]) for k in metrics), name


def test_mismatch_metrics_invariant_to_padding_content():
    """Garbage at masked positions of either input changes no metric."""
    opts = dict(tis_cap=2.0, seq_bounds=(0.9, 1.3), token_bounds=(0.95, 2.5), token_tis_cap=1.5)
    clean_old = torch.where(MASK.bool(), OLD, torch.zeros_like(OLD))
    a = mismatch_metrics(clean_old, SAMPLER, MASK, **opts)
    b = mismatch_metrics(OLD, _sampler_with_garbage(), MASK, **opts)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------------------------
# plugging into the losses


def _loss_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=F64)
    sampler = -torch.rand(4, 4, generator=g, dtype=F64) * 2 - 0.1
    old = sampler + (torch.rand(4, 4, generator=g, dtype=F64) - 0.5) * 1.5
    logp = (old + (torch.rand(4, 4, generator=g, dtype=F64) - 0.5) * 0.6).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=F64)
    return logp, old, sampler, adv, mask


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_tis_weight_multiplies_the_gradient_of_its_sequence_exactly(name):
    """For every loss: with weight = sequence_tis_weights(...), row i's gradient is w_i times the
    unweighted one, and the loss is sum_i w_i (row i's loss)."""
    fn = tensor_loss(name)  # its default parameters
    logp, old, sampler, adv, mask = _loss_batch()
    w = sequence_tis_weights(old, sampler, mask, cap=1.2)
    assert (w == 1.2).any() and (w < 1.2).any()  # both truncated and untruncated rows
    token_mean = name == "cispo"  # the only default token_mean aggregation
    n = mask.sum() if token_mean else 4
    base, _ = fn(logp, old, adv, mask, normalizer=n)
    g0 = torch.autograd.grad(base, logp)[0]
    loss, _ = fn(logp, old, adv, mask, normalizer=n, weight=w)
    g = torch.autograd.grad(loss, logp)[0]
    for i in range(4):
        assert torch.allclose(g[i], w[i] * g0[i], atol=ATOL, rtol=0)
    if name in ("clip_cov", "kl_cov"):  # a row alone is another call, with its own token selection
        return
    rows = [
        fn(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], normalizer=n)[0]
        for i in range(4)
    ]
    assert abs(loss.item() - sum(w[i].item() * rows[i].item() for i in range(4))) < ATOL


def _ref_grpo_token_weighted(logp, old, adv, mask, m_BT, el=0.2, eh=0.27, denominators="original"):
    """-(1/B) sum_i (1/n_i) sum_t M_it min(r A, clip(r) A); n_i = |y_i| or the number of kept tokens."""
    L, Ol, Mk, W = (t.detach().tolist() for t in (logp, old, mask, m_BT))
    total = 0.0
    for i in range(len(L)):
        toks = [t for t in range(len(L[i])) if Mk[i][t] == 1]
        kept = [t for t in toks if W[i][t] != 0]
        n_i = len(toks) if denominators == "original" else len(kept)
        if n_i == 0:
            continue
        s = 0.0
        for t in kept:
            r = math.exp(L[i][t] - Ol[i][t])
            s += W[i][t] * min(r * adv[i].item(), min(max(r, 1 - el), 1 + eh) * adv[i].item())
        total += s / n_i
    return -total / len(L)


def test_icepop_with_grpo_matches_the_ring_1t_objective():
    """grpo_loss(weight=icepop_weights) is IcePop's objective: M(k) per token, |y_i| denominators."""
    logp, old, sampler, adv, mask = _loss_batch(seed=1)
    m_BT = icepop_weights(old, sampler, mask, 0.7, 1.5)
    assert 0 < (m_BT == 0)[mask.bool()].sum() < mask.sum()  # some tokens masked, not all
    loss, _ = call("grpo", logp, old, adv, mask, weight=m_BT)
    assert abs(loss.item() - _ref_grpo_token_weighted(logp, old, adv, mask, m_BT)) < ATOL


def test_token_mask_as_weight_keeps_denominators_and_as_mask_renormalizes():
    """A 0/1 token mask as ``weight`` keeps |y_i|; AND-ed into ``mask`` it divides by the kept count."""
    logp, old, sampler, adv, mask = _loss_batch(seed=2)
    keep = token_mask(old, sampler, mask, 0.7, 1.5)
    as_weight, _ = call("grpo", logp, old, adv, mask, weight=keep)
    as_mask, _ = call("grpo", logp, old, adv, mask * keep)
    assert abs(as_weight.item() - _ref_grpo_token_weighted(logp, old, adv, mask, keep)) < ATOL
    want = _ref_grpo_token_weighted(logp, old, adv, mask, keep, denominators="kept")
    assert abs(as_mask.item() - want) < ATOL
    assert abs(as_weight.item() - as_mask.item()) > 1e-6


def test_sequence_mask_and_tis_combine_by_multiplication():
    """weight = TIS * sequence mask: dropped rows get zero gradient, kept rows w_i times theirs."""
    fn = tensor_loss("gspo")
    logp, old, sampler, adv, mask = _loss_batch(seed=3)
    tis = sequence_tis_weights(old, sampler, mask, cap=1.5)
    keep = sequence_mask(old, sampler, mask, 0.9, 1.1)
    assert 0 < keep.sum() < 4
    g0 = torch.autograd.grad(fn(logp, old, adv, mask, 0.2, 0.27)[0], logp)[0]
    g = torch.autograd.grad(fn(logp, old, adv, mask, 0.2, 0.27, weight=tis * keep)[0], logp)[0]
    assert torch.allclose(g, (tis * keep)[:, None] * g0, atol=ATOL, rtol=0)
    assert torch.all(g[keep == 0] == 0)


def test_every_correction_metric_has_a_declared_reduction():
    """The trainer combines micro-batch metrics by gspo.training.update.METRICS: every key a correction
    returns (prefixed ``mismatch/``) is declared there, token-weighted exactly when it ends in _tok."""
    from gspo.training.update import METRICS, TOKEN

    for name, correction in CORRECTIONS.items():
        _, _, metrics = correction(OLD, SAMPLER, MASK, cap=2.0, lo=0.5, hi=2.0)
        for k in metrics:
            assert f"mismatch/{k}" in METRICS, (name, k)
            if k.endswith("_tok"):
                assert METRICS[f"mismatch/{k}"] == TOKEN, (name, k)
