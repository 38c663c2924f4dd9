"""Expert volatility per optimizer step, dialled in: a calibration over depth, experts / top-k, lr and
optimizer steps per rollout on embedded MoEs a 2-core machine trains (issue 59, step 1).

Volatility is the trainer's own ``moe/volatility_experts`` (gspo.training.update.volatility): after
the first optimizer step of each RL step, over the response tokens of a minibatch that step did not
train on (the second; the only one with ``--num-minibatches 1``), the mean share of the k experts a
token activates that it did not activate under pi_old, ``|new \\ old| / k``, averaged over MoE
layers: the paper's unit (GSPO, arXiv 2507.18071, sec. 4.3: ~10% on Qwen3-30B-A3B). ``moe/volatility``
(the share of tokens whose top-k *set* changed at all) is kept beside it.

Token-ratio spread: per RL step ``log(max / min)`` of the token ratios pi_theta / pi_old over the
update (GRPO's own ``loss/ratio_*``; a sequence-ratio loss logs the unused token ratios as
``loss/tok_ratio_*``), averaged over the RL steps: the paper's causal story is that routing that moves
spreads the token ratios, which Routing Replay (R2, ``--routing-replay``) takes back.

Each cell: one warm start per (shape, seed) to held-out-like accuracy 0.3 (``gspo compare``'s gate,
shared by every lr / minibatch / algorithm of that shape and seed), then ``--steps`` RL steps (32
prompts x 8 responses, the study's defaults) with a held-out evaluation at step 0 and at the end.
Seeds 9000 and up, outside every study. Runs are reused when their folder holds a finished run.

    python benchmarks/volatility_calibration.py --phase all          # the committed table and plot
    python benchmarks/volatility_calibration.py --phase lr --seeds 9000

Writes ``benchmarks/volatility_calibration.json`` (per run and per cell) and ``.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT_JSON = HERE / "volatility_calibration.json"
OUT_PNG = HERE / "volatility_calibration.png"
VOL, VOL_TOKENS = "moe/volatility_experts", "moe/volatility"
WARM_TARGET, SFT_STEPS = 0.3, 600


@dataclasses.dataclass(frozen=True)
class Cell:
    """One calibration point: a model shape, an algorithm (``grpo``, ``grpo_replay``, ``gspo``), lr
    and optimizer steps per rollout."""

    model: str
    variant: str = "grpo"
    lr: float = 3e-4
    minibatches: int = 4

    @property
    def name(self) -> str:
        return f"{self.model}_{self.variant}_lr{self.lr:g}_mb{self.minibatches}"


# the grid, phase by phase (cheapest first: lr and minibatches on the default tiny MoE, then shapes)
TINY = "tiny-moe"
PHASES: dict[str, list[Cell]] = {
    "lr": [Cell(TINY, lr=lr) for lr in (3e-4, 1e-3, 3e-3)],
    "minibatches": [Cell(TINY, lr=1e-3, minibatches=m) for m in (1, 8)],
    "depth": [Cell(f"moe-l{n}-e16-k4", lr=6e-4) for n in (2, 6, 12)],
    # depth did not move it (2, 6, 12 layers: 1.5%, 1.6%, 1.2%), so experts on the cheapest depth
    "experts": [Cell(f"moe-l2-{m}", lr=6e-4) for m in ("e64-k4", "e64-k2", "e128-k2")],
    # the shapes level off near 2%: lr on the best of them, beside its dense twin (is it still stable?)
    "dial": [Cell(m, lr=lr) for lr in (1e-3, 2e-3) for m in ("moe-l2-e64-k2", "dense-l2-k2")]
    + [Cell("dense-l2-k2", lr=6e-4)],
    # one optimizer step per rollout kept tiny-moe stable at lr 1e-3 (mb 4 and 8 collapsed): two
    # minibatches, the fewest where pi_theta is off pi_old (so R2 can matter), at higher lr
    "dial_mb2": [
        Cell(m, lr=lr, minibatches=2) for lr in (1e-3, 2e-3) for m in ("moe-l2-e64-k2", "dense-l2-k2")
    ],
    # Routing Replay on the same cells: the token-ratio spread it takes back, and whether it keeps
    # GRPO's held-out accuracy where GRPO alone loses it
    "replay": [Cell("moe-l2-e64-k2", "grpo_replay", lr=lr) for lr in (6e-4, 1e-3, 2e-3)]
    + [Cell(TINY, "grpo_replay", lr=1e-3), Cell("moe-l6-e16-k4", "grpo_replay", lr=6e-4)],
    # the two candidate regimes for the positive control on moe-l2-e64-k2, on a second seed
    "choice": [
        Cell(m, v, lr=lr, minibatches=mb)
        for lr, mb in ((6e-4, 4), (1e-3, 2))
        for m, v in (("moe-l2-e64-k2", "grpo"), ("moe-l2-e64-k2", "grpo_replay"), ("dense-l2-k2", "grpo"))
    ],
}


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """One run's numbers from its ``metrics.jsonl`` rows: the means over its RL steps of the expert
    volatility in the paper's unit (``vol_experts``; also its first step alone, ``vol_first``, and
    the mean of the later ones, ``vol_later``), of the share of tokens whose expert set changed
    (``vol_tokens``) and of the token-ratio spread ``log(max / min)`` (``ratio_spread``; GRPO's own
    ratios, or the token ratios a sequence-ratio loss logs beside its own), and the held-out accuracy
    before the first RL step and at the last evaluation. None where the run logged no such metric
    (a dense model has no volatility)."""
    steps = [r for r in rows if "loss/loss" in r]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]

    def mean_of(values: Iterable[float | None]) -> float | None:
        vals = [v for v in values if v is not None and math.isfinite(v)]
        return statistics.fmean(vals) if vals else None

    def spread(r: dict[str, Any]) -> float | None:
        for lo, hi in (("loss/tok_ratio_min", "loss/tok_ratio_max"), ("loss/ratio_min", "loss/ratio_max")):
            if lo in r and hi in r and r[lo] > 0:
                return math.log(r[hi] / r[lo])
        return None

    return {
        "vol_experts": mean_of(r.get(VOL) for r in steps),
        # a fresh Adam's first step moves every weight by lr (m / sqrt(v) = sign(g)): kept apart
        "vol_first": mean_of(r.get(VOL) for r in steps[:1]),
        "vol_later": mean_of(r.get(VOL) for r in steps[1:]),
        "vol_tokens": mean_of(r.get(VOL_TOKENS) for r in steps),
        "ratio_spread": mean_of(spread(r) for r in steps),
        "acc_start": evals[0] if evals else None,
        "acc_end": evals[-1] if evals else None,
        "rl_steps": len(steps),
    }


def cell_stats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of each number, and for volatility its per-seed range."""
    out: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
    for key in (
        "vol_experts",
        "vol_first",
        "vol_later",
        "vol_tokens",
        "ratio_spread",
        "acc_start",
        "acc_end",
        "seconds",
    ):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
    vols = [r["vol_experts"] for r in runs if r.get("vol_experts") is not None]
    out["vol_experts_range"] = [min(vols), max(vols)] if vols else None
    return out


# ------------------------------------------------------------------------------------------------
# running (gspo's own warm start and train, in this process, one thread)


def _base(cell: Cell, seed: int, work: Path, steps: int) -> Any:
    from gspo.config import make_config
    from gspo.study.presets import VARIANTS

    return make_config(
        None,
        {
            "model": f"embedded:{cell.model}",
            "seed": seed,
            "sft_steps": SFT_STEPS,
            "steps": steps,
            "lr": cell.lr,
            "num_minibatches": cell.minibatches,
            "eval_every": steps,
            "eval_size": 200,
            "save_every": 0,
            "threads": 1,
            "progress": False,
            "output_dir": str(work / "runs"),
            "name": f"{cell.name}_s{seed}",
            **VARIANTS[cell.variant],
        },
    )


def run_cell(cell: Cell, seed: int, work: Path, steps: int) -> dict[str, Any]:
    """Warm start (reused per shape and seed) and RL steps of one cell and seed (reused when done)."""
    from gspo.launch import train
    from gspo.study.warm import warm_start_job
    from gspo.training.logger import read_metrics

    base = _base(cell, seed, work, steps)
    done = base.run_dir / "calibration.json"
    if done.exists():
        return json.loads(done.read_text())
    c0 = time.process_time()
    _, warm, warm_s = warm_start_job(base, seed, work, WARM_TARGET, work / "warm-starts")
    assert warm is not None
    t0, c1 = time.time(), time.process_time()
    cfg = dataclasses.replace(base, model=warm, tokenizer=warm, sft_steps=0, overwrite=True).validate()
    train(cfg)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    res = {
        "cell": dataclasses.asdict(cell),
        "seed": seed,
        "seconds": time.time() - t0,
        "warm_seconds": warm_s,
    }
    res |= {"cpu_seconds": time.process_time() - c1, "warm_cpu_seconds": c1 - c0}  # 0 for a reused warm start
    res |= summarize(rows)
    done.write_text(json.dumps(res, indent=1))
    return res


def collect(work: Path) -> list[dict[str, Any]]:
    """Every finished run under ``work`` (its ``calibration.json``, its numbers summarized again from
    its ``metrics.jsonl``), in a stable order."""
    from gspo.training.logger import read_metrics

    runs = []
    for p in sorted((work / "runs").glob("*/calibration.json")):
        runs.append(json.loads(p.read_text()) | summarize(read_metrics(p.parent / "metrics.jsonl")))
    return sorted(runs, key=lambda r: (Cell(**r["cell"]).name, r["seed"]))


def table(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (in the order of :data:`PHASES`, then any other cell found): its settings, phase and
    :func:`cell_stats` over its seeds."""
    by_cell: dict[Cell, list[dict[str, Any]]] = {}
    for r in runs:
        by_cell.setdefault(Cell(**r["cell"]), []).append(r)
    phase_of: dict[Cell, str] = {}
    for p, cs in PHASES.items():
        for c in cs:
            phase_of.setdefault(c, p)
    order = list(dict.fromkeys(c for cs in PHASES.values() for c in cs if c in by_cell))
    order += sorted((c for c in by_cell if c not in phase_of), key=lambda c: c.name)
    return [
        {"phase": phase_of.get(c, "extra"), **dataclasses.asdict(c), **cell_stats(by_cell[c])} for c in order
    ]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table as the write-up shows it."""
    head = (
        "| model | algo | lr | minibatches | volatility (paper's unit) | first step | steps 2+ | "
        "tokens changed | token-ratio spread | held-out acc start -> end | seeds |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lo, hi = r["vol_experts_range"] or (None, None)
        rng = f" [{_pct(lo)}, {_pct(hi)}]" if len(r["seeds"]) > 1 and lo is not None else ""
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['lr']:g} | {r['minibatches']} | {_pct(r['vol_experts'])}{rng} "
            f"| {_pct(r['vol_first'])} | {_pct(r['vol_later'])} | {_pct(r['vol_tokens'])} "
            f"| {_num(r['ratio_spread'])} | {_num(r['acc_start'])} -> {_num(r['acc_end'])} | {len(r['seeds'])} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Left: volatility per cell (first step, later steps) against the paper's ~10% and the 5% bar.
    Right: GRPO's token-ratio spread against volatility, with and without Routing Replay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    moe = [r for r in rows if r["vol_experts"] is not None and r["variant"] == "grpo"]
    labels = [f"{r['model']}\nlr {r['lr']:g} mb {r['minibatches']}" for r in moe]
    xs = range(len(moe))
    ax.bar([x - 0.2 for x in xs], [100 * r["vol_first"] for r in moe], 0.4, label="first RL step")
    ax.bar([x + 0.2 for x in xs], [100 * (r["vol_later"] or 0) for r in moe], 0.4, label="RL steps 2+")
    ax.axhline(10, color="k", ls="--", lw=1, label="paper ~10% (48 layers)")
    ax.axhline(5, color="grey", ls=":", lw=1, label="5% bar")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("activated experts changed per optimizer step (%)")
    ax.set_title("GRPO: expert volatility (paper's unit)")
    ax.legend(fontsize=8)
    groups = (("MoE, GRPO", "grpo", False, "o"), ("MoE, GRPO+R2", "grpo_replay", False, "s"))
    groups += (("dense twin, GRPO", "grpo", True, "D"),)
    for label, variant, dense, marker in groups:
        pts = [r for r in rows if r["variant"] == variant and (r["vol_experts"] is None) == dense]
        pts = [r for r in pts if r["ratio_spread"] is not None]
        fell = [r["acc_end"] is not None and r["acc_end"] < r["acc_start"] - 0.15 for r in pts]
        color = bx.scatter([], [], marker=marker, label=label).get_facecolor()[0]
        for r, f in zip(pts, fell, strict=True):
            face = "none" if f else color
            bx.scatter(
                100 * (r["vol_experts"] or 0),
                r["ratio_spread"],
                marker=marker,
                facecolors=face,
                edgecolors=color,
            )
    bx.scatter(
        [], [], marker="o", facecolors="none", edgecolors="grey", label="hollow: held-out acc fell > 0.15"
    )
    bx.set_xlabel("volatility (%, 0 = dense twin)")
    bx.set_ylabel("token-ratio spread, mean log(max/min) per step")
    bx.set_title("token-ratio spread vs volatility")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(work: Path, json_path: Path = OUT_JSON, png_path: Path = OUT_PNG) -> str:
    """The JSON table (per run and per cell, with the CPU seconds spent) and the plot; the markdown."""
    runs = collect(work)
    rows = table(runs)
    cpu = sum(r.get("cpu_seconds", 0) + r.get("warm_cpu_seconds", 0) for r in runs)
    doc = {
        "definition": __doc__.split("\n\n")[1].replace("\n", " "),
        "rl_steps": sorted({r["rl_steps"] for r in runs}),
        "warm_target": WARM_TARGET,
        # CPU seconds of the runs that recorded them (runs, and warm starts they made); the others
        # ran before the script recorded CPU time: their wall seconds only
        "cpu_seconds_recorded": round(cpu, 1),
        "runs_without_cpu_record": sum("cpu_seconds" not in r for r in runs),
        "wall_seconds": round(sum(r["seconds"] + r.get("warm_seconds", 0) for r in runs), 1),
        "cells": rows,
        "runs": runs,
    }
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(rows, png_path)
    return markdown(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default="all", help=f"one of {', '.join(PHASES)}, or all")
    ap.add_argument("--seeds", default="9000,9001", help="comma-separated (9000 and up: no study uses them)")
    ap.add_argument("--steps", type=int, default=10, help="RL steps per run")
    ap.add_argument("--work", default="runs/volatility-calibration", help="warm starts and run folders")
    ap.add_argument("--write", action="store_true", help="write the JSON table and the plot (all runs found)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.write:
        print(write(Path(args.work)))
        return 0
    cells = [c for p, cs in PHASES.items() if args.phase in ("all", p) for c in cs]
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work)
    for cell in cells:
        for seed in seeds:
            t0 = time.time()
            r = run_cell(cell, seed, work, args.steps)
            print(
                f"{cell.name} s{seed}: vol {r['vol_experts']} (tokens {r['vol_tokens']}), spread "
                f"{r['ratio_spread']}, acc {r['acc_start']} -> {r['acc_end']} ({time.time() - t0:.0f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
