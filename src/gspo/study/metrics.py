"""One run's numbers from its ``metrics.jsonl``: accuracy, collapse and spike events, clipping,
importance-ratio spread, expert volatility. Pure functions of the logged rows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

PAPER_VOLATILITY = 0.10  # GSPO paper, sec. 5.3: ~10% of activated experts change per update (48 layers)


@dataclass
class Criteria:
    """What counts as a collapse or a spike (stated in every report)."""

    acc_margin: float = 0.15
    """Accuracy collapse: from some eval on, held-out accuracy stays more than this (absolute) below
    the best it had reached before, to the end of the run."""
    reward_margin: float = 0.15
    """Reward collapse: the same rule on the training reward, smoothed over ``reward_window`` steps."""
    reward_window: int = 10
    spike_factor: float = 10.0
    """A grad-norm spike: a step whose grad norm exceeds ``spike_factor`` x the median of the
    previous ``spike_window`` steps. A ratio spike: the same rule on log(max importance ratio)."""
    spike_window: int = 20
    spike_min_history: int = 5
    ratio_spike_floor: float = 2.0
    """A ratio spike must also exceed this max ratio (a 10x jump of a 1.001 ratio is no spike)."""


def collapse_index(values: Sequence[float], margin: float) -> int | None:
    """First index ``i >= 1`` from which every value stays more than ``margin`` below the best of the
    values before ``i`` (a fall that does not recover by the end); None if there is none.
    Equivalent to: the last value is more than ``margin`` below the best before it."""
    n = len(values)
    if n < 2:
        return None
    suffix_max = list(values)
    for j in range(n - 2, -1, -1):
        suffix_max[j] = max(values[j], suffix_max[j + 1])
    best = values[0]
    for i in range(1, n):
        if suffix_max[i] < best - margin:
            return i
        best = max(best, values[i])
    return None


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def spike_indices(
    values: Sequence[float], factor: float, window: int, min_history: int = 5, floor: float = -math.inf
) -> list[int]:
    """Indices whose value exceeds ``factor`` x the median of the previous ``window`` values (with at
    least ``min_history`` of them) and ``floor``."""
    out = []
    for t, v in enumerate(values):
        hist = values[max(0, t - window) : t]
        if len(hist) >= min_history and v > floor and v > factor * statistics.median(hist):
            out.append(t)
    return out


def auc(steps: Sequence[int], values: Sequence[float]) -> float | None:
    """Area under the curve (trapezoids) divided by its step span: the run's time-averaged value."""
    if len(steps) < 2:
        return values[0] if values else None
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(steps) - 1))
    return area / (steps[-1] - steps[0])


def col(rows: list[dict[str, Any]], key: str, skip_step0: bool = True) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` where it is logged and finite (step 0 is the pre-RL eval)."""
    pts = [
        (r["step"], float(r[key]))
        for r in rows
        if r.get(key) is not None and math.isfinite(r[key]) and not (skip_step0 and r["step"] == 0)
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    _, v = col(rows, key)
    return statistics.fmean(v) if v else None


def _spread(rows: list[dict[str, Any]], prefix: str) -> float | None:
    """Mean over steps of ``log(max / min)`` of an importance ratio: how far apart the most and least
    up-weighted samples of a step are (0 when every ratio is 1)."""
    _, hi = col(rows, f"{prefix}_max")
    _, lo = col(rows, f"{prefix}_min")
    logs = [math.log(h / m) for h, m in zip(hi, lo, strict=False) if h > 0 and m > 0]
    return statistics.fmean(logs) if logs else None


def accuracy_stats(rows: list[dict[str, Any]], crit: Criteria) -> dict[str, Any]:
    """Held-out accuracy (and mean reward) at the start, the end, its best, AUC and collapse."""
    es, acc = col(rows, "eval/accuracy", skip_step0=False)
    _, score = col(rows, "eval/reward_mean", skip_step0=False)
    i = collapse_index(acc, crit.acc_margin)
    return {
        "acc_start": acc[0] if acc else None,
        "acc_final": acc[-1] if acc else None,
        "acc_best": max(acc) if acc else None,
        "acc_auc": auc(es, acc) if acc else None,
        "acc_gain": acc[-1] - acc[0] if acc else None,
        "drawdown": max(acc) - acc[-1] if acc else None,
        "acc_collapse_step": es[i] if i is not None else None,
        "score_start": score[0] if score else None,
        "score_final": score[-1] if score else None,
        "score_gain": score[-1] - score[0] if score else None,
    }


def event_stats(rows: list[dict[str, Any]], crit: Criteria) -> dict[str, Any]:
    """Reward collapse, grad-norm and ratio spikes (see :class:`Criteria`)."""
    rs, rew = col(rows, "rollout/reward_mean")
    j = collapse_index(moving_average(rew, crit.reward_window), crit.reward_margin)
    gs, gn = col(rows, "loss/grad_norm")
    qs, rmax = col(rows, "loss/ratio_max")
    logr = [math.log(max(r, 1e-12)) for r in rmax]
    window = (crit.spike_factor, crit.spike_window, crit.spike_min_history)
    return {
        "reward_collapse_step": rs[j] if j is not None else None,
        "reward_last20": statistics.fmean(rew[-20:]) if rew else None,
        "grad_spike_steps": [gs[k] for k in spike_indices(gn, *window)],
        "ratio_spike_steps": [qs[k] for k in spike_indices(logr, *window, math.log(crit.ratio_spike_floor))],
        "ratio_max_max": max(rmax) if rmax else None,
        "grad_norm_max": max(gn) if gn else None,
    }


# per-step means of logged metrics: run_stats key <- metrics.jsonl key
MEANS = {
    "clip_tok": "loss/clip_frac_tok",
    "clip_seq": "loss/clip_frac_seq",
    "volatility": "moe/volatility",
    "volatility_experts": "moe/volatility_experts",  # the paper's unit (absent in runs before 2026-12-04)
    "approx_kl": "loss/approx_kl",
    "step_s": "time/step_s",
    "mismatch_tok": "mismatch/token_abs_logp_diff",
    "response_len": "rollout/response_len",
}


def run_stats(rows: list[dict[str, Any]], crit: Criteria) -> dict[str, Any]:
    """One run's numbers from its metrics.jsonl rows. Ratio spreads: a token-ratio loss (GRPO) logs
    its token ratios as ``loss/ratio_*`` and the sequence ratios s_i as ``loss/seq_ratio_*``; a
    sequence-ratio loss (GSPO) logs s_i as ``loss/ratio_*`` and its token ratios as ``loss/tok_ratio_*``."""
    out = accuracy_stats(rows, crit) | event_stats(rows, crit)
    out |= {name: _mean(rows, key) for name, key in MEANS.items()}
    token_ratio_loss = bool(col(rows, "loss/seq_ratio_max")[0])
    # GSPO logs the token ratios it does not use as ``loss/tok_ratio_*`` (runs before 2026-12-04 did not)
    out["tok_ratio_spread"] = _spread(rows, "loss/ratio" if token_ratio_loss else "loss/tok_ratio")
    out["seq_ratio_spread"] = _spread(rows, "loss/seq_ratio" if token_ratio_loss else "loss/ratio")
    out["collapsed"] = out["acc_collapse_step"] is not None
    out["spikes"] = len(out["grad_spike_steps"]) + len(out["ratio_spike_steps"])
    out["events"] = int(out["collapsed"]) + int(out["reward_collapse_step"] is not None) + out["spikes"]
    return out


# numbers summarised per variant (mean and CI over seeds): key, label, shown as percent
SUMMARY_KEYS = [
    ("acc_start", "start acc", False),
    ("acc_final", "final acc", False),
    ("acc_best", "best acc", False),
    ("acc_auc", "acc AUC", False),
    ("drawdown", "best - final", False),
    ("score_final", "final held-out reward", False),
    ("clip_tok", "clipped tokens", True),
    ("volatility", "expert volatility", True),
    ("mismatch_tok", "sampler mismatch", "sci"),
    ("step_s", "s/step", False),
]
# paired comparisons: (a, b) -> per-seed a - b
PAIRS = [("gspo", "grpo"), ("grpo_replay", "grpo"), ("gspo", "grpo_replay"), ("gspo", "gspo_token")]
PAIR_KEYS = [
    ("acc_final", "final acc"),
    ("acc_auc", "acc AUC"),
    ("drawdown", "best - final"),
    ("score_final", "final held-out reward"),
    ("spikes", "spikes per run"),
]
# the update's geometry per variant: importance-ratio spread, clipping, drift, routing change
RATIO_KEYS = [
    ("tok_ratio_spread", "token ratio spread", False),
    ("seq_ratio_spread", "sequence ratio spread", False),
    ("clip_tok", "clipped tokens", True),
    ("clip_seq", "clipped sequences", True),
    ("approx_kl", "approx KL", "sci"),
    ("volatility", "expert volatility", True),
    ("volatility_experts", "activated experts changed", True),
    ("response_len", "response tokens", False),
]


def seed_means(per_seed: dict[str, dict[int, dict[str, Any]]], key: str) -> list[float]:
    """Per seed, the mean of ``key`` over the variants that ran it (``per_seed``: variant -> seed ->
    run stats): the variants of a seed share its warm start and prompts, so they are one cluster, not
    independent samples."""
    out = []
    for seed in sorted({s for v in per_seed.values() for s in v}):
        xs = [v[seed][key] for v in per_seed.values() if v.get(seed, {}).get(key) is not None]
        if xs:
            out.append(sum(xs) / len(xs))
    return out
