"""gspo.study.statistics against closed forms: t intervals and tests (scipy), the exact sign-flip
test (brute-force enumeration), Holm (a worked example), verdicts from adjusted p, power."""

import itertools
import math
import random

import numpy as np
import pytest
from scipy import stats

from gspo.study.statistics import (
    CONSISTENT,
    INCONCLUSIVE,
    INCONSISTENT,
    Comparison,
    Interval,
    adjust_family,
    compare_paired,
    paired_power,
    planning_sd,
    seeds_for_power,
    sign_flip_p,
    size_from_pilot,
    t_interval,
    t_test_p,
    welch_interval,
)


def test_t_interval_is_scipys_interval():
    xs = [0.12, -0.03, 0.08, 0.2, 0.05, 0.11, -0.01]
    iv = t_interval(xs)
    lo, hi = stats.t.interval(0.95, len(xs) - 1, loc=np.mean(xs), scale=stats.sem(xs))
    assert (iv.lo, iv.hi) == pytest.approx((lo, hi), rel=1e-12)
    res = stats.ttest_1samp(xs, 0.0).confidence_interval(0.95)
    assert (iv.lo, iv.hi) == pytest.approx((res.low, res.high), rel=1e-12)


def test_welch_interval_uses_the_exact_satterthwaite_df():
    a, b = [1.0, 2.5, 3.1, 4.0, 2.2], [4.0, 5.5, 6.0]
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    assert df != int(df)  # fractional: the old table rounded it down
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    iv = welch_interval(a, b)
    d = np.mean(a) - np.mean(b)
    assert (iv.mean, iv.lo, iv.hi) == pytest.approx((d, d - half, d + half), rel=1e-10)


def test_paired_t_p_is_scipys_and_handles_no_spread():
    d = [0.05, 0.02, -0.01, 0.07, 0.03]
    assert t_test_p(d) == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue, rel=1e-12)
    assert t_test_p(d, null=-0.02) == pytest.approx(stats.ttest_1samp(d, -0.02).pvalue, rel=1e-12)
    assert t_test_p([0.0, 0.0, 0.0]) == 1.0  # identical runs: no evidence of a difference
    # the same nonzero difference on every seed: t is undefined (x/0); p falls back to the exact
    # sign-flip p, 2 / 2^n (it used to be 0, so two agreeing seeds read as "consistent")
    assert t_test_p([0.1, 0.1, 0.1]) == pytest.approx(2 / 8)
    assert t_test_p([0.1, 0.1]) == pytest.approx(0.5)
    assert t_test_p([0.08, 0.08], null=0.08) == 1.0
    assert t_test_p([0.1]) is None


def _enumerated_p(d: list[float]) -> float:
    """Two-sided sign-flip p by listing every sign pattern (the definition)."""
    obs = abs(sum(d))
    hits = sum(abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= obs - 1e-12
               for signs in itertools.product((1, -1), repeat=len(d)))  # fmt: skip
    return hits / 2 ** len(d)


@pytest.mark.parametrize("n", [1, 3, 6, 9])
def test_sign_flip_p_is_exact_for_small_n(n):
    rng = random.Random(n)
    d = [rng.gauss(0.03, 0.05) for _ in range(n)]
    assert sign_flip_p(d) == pytest.approx(_enumerated_p(d), abs=1e-15)


def test_sign_flip_p_closed_forms():
    # every seed on one side: only the identity and the all-flipped pattern reach |sum|: 2 / 2^n
    assert sign_flip_p([0.1, 0.2, 0.05, 0.3, 0.1]) == pytest.approx(2 / 32)
    assert sign_flip_p([0.1] * 8) == pytest.approx(2 / 256)
    assert sign_flip_p([0.1] * 18) == pytest.approx(2 / 2**18)  # enumerated in chunks beyond 16
    # the null shifts the differences: testing a - b = -0.02 (non-inferiority)
    d = [0.01, -0.015, 0.0, 0.02, 0.005]
    assert sign_flip_p(d, null=-0.02) == pytest.approx(_enumerated_p([x + 0.02 for x in d]))
    assert sign_flip_p([0.0] * 5) == 1.0
    assert sign_flip_p([]) is None


def test_sign_flip_p_monte_carlo_beyond_the_exact_limit():
    """Beyond exact_max_n: a fixed-seed Monte Carlo estimate, reproducible, within a few standard
    errors of the exact p (computed here by the exact path)."""
    rng = random.Random(3)
    d = [rng.gauss(0.02, 0.05) for _ in range(14)]
    exact = sign_flip_p(d)
    mc = sign_flip_p(d, exact_max_n=10, n_mc=50_000)
    assert mc == sign_flip_p(d, exact_max_n=10, n_mc=50_000)  # fixed seed
    assert abs(mc - exact) < 4 * math.sqrt(exact * (1 - exact) / 50_000) + 1e-4
    assert sign_flip_p([0.1] * 50, n_mc=1000) == pytest.approx(1 / 1001)  # add-one: never 0


def _chunked_enumeration_p(d: list[float]) -> float:
    """Every one of the 2^n sign patterns, listed (the first 16 signs as a matrix, the rest looped):
    the definition, independent of the meet-in-the-middle count."""
    x = np.asarray(d)
    head = np.array(list(itertools.product((1.0, -1.0), repeat=16))) @ x[:16]
    obs, hits = abs(x.sum()) - 1e-9 * max(1.0, np.abs(x).sum()), 0
    for tail in itertools.product((1.0, -1.0), repeat=len(d) - 16):
        hits += int((np.abs(head + float(np.dot(tail, x[16:]))) >= obs).sum())
    return hits / 2 ** len(d)


def test_sign_flip_p_is_exact_for_27_seeds():
    """The confirmatory runs' n = 27 is exact (it was a 200k-draw Monte Carlo estimate above 20)."""
    from gspo.study.statistics import sign_flip_is_exact

    rng = random.Random(27)
    d = [rng.gauss(0.02, 0.05) for _ in range(27)]
    assert sign_flip_is_exact(27)
    assert sign_flip_p(d) == _chunked_enumeration_p(d)  # the same count of 2^27 patterns, exactly
    assert sign_flip_p([0.1] * 27) == 2 / 2**27


def test_holm_on_a_worked_example():
    from gspo.study.statistics import holm

    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005 x4 = 0.02; 0.01 x3 = 0.03; 0.03 x2 = 0.06; 0.04 x1 = 0.04 -> monotone 0.06
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # a declared family of 6 of which 4 are measured: the other two count as p = 1
    assert holm(p, family_size=6) == pytest.approx([0.05, 0.12, 0.12, 0.03])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([None, 0.02]) == [None, pytest.approx(0.02)]
    try:  # the reference implementation, where installed (not a test dependency)
        from statsmodels.stats.multitest import multipletests
    except ImportError:
        return
    rng = np.random.default_rng(0)
    for _ in range(20):
        ps = list(rng.uniform(0, 0.2, size=rng.integers(1, 9)))
        assert holm(ps) == pytest.approx(list(multipletests(ps, method="holm")[1]), rel=1e-12)


def _comp(mean: float, p: float, direction: str = "greater") -> Comparison:
    return Comparison(
        "acc_final", "gspo", "grpo", Interval(mean, mean - 0.01, mean + 0.01, 8), 8, 0, p, p, 0.0, direction
    )


def test_verdicts_follow_the_adjusted_p_not_the_raw_one():
    """Raw p 0.02, 0.03, 0.001. In a family of 3, Holm gives 0.001 x 3 = 0.003, 0.02 x 2 = 0.04 and
    max(0.04, 0.03 x 1) = 0.04: all significant. In a declared family of 10 only the smallest stays
    below 0.05, so the two positive differences get no verdict though their raw CIs exclude 0."""
    comps = [_comp(0.05, 0.02), _comp(0.04, 0.03), _comp(-0.1, 0.001)]
    adjust_family(comps, family_size=3)
    assert [c.p_adj for c in comps] == pytest.approx([0.04, 0.04, 0.003])
    assert [c.verdict for c in comps] == [CONSISTENT, CONSISTENT, INCONSISTENT]
    # the same three in a declared family of 10: 0.001 x 10 = 0.01, 0.02 x 9 = 0.18, 0.03 x 8 = 0.24
    comps = [_comp(0.05, 0.02), _comp(0.04, 0.03), _comp(-0.1, 0.001)]
    adjust_family(comps, family_size=10)
    assert [c.p_adj for c in comps] == pytest.approx([0.18, 0.24, 0.01])
    assert [c.verdict for c in comps] == [INCONCLUSIVE, INCONCLUSIVE, INCONSISTENT]
    assert all(c.interval.lo > 0 for c in comps[:2])  # raw CIs above 0, yet no verdict


def test_compare_paired_pairs_by_seed():
    a = {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9, 4: 0.2}
    b = {0: 0.4, 1: 0.55, 2: 0.6, 3: 0.85, 5: 0.1}
    c = compare_paired("acc_final", "gspo", "grpo", a, b)
    d = [0.1, 0.05, 0.1, 0.05]
    assert c.interval.n == 4 and (c.n_pos, c.n_neg) == (4, 0)
    assert c.p_t == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue)
    assert c.p_perm == pytest.approx(2 / 16)


def test_power_of_the_paired_t_test():
    # textbook: effect size 0.5 needs 34 pairs for 80% power at two-sided 0.05 (G*Power: 34)
    assert seeds_for_power(0.5, 1.0) == 34
    assert paired_power(34, 0.5, 1.0, 0.05) == pytest.approx(0.8078, abs=2e-3)
    # power by simulation agrees with the noncentral t
    rng = np.random.default_rng(1)
    sims = rng.normal(0.5, 1.0, size=(20_000, 20))
    rate = (stats.ttest_1samp(sims, 0.0, axis=1).pvalue < 0.05).mean()
    assert rate == pytest.approx(paired_power(20, 0.5, 1.0, 0.05), abs=0.015)
    # Holm's first threshold alpha / m needs more seeds
    assert seeds_for_power(0.5, 1.0, family_size=4) > 34
    assert planning_sd(1.0, 5) > 1.0 and planning_sd(1.0, 50) < planning_sd(1.0, 5)


def test_size_from_pilot():
    diffs = [0.1, 0.05, 0.08, 0.12, 0.07]
    s = size_from_pilot(diffs, delta=0.05, family_size=4)
    assert s["pilot_sd"] == pytest.approx(np.std(diffs, ddof=1))
    assert s["planning_sd"] == pytest.approx(planning_sd(s["pilot_sd"], 5))
    assert seeds_for_power(0.05, s["planning_sd"], family_size=4) == 12
    assert s["seeds"] == 16  # never under the floor of 16 seeds per arm
    assert s["power"] > 0.8
    assert size_from_pilot(diffs, delta=0.02, family_size=4)["seeds"] == seeds_for_power(
        0.02, s["planning_sd"], family_size=4, test="permutation"
    )


def test_power_is_computed_for_the_declared_sign_flip_test():
    """The presets declare the sign-flip test, so their power is the sign-flip test's (the t test's
    was quoted). Its smallest p is 2 / 2^n: at Holm's 0.05 / 4 five seeds can never reject, whatever
    the effect, while the t test claims 60% power there."""
    from gspo.study.statistics import power_of, sign_flip_power

    assert sign_flip_power(5, 2.0, 1.0, 0.0125) == 0.0
    assert paired_power(5, 2.0, 1.0, 0.0125) > 0.5
    # where its floor is far away it tracks the t test (normal data), within simulation error
    assert sign_flip_power(20, 0.5, 1.0, 0.05) == pytest.approx(paired_power(20, 0.5, 1.0, 0.05), abs=0.05)
    n = seeds_for_power(0.8, 1.0, family_size=4, test="permutation")
    assert sign_flip_power(n, 0.8, 1.0, 0.0125) >= 0.8 > sign_flip_power(n - 1, 0.8, 1.0, 0.0125)
    assert n >= seeds_for_power(0.8, 1.0, family_size=4)  # never fewer than the t test needs
    s = size_from_pilot([0.1, 0.05, 0.08, 0.12, 0.07], delta=0.05, family_size=4, min_seeds=2)
    assert s["test"] == "permutation"
    assert s["power"] == power_of("permutation", s["seeds"], 0.05, s["planning_sd"], 0.0125) >= 0.8
