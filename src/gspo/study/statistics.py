"""Statistics of a study, on ``scipy.stats``: intervals, paired tests, Holm's adjustment, verdicts, power.

A comparison of two variants is *paired by seed* (both start RL from the same warm start): its
numbers are the per-seed differences ``d_s = a_s - b_s``. For each comparison we report the mean
difference with a 95% Student-t interval (exact degrees of freedom from scipy), the two-sided p-value
of the paired t test and of an exact sign-flip permutation test. A verdict is given only to
*pre-registered* endpoints, and only from their Holm-adjusted p-value over the declared family
(see :mod:`gspo.study.presets`); everything else is exploratory, its intervals raw (unadjusted).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gspo.errors import GspoError


def _stats() -> Any:
    """scipy.stats, imported when first needed: ``gspo train`` reads the preset names (this module's
    importers) without it."""
    from scipy import stats

    return stats


ALPHA = 0.05
CONSISTENT, INCONSISTENT, INCONCLUSIVE = "consistent", "inconsistent", "inconclusive"
EXACT_MAX_N = 40  # exact by meeting in the middle (two halves of <= 2^20 sums); Monte Carlo beyond
MC_FLIPS = 200_000


@dataclass
class Interval:
    """A sample mean with its 95% confidence interval (``lo``/``hi`` None with fewer than 2 values)."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int

    @property
    def known(self) -> bool:
        return self.lo is not None and self.hi is not None

    def fmt(self, pct: bool | str = False, digits: int = 3) -> str:
        """``pct``: True for percent, ``"sci"`` for scientific notation."""
        if self.mean is None:
            return "n/a"

        def f(x: float) -> str:
            if pct == "sci":
                return f"{x:.1e}"
            return f"{100 * x:.{max(digits - 2, 1)}f}%" if pct else f"{x:.{digits}f}"

        return (
            f"{f(self.mean)} [{f(self.lo)}, {f(self.hi)}]" if self.known else f"{f(self.mean)} (n={self.n})"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def clean(xs: Sequence[float | None]) -> list[float]:
    """The finite values of ``xs`` (a run that never logged a number gives None)."""
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def t_quantile(df: float, level: float = 0.95) -> float:
    """Two-sided ``level`` Student-t multiplier ``t_{(1+level)/2, df}`` (df may be fractional: Welch)."""
    if not df > 0:
        raise ValueError("df must be > 0")
    return float(_stats().t.ppf((1 + level) / 2, df))


def t_interval(xs: Sequence[float | None], level: float = 0.95) -> Interval:
    """Mean and Student-t interval ``mean +- t_{df=n-1} * sd / sqrt(n)`` (None/NaN dropped)."""
    v = clean(xs)
    if not v:
        return Interval(None, None, None, 0)
    m = statistics.fmean(v)
    if len(v) < 2:
        return Interval(m, None, None, len(v))
    half = t_quantile(len(v) - 1, level) * statistics.stdev(v) / math.sqrt(len(v))
    return Interval(m, m - half, m + half, len(v))


def bootstrap_interval(xs: Sequence[float | None], n_boot: int = 10_000, seed: int = 0) -> Interval:
    """Mean and 95% percentile-bootstrap interval. With few seeds it is narrower than the t interval
    (it ignores that the sd itself is estimated): a descriptive alternative, never used for verdicts."""
    v = np.asarray(clean(xs), dtype=np.float64)
    if v.size == 0:
        return Interval(None, None, None, 0)
    if v.size < 2:
        return Interval(float(v[0]), None, None, 1)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return Interval(float(v.mean()), float(lo), float(hi), int(v.size))


def interval(xs: Sequence[float | None], method: str = "t") -> Interval:
    if method == "t":
        return t_interval(xs)
    if method == "bootstrap":
        return bootstrap_interval(xs)
    raise GspoError(f"--ci: expected t or bootstrap, got {method!r}")


def paired_differences(a: dict[int, float | None], b: dict[int, float | None]) -> list[float]:
    """``a[s] - b[s]`` over the seeds both have finite values for, in seed order."""
    return [
        a[s] - b[s]  # type: ignore[operator]
        for s in sorted(set(a) & set(b))
        if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s])  # type: ignore[arg-type]
    ]


def paired_interval(
    a: dict[int, float | None], b: dict[int, float | None], method: str = "t"
) -> tuple[Interval, int, int]:
    """CI of the per-seed difference ``a[s] - b[s]``; also how many seeds have a > b and a < b."""
    d = paired_differences(a, b)
    return interval(d, method), sum(x > 0 for x in d), sum(x < 0 for x in d)


def welch_interval(a: Sequence[float | None], b: Sequence[float | None]) -> Interval:
    """95% CI of mean(a) - mean(b) for independent samples (Welch: unequal variances, exact df)."""
    x, y = clean(a), clean(b)
    if not x or not y:
        return Interval(None, None, None, 0)
    d = statistics.fmean(x) - statistics.fmean(y)
    n = min(len(x), len(y))
    if len(x) < 2 or len(y) < 2:
        return Interval(d, None, None, n)
    if statistics.variance(x) + statistics.variance(y) == 0:
        return Interval(d, d, d, n)
    ci = _stats().ttest_ind(x, y, equal_var=False).confidence_interval(0.95)
    return Interval(d, float(ci.low), float(ci.high), n)


# ------------------------------------------------------------------------------------------------
# tests


def _no_spread(d: np.ndarray) -> bool:
    return bool(np.ptp(d) <= 1e-12 * max(1.0, float(np.abs(d).max())))


def t_test_p(diffs: Sequence[float], null: float = 0.0) -> float | None:
    """Two-sided p of the paired (one-sample) t test of ``mean(diffs) = null``; None under 2 values.
    With no spread the t statistic is undefined (0/0 on the null, x/0 off it): p is then the exact
    sign-flip p, the only distribution-free answer (1 on the null; ``2 / 2^n`` for ``n`` identical
    non-zero differences, never 0: two seeds that agree are not proof)."""
    d = np.asarray(diffs, dtype=np.float64) - null
    if d.size < 2:
        return None
    if _no_spread(d):
        return sign_flip_p(d)
    return float(_stats().ttest_1samp(d, 0.0).pvalue)


def _signed_sums(d: np.ndarray) -> np.ndarray:
    """``s @ d`` for every sign pattern ``s`` in ``{+1, -1}^n`` (2^n values)."""
    sums = np.zeros(1)
    for x in d:
        sums = np.concatenate([sums + x, sums - x])
    return sums


def sign_flip_p(
    diffs: Sequence[float],
    null: float = 0.0,
    exact_max_n: int = EXACT_MAX_N,
    n_mc: int = MC_FLIPS,
    seed: int = 0,
) -> float | None:
    """Two-sided p of the sign-flip permutation test of ``mean(diffs) = null``: under the null each
    ``d_s - null`` is as likely positive as negative (pairs are exchangeable), so p is the share of the
    ``2^n`` sign patterns whose |sum| reaches the observed one.

    Exact for ``n <= exact_max_n`` by meeting in the middle: the signed sums of each half of the
    seeds are listed (``2^(n/2)`` each), one list sorted, and for every sum ``a`` of the other the
    sums ``b`` with ``|a + b| >= observed`` are counted by binary search (27 seeds: 2^13 x 2^14, not
    2^27). Beyond, ``n_mc`` random patterns with a fixed ``seed`` and the add-one estimate
    ``(1 + k) / (1 + n_mc)``; :func:`sign_flip_is_exact` says which one a report quotes."""
    dev = np.asarray(diffs, dtype=np.float64) - null
    d = np.abs(dev)
    if d.size == 0:
        return None
    tol = 1e-9 * max(1.0, float(d.sum()))  # flips equal to the observed one up to rounding count as ties
    threshold = abs(float(dev.sum())) - tol
    if threshold <= 0:
        return 1.0
    if not sign_flip_is_exact(d.size, exact_max_n):
        rng = np.random.default_rng(seed)
        signs = rng.choice([-1.0, 1.0], size=(n_mc, d.size))
        k = int((np.abs(signs @ d) >= threshold).sum())
        return (1 + k) / (1 + n_mc)
    half = d.size // 2
    left, right = _signed_sums(d[:half]), np.sort(_signed_sums(d[half:]))
    # |a + b| >= t (t > 0) splits into b >= t - a and b <= -t - a, which never overlap
    above = right.size - np.searchsorted(right, threshold - left, side="left")
    below = np.searchsorted(right, -threshold - left, side="right")
    return float(above.sum() + below.sum()) / 2.0**d.size


def sign_flip_is_exact(n: int, exact_max_n: int = EXACT_MAX_N) -> bool:
    """Whether :func:`sign_flip_p` enumerates every pattern for ``n`` seeds (else Monte Carlo)."""
    return n <= exact_max_n


def holm(pvalues: Sequence[float | None], family_size: int | None = None) -> list[float | None]:
    """Holm's step-down adjusted p-values. ``family_size`` (default: the number of p-values) may be
    larger: the family's other hypotheses, not measured here, count as p = 1 (which can only make the
    adjustment more conservative). None (no p-value) stays None."""
    known = [(p, i) for i, p in enumerate(pvalues) if p is not None]
    m = max(family_size or 0, len(known))
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(known)):
        running = max(running, min(1.0, (m - rank) * p))  # monotone: never below an earlier step
        out[i] = running
    return out


def verdict(
    mean: float | None, p_adj: float | None, direction: str, margin: float, alpha: float = ALPHA
) -> str:
    """The three-decision reading of a two-sided test of ``difference = margin`` (adjusted p):
    significant with the mean on the claim's side (``greater``: above ``margin``) is **consistent**,
    on the other side **inconsistent**, not significant **inconclusive**."""
    if mean is None or p_adj is None or p_adj >= alpha or mean == margin:
        return INCONCLUSIVE
    above = mean > margin
    return CONSISTENT if above == (direction == "greater") else INCONSISTENT


@dataclass
class Comparison:
    """One paired comparison ``a - b`` of ``metric``: raw interval, both p-values and, for a declared
    endpoint, its adjusted p and verdict."""

    metric: str
    a: str
    b: str
    interval: Interval
    n_pos: int
    n_neg: int
    p_t: float | None
    p_perm: float | None
    margin: float = 0.0
    direction: str | None = None  # "greater" / "less" for a declared endpoint; None: exploratory
    test: str = "permutation"  # which p the family's adjustment uses
    p_adj: float | None = None
    verdict: str | None = None

    @property
    def p(self) -> float | None:
        return self.p_perm if self.test == "permutation" else self.p_t

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "interval": self.interval.to_dict()}


def compare_paired(
    metric: str, a: str, b: str, xa: dict[int, float | None], xb: dict[int, float | None], margin: float = 0.0
) -> Comparison:
    """The raw paired comparison (interval, sign counts, p-values of ``a - b = margin``)."""
    d = paired_differences(xa, xb)
    return Comparison(
        metric, a, b, t_interval(d), sum(x > 0 for x in d), sum(x < 0 for x in d),
        t_test_p(d, margin), sign_flip_p(d, margin), margin,
    )  # fmt: skip


def adjust_family(
    comps: list[Comparison], family_size: int, alpha: float = ALPHA, others: Sequence[float] = ()
) -> None:
    """Holm over a declared family: sets each declared comparison's ``p_adj`` and ``verdict``.
    ``others``: raw p-values of the family's endpoints measured elsewhere (other presets' runs), so
    the adjustment is over the family as run; endpoints never run count as p = 1."""
    adjusted = holm([c.p for c in comps] + list(others), family_size)
    for c, p in zip(comps, adjusted[: len(comps)], strict=True):
        c.p_adj = p
        c.verdict = verdict(c.interval.mean, p, c.direction or "greater", c.margin, alpha)


def endpoint_p(result: dict[str, Any]) -> float | None:
    """The raw p of a stored endpoint result (a ``summary.json`` preregistration result), by its
    declared test."""
    return result["p_perm"] if result.get("test", "permutation") == "permutation" else result["p_t"]


def fmt_p(p: float | None) -> str:
    if p is None:
        return "n/a"
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


# ------------------------------------------------------------------------------------------------
# sizing a confirmatory study


def planning_sd(sd: float, n: int, confidence: float = 0.8) -> float:
    """An upper ``confidence`` bound of the sd of the per-seed differences from a pilot of ``n`` seeds
    (chi-square), so a study is not sized on a pilot's lucky small sd (Browne 1995)."""
    return sd * math.sqrt((n - 1) / float(_stats().chi2.ppf(1 - confidence, n - 1)))


def paired_power(n: int, delta: float, sd: float, alpha: float) -> float:
    """Power of the two-sided paired t test at level ``alpha`` with ``n`` seeds, when the true mean
    difference is ``delta`` and its per-seed sd is ``sd`` (noncentral t)."""
    df, nc = n - 1, delta / sd * math.sqrt(n)
    crit = float(_stats().t.ppf(1 - alpha / 2, df))
    return float(_stats().nct.sf(crit, df, nc) + _stats().nct.cdf(-crit, df, nc))


def sign_flip_power(n: int, delta: float, sd: float, alpha: float, n_sim: int = 4000, seed: int = 0) -> float:
    """Power of the two-sided sign-flip test at level ``alpha`` with ``n`` seeds when the per-seed
    differences are normal with mean ``delta`` and sd ``sd``: the share of ``n_sim`` simulated studies
    (fixed ``seed``) whose :func:`sign_flip_p` is below ``alpha``. Unlike the t test it has a floor:
    its smallest p is ``2 / 2^n``, so below ``log2(2 / alpha)`` seeds it can never reject. Above
    ``EXACT_MAX_N`` seeds each p is the permutation distribution's normal limit (a Monte Carlo p per
    simulated study would cost 200k draws each)."""
    if 2.0 / 2.0**n >= alpha:
        return 0.0
    rng = np.random.default_rng(seed)
    draws = rng.normal(delta, sd, size=(n_sim, n))
    if not sign_flip_is_exact(n):
        # beyond exact enumeration, the permutation distribution's normal limit given |d|: the
        # sum of random signs times |d_s| has mean 0 and variance sum(d_s^2)
        z = np.abs(draws.sum(1)) / np.sqrt((draws**2).sum(1))
        return float((2 * _stats().norm.sf(z) < alpha).mean())
    return sum(sign_flip_p(d) < alpha for d in draws) / n_sim  # type: ignore[operator]


def power_of(test: str, n: int, delta: float, sd: float, alpha: float) -> float:
    """Power of the declared ``test`` ("permutation": sign-flip, "t": paired t)."""
    return (
        sign_flip_power(n, delta, sd, alpha) if test == "permutation" else paired_power(n, delta, sd, alpha)
    )


def seeds_for_power(
    delta: float,
    sd: float,
    alpha: float = ALPHA,
    power: float = 0.8,
    family_size: int = 1,
    n_max: int = 10_000,
    test: str = "t",
) -> int:
    """Seeds per arm for a paired two-sided test of one endpoint to reach ``power`` at ``delta``,
    at Holm's first (strictest) threshold ``alpha / family_size``: every endpoint of the family is then
    powered as if it were the one tested first. ``test`` is the declared test: the sign-flip search
    starts at the t test's answer (the permutation test is not more powerful on normal data) and
    steps up by simulation."""
    level = alpha / family_size
    start = 2
    for n in range(2, n_max + 1):
        if paired_power(n, delta, sd, level) >= power:
            start = n
            break
    else:
        raise ValueError(f"more than {n_max} seeds needed (delta {delta}, sd {sd})")
    if test != "permutation":
        return start
    for n in range(start, n_max + 1):
        if sign_flip_power(n, delta, sd, level) >= power:
            return n
    raise ValueError(f"more than {n_max} seeds needed (delta {delta}, sd {sd})")


def size_from_pilot(
    diffs: Sequence[float],
    delta: float,
    alpha: float = ALPHA,
    power: float = 0.8,
    family_size: int = 1,
    confidence: float = 0.8,
    min_seeds: int = 16,
    test: str = "permutation",
) -> dict[str, Any]:
    """Seeds per arm for a confirmatory run from a pilot's per-seed differences: the pilot's sd, its
    upper ``confidence`` bound (:func:`planning_sd`), the seeds :func:`seeds_for_power` needs to detect
    ``delta`` with the declared ``test`` (the smallest difference worth finding, not the pilot's
    estimate, which a selected pilot overstates), at least ``min_seeds``, and the power that number of
    seeds has under that test."""
    d = clean(diffs)
    sd = statistics.stdev(d)
    plan = planning_sd(sd, len(d), confidence)
    n = max(min_seeds, seeds_for_power(delta, plan, alpha, power, family_size, test=test))
    return {
        "pilot_n": len(d), "pilot_mean": statistics.fmean(d), "pilot_sd": sd, "planning_sd": plan,
        "delta": delta, "alpha": alpha, "family_size": family_size, "power_target": power, "seeds": n,
        "test": test, "power": power_of(test, n, delta, plan, alpha / family_size),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# one declared interim look: O'Brien-Fleming-type alpha spending (Lan & DeMets 1983)


def obrien_fleming_spent(alpha: float, t: float) -> float:
    """Two-sided type I error spent by information fraction ``t`` (0 < t <= 1) under the
    O'Brien-Fleming-type spending function ``2 - 2 Phi(z_{1-alpha/2} / sqrt(t))``; ``alpha`` at t = 1."""
    return float(2.0 * _stats().norm.sf(_stats().norm.isf(alpha / 2.0) / math.sqrt(t)))


def interim_levels(alpha: float, t: float) -> tuple[float, float]:
    """Nominal two-sided levels of a two-look design (an interim look at information fraction ``t``,
    the final at 1) that spends ``alpha`` by :func:`obrien_fleming_spent`: the interim level is what is
    spent by ``t``; the final boundary ``c2`` solves ``P(|Z1| < c1, |Z2| >= c2) = alpha - alpha_1``
    for the look statistics' bivariate normal with correlation ``sqrt(t)`` (scipy's bivariate
    normal cdf, then a root search). A look rejects when its p is below its level."""
    if not 0 < t < 1:
        raise ValueError(f"interim information fraction must be in (0, 1), got {t}")
    a1 = obrien_fleming_spent(alpha, t)
    c1 = float(_stats().norm.isf(a1 / 2.0))
    mvn = _stats().multivariate_normal(mean=[0.0, 0.0], cov=[[1.0, math.sqrt(t)], [math.sqrt(t), 1.0]])

    def box(c2: float) -> float:  # P(|Z1| < c1, |Z2| < c2)
        return float(mvn.cdf([c1, c2]) - mvn.cdf([-c1, c2]) - mvn.cdf([c1, -c2]) + mvn.cdf([-c1, -c2]))

    # P(|Z1| < c1, |Z2| >= c2) = P(|Z1| < c1) - box(c2), decreasing in c2
    inside = 1.0 - a1

    def excess(c2: float) -> float:
        return inside - box(c2) - (alpha - a1)

    from scipy.optimize import brentq

    c2 = float(brentq(excess, 0.5, 10.0, xtol=1e-10))
    return a1, float(2.0 * _stats().norm.sf(c2))
