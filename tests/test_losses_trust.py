"""Math tests for DPPO (Binary-TV, Binary-KL), Clip-Cov and KL-Cov (:mod:`gspo.losses_trust`):
plain-Python float64 references (lists + math, no torch) of value and per-token gradient, every mask
region of each, both aggregations; hand-computed numbers; the identities with CISPO / GRPO where they
hold; the per-call selection of Clip-Cov and KL-Cov. The properties every loss shares run over them
in tests/test_losses.py and tests/test_properties.py (VARIANTS)."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import call
from test_losses import ATOL, F64, _grad, _token_batch

from gspo.loss_prologue import loss_inputs
from gspo.losses_trust import binary_kl, binary_tv, select_top, token_covariance

C = 20.0  # DPPO's default cap of the importance weight

# ----------------------------------------------------------------------------------------------
# references


def _rows(t: torch.Tensor) -> list[list[float]]:
    return t.detach().to(F64).tolist()


def _adv_rows(adv: torch.Tensor, T: int) -> list[list[float]]:
    return _rows(adv if adv.dim() == 2 else adv[:, None].expand(-1, T))


def _valid(mask) -> list[tuple[int, int]]:
    M = _rows(mask)
    return [(i, t) for i in range(len(M)) for t in range(len(M[0])) if M[i][t] == 1]


def _ratio(lp: float, o: float) -> float:
    return math.exp(min(max(lp - o, -20.0), 20.0))


def ref_binary_kl(lp: float, o: float) -> float:
    """KL((p_o, 1 - p_o) || (p, 1 - p)) of log-probs <= 0."""
    p, po = math.exp(lp), math.exp(o)
    first = po * (o - lp)
    if po == 1.0:
        return first
    if p == 1.0:
        return math.inf
    return first + (1 - po) * math.log((1 - po) / (1 - p))


def dppo_region(lp: float, o: float, a: float, kind: str, dl: float, dh: float) -> str:
    """Where a token falls: "high" (A > 0, risen past the region), "low" (A < 0, fallen past it),
    "in" (kept)."""
    lp, o = min(lp, 0.0), min(o, 0.0)
    if kind == "tv":
        d = math.exp(lp) - math.exp(o)
        high, low = d > dh, d < -dl
    else:
        kl = ref_binary_kl(lp, o)
        high, low = lp > o and kl > dh, lp < o and kl > dl
    return "high" if a > 0 and high else "low" if a < 0 and low else "in"


def _aggregate(terms, grads, mask, agg, n):
    """-(1/N) sum of per-token terms (token_mean) or of per-sequence token means; the gradient [B][T]
    likewise, from each token's d(term)/d logp."""
    M = _rows(mask)
    B, T = len(M), len(M[0])
    n_tok = [sum(r) for r in M]
    N = (sum(n_tok) if agg == "token_mean" else B) if n is None else n
    value, grad = 0.0, [[0.0] * T for _ in range(B)]
    for (i, t), term in terms.items():
        per = 1.0 if agg == "token_mean" else 1.0 / n_tok[i]
        value += term * per
        grad[i][t] = -grads[(i, t)] * per / N
    return -value / N, grad


def ref_dppo(logp, old, adv, mask, kind, dl, dh, agg="token_mean", n=None, c=C):
    """(value, gradient, regions) of DPPO: kept tokens contribute w A, w = min(r, C); d/d logp = w A."""
    L, Lo, A = _rows(logp), _rows(old), _adv_rows(adv, mask.shape[1])
    terms, grads, regions = {}, {}, {}
    for i, t in _valid(mask):
        region = dppo_region(L[i][t], Lo[i][t], A[i][t], kind, dl, dh)
        w = min(_ratio(L[i][t], Lo[i][t]), c)
        terms[(i, t)] = grads[(i, t)] = w * A[i][t] if region == "in" else 0.0
        regions[(i, t)] = region
    return (*_aggregate(terms, grads, mask, agg, n), regions)


def ref_covariance(logp, adv, mask) -> dict[tuple[int, int], float]:
    L, A = _rows(logp), _adv_rows(adv, mask.shape[1])
    toks = _valid(mask)
    ma = sum(A[i][t] for i, t in toks) / len(toks)
    ml = sum(min(L[i][t], 0.0) for i, t in toks) / len(toks)
    return {(i, t): (A[i][t] - ma) * (min(L[i][t], 0.0) - ml) for i, t in toks}


def _top(cov: dict, pool: list, ratio: float, n_tok: int) -> set:
    """verl's count max(int(ratio * n), 1); the largest covariances (ties: the first position)."""
    k = max(int(ratio * n_tok), 1)
    return set(sorted(pool, key=lambda it: (-cov[it], it))[:k])


def ref_clip_cov(logp, old, adv, mask, el, eh, ratio, lb, ub, agg="token_mean", n=None):
    """(value, gradient, regions): GRPO's min(r A, clip(r) A) with the selected tokens' terms zeroed;
    regions: "clipped" (PPO's clip binds), "selected", "band" (in the band, not selected), "out"."""
    L, Lo, A = _rows(logp), _rows(old), _adv_rows(adv, mask.shape[1])
    cov = ref_covariance(logp, adv, mask)
    terms, grads, regions = {}, {}, {}
    for i, t in _valid(mask):
        r, a = _ratio(L[i][t], Lo[i][t]), A[i][t]
        clipped = (a > 0 and r > 1 + eh) or (a < 0 and r < 1 - el)
        terms[(i, t)] = min(r * a, min(max(r, 1 - el), 1 + eh) * a)
        grads[(i, t)] = 0.0 if clipped else r * a
        regions[(i, t)] = "clipped" if clipped else "band" if lb < cov[(i, t)] < ub else "out"
    pool = [it for it, reg in regions.items() if reg == "band"]
    for it in _top(cov, pool, ratio, len(regions)):
        terms[it] = grads[it] = 0.0
        regions[it] = "selected"
    return (*_aggregate(terms, grads, mask, agg, n), regions)


def ref_kl_cov(logp, old, adv, mask, ratio, coef, agg="token_mean", n=None):
    """(value, gradient, selected): r A, minus coef |log r| on the top-k covariance tokens."""
    L, Lo, A = _rows(logp), _rows(old), _adv_rows(adv, mask.shape[1])
    cov = ref_covariance(logp, adv, mask)
    selected = _top(cov, list(cov), ratio, len(cov))
    terms, grads = {}, {}
    for i, t in cov:
        d = min(max(L[i][t] - Lo[i][t], -20.0), 20.0)
        r, a = math.exp(d), A[i][t]
        pen = coef if (i, t) in selected else 0.0
        terms[(i, t)] = r * a - pen * abs(d)
        grads[(i, t)] = r * a - pen * (1.0 if d > 0 else -1.0 if d < 0 else 0.0)
    return (*_aggregate(terms, grads, mask, agg, n), selected)


def _close(a: torch.Tensor, b: list[list[float]]) -> bool:
    return torch.allclose(a, torch.tensor(b, dtype=F64), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# fixtures

# rows of (p_old, p_theta) per token, by hand: every DPPO region for both divergences (see below)
PROBS = [
    [(0.5, 0.6), (0.5, 0.7), (0.5, 0.2), (0.01, 0.5), None],  # A > 0: in, high, fell, high
    [(0.5, 0.4), (0.5, 0.3), (0.3, 0.9), (0.9, 0.6), None],  # A < 0: in, low, rose, low
    [(1e-4, 3e-3), (0.2, 0.21), None, None, None],  # A > 0, ratio 30 > C: kept with w = C
    [(0.999, 0.5), (0.02, 0.019), (1.0, 0.9), None, None],  # A < 0: low, in, from p_old = 1
    [(0.4, 0.9), (0.6, 0.1), None, None, None],  # A = 0: never outside, no gradient
]
PROB_ADV = [1.0, -1.5, 0.7, -0.4, 0.0]


def _prob_batch():
    old = torch.full((5, 5), -7.0, dtype=F64)
    logp = torch.full((5, 5), -7.0, dtype=F64)
    mask = torch.zeros(5, 5, dtype=F64)
    for i, row in enumerate(PROBS):
        for t, pair in enumerate(row):
            if pair is not None:
                old[i, t], logp[i, t], mask[i, t] = math.log(pair[0]), math.log(pair[1]), 1.0
    return logp.requires_grad_(True), old, torch.tensor(PROB_ADV, dtype=F64), mask


def _varied_adv(adv: torch.Tensor, seed: int) -> torch.Tensor:
    """Per-token advantages around each row's (so that covariances vary within a row too)."""
    g = torch.Generator().manual_seed(seed)
    return adv[:, None] * (1 + 0.5 * torch.rand(5, 5, generator=g, dtype=F64))


def _dppo_cases():
    yield _prob_batch()
    for seed in (3, 4):
        logp, old, adv, mask = _token_batch(seed=seed, scale=1.5)
        yield logp, old, _varied_adv(adv, seed), mask


# ----------------------------------------------------------------------------------------------
# DPPO


def test_binary_divergences_hand_computed():
    """TV(0.5 -> 0.7) = 0.2; KL((.5,.5) || (.7,.3)) = .5 ln(5/7) + .5 ln(5/3); p_old = 1 gives
    -ln p (the second term's limit 0); p_theta = 1 > p_old gives +inf; equal probabilities 0."""
    lp = torch.tensor([math.log(0.7), math.log(0.9), 0.0, math.log(0.3)], dtype=F64)
    old = torch.tensor([math.log(0.5), 0.0, math.log(0.5), math.log(0.3)], dtype=F64)
    assert torch.allclose(binary_tv(lp, old), torch.tensor([0.2, -0.1, 0.5, 0.0], dtype=F64), atol=ATOL)
    kl = binary_kl(lp, old)
    want = [0.5 * math.log(5 / 7) + 0.5 * math.log(5 / 3), -math.log(0.9), math.inf, 0.0]
    assert torch.allclose(kl[[0, 1, 3]], torch.tensor(want, dtype=F64)[[0, 1, 3]], atol=ATOL, rtol=0)
    assert kl[2].item() == math.inf
    # near p = 1: 1 - p from expm1 keeps its digits (1 - exp(-1e-12) is 1e-12 to 1e-4 only)
    tiny = binary_kl(torch.tensor([-2e-12], dtype=F64), torch.tensor([-1e-12], dtype=F64))
    want_tiny = (1 - 1e-12) * (-1e-12 + 2e-12) + 1e-12 * math.log(1e-12 / 2e-12)  # 3.07e-13
    assert abs(tiny.item() - want_tiny) < 1e-20


def test_dppo_tv_hand_computed():
    """Row 0 of the hand batch (A = 1, four tokens, p_old -> p: .5->.6, .5->.7, .5->.2, .01->.5):
    TV .1 in, .2 > .15 out, -.3 (fell; A > 0 keeps it), .49 out. Kept: tokens 0 and 2, weights
    1.2 and 0.4. token_mean over the row's 4 tokens: value -(1.2 + 0.4) / 4, gradients -w / 4."""
    logp, old, adv, mask = _prob_batch()
    loss, m = call("dppo_tv", logp[:1], old[:1], adv[:1], mask[:1])
    assert abs(loss.item() - (-(1.2 + 0.4) / 4)) < ATOL
    assert _close(_grad(loss, logp)[:1], [[-1.2 / 4, 0.0, -0.4 / 4, 0.0, 0.0]])
    assert m["clip_frac_tok_high"].item() == 0.5 and m["clip_frac_tok_low"].item() == 0.0


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("n", [None, 11.0])
def test_dppo_value_and_gradient_match_reference_every_region(kind, aggregation, n):
    """dppo_{tv,kl}_loss equals the float64 reference in value and per-token gradient; the cases hold
    every region: in, above (A > 0), below (A < 0), moved the other way (kept), A = 0, w capped at C."""
    seen = set()
    d = 0.15 if kind == "tv" else 0.05
    for logp, old, adv, mask in _dppo_cases():
        loss, m = call(f"dppo_{kind}", logp, old, adv, mask, aggregation=aggregation, normalizer=n)
        want, want_g, regions = ref_dppo(logp, old, adv, mask, kind, d, d, aggregation, n)
        assert abs(loss.item() - want) < ATOL
        assert _close(_grad(loss, logp), want_g)
        n_tok = len(regions)
        for side in ("low", "high"):
            share = sum(r == side for r in regions.values()) / n_tok
            assert abs(m[f"clip_frac_tok_{side}"].item() - share) < ATOL
        A, L, Lo = _adv_rows(adv, 5), _rows(logp), _rows(old)
        for (i, t), r in regions.items():
            moved_back = (A[i][t] > 0 and L[i][t] < Lo[i][t]) or (A[i][t] < 0 and L[i][t] > Lo[i][t])
            seen.add("back" if r == "in" and moved_back else r)
            seen.add("capped" if r == "in" and _ratio(L[i][t], Lo[i][t]) > C else "")
            seen.add("zero" if A[i][t] == 0 else "")
    assert {"in", "low", "high", "back", "capped", "zero"} <= seen


@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_thresholds_and_cap_are_its_parameters(kind):
    """Other thresholds (asymmetric) and another cap C match the reference: the regions move."""
    logp, old, adv, mask = _prob_batch()
    loss, _ = call(f"dppo_{kind}", logp, old, adv, mask, 0.35, 0.02, max_weight=5.0)
    want, want_g, regions = ref_dppo(logp, old, adv, mask, kind, 0.35, 0.02, c=5.0)
    assert abs(loss.item() - want) < ATOL and _close(_grad(loss, logp), want_g)
    default, _, regions0 = ref_dppo(logp, old, adv, mask, kind, 0.15, 0.15)
    assert regions != regions0 and abs(want - default) > 1e-3


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_dppo_on_policy_is_cispo_and_reinforce(kind, aggregation):
    """On-policy (p_theta = p_old) every token is inside the region and w = 1: value and gradient are
    CISPO's on-policy ones, the plain policy gradient."""
    logp, old, adv, mask = _token_batch(seed=5)
    on = logp.detach().clone()
    x1, x2 = on.clone().requires_grad_(True), on.clone().requires_grad_(True)
    l1, m = call(f"dppo_{kind}", x1, on, adv, mask, aggregation=aggregation)
    l2, _ = call("cispo", x2, on, adv, mask, aggregation=aggregation)
    assert abs(l1.item() - l2.item()) < ATOL and torch.allclose(_grad(l1, x1), _grad(l2, x2), atol=ATOL)
    assert m["clip_frac_tok"].item() == 0.0


def test_dppo_keeps_rare_tokens_the_ratio_clip_drops_and_drops_likely_ones_it_keeps():
    """The paper's two examples: a rare token 1e-5 -> 1e-3 with A > 0 (ratio 100: GRPO's clip drops
    it) moved by 0.001 in probability, inside DPPO's region: kept with w = C; a likely one 0.99 -> 0.8
    with A < 0 (ratio 0.808, inside GRPO's [0.8, 1.27]: GRPO keeps it) lost 0.19 of probability, more
    than TV's 0.15: DPPO drops it."""
    old = torch.tensor([[math.log(1e-5)], [math.log(0.99)]], dtype=F64)
    logp = torch.tensor([[math.log(1e-3)], [math.log(0.8)]], dtype=F64, requires_grad=True)
    adv, mask = torch.tensor([1.0, -1.0], dtype=F64), torch.ones(2, 1, dtype=F64)
    g = _grad(call("dppo_tv", logp, old, adv, mask)[0], logp)
    assert abs(g[0, 0].item() - (-C / 2)) < ATOL and g[1, 0].item() == 0.0
    g_grpo = _grad(call("grpo", logp, old, adv, mask)[0], logp)
    assert g_grpo[0, 0].item() == 0.0 and abs(g_grpo[1, 0].item() - (0.8 / 0.99) / 2) < ATOL


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_rejects_nonpositive_thresholds(name):
    logp, old, adv, mask = _prob_batch()
    for bad in (0.0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be a finite number > 0"):
            call(name, logp, old, adv, mask, bad, 0.1)
        with pytest.raises(ValueError, match="max_weight"):
            call(name, logp, old, adv, mask, max_weight=bad)


# ----------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov

COV_PARAMS = {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.2, "clip_cov_ub": 1.0}


def _cov_cases():
    for seed in (0, 1, 2):
        logp, old, adv, mask = _token_batch(seed=seed, scale=0.6)
        yield logp, old, _varied_adv(adv, seed), mask
    yield _token_batch(seed=6, scale=0.6)  # [B] advantages


def test_token_covariance_hand_computed():
    """Tokens (A, logp) = (1, -1), (0, -3), (2, 0) (the third's logp given as +5: a log-prob is
    clamped to 0), means 1 and -4/3: cov = 0, (-1)(-3 + 4/3), (1)(0 + 4/3); padding 0."""
    logp = torch.tensor([[-1.0, -3.0, 5.0, 9.0]], dtype=F64)
    adv = torch.tensor([[1.0, 0.0, 2.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=F64)
    inp = loss_inputs(logp, logp, mask, adv)
    cov = token_covariance(inp, inp.token_advantages())
    assert torch.allclose(cov, torch.tensor([[0.0, 5 / 3, 4 / 3, 0.0]], dtype=F64), atol=ATOL, rtol=0)


def test_select_top_count_is_verls_floor_with_at_least_one():
    """k = max(1, int(fraction * n)) in float64 arithmetic (0.29 * 100 = 28.999...: 28, not float32's
    29); ties go to the first position; never outside the pool."""
    n = 100
    cov = torch.arange(n, dtype=torch.float32).flip(0).view(10, 10)  # distinct, descending
    pool = torch.ones(10, 10, dtype=torch.bool)
    assert select_top(cov, pool, 0.29, torch.tensor(float(n))).sum().item() == int(0.29 * n) == 28
    assert select_top(cov, pool, 1e-4, torch.tensor(float(n))).sum().item() == 1
    assert select_top(cov, pool, 0.05, torch.tensor(float(n))).view(-1)[:5].all()
    ties = torch.zeros(2, 3)
    sel = select_top(ties, torch.tensor([[False, True, True], [True, True, True]]), 0.4, torch.tensor(6.0))
    assert sel.tolist() == [[False, True, True], [False, False, False]]
    assert not select_top(cov, torch.zeros(10, 10, dtype=torch.bool), 0.5, torch.tensor(100.0)).any()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("n", [None, 9.0])
def test_clip_cov_value_and_gradient_match_reference_every_region(aggregation, n):
    """clip_cov_loss equals the float64 reference in value and per-token gradient; the cases hold every
    region: PPO-clipped, selected (detached), in the band but beyond the count k, outside the band."""
    seen = set()
    for logp, old, adv, mask in _cov_cases():
        loss, m = call("clip_cov", logp, old, adv, mask, aggregation=aggregation, normalizer=n, **COV_PARAMS)
        want, want_g, regions = ref_clip_cov(logp, old, adv, mask, 0.2, 0.2, 0.2, 0.2, 1.0, aggregation, n)
        assert abs(loss.item() - want) < ATOL
        assert _close(_grad(loss, logp), want_g)
        chosen = [it for it, r in regions.items() if r == "selected"]
        assert abs(m["cov_frac_tok"].item() - len(chosen) / len(regions)) < ATOL
        cov = ref_covariance(logp, adv, mask)
        assert abs(m["cov_threshold"].item() - min(cov[it] for it in chosen)) < ATOL
        seen |= set(regions.values())
    assert seen == {"clipped", "selected", "band", "out"}


def test_clip_cov_defaults_select_one_token_in_the_band_or_none():
    """verl's defaults (2e-4, band (1, 5)) on 15 tokens: k = 1, the largest covariance in (1, 5) that
    the clip leaves; with none in the band nothing is detached (threshold metric 0) and the loss is
    GRPO's with clip range 0.2 / 0.2."""
    logp, old, adv, mask = _token_batch(seed=2, scale=0.1)
    adv = _varied_adv(adv, 2) * 3
    loss, m = call("clip_cov", logp, old, adv, mask)
    want, want_g, regions = ref_clip_cov(logp, old, adv, mask, 0.2, 0.2, 2e-4, 1.0, 5.0)
    assert list(regions.values()).count("selected") == 1 and m["cov_frac_tok"].item() == 1 / 15
    assert abs(loss.item() - want) < ATOL and _close(_grad(loss, logp), want_g)
    x = logp.detach().clone().requires_grad_(True)
    loss0, m0 = call("clip_cov", x, old, adv * 1e-3, mask)
    grpo, _ = call("grpo", x, old, adv * 1e-3, mask, 0.2, 0.2, aggregation="token_mean")
    assert m0["cov_frac_tok"].item() == 0.0 and m0["cov_threshold"].item() == 0.0
    assert abs(loss0.item() - grpo.item()) < ATOL


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("n", [None, 9.0])
def test_kl_cov_value_and_gradient_match_reference(aggregation, n):
    """kl_cov_loss equals the float64 reference in value and per-token gradient (selected tokens with
    log r above and below 0, unselected ones); metrics: the share selected, the k-th covariance."""
    signs = set()
    for ratio, coef in ((0.2, 1.0), (0.5, 0.3)):
        for logp, old, adv, mask in _cov_cases():
            kw = {"kl_cov_ratio": ratio, "kl_cov_coef": coef}
            loss, m = call("kl_cov", logp, old, adv, mask, aggregation=aggregation, normalizer=n, **kw)
            want, want_g, selected = ref_kl_cov(logp, old, adv, mask, ratio, coef, aggregation, n)
            assert abs(loss.item() - want) < ATOL
            assert _close(_grad(loss, logp), want_g)
            assert len(selected) == int(ratio * 15)
            assert abs(m["cov_frac_tok"].item() - len(selected) / 15) < ATOL
            cov = ref_covariance(logp, adv, mask)
            assert abs(m["cov_threshold"].item() - min(cov[it] for it in selected)) < ATOL
            d = (logp.detach() - old).tolist()
            signs |= {d[i][t] > 0 for i, t in selected}
    assert signs == {True, False}


def test_kl_cov_without_penalty_is_unclipped_grpo():
    """kl_cov_coef = 0: the unclipped token policy gradient, i.e. GRPO with an infinite clip range."""
    logp, old, adv, mask = _token_batch(seed=7, scale=0.8)
    x1, x2 = logp.detach().clone().requires_grad_(True), logp.detach().clone().requires_grad_(True)
    l1, _ = call("kl_cov", x1, old, adv, mask, kl_cov_coef=0.0)
    l2, _ = call("grpo", x2, old, adv, mask, 1.0, 1e9, aggregation="token_mean")
    assert abs(l1.item() - l2.item()) < ATOL and torch.allclose(_grad(l1, x1), _grad(l2, x2), atol=ATOL)


def test_kl_cov_hand_computed():
    """Three tokens, one row, A = (1, 0, -1) per token, log r = (0.1, -0.2, 0.3), logp = (-1, -2, -3):
    means A 0, logp -2: cov = (1)(1), 0, (-1)(-1) = 1, 0, 1: the tie goes to the first, k =
    max(1, int(0.4 * 3)) = 1: token 0 pays 0.5 |0.1|. token_mean: value -(e^.1 - .05 - e^.3) / 3;
    gradient -(e^.1 - .5) / 3, 0, e^.3 / 3."""
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=F64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.1, -0.2, 0.3]], dtype=F64)
    adv = torch.tensor([[1.0, 0.0, -1.0]], dtype=F64)
    loss, m = call("kl_cov", logp, old, adv, torch.ones(1, 3, dtype=F64), kl_cov_ratio=0.4, kl_cov_coef=0.5)
    e1, e3 = math.exp(0.1), math.exp(0.3)
    assert abs(loss.item() - (-(e1 - 0.05 - e3) / 3)) < ATOL
    assert _close(_grad(loss, logp), [[-(e1 - 0.5) / 3, 0.0, e3 / 3]])
    assert abs(m["cov_frac_tok"].item() - 1 / 3) < ATOL and abs(m["cov_threshold"].item() - 1.0) < ATOL


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_selection_is_per_call(name):
    """The covariance's means and the count k are those of the tokens one call is given (verl: one
    micro-batch on one rank): two halves with the global normalizer each select their own tokens,
    each equal to its own reference, and together differ from the whole batch in one call."""
    logp, old, adv, mask = _token_batch(seed=0, scale=0.6)
    adv = _varied_adv(adv, 0)
    kw = COV_PARAMS if name == "clip_cov" else {"kl_cov_ratio": 0.2, "kl_cov_coef": 1.0}
    ref = (
        (lambda *a, **k: ref_clip_cov(*a, 0.2, 0.2, 0.2, 0.2, 1.0, **k))
        if name == "clip_cov"
        else (lambda *a, **k: ref_kl_cov(*a, 0.2, 1.0, **k))
    )
    n = mask.sum()
    whole, _ = call(name, logp, old, adv, mask, **kw)
    halves = 0.0
    for rows in (slice(0, 2), slice(2, 5)):
        part, _ = call(name, logp[rows], old[rows], adv[rows], mask[rows], normalizer=n, **kw)
        want = ref(logp[rows], old[rows], adv[rows], mask[rows], n=float(n))[0]
        assert abs(part.item() - want) < ATOL
        halves += part.item()
    assert abs(halves - whole.item()) > 1e-4


def test_cov_losses_reject_bad_fractions_and_band():
    logp, old, adv, mask = _token_batch(seed=0)
    for bad in (0.0, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="clip_cov_ratio must be a fraction in"):
            call("clip_cov", logp, old, adv, mask, clip_cov_ratio=bad)
        with pytest.raises(ValueError, match="kl_cov_ratio must be a fraction in"):
            call("kl_cov", logp, old, adv, mask, kl_cov_ratio=bad)
    with pytest.raises(ValueError, match="clip_cov_lb must be below clip_cov_ub"):
        call("clip_cov", logp, old, adv, mask, clip_cov_lb=5.0, clip_cov_ub=5.0)
    with pytest.raises(ValueError, match="kl_cov_coef"):
        call("kl_cov", logp, old, adv, mask, kl_cov_coef=-1.0)


def test_weight_applies_after_the_selection():
    """A [B] weight (TIS, OPSM) multiplies each row's terms but never changes which tokens are
    selected (as verl's rollout_is_weights): the weighted loss is sum_i w_i (row i's term)."""
    logp, old, adv, mask = _token_batch(seed=1, scale=0.6)
    adv = _varied_adv(adv, 1)
    w = torch.tensor([0.5, 2.0, 0.0, 1.3, 0.7], dtype=F64)
    for name, kw in (("clip_cov", COV_PARAMS), ("kl_cov", {"kl_cov_ratio": 0.2, "kl_cov_coef": 1.0})):
        g0 = _grad(call(name, logp, old, adv, mask, **kw)[0], logp)
        lw, mw = call(name, logp, old, adv, mask, weight=w, **kw)
        assert torch.allclose(_grad(lw, logp), w[:, None] * g0, atol=ATOL, rtol=0)
        m0 = call(name, logp, old, adv, mask, **kw)[1]
        assert all(torch.equal(m0[k], mw[k]) for k in m0)
