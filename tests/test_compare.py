"""`gspo compare`: variants from one warm start per seed, run side by side; the report's CI tables."""

import csv
import json
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.compare import run_compare, write_study
from gspo.errors import GspoError
from gspo.train.logger import read_metrics

VARIANTS = ["gspo", "gspo_token", "grpo", "grpo_replay"]
TINY = dict(
    steps=3,
    sft_steps=3,
    eval_size=8,
    prompts_per_step=4,
    group_size=4,
    max_new_tokens=8,
    eval_every=1,
    threads=1,
    progress=False,
)


def test_compare_two_seeds_two_workers_writes_ci_report(tmp_path):
    """2 seeds x 4 variants in 2 worker processes: every run starts from its seed's warm start, and
    report.md holds the per-variant CI table, the paired differences and the claims with verdicts."""
    warm_dir = str(tmp_path / "warm")
    report = run_compare(None, TINY, [0, 1], VARIANTS, str(tmp_path), workers=2, warm_dir=warm_dir)
    text = report.read_text()
    folders = json.loads((tmp_path / "warm_starts.json").read_text())
    for s in (0, 1):
        assert folders[str(s)].startswith(warm_dir) and (Path(folders[str(s)]) / "config.json").exists()
        rows = {v: read_metrics(tmp_path / f"{v}-s{s}" / "metrics.jsonl") for v in VARIANTS}
        for v, r in rows.items():
            assert [x["step"] for x in r] == [0, 1, 2, 3], v
            assert "moe/volatility" in r[1]
            assert not (tmp_path / f"{v}-s{s}" / "checkpoints").exists()  # finished: only final/ kept
        # one warm start per seed, shared: identical initial accuracy across variants
        assert len({r[0]["eval/accuracy"] for r in rows.values()}) == 1
    assert "## Per variant: mean [95% CI over seeds, Student t]" in text
    for v in VARIANTS:
        assert f"| {v} | 2 | " in text  # n = 2 seeds, with intervals
    assert "| gspo - grpo | " in text and "| grpo_replay - grpo | " in text
    assert "## The paper's claims and this run" in text and "GRPO on MoE needs Routing Replay" in text
    verdicts = [ln.rsplit("|", 2)[-2].strip() for ln in text.splitlines() if ln.startswith("| GSPO trains")]
    assert verdicts and all(v in ("consistent", "inconsistent", "inconclusive") for v in verdicts)
    for png in ["reward.png", "accuracy.png", "clip_fraction.png", "volatility.png", "grad_norm.png"]:
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summary"]["gspo"]["acc_final"]["n"] == 2
    assert set(summary["per_seed"]["grpo"]) == {"0", "1"}
    with (tmp_path / "per_seed.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 8
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["workers"] == 2 and timing["wall_s"] > 0 and "gspo-s1" in timing["jobs_s"]

    # a second call reuses every finished run (nothing retrains) and rewrites the same report
    mtime = (tmp_path / "gspo-s0" / "metrics.jsonl").stat().st_mtime
    run_compare(None, TINY, [0, 1], VARIANTS, str(tmp_path), workers=1, warm_dir=warm_dir)
    assert (tmp_path / "gspo-s0" / "metrics.jsonl").stat().st_mtime == mtime

    # a field the saved config lacks (added by a newer gspo) counts as its default: still reused
    saved = tmp_path / "gspo-s0" / "config.yaml"
    saved.write_text(
        "\n".join(ln for ln in saved.read_text().splitlines() if not ln.startswith("log_volatility"))
    )
    run_compare(None, TINY, [0], ["gspo"], str(tmp_path), workers=1, warm_dir=warm_dir)
    assert (tmp_path / "gspo-s0" / "metrics.jsonl").stat().st_mtime == mtime
    # a finished run made with other settings is never silently replaced
    with pytest.raises(GspoError, match="finished run made with other settings"):
        run_compare(None, {**TINY, "lr": 1e-4}, [0], ["gspo"], str(tmp_path), workers=1, warm_dir=warm_dir)

    # the study report combines compare folders
    study = write_study([str(tmp_path)], tmp_path / "study")
    assert "| [custom]" in study.read_text() and (tmp_path / "study" / "regimes.png").exists()


def test_compare_cli_preset_and_errors(tmp_path, capsys):
    """The CLI takes a preset and one-line errors for bad input."""
    assert main(["compare", "--preset", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["compare", "--variants", "gspo,ppo", "--out", str(tmp_path)]) == 2
    assert "--variants: unknown ppo" in capsys.readouterr().err
    assert main(["compare", "--seeds", "0,x", "--out", str(tmp_path)]) == 2
    assert main(["compare", "--study", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "has no summary.json" in capsys.readouterr().err
