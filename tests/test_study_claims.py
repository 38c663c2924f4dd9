"""The numbers docs/stability and docs/multiturn quote after issue 46's corrections follow from the stored
per-seed data: the exact sign-flip p of the 27-seed confirm runs (their reports' were Monte Carlo),
smollm2-copy's bootstrap intervals and its planning-rule sizing, and the SmolLM2 tool study's p for the
procedure followed (a look at 5 seeds at 0.05, then at 8)."""

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from gspo.study.statistics import bootstrap_interval, sign_flip_p, size_from_pilot, t_test_p

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _column(name: str, variant: str, key: str) -> dict[int, float]:
    with (DOCS / "stability" / name / "per_seed.csv").open() as f:
        return {int(r["seed"]): float(r[key]) for r in csv.DictReader(f) if r["variant"] == variant}


def _diffs(name: str, key: str = "acc_final") -> list[float]:
    a, b = _column(name, "gspo", key), _column(name, "grpo", key)
    return [a[s] - b[s] for s in sorted(a)]


def test_the_27_seed_confirm_runs_exact_p_and_the_stored_monte_carlo_one():
    stored = json.loads((DOCS / "stability" / "confirm-lr-1e-3" / "summary.json").read_text())
    assert stored["preregistration"]["results"][0]["p_perm"] == pytest.approx(571 / 200_001)  # MC
    p = sign_flip_p(_diffs("confirm-lr-1e-3"))
    assert p == pytest.approx(0.002937, abs=5e-7) and f"{4 * p:.2g}" == "0.012"
    assert sign_flip_p(_diffs("confirm-staleness-8")) == pytest.approx(0.6902, abs=5e-5)
    text = (DOCS / "stability" / "confirm-lr-1e-3" / "report.md").read_text()
    assert "**Monte Carlo (MC)**" in text and "exact sign-flip permutation" not in text


def test_smollm2_copy_bootstrap_intervals_and_planning_rule():
    d = _diffs("smollm2-copy")
    assert bootstrap_interval(d).fmt() == "0.215 [-0.328, 0.695]"
    assert (
        bootstrap_interval(list(_column("smollm2-copy", "gspo", "acc_final").values())).fmt()
        == "0.676 [0.355, 0.918]"
    )
    assert (
        bootstrap_interval(list(_column("smollm2-copy", "grpo", "acc_final").values())).fmt()
        == "0.461 [0.117, 0.797]"
    )
    assert f"{sign_flip_p(d):.2f}" == "0.55"
    plan = size_from_pilot(d, 0.2, test="t")
    assert plan["seeds"] == 232 and f"{plan['planning_sd']:.2f}" == "1.08"


def test_smollm2_tool_gain_p_for_the_procedure_followed():
    """Reject if the 5-seed t p < 0.05, else if the 8-seed p <= the observed 0.0152: ~0.056 with the t
    test (bivariate normal, correlation sqrt(5/8)), 20/256 = 0.078 over the sign patterns of the gains."""
    record = json.loads((DOCS / "multiturn" / "smollm2" / "results.json").read_text())
    gain = {r["seed"]: r["final"] - r["initial"] for r in record["runs"] if r["arm"] == "tools"}
    d = np.array([gain[s] for s in range(8)])
    p8 = t_test_p(d)
    assert p8 == pytest.approx(record["summary"]["tools"]["p"]) and t_test_p(d[:5]) > 0.05
    rho, c1, c2 = math.sqrt(5 / 8), stats.norm.isf(0.025), stats.norm.isf(p8 / 2)
    mvn = stats.multivariate_normal([0, 0], [[1, rho], [rho, 1]])
    inside = mvn.cdf([c1, c2]) - mvn.cdf([-c1, c2]) - mvn.cdf([c1, -c2]) + mvn.cdf([-c1, -c2])
    assert 1 - inside == pytest.approx(0.0557, abs=5e-4)
    hits = 0
    for signs in itertools.product([1.0, -1.0], repeat=8):
        x = np.abs(d) * np.array(signs)
        hits += t_test_p(x[:5]) < 0.05 or t_test_p(x) <= p8 + 1e-12
    assert hits == 20  # 20 / 256 = 0.078
