"""The report says "pre-registered" only for runs bound to a declaration committed before they started
(issue 36 item 2): every run records the preset's sha256, endpoints and family (gspo compare writes the
record before a run trains), and the commit that last changed the preset precedes every run's start."""

import json
import time
from pathlib import Path

from study_binding_helpers import commit, declare, record_runs
from test_study_report import TINY, _runs

from gspo.config import Config
from gspo.study import load_preset, write_report
from gspo.study.presets import RUN_RECORD

PRESET = (
    "seeds: [0, 1, 2, 3, 4, 5]\nvariants: [gspo, grpo]\n"
    "primary:\n  - {metric: acc_final, contrast: gspo - grpo, direction: greater}\n"
    "family: {name: fam, size: 1}\n"
)
VERDICTS = ("**consistent**", "**inconclusive**", "**inconsistent**", "pre-registered: **")


def _study(tmp: Path) -> tuple[Path, Path]:
    """Six seeds, every one favouring GSPO (a consistent verdict when bound); the preset in a git repo."""
    out, repo = tmp / "out", tmp / "repo"
    repo.mkdir()
    _runs(out, {"gspo": [0.7 + 0.01 * s for s in range(6)], "grpo": [0.5 + 0.01 * s for s in range(6)]})
    preset = repo / "p.yaml"
    preset.write_text(PRESET)
    declare(preset)
    return out, preset


def _report(out: Path, preset: Path) -> tuple[str, dict]:
    text = write_report(
        out, ["gspo", "grpo"], list(range(6)), Config(**TINY), preset=load_preset(str(preset))
    )
    return text.read_text(), json.loads((out / "summary.json").read_text())["preregistration"]


def _refuses(text: str, pre: dict, why: str) -> None:
    head = text.split("## Per variant")[0]
    assert "**Not pre-registered**" in head and why in head, head
    assert "Pre-registered: declared" not in text and "declared before the runs" not in text.lower()
    assert not any(v in text for v in VERDICTS)
    assert pre["preregistered"] is False and why in pre["why_not"]
    assert "results" not in pre and all(r["verdict"] is None for r in pre["results_exploratory"])


def test_matching_hash_and_earlier_commit_is_preregistered(tmp_path):
    out, preset = _study(tmp_path)
    commit(preset.parent, preset, time.time() - 3600)
    record_runs(out, preset)
    text, pre = _report(out, preset)
    assert "Pre-registered: declared in `p.yaml`" in text and "| **consistent** |" in text
    assert pre["preregistered"] is True and pre["results"][0]["verdict"] == "consistent"


def test_a_preset_edited_after_its_runs_is_not_preregistered(tmp_path):
    """The runs recorded the preset; it was then edited and committed, still before the runs' recorded
    start: only the hashes tell. First its seeds (the same endpoints), then its `primary` (the runs ran
    for a 0.1 margin, the preset now declares 0)."""
    out, preset = _study(tmp_path)
    record_runs(out, preset)
    preset.write_text(PRESET.replace("seeds: [0, 1, 2, 3, 4, 5]", "seeds: [0, 1, 2, 3, 4, 5, 6]"))
    commit(preset.parent, preset, time.time() - 3600)
    _refuses(*_report(out, preset), "the preset changed after the runs: hashes differ")
    preset.write_text(PRESET.replace("direction: greater}", "direction: greater, margin: 0.1}"))
    record_runs(out, preset)
    preset.write_text(PRESET)
    commit(preset.parent, preset, time.time() - 1800)
    _refuses(*_report(out, preset), "the preset changed after the runs: hashes differ")


def test_a_declaration_committed_after_the_runs_started_is_not_preregistered(tmp_path):
    out, preset = _study(tmp_path)
    commit(preset.parent, preset, time.time())
    record_runs(out, preset, started=time.time() - 3600)
    _refuses(*_report(out, preset), "the declaration was committed (")


def test_runs_without_a_record_or_an_uncommitted_preset_are_not_preregistered(tmp_path):
    out, preset = _study(tmp_path)
    commit(preset.parent, preset, time.time() - 3600)
    _refuses(*_report(out, preset), "runs do not record their declaration")
    record_runs(out, preset)
    (out / "grpo-s3" / RUN_RECORD).write_text("[not a record")
    _refuses(*_report(out, preset), "grpo-s3 have no")
    record_runs(out, preset)
    preset.write_text(preset.read_text() + "# a comment, not committed\n")
    record_runs(out, preset)  # the runs even record the uncommitted bytes
    _refuses(*_report(out, preset), "uncommitted changes")


def test_compare_records_the_declaration_before_a_run_trains(tmp_path):
    """The runner's preparation of a run folder (no training): the record names the preset's sha256,
    endpoints, family, declaring commit, gspo's commit and the start time; a resumed run keeps its
    first record; a folder holding only a record counts as empty."""
    import dataclasses
    import hashlib

    from gspo.study.binding import run_record
    from gspo.study.runner import Jobs, plan_run

    repo = tmp_path / "repo"
    repo.mkdir()
    preset = repo / "p.yaml"
    preset.write_text(PRESET)
    commit(repo, preset, time.time() - 3600)
    p = load_preset(str(preset))
    base = Config(**{**TINY, "sft_steps": 0})
    out = tmp_path / "out"
    jobs = Jobs(base, [0], ["gspo", "grpo"], out, None, tmp_path / "warm", record=run_record(p))
    t0 = time.time()
    todo = jobs.warm_done(0, None, 0.0)
    assert [c.run_name for c in todo] == ["gspo-s0", "grpo-s0"]
    rec = json.loads((out / "gspo-s0" / RUN_RECORD).read_text())
    assert rec["preset_sha256"] == hashlib.sha256(preset.read_bytes()).hexdigest()
    assert rec["primary"] == [
        {"metric": "acc_final", "a": "gspo", "b": "grpo", "direction": "greater", "margin": 0.0}
    ]
    assert rec["family"]["name"] == "fam" and rec["run"] == "gspo-s0"
    assert len(rec["declaring_commit"]) == 40 and rec["preset_committed"] is True
    assert rec["gspo_dirty"] in (True, False, None) and "gspo_commit" in rec
    assert t0 <= rec["started_at"] <= time.time()
    assert plan_run(todo[0]) == todo[0]  # only the record there: starts as in an empty folder
    from gspo.study.runner import prepare_run

    prepare_run(dataclasses.replace(todo[0], resume=True), {"preset_sha256": "other"})
    assert json.loads((out / "gspo-s0" / RUN_RECORD).read_text()) == rec  # a resume keeps the first start
