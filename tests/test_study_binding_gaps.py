"""Issue 59 step 5, binding without gaps: a run from a checkout with uncommitted changes is not
pre-registered; the declaration binds the fully resolved config (every field of every arm's config
and the plan gspo resolves from it, defaults included, the warm-start gate, the analysis criteria),
so a code default changed after the declaration is caught; an analysed subset in which an arm has
no runs says so (the later-date rule: test_study_binding_seeds.py)."""

import json
import time
from pathlib import Path

from study_binding_helpers import commit, declare, record_runs
from test_study_binding import PRESET, _refuses
from test_study_report import TINY, _runs

from gspo.config import Config, make_config
from gspo.study import load_preset, write_report
from gspo.study.binding import main, resolved_settings, resolved_sha256
from gspo.study.metrics import Criteria

SAPO = PRESET.replace("variants: [gspo, grpo]", "variants: [gspo, grpo, sapo]") + (
    "secondary:\n  - {metric: acc_final, contrast: sapo - grpo, direction: greater}\n"
)


def _study(tmp: Path, text: str = PRESET) -> tuple[Path, Path]:
    """Six seeds favouring GSPO, the preset declared (its resolved config included) and committed an
    hour before the runs, which record it from a clean checkout."""
    out, repo = tmp / "out", tmp / "repo"
    repo.mkdir(parents=True)
    _runs(out, {"gspo": [0.7 + 0.01 * s for s in range(6)], "grpo": [0.5 + 0.01 * s for s in range(6)]})
    preset = repo / "p.yaml"
    preset.write_text(text)
    declare(preset)
    commit(repo, preset, time.time() - 3600)
    record_runs(out, preset)
    return out, preset


def _report(
    out: Path, preset: Path, seeds: list[int], variants: tuple[str, ...] = ("gspo", "grpo"), **kw: object
) -> tuple[str, dict]:
    p = load_preset(str(preset))
    text = write_report(out, list(variants), seeds, Config(**TINY), preset=p, **kw).read_text()
    return text, json.loads((out / "summary.json").read_text())["preregistration"]


def test_a_run_from_a_dirty_checkout_is_not_preregistered(tmp_path):
    """Runs recording ``gspo_dirty`` true (uncommitted changes in gspo's checkout: the code they ran is
    in no commit) or not recording it at all are not bound; the same runs from a clean one are."""
    out, preset = _study(tmp_path)
    assert _report(out, preset, list(range(6)))[1]["preregistered"] is True
    record_runs(out, preset, gspo_dirty=True)
    _refuses(*_report(out, preset, list(range(6))), "ran from a gspo checkout with uncommitted changes")
    record_runs(out, preset, gspo_dirty=None)
    _refuses(*_report(out, preset, list(range(6))), "record no clean gspo checkout")


def test_a_code_default_changed_after_the_declaration_is_caught(tmp_path):
    """The preset's lines say nothing of adam_beta2; runs whose gspo resolved it to 0.999 (a default
    changed after the declaration) are not bound, the field named; a preset that declares no resolved
    config is not bound either, and its message gives the hash `python -m gspo.study.binding` prints."""
    out, preset = _study(tmp_path)
    p = load_preset(str(preset))
    other = resolved_settings(p, make_config(None, {**p.config, "adam_beta2": 0.999}))
    assert resolved_sha256(other) != p.resolved_sha256
    record_runs(out, preset, resolved=other, resolved_sha256=resolved_sha256(other))
    text, pre = _report(out, preset, list(range(6)))
    _refuses(text, pre, "resolved the preset to another config than the declared resolved_sha256")
    assert "adam_beta2 0.999 -> 0.99" in pre["why_not"]

    out2, bare = _study(tmp_path / "b")
    bare.write_text(PRESET)  # the declaration without its resolved config, committed
    commit(bare.parent, bare, time.time() - 3600)
    record_runs(out2, bare)
    text, pre = _report(out2, bare, list(range(6)))
    _refuses(text, pre, "the preset does not declare its resolved config")
    assert f"resolved_sha256: {resolved_sha256(resolved_settings(load_preset(str(bare))))}" in pre["why_not"]


def test_the_resolution_holds_what_the_code_decides(tmp_path, capsys):
    """What the hash covers beyond the preset's lines: each arm's resolved loss parameters (GRPO's
    clip 0.2 / 0.27 and aggregation, GSPO's 3e-4 / 4e-4: defaults gspo picks per algorithm), the
    warm-start gate and
    the analysis criteria; steering settings (threads, progress, the run's name) do not enter, a
    changed lr does. The command prints the same hash."""
    from gspo.study.runner import _base_config

    path = tmp_path / "p.yaml"
    path.write_text(PRESET)
    p = load_preset(str(path))
    r = resolved_settings(p)
    grpo = dict(r["variants"]["grpo"]["update"]["loss_kwargs"])
    assert grpo == {"eps_low": 0.2, "eps_high": 0.27, "aggregation": "seq_mean_token_mean"}
    assert dict(r["variants"]["gspo"]["update"]["loss_kwargs"]) == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert r["warm_gate"]["check_every"] == 10 and r["criteria"]["acc_margin"] == 0.15
    steered = _base_config(p, None, {"threads": 1, "progress": False, "save_every": 7}, 2)
    assert resolved_sha256(resolved_settings(p, steered)) == resolved_sha256(
        resolved_settings(p, _base_config(p, None, {}, 1))
    )
    assert resolved_sha256(resolved_settings(p, _base_config(p, None, {"lr": 1e-4}, 2))) != resolved_sha256(r)
    # what the command prints is what a compare's runs record (studies run in reproducible mode)
    assert resolved_sha256(resolved_settings(p, _base_config(p, None, {}, 2))) == resolved_sha256(r)
    assert main([str(path)]) == 0 and capsys.readouterr().out.strip() == resolved_sha256(r)


def test_analysis_criteria_other_than_the_declared_ones_are_not_bound(tmp_path):
    out, preset = _study(tmp_path)
    _refuses(
        *_report(out, preset, list(range(6)), criteria=Criteria(acc_margin=0.3)),
        "the analysis criteria (collapse and spike rules) are not the declared ones",
    )


def test_a_subset_with_an_arm_without_runs_names_the_arm(tmp_path):
    """Seeds 0-1 analysed of the declared 0-5 while a secondary endpoint's arm (sapo) has no run: the
    message names the arm and the seeds no arm ran (2-5), never a seed that did run ("missing 0")."""
    out, preset = _study(tmp_path, SAPO)
    text, pre = _report(out, preset, [0, 1], ("gspo", "grpo", "sapo"))
    why = pre["why_not"]
    _refuses(text, pre, "no runs of sapo")
    assert "missing 2, 3, 4 ..." in why and "missing 0" not in why and "missing 1" not in why, why
    _runs(out, {"sapo": [0.6] * 5})  # seeds 0-4: sapo alone lacks 5
    record_runs(out, preset)
    why = _report(out, preset, list(range(6)), ("gspo", "grpo", "sapo"))[1]["why_not"]
    assert "missing 5 of sapo" in why and "no runs" not in why, why
