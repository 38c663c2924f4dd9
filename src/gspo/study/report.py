"""The report of one compare folder: ``report.md``, ``summary.json`` and ``per_seed.csv``.

The report opens with the preset's pre-registration (its primary endpoints, family and the commit
they were declared at) and their verdicts, read from Holm-adjusted p-values. Every other number
(per-variant means, paired differences, the paper's claims) is exploratory: raw (unadjusted)
intervals and p-values, no verdict.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from gspo.config import Config
from gspo.repro import describe, read_environment
from gspo.resolve import pi_old_source
from gspo.study.binding import declaration
from gspo.study.endpoints import (
    PerSeed,
    column,
    endpoint_comparison,
    secondary,
    secondary_data,
    secondary_lines,
)
from gspo.study.metrics import (
    PAIR_KEYS,
    PAIRS,
    PAPER_VOLATILITY,
    RATIO_KEYS,
    SUMMARY_KEYS,
    Criteria,
    run_stats,
    seed_means,
)
from gspo.study.plots import band_plots, curves
from gspo.study.presets import RUN_RECORD, WARM_CHECK_EVERY, WARM_CHECK_PROMPTS, Preset
from gspo.study.statistics import (
    EXACT_MAX_N,
    MC_FLIPS,
    Comparison,
    adjust_family,
    compare_paired,
    fmt_p,
    interval,
    sign_flip_is_exact,
)
from gspo.training.logger import read_metrics

CI_NAMES = {"t": "Student t", "bootstrap": "percentile bootstrap"}


def collect(out: Path, variants: list[str], seeds: list[int], crit: Criteria) -> PerSeed:
    """variant -> seed -> run_stats, for the runs that have metrics."""
    per: PerSeed = {}
    for v in variants:
        for s in seeds:
            path = out / f"{v}-s{s}" / "metrics.jsonl"
            if path.exists():
                per.setdefault(v, {})[s] = run_stats(read_metrics(path), crit)
    return per


def run_records(out: Path, per: PerSeed) -> dict[str, Any]:
    """Run name -> its :data:`RUN_RECORD` (what gspo compare ran it for), None where it has none or
    it is not a JSON mapping (a run from before the record, or not started by gspo compare)."""
    recs: dict[str, Any] = {}
    for v in per:
        for s in per[v]:
            path = out / f"{v}-s{s}" / RUN_RECORD
            try:
                rec = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                rec = None
            recs[f"{v}-s{s}"] = rec if isinstance(rec, dict) else None
    return recs


def confirmatory(per: PerSeed, preset: Preset, level: float | None = None) -> list[Comparison]:
    """The preset's declared endpoints, tested and Holm-adjusted over its declared family (the
    family's endpoints not run here count as p = 1: what sibling folders hold on disk never enters);
    verdicts at ``level`` (the look's nominal level; default the family's alpha)."""
    if not preset.primary or preset.family is None:
        return []
    comps = [endpoint_comparison(per, e, preset.family.test) for e in preset.primary]
    adjust_family(comps, preset.family.size, preset.family.alpha if level is None else level)
    return comps


def analysed_seeds(per: PerSeed, preset: Preset) -> dict[str, list[int]]:
    """variant -> the seeds it has runs of, for every arm of the declared endpoints."""
    arms = {x for e in preset.primary + preset.secondary for x in e.arms}
    return {v: sorted(per.get(v, {})) for v in sorted(arms)}


def exploratory(per: PerSeed, pairs: list[tuple[str, str]]) -> dict[tuple[str, str, str], Comparison]:
    """Every (pair, metric) of ``pairs`` x :data:`PAIR_KEYS`, raw."""
    return {
        (a, b, key): compare_paired(key, a, b, column(per, a, key), column(per, b, key))
        for a, b in pairs
        if a in per and b in per
        for key, _ in PAIR_KEYS
    }


def _declared(confirm: list[Comparison], c: Comparison, direction: str | None) -> Comparison | None:
    """The declared endpoint that *is* claim ``c``: same metric, same arms in the same order, same
    margin and direction. Reversed arms or another margin test another hypothesis (a non-inferiority
    row must not inherit a superiority verdict, nor a reversed claim a verdict of the wrong sign)."""
    key = (c.metric, c.a, c.b, c.margin, direction)
    return next((d for d in confirm if (d.metric, d.a, d.b, d.margin, d.direction) == key), None)


def claim_status(
    c: Comparison, confirm: list[Comparison], direction: str | None = "greater", second: tuple[int, ...] = ()
) -> str:
    """A claim's last column: the pre-registered verdict when the claim is a declared endpoint (its
    family named when it is a secondary one: ``second`` holds their ids), otherwise the raw p and no
    verdict."""
    d = _declared(confirm, c, direction)
    if d is not None:
        which = "pre-registered secondary" if id(d) in second else "pre-registered"
        return f"{which}: **{d.verdict}** (Holm p = {fmt_p(d.p_adj)} over its family)"
    return f"exploratory: no verdict (raw p_perm = {fmt_p(c.p_perm)}, p_t = {fmt_p(c.p_t)})"


def _seeds_txt(c: Comparison) -> str:
    return f"; {c.n_pos} of {c.interval.n} seeds >0, {c.n_neg} <0"


# the paper's claims (arXiv 2507.18071) as paired comparisons: (claim, a, b, metric, margin, reading)
CLAIMS = [
    ("GSPO ends with higher held-out accuracy than GRPO (final)", "gspo", "grpo", "acc_final", 0.0, "a - b > 0"),
    ("GSPO's held-out accuracy curve lies above GRPO's (AUC)", "gspo", "grpo", "acc_auc", 0.0, "a - b > 0"),
    ("GRPO is less stable than GSPO (falls further from its best)", "grpo", "gspo", "drawdown", 0.0, "a - b > 0"),
    ("GRPO's updates are spikier than GSPO's", "grpo", "gspo", "spikes", 0.0, "a - b > 0"),
    ("GRPO on MoE needs Routing Replay (replay improves GRPO)", "grpo_replay", "grpo", "acc_final", 0.0, "a - b > 0"),
    (
        "GSPO does not need Routing Replay (matches or beats GRPO+replay without it)",
        "gspo", "grpo_replay", "acc_final", -0.02, "non-inferiority: a - b > -0.02",
    ),
    (
        "GSPO-token equals GSPO when all tokens share the sequence advantage",
        "gspo", "gspo_token", "acc_final", 0.0, "|a - b| small (identical in exact arithmetic)",
    ),
]  # fmt: skip


def claims(
    per: PerSeed, ci: str, confirm: list[Comparison], second: tuple[int, ...] = ()
) -> list[tuple[str, str, str, str]]:
    """(claim, measured, read as, status) rows; a status is a verdict only for a declared endpoint
    (primary, or secondary: ``second`` holds the ids of those among ``confirm``) of bound runs."""
    rows = []
    for claim, a, b, key, margin, reading in CLAIMS:
        if a not in per or b not in per:
            continue
        c = compare_paired(key, a, b, column(per, a, key), column(per, b, key), margin)
        direction = "greater" if reading.startswith(("a - b >", "non-inferiority")) else None
        status = claim_status(c, confirm, direction, second)
        rows.append((claim, f"{a} - {b} {c.interval.fmt()}{_seeds_txt(c)}", reading, status))
    if "gspo" in per and "grpo" in per:
        logr = [
            math.log10(r["clip_tok"] / per["grpo"][s]["clip_tok"])
            for s, r in per["gspo"].items()
            if s in per["grpo"] and r.get("clip_tok") and per["grpo"][s].get("clip_tok")
        ]
        iv = interval(logr, ci)
        ratio = f"{10**iv.mean:.0f}x [{10**iv.lo:.0f}x, {10**iv.hi:.0f}x]" if iv.known else "n/a"
        rows.append(
            (
                "GSPO clips far more tokens than GRPO (paper: ~15% vs ~0.13%, ~100x)",
                f"per-seed ratio GSPO/GRPO clipped tokens {ratio}",
                "log10 ratio > 1",
                "exploratory: no verdict",
            )
        )
    vols = seed_means(per, "volatility")  # one value per seed: its variants are one cluster
    shares = seed_means(per, "volatility_experts")
    if vols:
        share = (
            f"; in the paper's unit, {interval(shares, ci).fmt(pct=True)} of the activated experts change"
            if shares
            else "; the paper's unit (share of activated experts) was not logged by these runs"
        )
        rows.append(
            (
                "About 10% of activated experts change per update (48-layer Qwen3-30B-A3B)",
                f"{interval(vols, ci).fmt(pct=True)} of response tokens change their top-k expert set after "
                f"one optimizer step{share} (intervals over {len(vols)} per-seed means of all variants)",
                "measured (different scale)",
                "measured",
            )
        )
    return rows


def _warm_info(out: Path, seeds: list[int]) -> tuple[float | None, list[str]]:
    """The warm starts' accuracy target and, per seed, its steps (and the gate's accuracy)."""
    where = out / "warm_starts.json"
    folders = json.loads(where.read_text()) if where.exists() else {}
    target, info = None, []
    for s in seeds:
        f = Path(folders.get(str(s)) or out / "missing") / "warm_start.json"
        if not f.exists():
            info.append(f"s{s} -")
            continue
        w = json.loads(f.read_text())
        target = w.get("key", {}).get("target") if target is None else target
        acc = w.get("gate_acc")
        info.append(f"s{s} {w.get('steps')}" + (f" ({acc:.2f})" if acc is not None else ""))
    return target, info


def _minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def sampler_dtype(c: dict[str, Any]) -> str:
    r = c.get("rollout_dtype")
    return f" (sampler {r})" if r and r != c.get("dtype") else ""


def _header(
    out: Path, seeds: list[int], base: Config, preset: Preset, timing: dict[str, Any], envs: dict[str, Any]
) -> list[str]:
    target, info = _warm_info(out, seeds)
    warm = (
        f"warm start {base.sft_steps} steps at lr {base.sft_lr}"
        if target is None
        else f"warm start at lr {base.sft_lr} until greedy accuracy on {WARM_CHECK_PROMPTS} held-out-like "
        f"prompts reaches {target} (checked every {WARM_CHECK_EVERY} steps, at most {base.sft_steps})"
    )
    load = timing.get("mean_load_1min")
    return [
        f"# GSPO vs GRPO: preset `{preset.name}`",
        "",
        preset.description,
        "",
        f"Task `{base.task}` (reward `{base.reward}`), model `{base.model}`, {warm}, {base.steps} RL steps "
        f"of {base.prompts_per_step} prompts x {base.group_size} responses (at most {base.max_new_tokens} "
        f"tokens), **{base.num_minibatches} optimizer steps per rollout batch**, lr {base.lr}, dtype "
        f"{base.dtype}{sampler_dtype(base.to_dict())}, pi_old `{pi_old_source(base)}`, held-out eval of "
        f"{base.eval_size} prompts every {base.eval_every} steps. Seeds {seeds}; per seed one warm start "
        "shared by every variant, so variants are compared paired by seed.",
        "",
        "Warm start per seed (steps; the gate's greedy accuracy when it stopped): " + ", ".join(info) + ".",
        "",
        f"Command: `{timing.get('command', 'n/a')}`  ",
        f"Wall time: {_minutes(timing.get('wall_s'))} with {timing.get('workers', '?')} worker process(es) "
        f"on {timing.get('cpus', '?')} CPUs, mean 1-min load average {'n/a' if load is None else f'{load:.1f}'}"
        + (f" (documented for this preset: {preset.runtime})" if preset.runtime else ""),
        "",
        describe(envs),
        "",
    ]


def _test_name(test: str, ns: list[int]) -> str:
    """How the family's p-values were computed: the sign-flip p is exact up to ``EXACT_MAX_N`` seeds."""
    if test != "permutation":
        return "paired t"
    if all(sign_flip_is_exact(n) for n in ns):
        return "exact sign-flip permutation"
    return f"sign-flip permutation (exact up to {EXACT_MAX_N} seeds, Monte Carlo with {MC_FLIPS} draws above)"


def _family_text(preset: Preset, confirm: list[Comparison], decl: dict[str, Any]) -> str:
    unrun = max(0, preset.family.size - len(confirm)) if preset.family else 0
    text = f"Holm over the declared family: this preset's {len(confirm)} endpoint(s)"
    text += (
        f"; the family's {unrun} others count as p = 1 here (the combined study adjusts over them)."
        if unrun
        else "."
    )
    if decl.get("look") and preset.interim:
        a1, a2 = decl["levels"]
        text += (
            f" Declared interim look after {preset.interim} of {len(preset.seeds)} seeds, O'Brien-Fleming-"
            f"type spending: nominal levels {a1:.4g} (interim) and {a2:.4g} (final); this is the "
            f"**{decl['look']} look**, read at {decl['level']:.4g}"
            + (
                f" (not significant: continue to all {len(preset.seeds)} declared seeds)."
                if decl["look"] == "interim"
                else "."
            )
        )
    return text


def _preregistration(preset: Preset, confirm: list[Comparison], decl: dict[str, Any]) -> list[str]:
    if not confirm or preset.family is None:
        return [
            "## Pre-registration",
            "",
            "None: this preset declared no primary endpoint before it ran, so **every result below is "
            "exploratory** (raw intervals and p-values, no verdicts).",
            "",
        ]
    if not decl.get("preregistered"):
        return _not_preregistered(preset, confirm, decl)
    f = preset.family
    lines = [
        "## Pre-registration",
        "",
        f"Pre-registered: declared in `{preset.path.name if preset.path else preset.name}`, committed at "
        f"`{decl.get('file_commit')}` ({_utc(decl.get('commit_time'))}), before every run started (the "
        f"first at {_utc(decl.get('first_start'))}), in the history of every run's clean checkout; every run "
        "records this file's sha256, its endpoints, no setting changed from it and the declared resolved config "
        f"(`{(preset.resolved_sha256 or '')[:12]}`: every default); the analysed seeds are the declared ones"
        + (
            f"; declared at `{preset.declared_at}` (same declaration there: {decl.get('declared_at_matches')})"
            if preset.declared_at
            else ""
        )
        + f". Family `{f.name}`: {f.size} hypotheses, family-wise error {f.alpha} (Holm), test: "
        f"{_test_name(f.test, [c.interval.n for c in confirm])} (two-sided; the verdict "
        "reads its sign). " + _family_text(preset, confirm, decl),
        "",
        "| endpoint | n | mean [raw 95% CI] | p (t) | p (sign-flip) | Holm-adjusted p | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for e, c in zip(preset.primary, confirm, strict=True):
        lines.append(
            f"| {e.text()} | {c.interval.n} | {c.interval.fmt()} | {fmt_p(c.p_t)} | {fmt_p(c.p_perm)} | "
            f"{fmt_p(c.p_adj)} | **{c.verdict}** |"
        )
    return lines + [
        "",
        "Everything after this section is exploratory: raw (unadjusted) numbers, no verdicts.",
        "",
    ]


def _utc(t: float | None) -> str:
    return "unknown" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _not_preregistered(preset: Preset, confirm: list[Comparison], decl: dict[str, Any]) -> list[str]:
    """The preset's endpoints when its runs are not bound to a committed declaration: why not, and
    their raw numbers with no adjusted p and no verdict."""
    name = preset.path.name if preset.path else preset.name
    lines = [
        "## Pre-registration",
        "",
        f"**Not pre-registered**: {decl.get('why_not')}. The endpoints `{name}` names now are shown as "
        "**exploratory** (raw intervals and p-values, no adjusted p, no verdicts).",
        "",
        "| endpoint | n | mean [raw 95% CI] | p (t) | p (sign-flip) | status |",
        "|---|---|---|---|---|---|",
    ]
    for e, c in zip(preset.primary, confirm, strict=True):
        lines.append(
            f"| {e.text()} | {c.interval.n} | {c.interval.fmt()} | {fmt_p(c.p_t)} | {fmt_p(c.p_perm)} | "
            "exploratory: no verdict |"
        )
    return lines + ["", "Everything below is exploratory: raw (unadjusted) numbers, no verdicts.", ""]


def _variant_tables(per: PerSeed, ci: str, crit: Criteria) -> list[str]:
    name = CI_NAMES.get(ci, ci)
    lines = [
        f"## Per variant: mean [raw 95% CI over seeds, {name}]",
        "",
        "| variant | n | " + " | ".join(lbl for _, lbl, _ in SUMMARY_KEYS) + " | acc collapses | reward "
        "collapses | grad-norm spikes | ratio spikes |",
        "|---" * (len(SUMMARY_KEYS) + 6) + "|",
    ]
    for v, runs in per.items():
        rs = list(runs.values())
        cells = [interval([r.get(k) for r in rs], ci).fmt(pct) for k, _, pct in SUMMARY_KEYS]
        cells += [
            f"{sum(r['acc_collapse_step'] is not None for r in rs)}/{len(rs)}",
            f"{sum(r['reward_collapse_step'] is not None for r in rs)}/{len(rs)}",
            str(sum(len(r["grad_spike_steps"]) for r in rs)),
            str(sum(len(r["ratio_spike_steps"]) for r in rs)),
        ]
        lines.append(f"| {v} | {len(rs)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Collapse events (per run): **accuracy collapse**: from some eval on, held-out accuracy stays "
        f"more than {crit.acc_margin} below the best it had reached before, to the end of the run; "
        f"**reward collapse**: the same with margin {crit.reward_margin} on the training reward "
        f"({crit.reward_window}-step trailing mean); **grad-norm spike**: a step whose grad norm exceeds "
        f"{crit.spike_factor:g}x the median of the previous {crit.spike_window} steps; **ratio spike**: "
        f"the same on log(max importance ratio), with a max ratio above {crit.ratio_spike_floor:g}. "
        "AUC: area under the held-out accuracy curve divided by the steps. Held-out reward: the task's "
        "mean reward (partial credit where the reward gives it). Sampler mismatch: mean "
        "|log pi_trainer - log pi_sampler| per response token at pi_old.",
        "",
        f"## Importance ratios, clipping and routing per variant: mean [raw 95% CI, {name}]",
        "",
        "| variant | " + " | ".join(lbl for _, lbl, _ in RATIO_KEYS) + " |",
        "|---" * (len(RATIO_KEYS) + 1) + "|",
    ]
    for v, runs in per.items():
        cells = [interval([r.get(k) for r in runs.values()], ci).fmt(pct) for k, _, pct in RATIO_KEYS]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines + [
        "",
        "Ratio spread: the mean over steps of log(max / min) of the importance ratios in a step. Token "
        "ratios are logged by token-ratio losses (GRPO) only; the sequence ratio s_i (the length-"
        "normalised geometric mean of the token ratios) by every loss. Volatility: the fraction of "
        "response tokens whose top-k expert set changes over one optimizer step (paper: "
        f"~{PAPER_VOLATILITY:.0%} on 48 layers).",
        "",
    ]


def _paired_table(pairs: dict[tuple[str, str, str], Comparison], order: list[tuple[str, str]]) -> list[str]:
    lines = [
        "## Paired by seed, exploratory: mean difference [raw (unadjusted) 95% t CI], raw p (sign-flip), "
        "seeds with a > b / a < b",
        "",
        "| a - b | " + " | ".join(lbl for _, lbl in PAIR_KEYS) + " |",
        "|---" * (len(PAIR_KEYS) + 1) + "|",
    ]
    for a, b in order:
        if (a, b, PAIR_KEYS[0][0]) in pairs:
            cells = [pairs[(a, b, k)] for k, _ in PAIR_KEYS]
            fmt = [f"{c.interval.fmt()} p={fmt_p(c.p_perm)} ({c.n_pos}/{c.n_neg})" for c in cells]
            lines.append(f"| {a} - {b} | " + " | ".join(fmt) + " |")
    return lines + [""]


def _per_seed_table(per: PerSeed) -> list[str]:
    cols = [
        ("acc_start", "start"), ("acc_final", "final"), ("acc_best", "best"), ("acc_auc", "AUC"),
        ("score_final", "final reward"), ("volatility", "volatility"), ("clip_tok", "clip tok"),
        ("acc_collapse_step", "acc collapse at"), ("reward_collapse_step", "reward collapse at"),
        ("grad_spike_steps", "grad spikes at"), ("ratio_spike_steps", "ratio spikes at"),
    ]  # fmt: skip

    def cell(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, list):
            return ",".join(map(str, x[:6])) + ("..." if len(x) > 6 else "") if x else "-"
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["## Per seed", "", "| variant | seed | " + " | ".join(c for _, c in cols) + " |"]
    lines.append("|---" * (len(cols) + 2) + "|")
    for v in per:
        for s, r in sorted(per[v].items()):
            lines.append(f"| {v} | {s} | " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |")
    return lines + [""]


def write_report(
    out: Path,
    variants: list[str],
    seeds: list[int],
    base: Config,
    preset: Preset | None = None,
    ci: str = "t",
    criteria: Criteria | None = None,
) -> Path:
    """report.md, summary.json and per_seed.csv of the runs in ``out``; returns report.md's path."""
    crit = criteria or Criteria()
    preset = preset or Preset(name="custom")
    per = collect(out, variants, seeds, crit)
    images = band_plots(out, variants, seeds, ci)
    decl = declaration(preset, run_records(out, per), analysed_seeds(per, preset), crit)
    order = PAIRS + [p for p in preset.pairs if p not in PAIRS]
    confirm, pairs = confirmatory(per, preset, decl.get("level")), exploratory(per, order)
    second = secondary(per, preset, decl)
    decl |= secondary_data(preset, second)
    bound = list(confirm) if decl.get("preregistered") else []  # no verdict without a binding declaration
    bound += [c for c in second if c.verdict]
    timing_file = out / "timing.json"
    timing = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    envs = {f"{v}-s{s}": read_environment(out / f"{v}-s{s}") for v in per for s in per[v]}
    lines = _header(out, seeds, base, preset, timing, envs) + _preregistration(preset, confirm, decl)
    lines += secondary_lines(preset, second, decl)
    lines += _variant_tables(per, ci, crit) + _paired_table(pairs, order)
    lines += [
        "## The paper's claims and this run",
        "",
        "A claim gets a verdict only when this preset declared it as an endpoint (primary, or secondary "
        "in its own declared family: above) and its runs are bound to the declaration; the others are "
        "exploratory and show the raw interval and p-values.",
        "",
        "| claim (arXiv 2507.18071) | measured here (raw 95% CI) | read as | status |",
        "|---|---|---|---|",
    ]
    claim_rows = claims(per, ci, bound, tuple(id(c) for c in second if c.verdict))
    lines += [f"| {c} | {m} | {r} | {v} |" for c, m, r, v in claim_rows] + [""]
    lines += _per_seed_table(per)
    for title, fname in images:
        lines += [f"### {title}", "", f"![{title}]({fname})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    timing = timing | {"environments": envs}  # to summary.json's own key
    _write_data(out, preset, base, seeds, variants, ci, crit, timing, per, confirm, pairs, claim_rows, decl)
    return report


def _write_data(
    out: Path,
    preset: Preset,
    base: Config,
    seeds: list[int],
    variants: list[str],
    ci: str,
    crit: Criteria,
    timing: dict[str, Any],
    per: PerSeed,
    confirm: list[Comparison],
    pairs: dict[tuple[str, str, str], Comparison],
    claim_rows: list[tuple[str, str, str, str]],
    decl: dict[str, Any],
) -> None:
    """summary.json (everything the study needs, no metrics.jsonl) and per_seed.csv."""
    data = {
        "preset": preset.name,
        "description": preset.description,
        "config": base.to_dict(),
        "seeds": seeds,
        "variants": variants,
        "ci": ci,
        "criteria": dataclasses.asdict(crit),
        "timing": {k: v for k, v in timing.items() if k != "environments"},
        "environments": timing.get("environments", {}),  # run -> what decided its numbers (gspo.repro)
        "per_seed": {v: {str(s): r for s, r in per[v].items()} for v in per},
        "summary": {
            v: {
                k: interval([r.get(k) for r in per[v].values()], ci).to_dict()
                for k, _, _ in SUMMARY_KEYS + RATIO_KEYS
            }
            for v in per
        },
        "paired": {
            f"{a}-{b}:{key}": {
                **c.interval.to_dict(),
                "n_pos": c.n_pos,
                "n_neg": c.n_neg,
                "p_t": c.p_t,
                "p_perm": c.p_perm,
            }
            for (a, b, key), c in pairs.items()
        },
        "preregistration": {
            "primary": [e.record() for e in preset.primary],
            "family": dataclasses.asdict(preset.family) if preset.family else None,
            **decl,
            # endpoints whose runs are not bound to the declaration: numbers only, no study verdict
            "results" if decl.get("preregistered") else "results_exploratory": [
                c.to_dict() | ({} if decl.get("preregistered") else {"verdict": None}) for c in confirm
            ],
        },
        "claims": [dict(claim=c, measured=m, read_as=r, status=v) for c, m, r, v in claim_rows],
        # held-out accuracy curves (the study's plots need no metrics.jsonl)
        "curves": {
            v: {str(s): sorted(c.items()) for s, c in curves(out, v, seeds, "eval/accuracy", 1).items()}
            for v in variants
        },
    }
    (out / "summary.json").write_text(json.dumps(data, indent=1))
    with (out / "per_seed.csv").open("w", newline="") as f:
        keys = list(next(iter(next(iter(per.values())).values()))) if per else []
        w = csv.writer(f)
        w.writerow(["variant", "seed", *keys])
        for v in per:
            for s, r in sorted(per[v].items()):
                w.writerow(
                    [v, s, *[";".join(map(str, r[k])) if isinstance(r[k], list) else r[k] for k in keys]]
                )
