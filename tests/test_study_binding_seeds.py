"""A pre-registration that binds (issue 46 item 1, issue 49 item 2, issue 44 gap 5, issue 59 step 5):
the analysed seeds are the declared ones, no setting changed from the declaration, the declaring
commit precedes the *first* run's start (by the later of author and committer date) and is an
ancestor of the checkout each run ran from; one interim look only when declared with its
O'Brien-Fleming-type spending."""

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from study_binding_helpers import commit, declare, record_runs
from test_study_binding import PRESET, _refuses
from test_study_report import TINY, _runs

from gspo.config import Config
from gspo.errors import GspoError
from gspo.study import load_preset, write_report
from gspo.study.statistics import interim_levels, obrien_fleming_spent


def _study(tmp: Path, n: int, preset_text: str = PRESET) -> tuple[Path, Path]:
    out, repo = tmp / "out", tmp / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    _runs(out, {"gspo": [0.7 + 0.01 * s for s in range(n)], "grpo": [0.5 + 0.01 * s for s in range(n)]})
    preset = repo / "p.yaml"
    preset.write_text(preset_text)
    declare(preset)
    return out, preset


def _report(out: Path, preset: Path, seeds: list[int]) -> tuple[str, dict]:
    text = write_report(out, ["gspo", "grpo"], seeds, Config(**TINY), preset=load_preset(str(preset)))
    return text.read_text(), json.loads((out / "summary.json").read_text())["preregistration"]


def test_the_declaration_must_precede_the_first_run_not_the_last(tmp_path):
    """Runs started at different times; the declaration was committed between the first and the
    last: not pre-registered, naming the first run (comparing with the last run's start, the mutant
    of issue 44 gap 5, would call it pre-registered)."""
    out, preset = _study(tmp_path, 6)
    now = time.time()
    commit(preset.parent, preset, now - 3600)
    starts = {
        f"{v}-s{s}": now - (7200 if (v, s) == ("grpo", 2) else 60) for v in ("gspo", "grpo") for s in range(6)
    }
    record_runs(out, preset, started=starts)
    _refuses(*_report(out, preset, list(range(6))), "after run grpo-s2 started")
    record_runs(out, preset, started=now - 60)  # every run after the declaration: bound
    assert _report(out, preset, list(range(6)))[1]["preregistered"] is True


def test_the_analysed_seeds_must_be_the_declared_ones(tmp_path):
    """Declared seeds 0-5: analysed on 0-3 (fewer), 0-7 (more) or 0-3 and 6-7 (others): not
    pre-registered, no verdict, the report names the missing and undeclared seeds."""
    out, preset = _study(tmp_path, 8)
    commit(preset.parent, preset, time.time() - 3600)
    record_runs(out, preset)
    _refuses(*_report(out, preset, [0, 1, 2, 3]), "the analysed seeds are not the declared ones")
    assert "missing 4, 5" in _report(out, preset, [0, 1, 2, 3])[1]["why_not"]
    text, pre = _report(out, preset, list(range(8)))
    _refuses(text, pre, "not declared 6, 7")
    _refuses(*_report(out, preset, [0, 1, 2, 3, 6, 7]), "missing 4, 5; not declared 6, 7")
    assert _report(out, preset, list(range(6)))[1]["preregistered"] is True


def test_a_setting_changed_from_the_declaration_is_exploratory_and_named(tmp_path):
    """A run recording an override of the declaration (lr, steps) is exploratory, the report naming
    each; runs recording neither seeds nor settings (before this check) are not bound either."""
    out, preset = _study(tmp_path, 6)
    commit(preset.parent, preset, time.time() - 3600)
    over = {"lr": {"declared": 0.001, "used": 0.0003}, "steps": {"declared": 50, "used": 1}}
    record_runs(out, preset, overrides=over)
    text, pre = _report(out, preset, list(range(6)))
    _refuses(text, pre, "settings changed from the declaration")
    assert "lr 0.001 -> 0.0003" in pre["why_not"] and "steps 50 -> 1" in pre["why_not"]
    record_runs(out, preset, overrides=None)
    _refuses(*_report(out, preset, list(range(6))), "record neither their seeds nor their settings")


def test_compare_records_the_seeds_and_every_override(tmp_path):
    """What run_compare records: the declared and the run seeds, and each setting, variant list and
    warm target it runs otherwise than the preset declares (steering flags aside)."""
    from gspo.study.runner import _base_config, _changed

    p = load_preset("confirm-lr-1e-3")
    declared = _base_config(p, None, {}, 1)
    base = _base_config(p, None, {"lr": 3e-4, "steps": 1, "threads": 1, "progress": False}, 2)
    got = _changed(p, declared, base, ["gspo"], 0.5)
    assert got["lr"] == {"declared": p.config["lr"], "used": 3e-4} and got["steps"]["used"] == 1
    assert got["variants"]["used"] == ["gspo"] and got["warm_target"]["used"] == 0.5
    assert "threads" not in got and "progress" not in got
    assert _changed(p, declared, _base_config(p, None, {}, 2), p.variants, p.warm_target) == {}


def test_the_declaring_commit_must_be_an_ancestor_of_each_runs_checkout(tmp_path):
    """Runs that record a checkout whose history lacks the declaring commit (run from another branch
    or before the declaration was merged): not pre-registered, however early the commit's date."""
    out, preset = _study(tmp_path, 6)
    repo = preset.parent
    other = repo / "other.txt"
    other.write_text("x")
    commit(repo, other, time.time() - 7200)
    before = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    commit(repo, preset, time.time() - 3600)
    record_runs(out, preset, preset_repo_head=before)
    _refuses(*_report(out, preset, list(range(6))), "is not an ancestor of the commit runs")
    record_runs(out, preset)
    assert _report(out, preset, list(range(6)))[1]["preregistered"] is True


def test_the_later_of_author_and_committer_date_is_the_declarations(tmp_path):
    """Issue 59 step 5: either date can be set to any past time (``git commit --date``, an amend,
    GIT_COMMITTER_DATE), so the declaration is dated by the later one. Authored before the runs but
    committed after their start (a rebase, or a backdated author date): not pre-registered; committed
    before them with a backdated committer date but authored after: not either; both before: bound."""
    out, preset = _study(tmp_path, 6)
    now = time.time()
    commit(preset.parent, preset, now - 3600, committed=now + 3600)
    record_runs(out, preset, started=now)
    text, pre = _report(out, preset, list(range(6)))
    _refuses(text, pre, "the declaration was committed (")
    assert pre["commit_time"] == int(now + 3600)
    preset.write_text(preset.read_text() + "# again\n")
    commit(preset.parent, preset, now + 3600, committed=now - 3600)
    record_runs(out, preset, started=now)
    _refuses(*_report(out, preset, list(range(6))), "the declaration was committed (")
    preset.write_text(preset.read_text() + "# and again\n")
    commit(preset.parent, preset, now - 7200, committed=now - 3600)
    record_runs(out, preset, started=now)
    text, pre = _report(out, preset, list(range(6)))
    assert pre["preregistered"] is True and pre["commit_time"] == int(now - 3600), pre.get("why_not")


def _add_run(out: Path, variant: str, seed: int) -> None:
    """One more finished run, ``<variant>-s<seed>``, under ``out``."""
    _runs(out / "more", {variant: [0.7] * (seed + 1)})
    (out / "more" / f"{variant}-s{seed}").rename(out / f"{variant}-s{seed}")
    shutil.rmtree(out / "more")


def test_one_arm_on_undeclared_seeds_is_not_preregistered(tmp_path):
    """Issue 57 gap 8: GSPO ran the declared seeds 0-5 and an undeclared 6, GRPO only 0-5: the seeds
    both arms share are the declared ones, but what is analysed is not (seed 6 is named)."""
    out, preset = _study(tmp_path, 6)
    _add_run(out, "gspo", 6)
    commit(preset.parent, preset, time.time() - 3600)
    record_runs(out, preset)
    _refuses(*_report(out, preset, list(range(7))), "not declared 6")


SECONDARY = PRESET.replace("variants: [gspo, grpo]", "variants: [gspo, grpo, sapo]") + (
    "secondary:\n  - {metric: acc_final, contrast: sapo - grpo, direction: greater}\n"
)


def test_a_secondary_endpoints_arm_is_seed_checked_too(tmp_path):
    """Issue 57 gap 8: a secondary endpoint's arm (sapo) with a seed missing: not pre-registered, the
    seed named, though the primary endpoint's arms have every declared seed."""
    out, preset = _study(tmp_path, 6, SECONDARY)
    _runs(out, {"sapo": [0.6] * 5})  # seeds 0-4
    commit(preset.parent, preset, time.time() - 3600)
    record_runs(out, preset)
    text = write_report(
        out, ["gspo", "grpo", "sapo"], list(range(6)), Config(**TINY), preset=load_preset(str(preset))
    ).read_text()
    pre = json.loads((out / "summary.json").read_text())["preregistration"]
    _refuses(text, pre, "missing 5")
    _add_run(out, "sapo", 5)
    record_runs(out, preset)
    text = write_report(
        out, ["gspo", "grpo", "sapo"], list(range(6)), Config(**TINY), preset=load_preset(str(preset))
    ).read_text()
    assert json.loads((out / "summary.json").read_text())["preregistration"]["preregistered"] is True


def test_the_familys_own_alpha_is_the_level(tmp_path):
    """Issue 57 gap 8: a family declared at alpha 0.01: the final look's level is 0.01, and the six
    seeds' exact p = 2/64 = 0.031 (significant at 0.05) is inconclusive there."""
    out, preset = _study(tmp_path, 6, PRESET.replace("size: 1}", "size: 1, alpha: 0.01}"))
    commit(preset.parent, preset, time.time() - 3600)
    record_runs(out, preset)
    _, pre = _report(out, preset, list(range(6)))
    assert pre["preregistered"] is True and pre["level"] == pytest.approx(0.01)
    assert pre["results"][0]["p_adj"] == pytest.approx(2 / 64)
    assert pre["results"][0]["verdict"] == "inconclusive"


def test_a_declaration_committed_in_the_same_second_as_the_first_start_is_not_before_it(tmp_path):
    """Issue 57 gap 8: commit and first start in the same second (git keeps whole seconds): the
    declaration does not precede the runs; one second earlier it does."""
    out, preset = _study(tmp_path, 6)
    when = int(time.time()) - 3600
    commit(preset.parent, preset, when)
    record_runs(out, preset, started=float(when))
    _refuses(*_report(out, preset, list(range(6))), "the declaration was committed (")
    record_runs(out, preset, started=float(when + 1))
    assert _report(out, preset, list(range(6)))[1]["preregistered"] is True


def test_declared_at_compares_the_seeds_too(tmp_path):
    """Issue 57 gap 8: ``declared_at`` names the commit the declaration was made at; the report says
    whether the file there declares the same thing: not when only its seeds differ."""
    out, preset = _study(tmp_path, 6)
    repo = preset.parent
    preset.write_text(PRESET.replace("[0, 1, 2, 3, 4, 5]", "[0, 1, 2, 3, 4, 5, 6]"))
    commit(repo, preset, time.time() - 7200)
    first = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    preset.write_text(PRESET + f"declared_at: {first.stdout.strip()}\n")
    declare(preset)
    commit(repo, preset, time.time() - 3600)
    record_runs(out, preset)
    text, pre = _report(out, preset, list(range(6)))
    assert pre["preregistered"] is True, pre.get("why_not")
    assert "(same declaration there: False)" in text
    preset.write_text(PRESET + "# a comment\n")  # the same declaration, other bytes
    commit(repo, preset, time.time() - 7000)
    second = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    preset.write_text(PRESET + f"declared_at: {second.stdout.strip()}\n")
    declare(preset)
    commit(repo, preset, time.time() - 3600)
    record_runs(out, preset)
    assert "(same declaration there: True)" in _report(out, preset, list(range(6)))[0]


INTERIM = PRESET.replace("family:", "interim: {seeds: 3, spending: obrien-fleming}\nfamily:")


def test_one_declared_interim_look_with_its_spending_rule(tmp_path):
    """Declared before any run: an interim look after 3 of 6 seeds, O'Brien-Fleming-type spending.
    Seeds 0-2 are the interim look, read at its nominal level (0.0056: 3 seeds can never reach it, so
    inconclusive); seeds 0-5 the final look at 0.0478. Without the declaration seeds 0-2 are refused."""
    out, preset = _study(tmp_path, 6, INTERIM)
    commit(preset.parent, preset, time.time() - 3600)
    record_runs(out, preset)
    a1, a2 = interim_levels(0.05, 0.5)
    text, pre = _report(out, preset, [0, 1, 2])
    assert pre["preregistered"] is True and pre["look"] == "interim" and pre["level"] == pytest.approx(a1)
    assert "this is the **interim look**" in text and pre["results"][0]["verdict"] == "inconclusive"
    text, pre = _report(out, preset, list(range(6)))
    assert pre["look"] == "final" and pre["level"] == pytest.approx(a2)
    assert (
        pre["results"][0]["p_adj"] == pytest.approx(2 / 64) and pre["results"][0]["verdict"] == "consistent"
    )
    _refuses(*_report(out, preset, [0, 1, 2, 3]), "(interim look: the first 3); not declared 3")
    out2, plain = _study(tmp_path / "b", 6)
    commit(plain.parent, plain, time.time() - 3600)
    record_runs(out2, plain)
    _refuses(*_report(out2, plain, [0, 1, 2]), "missing 3, 4, 5")


@pytest.mark.parametrize(
    "interim",
    [
        "{seeds: 3}",
        "{seeds: 3, spending: pocock}",
        "{seeds: 6, spending: obrien-fleming}",
        "{seeds: 1, spending: obrien-fleming}",
    ],
)
def test_a_bad_interim_declaration_is_one_line(tmp_path, interim):
    path = tmp_path / "p.yaml"
    path.write_text(PRESET.replace("family:", f"interim: {interim}\nfamily:"))
    with pytest.raises(GspoError, match=r"p.yaml:\d+: 'interim' must be") as e:
        load_preset(str(path))
    assert "\n" not in str(e.value)


def test_obrien_fleming_spending_on_a_worked_example():
    """Two looks at information 0.5 and 1, two-sided alpha 0.05 (Lan & DeMets 1983, O'Brien-Fleming
    type): spent by 0.5 is 2 - 2 Phi(1.95996 / sqrt(0.5)) = 2 - 2 Phi(2.7718) = 0.005575; the final
    boundary is z = 1.9793 (nominal p 0.0478), and the design's total error is 0.05 (checked by
    simulating 2M pairs of look statistics with correlation sqrt(0.5))."""
    assert obrien_fleming_spent(0.05, 1.0) == pytest.approx(0.05)
    a1, a2 = interim_levels(0.05, 0.5)
    assert a1 == pytest.approx(0.0055746, abs=2e-7)
    assert stats.norm.isf(a1 / 2) == pytest.approx(1.959964 / 0.5**0.5, abs=1e-5)
    assert stats.norm.isf(a2 / 2) == pytest.approx(1.9793, abs=5e-4)
    rng = np.random.default_rng(0)
    z1 = rng.standard_normal(2_000_000)
    z2 = 0.5**0.5 * z1 + 0.5**0.5 * rng.standard_normal(z1.size)
    total = ((np.abs(z1) >= stats.norm.isf(a1 / 2)) | (np.abs(z2) >= stats.norm.isf(a2 / 2))).mean()
    assert total == pytest.approx(0.05, abs=0.0005)  # binomial sd 0.00015


@pytest.mark.slow
def test_compare_on_other_seeds_and_settings_than_declared_is_not_preregistered(tmp_path):
    """Issue 49 item 2 through the CLI: `gspo compare --preset confirm-lr-1e-3 --seeds 0 --lr 3e-4`
    (a shipped, committed preset): the runs record their seeds and overrides, and the report says
    "Not pre-registered", naming lr and the undeclared seed, with no verdict (~90 s on 2 busy cores)."""
    from cli_helpers import gspo

    out = tmp_path / "o"
    tiny = ["--sft-steps", "0", "--steps", "1", "--eval-size", "2", "--prompts-per-step", "2"]
    tiny += ["--group-size", "2", "--max-new-tokens", "8", "--no-progress", "--workers", "1"]
    r = gspo("compare", "--preset", "confirm-lr-1e-3", "--seeds", "0", "--variants", "gspo,grpo", "--lr", "3e-4",
             *tiny, "--out", str(out), timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rec = json.loads((out / "gspo-s0" / "declaration.json").read_text())
    assert rec["seeds"] == [0] and rec["declared_seeds"][0] == 100
    assert rec["overrides"]["lr"] == {"declared": 1e-3, "used": 3e-4}
    pre = json.loads((out / "summary.json").read_text())["preregistration"]
    assert pre["preregistered"] is False and "results" not in pre
    assert "lr 0.001 -> 0.0003" in pre["why_not"] and "not declared 0" in pre["why_not"]
    head = (out / "report.md").read_text().split("## Per variant")[0]
    assert "**Not pre-registered**" in head and "before every run started" not in head
