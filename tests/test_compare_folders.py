"""`gspo compare`'s folders (issue 49 items 1, 3, 7, 8): a user's report files are never overwritten,
a run whose final/ lacks its weights is not reused as finished, an empty preset and a locked run folder
are one line naming the right option."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line
from safetensors.torch import save_file
from test_study_report import TINY, _runs

from gspo.cli import main
from gspo.config import Config, make_config, save_yaml
from gspo.errors import GspoError
from gspo.study import write_report
from gspo.study.folders import claim_folder
from gspo.study.runner import plan_run
from gspo.training.checkpoint_files import final_complete

FAST = ["--seeds", "0", "--variants", "gspo,grpo", "--workers", "1", "--sft-steps", "0", "--steps", "1"]
FAST += ["--model", "embedded:tiny-moe", "--eval-size", "2", "--no-progress"]


def _md5s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _one_line(r) -> str:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, err)
    assert err.startswith("gspo: error:") and "\n" not in err and "Traceback" not in err, err
    return err


def test_compare_and_study_never_overwrite_a_users_report_files(tmp_path, capsys):
    """A folder holding a user's report.md, summary.json and per_seed.csv (not a compare's): compare
    --out it is refused in one line before any run, every byte kept (md5 before and after); the same
    for --study over a user's study.json. A folder the comparison wrote (its marker, or from before
    the marker its own summary.json) is written again. (In-process: the command's own code path, no
    interpreter start per call; a subprocess's one-line refusals are tested in test_reliability.)"""
    mine = tmp_path / "D"
    mine.mkdir()
    for name in ("report.md", "summary.json", "per_seed.csv"):
        (mine / name).write_text(f"mine: {name}\n")
    before = _md5s(mine)
    err = one_line(capsys, ["compare", *FAST, "--out", str(mine)], "did not write")
    assert str(mine) in err and "report.md" in err and err.startswith("gspo: error:")
    assert _md5s(mine) == before and sorted(p.name for p in mine.iterdir()) == sorted(before)

    ran = tmp_path / "ran"  # a compare's folder, as write_report leaves it (the summary the study reads)
    _runs(ran, {"gspo": [0.6, 0.7], "grpo": [0.5, 0.5]})
    write_report(ran, ["gspo", "grpo"], [0, 1], Config(**TINY))
    study = tmp_path / "S"
    study.mkdir()
    (study / "study.json").write_text('{"my": "data"}')
    before = _md5s(study)
    err = one_line(capsys, ["compare", "--study", str(ran), "--out", str(study)], "did not write")
    assert "study.json" in err and _md5s(study) == before

    fresh = tmp_path / "fresh"
    assert main(["compare", "--study", str(ran), "--out", str(fresh)]) == 0, capsys.readouterr().err
    assert main(["compare", "--study", str(ran), "--out", str(fresh)]) == 0  # its own: again
    assert (fresh / "study.json").exists() and (fresh / ".gspo-study").is_file()
    claim_folder(ran, "compare")  # from before the marker: its own summary.json says so
    assert (ran / ".gspo-compare").is_file()


def test_a_run_whose_final_folder_lacks_its_weights_is_not_reused(tmp_path):
    """final/ with config.json only (a save stopped by a full disk): the run is not finished, so the
    comparison does not say "done already" (it starts it over: no checkpoint); with model.safetensors,
    or an index whose every shard is there, it is reused."""
    values = dict(name="gspo-s0", output_dir=str(tmp_path), seed=0, algo="gspo", routing_replay=False)
    cfg = make_config(None, {**values, "sft_steps": 0})
    run, final = cfg.run_dir, cfg.run_dir / "final"
    final.mkdir(parents=True)
    save_yaml(cfg, run / "config.yaml")
    (final / "config.json").write_text("{}")
    assert not final_complete(run)
    assert plan_run(cfg) is not None and plan_run(cfg).overwrite
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (final / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"a": torch.ones(3)}, final / "model-00001-of-00002.safetensors")
    assert not final_complete(run) and plan_run(cfg) is not None  # a shard missing
    save_file({"b": torch.ones(3)}, final / "model-00002-of-00002.safetensors")
    assert final_complete(run) and plan_run(cfg) is None
    for f in final.glob("model*"):
        f.unlink()
    save_file({"a": torch.ones(3)}, final / "model.safetensors")
    assert final_complete(run) and plan_run(cfg) is None
    # cut short (a copy or a disk that lost its tail): refused in one line, or with overwrite redone
    whole = (final / "model.safetensors").read_bytes()
    (final / "model.safetensors").write_bytes(whole[:-4])
    with pytest.raises(
        GspoError, match=r"is a finished run whose final model is damaged \(model.safetensors: "
    ):
        plan_run(cfg)
    assert plan_run(cfg, overwrite=True).overwrite


def test_empty_preset_and_a_locked_run_folder_are_one_line(tmp_path, capsys):
    """An empty preset file (or comments only) is refused, not run as the defaults; a run folder
    another gspo holds is refused naming compare's own option (--out), not train's --name."""
    from gspo.training.checkpoint_files import lock_run_dir

    for text in ("", "# nothing yet\n", "{}\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        rc = main(["compare", "--preset", str(empty), "--out", str(tmp_path / "o"), *FAST])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err and str(empty) in err and "preset file is empty" in err, err
    assert not (tmp_path / "o").exists()
    out = tmp_path / "out"
    (out / "gspo-s0").mkdir(parents=True)
    held = lock_run_dir(out / "gspo-s0")  # another gspo's run in this folder
    try:
        rc = main(["compare", "--out", str(out), *FAST[:2], "--variants", "gspo", *FAST[4:]])
    finally:
        held.release()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "in use by another gspo process" in err, err
    assert "pass another --out" in err and "--name" not in err


def test_a_dangling_report_symlink_is_refused_not_written_through(tmp_path, capsys):
    """Issue 57 gap 9: ``--out`` holding a ``report.md`` symlink to a file that does not exist (yet):
    refused in one line before any run like any report file compare did not write; nothing is created
    where the link points, outside ``--out``."""
    out, outside = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    outside.mkdir()
    (out / "report.md").symlink_to(outside / "report.md")
    with pytest.raises(GspoError, match="holds report.md"):
        claim_folder(out, "compare")
    rc = main(["compare", *FAST, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "report.md" in err and "did not write" in err, err
    assert list(outside.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["report.md"]


def test_a_users_summary_with_one_of_compares_keys_is_not_taken_for_compares(tmp_path, capsys):
    """Issue 57 gap 9: a folder from before the marker is recognised by a summary.json holding every
    key of compare's; a user's summary.json with only one of them (``per_seed``) is the user's: their
    report.md is refused, byte for byte kept, no marker written."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"per_seed": [1, 2], "mine": True}))
    (out / "report.md").write_text("my report\n")
    before = _md5s(out)
    with pytest.raises(GspoError, match="holds report.md, summary.json"):
        claim_folder(out, "compare")
    rc = main(["compare", *FAST, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "report.md" in err and "did not write" in err, err
    assert _md5s(out) == before and not (out / ".gspo-compare").exists()
