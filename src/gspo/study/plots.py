"""Plots of a study: per-variant curves with confidence bands over seeds, paired differences, regimes.

Bands are descriptive (raw, unadjusted 95% intervals per step); verdicts never come from a plot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gspo.study.metrics import PAPER_VOLATILITY, col, moving_average
from gspo.study.statistics import Interval, interval
from gspo.training.logger import read_metrics

PLOTS = [
    ("eval/accuracy", "held-out accuracy (greedy)", "accuracy.png", 1),
    ("eval/reward_mean", "held-out reward (greedy)", "eval_reward.png", 1),
    ("rollout/reward_mean", "training reward (10-step mean)", "reward.png", 10),
    ("loss/clip_frac_tok", "clipped-token fraction", "clip_fraction.png", 5),
    ("moe/volatility", "expert-activation volatility per update", "volatility.png", 5),
    ("loss/grad_norm", "grad norm (before clipping)", "grad_norm.png", 1),
    ("loss/ratio_max", "max importance ratio per step", "ratio_max.png", 1),
]
_GEOMETRIC = ("loss/ratio_max", "loss/grad_norm")  # heavy-tailed: geometric mean, CI of logs
_UNIT = ("eval/accuracy", "eval/reward_mean", "rollout/reward_mean")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves(out: Path, variant: str, seeds: list[int], key: str, smooth: int) -> dict[int, dict[int, float]]:
    """seed -> {step: value} (trailing mean over ``smooth`` steps)."""
    res = {}
    for s in seeds:
        path = out / f"{variant}-s{s}" / "metrics.jsonl"
        if not path.exists():
            continue
        st, v = col(read_metrics(path), key, skip_step0=not key.startswith("eval/"))
        if st:
            res[s] = dict(zip(st, moving_average(v, smooth) if smooth > 1 else v, strict=True))
    return res


def band(ax: Any, steps: list[int], iv: list[Interval], label: str) -> None:
    """A mean line with its interval as a shaded band (steps without a mean left out)."""
    kept = [(st, i) for st, i in zip(steps, iv, strict=True) if i.mean is not None]
    if not kept:
        return
    xs, ivs = [st for st, _ in kept], [i for _, i in kept]
    (line,) = ax.plot(xs, [i.mean for i in ivs], label=label, marker="." if len(xs) < 30 else None)
    ax.fill_between(
        xs,
        [i.lo if i.known else i.mean for i in ivs],
        [i.hi if i.known else i.mean for i in ivs],
        color=line.get_color(),
        alpha=0.18,
        linewidth=0,
    )


def _step_intervals(cur: dict[int, dict[int, float]], geo: bool, ci: str) -> tuple[list[int], list[Interval]]:
    steps = sorted({st for c in cur.values() for st in c})
    if not geo:
        return steps, [interval([c.get(st) for c in cur.values()], ci) for st in steps]
    logs = [[math.log(c[st]) for c in cur.values() if c.get(st, 0) > 0] for st in steps]
    return steps, [
        Interval(*(None if x is None else math.exp(x) for x in (i.mean, i.lo, i.hi)), i.n)
        for i in (interval(xs, ci) for xs in logs)
    ]


def band_plots(out: Path, variants: list[str], seeds: list[int], ci: str) -> list[tuple[str, str]]:
    """One figure per logged metric (:data:`PLOTS`) and the paired accuracy plot; (title, file) each."""
    plt = _plt()
    images = []
    for key, title, fname, smooth in PLOTS:
        curs = {v: curves(out, v, seeds, key, smooth) for v in variants}
        geo = key in _GEOMETRIC and any(
            x > 0 for cur in curs.values() for c in cur.values() for x in c.values()
        )
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        for v, cur in curs.items():
            if cur:
                band(ax, *_step_intervals(cur, geo, ci), f"{v} (n={len(cur)})")
        if ax.get_lines():
            ax.set_title(
                f"{title}: {'geometric mean' if geo else 'mean'}, raw 95% CI over seeds", fontsize=10
            )
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if key == "loss/clip_frac_tok":
                ax.set_yscale("symlog", linthresh=1e-3)
            if geo:
                ax.set_yscale("log")
            if key in _UNIT:
                ax.set_ylim(-0.02, 1.02)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=100)
            images.append((title, fname))
        plt.close(fig)
    paired = _paired_plot(out, variants, seeds, ci)
    if paired:
        images.insert(1, paired)
    return images


def _paired_plot(out: Path, variants: list[str], seeds: list[int], ci: str) -> tuple[str, str] | None:
    """Each variant's held-out accuracy minus the reference's, seed by seed."""
    plt = _plt()
    ref = "grpo" if "grpo" in variants else variants[0]
    base = curves(out, ref, seeds, "eval/accuracy", 1)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for v in variants:
        cur = curves(out, v, seeds, "eval/accuracy", 1)
        common = sorted(set(cur) & set(base))
        if v == ref or not common:
            continue
        steps = sorted({st for s in common for st in cur[s]} & {st for s in common for st in base[s]})
        iv = [
            interval([cur[s][st] - base[s][st] for s in common if st in cur[s] and st in base[s]], ci)
            for st in steps
        ]
        band(ax, steps, iv, f"{v} - {ref} (n={len(common)})")
    drawn = bool(ax.get_lines())
    if drawn:
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"held-out accuracy minus {ref}'s, paired by seed: mean, raw 95% CI", fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "accuracy_paired.png", dpi=100)
    plt.close(fig)
    return (f"held-out accuracy minus {ref}'s (paired by seed)", "accuracy_paired.png") if drawn else None


def regimes_plot(out: Path, rows: list[dict[str, Any]]) -> None:
    """regimes.png: expert volatility per regime next to the paper's, and GSPO - GRPO per regime."""
    plt = _plt()
    names = [row["preset"] for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    for i, row in enumerate(rows):
        vd = row["volatility"]
        if vd["mean"] is not None:
            lo = vd["lo"] if vd["lo"] is not None else vd["mean"]
            hi = vd["hi"] if vd["hi"] is not None else vd["mean"]
            ax.errorbar(
                [i],
                [100 * vd["mean"]],
                yerr=[[100 * (vd["mean"] - lo)], [100 * (hi - vd["mean"])]],
                fmt="o",
                capsize=4,
            )
    ax.axhline(100 * PAPER_VOLATILITY, color="red", ls="--", label="paper (48 layers)")
    ax.set_ylabel("% tokens whose experts change")
    ax.set_title("expert volatility per update (raw 95% CI)", fontsize=10)
    ax = axes[1]
    for j, (key, lbl) in enumerate([("gspo-grpo:acc_final", "final acc"), ("gspo-grpo:acc_auc", "acc AUC")]):
        xs, ms, lo, hi = [], [], [], []
        for i, row in enumerate(rows):
            d = row.get(key)
            if d and d["mean"] is not None:
                xs.append(i + (j - 0.5) * 0.2)
                ms.append(d["mean"])
                lo.append(d["mean"] - (d["lo"] if d["lo"] is not None else d["mean"]))
                hi.append((d["hi"] if d["hi"] is not None else d["mean"]) - d["mean"])
        ax.errorbar(xs, ms, yerr=[lo, hi], fmt="o", capsize=4, label=lbl)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title("GSPO - GRPO, paired by seed (raw 95% CI)", fontsize=10)
    for ax in axes:
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "regimes.png", dpi=100)
    plt.close(fig)


def accuracy_by_regime_plot(out: Path, regs: list[dict[str, Any]], ci: str) -> None:
    """accuracy_by_regime.png: held-out accuracy curves per regime from the summaries' curves."""
    plt = _plt()
    n = len(regs)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for k, r in enumerate(regs):
        ax = axes[k // cols][k % cols]
        for v in r["variants"]:
            cur = {s: dict(map(tuple, pts)) for s, pts in r.get("curves", {}).get(v, {}).items()}
            if cur:
                band(ax, *_step_intervals(cur, False, ci), v)
        ax.set_title(r["preset"], fontsize=9)
        ax.grid(alpha=0.3)
        if k == 0 and ax.get_lines():
            ax.legend(fontsize=7)
    for k in range(n, nrows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle("held-out accuracy per regime: mean and raw 95% CI over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "accuracy_by_regime.png", dpi=100)
    plt.close(fig)
