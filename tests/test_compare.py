"""`gspo compare`: variants from one warm start per seed, run side by side; the report's CI tables."""

import csv
import json
from pathlib import Path

import pytest
from study_binding_helpers import bind

from gspo.cli import main
from gspo.compare import run_compare, write_study
from gspo.errors import GspoError
from gspo.training.logger import read_metrics

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


@pytest.mark.slow  # the slow tier (an end-to-end run of ~20 s here): CI runs it
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
    assert "## Per variant: mean [raw 95% CI over seeds, Student t]" in text
    assert "## Pre-registration" in text and "every result below is exploratory" in text
    for v in VARIANTS:
        assert f"| {v} | 2 | " in text  # n = 2 seeds, with intervals
    assert "| gspo - grpo | " in text and "| grpo_replay - grpo | " in text
    assert "## The paper's claims and this run" in text and "GRPO on MoE needs Routing Replay" in text
    # two seeds of a 3-step run imply no verdict: which verdict the data implies is pinned on
    # constructed runs in test_report_verdict_follows_the_data
    assert (
        sum(
            ln.startswith(("| GSPO ends with", "| GSPO's held-out accuracy curve"))
            for ln in text.splitlines()
        )
        == 2
    )
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


def _write_runs(out: Path, finals: dict[str, list[float]]) -> None:
    """Metrics of finished runs, one per variant and seed: held-out accuracy 0.3 at the shared warm
    start, then 0.3 -> ``final`` over 4 evals (so the final accuracy, AUC and drawdown are known)."""
    for v, per_seed in finals.items():
        for s, final in enumerate(per_seed):
            run = out / f"{v}-s{s}"
            run.mkdir(parents=True)
            rows = [{"step": k, "eval/accuracy": 0.3 + (final - 0.3) * k / 4} for k in range(5)]
            for r in rows[1:]:
                r |= {"rollout/reward_mean": 0.5, "loss/grad_norm": 1.0, "loss/ratio_max": 1.0}
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


PRESET = """
description: constructed runs
runtime: none
seeds: [0, 1, 2, 3, 4, 5, 6, 7]
variants: [gspo, grpo]
primary:
  - {metric: acc_final, contrast: gspo - grpo, direction: greater}
family: {name: test, size: 1}
"""


@pytest.mark.parametrize(
    ("gspo_minus_grpo", "verdict"), [(0.2, "consistent"), (-0.2, "inconsistent"), (0.0, "inconclusive")]
)
def test_report_verdict_follows_the_data(tmp_path, gspo_minus_grpo, verdict):
    """Eight seeds whose GSPO - GRPO final accuracy is +0.2 (+-0.01), -0.2 or 0 (+-0.01): the declared
    endpoint "GSPO - GRPO final accuracy > 0" gets the verdict the numbers imply (exact sign-flip p
    2/256 when every seed agrees), and the same claim undeclared gets none."""
    from gspo.compare import load_preset, write_report
    from gspo.config import Config

    jitter = [0.01, -0.01, 0.0, 0.005, -0.005, 0.002, -0.002, 0.004]
    grpo = [0.5 + j for j in jitter]
    gspo = [0.5 + gspo_minus_grpo + j * (1 if gspo_minus_grpo else -1) for j in jitter]
    _write_runs(tmp_path, {"gspo": gspo, "grpo": grpo})
    (tmp_path / "p.yaml").write_text(PRESET)
    bind(tmp_path, tmp_path / "p.yaml")  # committed before the runs, which record it: pre-registered
    preset = load_preset(str(tmp_path / "p.yaml"))
    text = write_report(tmp_path, ["gspo", "grpo"], list(range(8)), Config(**TINY), preset=preset).read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| acc_final: gspo - grpo > 0 |"))
    assert row.rsplit("|", 2)[-2].strip() == f"**{verdict}**", row
    claim = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("| GSPO ends with higher held-out accuracy than GRPO (final")
    )
    assert f"pre-registered: **{verdict}**" in claim, claim
    # undeclared (no preset): the same numbers are exploratory, with no verdict anywhere
    text = write_report(tmp_path, ["gspo", "grpo"], list(range(8)), Config(**TINY)).read_text()
    claim = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("| GSPO ends with higher held-out accuracy than GRPO (final")
    )
    assert "exploratory: no verdict" in claim and verdict not in claim.split("|")[-2]
