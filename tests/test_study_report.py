"""Reports on constructed runs: the study adjusts a declared family over all its folders, and shows
the per-token and per-sequence ratio spreads the training loop logged."""

import json
from pathlib import Path

import pytest
from study_binding_helpers import bind

from gspo.config import Config
from gspo.study import load_preset, write_report, write_study

TINY = dict(steps=3, sft_steps=3, eval_size=8, prompts_per_step=4, group_size=4, max_new_tokens=8)


def _runs(out: Path, finals: dict[str, list[float]], gspo_token_ratios: bool = False) -> None:
    """Finished runs: held-out accuracy 0.3 -> ``final`` over 4 evals; importance ratios per step."""
    for v, per_seed in finals.items():
        for s, final in enumerate(per_seed):
            run = out / f"{v}-s{s}"
            run.mkdir(parents=True)
            rows = [{"step": k, "eval/accuracy": 0.3 + (final - 0.3) * k / 4} for k in range(5)]
            for r in rows[1:]:
                r |= {"rollout/reward_mean": 0.5, "loss/grad_norm": 1.0, "loss/ratio_max": 1.5}
                r |= {"loss/ratio_min": 0.5, "loss/clip_frac_tok": 0.1, "loss/clip_frac_seq": 0.2}
                if v.startswith("grpo"):  # a token-ratio loss also logs the sequence ratios s_i
                    r |= {"loss/seq_ratio_max": 1.1, "loss/seq_ratio_min": 1.0}
                elif gspo_token_ratios:  # GSPO logs the token ratios it does not use
                    r |= {"loss/tok_ratio_max": 2.0, "loss/tok_ratio_min": 0.25}
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _preset(tmp: Path, name: str) -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(
        "description: d\nruntime: r\nseeds: [0, 1, 2, 3, 4, 5]\nvariants: [gspo, grpo]\n"
        "primary:\n  - {metric: acc_final, contrast: gspo - grpo, direction: greater}\n"
        "family: {name: fam, size: 3}\n"
    )
    return str(path)


def test_study_adjusts_a_family_over_every_folder(tmp_path):
    """Two folders each declare one endpoint of a family of 3. Every seed favours GSPO in both, so
    each raw sign-flip p is 2/64; in its own report each is adjusted as if the other two were p = 1
    (x3), and the study adjusts them together (x3, then x2 -> max): both 0.094, inconclusive."""
    seeds = range(6)
    dirs = []
    for k, gap in enumerate([0.2, 0.1]):
        d = tmp_path / f"r{k}"
        _runs(d, {"gspo": [0.5 + gap + 0.01 * s for s in seeds], "grpo": [0.5 + 0.01 * s for s in seeds]})
        path = Path(_preset(tmp_path, f"r{k}"))
        bind(d, path)  # committed before the runs, which record it
        preset = load_preset(str(path))
        text = write_report(d, ["gspo", "grpo"], list(seeds), Config(**TINY), preset=preset).read_text()
        assert "| acc_final: gspo - grpo > 0 | 6 |" in text and "0.094 | **inconclusive** |" in text
        dirs.append(str(d))
    study = write_study(dirs, tmp_path / "study").read_text()
    assert "Family `fam`: 3 hypotheses (2 measured here" in study
    rows = [ln for ln in study.splitlines() if "| acc_final: gspo - grpo > 0 |" in ln]
    assert len(rows) == 2 and all("| 0.031 | 0.094 | **inconclusive** |" in r for r in rows), rows
    fams = json.loads((tmp_path / "study" / "study.json").read_text())["families"]
    assert [e["p_adj_study"] for e in fams["fam"]["endpoints"]] == pytest.approx([3 * 2 / 64, 3 * 2 / 64])
    after = study.split("## Regimes")[1]
    assert "raw (unadjusted)" in after and not any(
        f"**{v}**" in after for v in ("consistent", "inconclusive")
    )


def test_report_shows_token_and_sequence_ratio_spreads(tmp_path):
    import math

    _runs(tmp_path, {"gspo": [0.6, 0.6], "grpo": [0.5, 0.5]})
    write_report(tmp_path, ["gspo", "grpo"], [0, 1], Config(**TINY))
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    # GSPO's own ratio is s_i (no token ratios logged); GRPO's is per token, with s_i logged beside it
    assert summary["gspo"]["tok_ratio_spread"]["mean"] is None
    assert summary["gspo"]["seq_ratio_spread"]["mean"] == pytest.approx(math.log(3))
    assert summary["grpo"]["tok_ratio_spread"]["mean"] == pytest.approx(math.log(3))
    assert summary["grpo"]["seq_ratio_spread"]["mean"] == pytest.approx(math.log(1.1))
    assert summary["grpo"]["clip_seq"]["mean"] == pytest.approx(0.2)
    text = (tmp_path / "report.md").read_text()
    assert "## Importance ratios, clipping and routing per variant" in text
    _runs(tmp_path / "new", {"gspo": [0.6, 0.6], "grpo": [0.5, 0.5]}, gspo_token_ratios=True)
    write_report(tmp_path / "new", ["gspo", "grpo"], [0, 1], Config(**TINY))
    summary = json.loads((tmp_path / "new" / "summary.json").read_text())["summary"]
    assert summary["gspo"]["tok_ratio_spread"]["mean"] == pytest.approx(math.log(8))
    assert summary["gspo"]["seq_ratio_spread"]["mean"] == pytest.approx(math.log(3))


def test_study_volatility_interval_clusters_the_variants_of_a_seed():
    """Variants of one seed share its warm start and prompts: the interval is over per-seed means
    (3 seeds), not over the 6 runs as if independent."""
    from gspo.study.metrics import seed_means

    r = {"per_seed": {"gspo": {0: {"volatility": 0.1}, 1: {"volatility": 0.2}, 2: {"volatility": 0.3}},
                      "grpo": {0: {"volatility": 0.3}, 1: {"volatility": None}, 2: {"volatility": 0.5}}}}  # fmt: skip
    assert seed_means(r["per_seed"], "volatility") == pytest.approx([0.2, 0.2, 0.4])


def test_a_claim_inherits_a_verdict_only_from_the_same_hypothesis():
    """The declared endpoint is GSPO - GRPO+replay final accuracy > 0. The claims table's
    non-inferiority row (same arms, margin -0.02) and a claim with the arms reversed test other
    hypotheses: they stay exploratory (the old match on metric and arms gave both the declared verdict)."""
    from gspo.study.report import claim_status
    from gspo.study.statistics import adjust_family, compare_paired

    a = {s: 0.6 + 0.01 * s for s in range(6)}
    b = {s: 0.5 for s in range(6)}
    declared = compare_paired("acc_final", "gspo", "grpo_replay", a, b, 0.0)
    declared.direction, declared.test = "greater", "permutation"
    adjust_family([declared], 1)
    assert declared.verdict == "consistent"
    same = compare_paired("acc_final", "gspo", "grpo_replay", a, b, 0.0)
    assert "pre-registered: **consistent**" in claim_status(same, [declared])
    non_inferiority = compare_paired("acc_final", "gspo", "grpo_replay", a, b, -0.02)
    assert claim_status(non_inferiority, [declared]).startswith("exploratory")
    reversed_arms = compare_paired("acc_final", "grpo_replay", "gspo", b, a, 0.0)
    assert claim_status(reversed_arms, [declared]).startswith("exploratory")
    assert claim_status(same, [declared], direction=None).startswith("exploratory")  # an equivalence claim


def test_report_volatility_interval_clusters_the_variants_of_a_seed():
    """The per-preset report's volatility row: the interval over per-seed means, as the study's
    (it treated all 5 runs as independent)."""
    from gspo.study.report import claims
    from gspo.study.statistics import interval

    per = {"gspo": {0: {"volatility": 0.1}, 1: {"volatility": 0.2}, 2: {"volatility": 0.3}},
           "grpo": {0: {"volatility": 0.3}, 2: {"volatility": 0.5}}}  # fmt: skip
    row = next(r for r in claims(per, "t", []) if r[0].startswith("About 10%"))
    assert interval([0.2, 0.2, 0.4]).fmt(pct=True) in row[1] and "3 per-seed means" in row[1]
    assert "was not logged" in row[1]
    per["gspo"][0]["volatility_experts"] = 0.05
    per["grpo"][0]["volatility_experts"] = 0.15
    row = next(r for r in claims(per, "t", []) if r[0].startswith("About 10%"))
    assert f"{interval([0.1]).fmt(pct=True)} of the activated experts change" in row[1]


def test_a_preset_report_adjusts_over_the_declared_family_never_what_is_on_disk(tmp_path):
    """r0 (every seed favours GSPO: sign-flip p 2/64) and r1 (one seed ties: p 4/64) each declare one
    endpoint of a family of 3. r1's report, written beside r0's, adjusts over the declared family: its
    other 2 endpoints count as p = 1 (3 x 4/64 = 0.1875), whatever sibling folders are on disk (the old
    family-as-run read r0's folder and gave max(3 x 2/64, 2 x 4/64) = 0.125, and another number
    without it: not reproducible, issue 46 item 1). The combined study adjusts over both folders."""
    seeds = list(range(6))
    texts = []
    for k, gaps in enumerate([[0.1] * 6, [0.1] * 5 + [0.0]]):
        d = tmp_path / f"r{k}"
        _runs(d, {"gspo": [0.5 + g for g in gaps], "grpo": [0.5] * 6})
        path = Path(_preset(tmp_path, f"r{k}"))
        bind(d, path)
        preset = load_preset(str(path))
        texts.append(write_report(d, ["gspo", "grpo"], seeds, Config(**TINY), preset=preset).read_text())
    pre = json.loads((tmp_path / "r1" / "summary.json").read_text())["preregistration"]
    assert pre["results"][0]["p_perm"] == pytest.approx(4 / 64)
    assert pre["results"][0]["p_adj"] == pytest.approx(3 * 4 / 64)
    assert "family_as_run" not in pre
    assert (
        "Holm over the declared family: this preset's 1 endpoint(s); the family's 2 others count as p = 1"
        in texts[1]
    )
    import shutil

    shutil.rmtree(tmp_path / "r0")  # the sibling gone: r1's report is the same
    again = write_report(
        tmp_path / "r1",
        ["gspo", "grpo"],
        seeds,
        Config(**TINY),
        preset=load_preset(str(tmp_path / "r1.yaml")),
    )
    assert (
        json.loads((tmp_path / "r1" / "summary.json").read_text())["preregistration"]["results"]
        == pre["results"]
    )
    assert again.read_text().split("Wall time")[1] == texts[1].split("Wall time")[1]
