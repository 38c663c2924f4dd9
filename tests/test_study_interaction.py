"""An interaction endpoint, ``(a - b) - (c - d)`` paired by seed, declared secondary endpoints with their
own Holm family, and arms on another model that warm-start from that model (issue 46 item 3:
``confirm-moe-interaction``, declared and not run)."""

from pathlib import Path

import pytest
from study_binding_helpers import bind
from test_study_report import TINY, _runs

from gspo.config import Config
from gspo.errors import GspoError
from gspo.study import load_preset, write_report
from gspo.study.statistics import holm, sign_flip_p

PRESET = """seeds: [0, 1, 2, 3, 4, 5]
variants: [gspo, grpo, grpo_replay, gspo_dense, grpo_dense]
arms:
  gspo_dense: {algo: gspo, model: "embedded:tiny-dense"}
  grpo_dense: {algo: grpo, model: "embedded:tiny-dense"}
primary:
  - {metric: acc_final, contrast: (gspo - grpo) - (gspo_dense - grpo_dense), direction: greater}
family: {name: inter, size: 1}
secondary:
  - {metric: acc_final, contrast: gspo - grpo, direction: greater}
  - {metric: acc_final, contrast: grpo_replay - grpo, direction: greater}
  - {metric: acc_final, contrast: gspo - grpo_replay, direction: greater, margin: -0.02}
secondary_family: {name: inter-2, size: 3}
"""
FINALS = {
    "gspo": [0.70, 0.72, 0.69, 0.75, 0.71, 0.70],
    "grpo": [0.50, 0.55, 0.52, 0.50, 0.49, 0.51],
    "grpo_replay": [0.52, 0.54, 0.50, 0.53, 0.52, 0.50],
    "gspo_dense": [0.60, 0.61, 0.62, 0.60, 0.59, 0.61],
    "grpo_dense": [0.55, 0.57, 0.58, 0.52, 0.56, 0.57],
}


def test_interaction_and_secondary_endpoints_are_tested_and_adjusted(tmp_path):
    out = tmp_path / "out"
    _runs(out, FINALS)
    repo = tmp_path / "repo"
    repo.mkdir()
    preset = repo / "p.yaml"
    preset.write_text(PRESET)
    p = load_preset(str(preset))
    seeds = list(range(6))

    def report() -> tuple[str, dict]:
        import json

        text = write_report(out, list(FINALS), seeds, Config(**TINY), preset=p).read_text()
        return text, json.loads((out / "summary.json").read_text())["preregistration"]

    text, pre = report()  # not bound yet: numbers, no verdicts
    assert pre["preregistered"] is False and all(r["verdict"] is None for r in pre["secondary_results"])
    bind(out, preset)
    p = load_preset(str(preset))  # as declared: its resolved config added by bind
    text, pre = report()
    inter = [
        (FINALS["gspo"][s] - FINALS["grpo"][s]) - (FINALS["gspo_dense"][s] - FINALS["grpo_dense"][s])
        for s in seeds
    ]
    res = pre["results"][0]
    assert res["p_perm"] == pytest.approx(sign_flip_p(inter)) and res["interval"]["mean"] == pytest.approx(
        sum(inter) / 6
    )
    assert (
        res["a"] == "gspo - grpo" and res["b"] == "gspo_dense - grpo_dense" and res["verdict"] == "consistent"
    )
    assert (
        "(gspo - grpo) - (gspo_dense - grpo_dense)" in text and "### Secondary endpoints (declared)" in text
    )
    sec = pre["secondary_results"]
    raw = [r["p_perm"] for r in sec]
    assert [r["p_adj"] for r in sec] == pytest.approx(holm(raw, 3))
    assert sec[0]["p_perm"] == pytest.approx(2 / 64) and sec[0]["p_adj"] == pytest.approx(3 * 2 / 64)
    assert [r["verdict"] for r in sec] == ["inconclusive"] * 3  # bound: verdicts, from Holm over 3
    # the claims table names a secondary endpoint's verdict as such, and says why it may carry one
    row = next(ln for ln in text.splitlines() if ln.startswith("| GSPO ends with higher held-out accuracy"))
    assert "pre-registered secondary: **inconclusive**" in row
    assert "as a primary endpoint (above)" not in text and "(primary, or secondary in its own" in text
    assert pre["secondary_family"]["size"] == 3


def test_arms_on_another_model_warm_start_from_that_model(tmp_path):
    """The dense arms form their own warm-start group: one warm start per model and seed, in its own
    folder; the runs of each start from their own model's warm start."""
    from gspo.study.runner import Jobs, _base_config

    p = load_preset("confirm-moe-interaction")
    jobs = Jobs(
        _base_config(p, None, {}, 1),
        p.seeds[:1],
        p.variants,
        tmp_path / "o",
        p.warm_target,
        tmp_path / "w",
        arms=p.arms,
    )
    groups = jobs.groups()
    assert [g.model for g in groups.values()] == ["embedded:small-moe", "embedded:small-dense"]
    keys = list(groups)
    assert jobs.group_variants(keys[0]) == ["gspo", "grpo", "grpo_replay"]
    assert jobs.group_variants(keys[1]) == ["gspo_dense", "grpo_dense"]
    moe, dense = (jobs.warm_folder(p.seeds[0], k) for k in keys)
    assert (
        moe != dense
        and moe.parent.name.startswith("small-moe")
        and dense.parent.name.startswith("small-dense")
    )
    cfg = jobs.run_cfg("gspo_dense", p.seeds[0], str(dense))
    assert cfg.model == str(dense) and cfg.algo == "gspo" and cfg.sft_steps == 0
    jobs.check_folders()  # nothing there yet: every run planned, nothing written
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "contrast, what",
    [
        ("(gspo - grpo) - (gspo_dense)", "contrast must be"),
        ("(gspo - grpo) - (gspo - nope)", "contrast must be"),
    ],
)
def test_a_bad_interaction_or_secondary_is_one_line(tmp_path, contrast, what):
    path = tmp_path / "p.yaml"
    path.write_text(PRESET.replace("(gspo - grpo) - (gspo_dense - grpo_dense)", contrast))
    with pytest.raises(GspoError, match=what):
        load_preset(str(path))
    path.write_text(PRESET.split("secondary:")[0] + "secondary_family: {name: x}\n")
    with pytest.raises(GspoError, match="'secondary_family' without 'secondary'"):
        load_preset(str(path))
    assert Path(path).exists()


def test_declared_pairs_extend_the_exploratory_table(tmp_path):
    """``pairs: [a - b]`` adds raw paired differences (no verdict) to the report's exploratory table
    and to summary.json, computed as every other pair: the mean of the per-seed differences."""
    import json

    out = tmp_path / "out"
    _runs(out, FINALS)
    preset = tmp_path / "p.yaml"
    preset.write_text(PRESET + "pairs: [grpo_dense - grpo, gspo - grpo]\n")
    p = load_preset(str(preset))
    assert p.pairs == [("grpo_dense", "grpo"), ("gspo", "grpo")]
    text = write_report(out, list(FINALS), list(range(6)), Config(**TINY), preset=p).read_text()
    diff = sum(d - g for d, g in zip(FINALS["grpo_dense"], FINALS["grpo"], strict=True)) / 6
    row = next(line for line in text.splitlines() if line.startswith("| grpo_dense - grpo |"))
    assert f"{diff:.3f}" in row
    assert sum(line.startswith("| gspo - grpo |") for line in text.splitlines()) == 1  # built-in: once
    summary = json.loads((out / "summary.json").read_text())
    assert "grpo_dense-grpo:acc_final" in json.dumps(summary)
