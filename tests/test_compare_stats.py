"""`gspo compare` statistics on hand-made numbers: intervals, verdicts, collapse and spike detection."""

import math

import pytest
from scipy import stats

from gspo.compare import (
    CONSISTENT,
    INCONCLUSIVE,
    INCONSISTENT,
    Criteria,
    auc,
    bootstrap_interval,
    collapse_index,
    list_presets,
    load_preset,
    moving_average,
    paired_interval,
    run_stats,
    spike_indices,
    t_interval,
    t_quantile,
    verdict,
    welch_interval,
)
from gspo.config import make_config
from gspo.errors import GspoError


def test_t_interval_of_known_sample():
    # mean 3, sd sqrt(2.5), se sqrt(0.5); t_{0.975,4} = 2.7764451 (scipy; the tables' 2.776 rounded)
    iv = t_interval([1, 2, 3, 4, 5])
    half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)
    assert iv.mean == pytest.approx(3.0)
    assert (iv.lo, iv.hi) == pytest.approx((3 - half, 3 + half))
    assert iv.n == 5 and iv.known


def test_t_interval_edge_cases():
    assert t_interval([]).mean is None
    one = t_interval([0.4])
    assert one.mean == 0.4 and not one.known  # one seed: no interval, hence no verdict
    same = t_interval([0.2, 0.2, 0.2])
    assert (same.lo, same.hi) == pytest.approx((0.2, 0.2))
    assert t_interval([1.0, None, float("nan"), 3.0]).n == 2  # None and NaN are dropped


def test_t_quantiles_are_scipys_with_exact_df():
    """No table: every df has its own quantile (the old table rounded df down to the nearest entry)."""
    assert t_quantile(1) == pytest.approx(12.7062047, abs=1e-6)
    assert t_quantile(4) == pytest.approx(2.7764451, abs=1e-6)
    assert t_quantile(35) == pytest.approx(2.0301079, abs=1e-6)  # the table gave df 30's 2.042
    assert t_quantile(7.5) == pytest.approx(stats.t.ppf(0.975, 7.5))  # fractional (Welch) df
    assert t_quantile(1e6) == pytest.approx(1.959966, abs=1e-5)
    with pytest.raises(ValueError):
        t_quantile(0)


def test_bootstrap_interval():
    iv = bootstrap_interval([1, 2, 3, 4, 5])
    t = t_interval([1, 2, 3, 4, 5])
    assert iv.mean == 3.0 and 1 <= iv.lo < 3 < iv.hi <= 5
    assert t.lo < iv.lo and iv.hi < t.hi  # percentile bootstrap is narrower with few values
    assert bootstrap_interval([1, 2, 3, 4, 5]) == iv  # seeded: reproducible


def test_paired_interval_uses_common_seeds_only():
    a = {0: 0.5, 1: 0.6, 2: 0.7, 3: 0.9}
    b = {0: 0.4, 1: 0.5, 2: 0.6, 4: 0.1}
    iv, n_pos, n_neg = paired_interval(a, b)
    assert iv.n == 3 and iv.mean == pytest.approx(0.1) and iv.lo == pytest.approx(0.1)
    assert (n_pos, n_neg) == (3, 0)
    # pairing removes the per-seed offset that an unpaired comparison would count as noise
    a2 = {0: 0.2, 1: 0.5, 2: 0.8}
    b2 = {0: 0.18, 1: 0.475, 2: 0.78}
    iv2, _, _ = paired_interval(a2, b2)
    assert iv2.lo > 0
    assert welch_interval(list(a2.values()), list(b2.values())).lo < 0


def test_welch_interval_known_values():
    # d = -3, se^2 = 1/3 + 1/3, df = 4 -> t_{0.975,4}
    iv = welch_interval([1, 2, 3], [4, 5, 6])
    half = stats.t.ppf(0.975, 4) * math.sqrt(2 / 3)
    assert (iv.mean, iv.lo, iv.hi) == pytest.approx((-3, -3 - half, -3 + half))


def test_verdict_reads_the_adjusted_p_and_the_sign():
    """Three decisions: significant (adjusted p < alpha) on the claim's side of the margin is
    consistent, on the other side inconsistent; not significant (or no p) inconclusive."""
    assert verdict(0.1, 0.01, "greater", 0.0) == CONSISTENT
    assert verdict(-0.1, 0.01, "greater", 0.0) == INCONSISTENT
    assert verdict(0.1, 0.06, "greater", 0.0) == INCONCLUSIVE  # raw p may be < 0.05: adjusted is not
    assert verdict(0.3, None, "greater", 0.0) == INCONCLUSIVE  # one seed: never a verdict
    assert verdict(-0.1, 0.01, "less", 0.0) == CONSISTENT
    # non-inferiority: "not worse by more than 0.02" is a test of a - b = -0.02
    assert verdict(0.0, 0.01, "greater", -0.02) == CONSISTENT
    assert verdict(-0.1, 0.01, "greater", -0.02) == INCONSISTENT


def test_collapse_index_on_synthetic_curves():
    # rises to 0.7, falls to 0.4 and stays there: collapse at index 3
    assert collapse_index([0.5, 0.6, 0.7, 0.4, 0.4, 0.45], 0.15) == 3
    # falls, then recovers: no collapse
    assert collapse_index([0.5, 0.7, 0.4, 0.4, 0.7], 0.15) is None
    # a dip smaller than the margin is noise
    assert collapse_index([0.5, 0.7, 0.6, 0.58, 0.6], 0.15) is None
    # falls, partly recovers, but never back within the margin of the best: collapse at the fall
    assert collapse_index([0.5, 0.8, 0.3, 0.5, 0.6], 0.15) == 2
    # only the last eval falls: still a collapse (nothing after it recovers)
    assert collapse_index([0.5, 0.7, 0.7, 0.5], 0.15) == 3
    # monotone rise, flat, too short
    assert collapse_index([0.1, 0.2, 0.3, 0.4], 0.15) is None
    assert collapse_index([0.5] * 10, 0.0) is None
    assert collapse_index([0.9], 0.15) is None
    # a fall to zero (the paper's GRPO-on-MoE collapse)
    assert collapse_index([0.3, 0.5, 0.6, 0.2, 0.05, 0.0, 0.0], 0.15) == 3


def test_spikes_and_moving_average():
    g = [1.0, 1.2, 0.9, 1.1, 1.0, 1.0, 1.1, 0.9, 1.0, 1.0, 25.0, 1.0, 1.1, 1.0]
    assert spike_indices(g, 10.0, 20) == [10]
    assert spike_indices(g, 30.0, 20) == []
    assert spike_indices([100.0, 1, 1, 1], 10.0, 20) == []  # no history before it: not counted
    assert spike_indices([0.01] * 10 + [0.5], 10.0, 20, floor=math.log(2.0)) == []  # under the floor
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]


def test_auc_is_time_averaged_accuracy():
    assert auc([0, 10, 20], [0.0, 1.0, 1.0]) == pytest.approx(0.75)
    assert auc([0, 10, 30], [0.5, 0.5, 0.5]) == pytest.approx(0.5)
    assert auc([0], [0.3]) == 0.3


def _rows(acc, reward, grad, ratio, every=2):
    rows = [{"step": 0, "eval/accuracy": acc[0]}]
    for i in range(1, len(reward) + 1):
        r = {
            "step": i,
            "rollout/reward_mean": reward[i - 1],
            "loss/grad_norm": grad[i - 1],
            "loss/ratio_max": ratio[i - 1],
            "loss/clip_frac_tok": 0.1,
            "moe/volatility": 0.02,
        }
        if i % every == 0:
            r["eval/accuracy"] = acc[i // every]
        rows.append(r)
    return rows


def test_run_stats_detects_every_event_kind():
    n = 40
    acc = [0.3, 0.5, 0.6, 0.7] + [0.7] * 6 + [0.2] * 11  # evals at steps 0, 2, ..., 40
    reward = [0.5] * 20 + [0.1] * 20
    grad = [1.0] * 25 + [50.0] + [1.0] * 14
    ratio = [1.2] * 30 + [30.0] + [1.2] * 9
    s = run_stats(_rows(acc, reward, grad, ratio), Criteria())
    assert s["acc_start"] == 0.3 and s["acc_final"] == 0.2 and s["acc_best"] == 0.7
    assert s["drawdown"] == pytest.approx(0.5) and s["collapsed"]
    assert s["acc_collapse_step"] == 20
    assert s["reward_collapse_step"] is not None and 21 <= s["reward_collapse_step"] <= 30
    assert s["grad_spike_steps"] == [26] and s["ratio_spike_steps"] == [31]
    assert s["events"] == 4 and s["spikes"] == 2
    assert s["volatility"] == pytest.approx(0.02) and s["clip_tok"] == pytest.approx(0.1)
    # a healthy run: no events
    ok = run_stats(_rows([0.3 + 0.01 * i for i in range(21)], [0.5] * n, [1.0] * n, [1.2] * n), Criteria())
    assert not ok["collapsed"] and ok["events"] == 0 and ok["acc_gain"] == pytest.approx(0.2)


def test_every_shipped_preset_loads_and_validates():
    names = list_presets()
    assert "default" in names
    for name in names:
        p = load_preset(name)
        assert p.description and p.runtime, f"preset {name} must document itself and its run time"
        assert len(p.seeds) >= 5
        make_config(None, p.config)  # every value valid
    with pytest.raises(GspoError, match="unknown preset"):
        load_preset("no-such-preset")
