"""Does RL teach the tiny model to use the calculator? Held-out accuracy before and after RL, over
seeds, with the tool and without it (same task, same warm-start and RL budget), the paired gains'
95% t intervals, and ``curves.png`` (mean held-out accuracy per RL step, each seed faint).

    python docs/multiturn/learn.py --seeds 0-4 --workers 2      # writes docs/multiturn/{results.json,curves.png}

The settings are :data:`TOOLS` / :data:`NO_TOOLS` (``tests/test_multiturn_learns.py`` runs the same).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# add_long (two 4-digit numbers, a 5-digit sum): the warm start's demonstrations call calc(...) on
# a random 40% of the rows and answer directly on the rest, so it leaves a model that can use the
# calculator but calls it on some prompts only; RL is rewarded on the answer alone.
COMMON: dict[str, Any] = dict(
    model="embedded:tiny-dense", task="add_long", max_new_tokens=20, sft_steps=1000, sft_batch_size=32,
    steps=20, lr=5e-4, prompts_per_step=16, group_size=8, eval_size=100, eval_every=5, save_every=1000,
    threads=1, progress=False,
)  # fmt: skip
TOOLS: dict[str, Any] = COMMON | dict(
    env="tools:calc", max_turns=2, max_trajectory_tokens=40, sft_tool_fraction=0.4
)
NO_TOOLS: dict[str, Any] = COMMON  # single-turn: the warm start on the answers, the model answers directly


def run_one(arm: str, seed: int, out_dir: str) -> dict[str, Any]:
    """One run of ``arm`` ("tools" or "no_tools"); its held-out accuracy per evaluated RL step."""
    import torch

    from gspo import train
    from gspo.config import Config

    torch.set_num_threads(1)
    cfg = TOOLS if arm == "tools" else NO_TOOLS
    res = train(Config(output_dir=out_dir, name=f"{arm}-s{seed}", seed=seed, **cfg))
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    calls = [r.get("eval/multi_turn_frac") for r in rows if "eval/accuracy" in r]
    return {
        "arm": arm, "seed": seed, "initial": res.initial_accuracy, "final": res.final_accuracy,
        "curve": curve, "tool_frac": calls,
    }  # fmt: skip


def run_all(seeds: list[int], out_dir: str, workers: int) -> list[dict[str, Any]]:
    jobs = [(arm, s) for s in seeds for arm in ("tools", "no_tools")]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(run_one, *zip(*jobs, strict=True), [out_dir] * len(jobs)))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: mean gain (final - initial) with its 95% paired t interval over seeds; and the gain of
    tools over no tools, paired by seed."""
    from gspo.study.statistics import paired_interval

    out: dict[str, Any] = {}
    by = {arm: {r["seed"]: r for r in runs if r["arm"] == arm} for arm in ("tools", "no_tools")}
    for arm, rs in by.items():
        ci, up, down = paired_interval(
            {s: r["final"] for s, r in rs.items()}, {s: r["initial"] for s, r in rs.items()}
        )
        out[arm] = {"gain": ci.to_dict(), "seeds_up": up, "seeds_down": down}
    gain = {arm: {s: r["final"] - r["initial"] for s, r in rs.items()} for arm, rs in by.items()}
    ci, up, down = paired_interval(gain["tools"], gain["no_tools"])
    out["tools_minus_no_tools"] = {"gain": ci.to_dict(), "seeds_up": up, "seeds_down": down}
    final = {arm: {s: r["final"] for s, r in rs.items()} for arm, rs in by.items()}
    ci, up, down = paired_interval(final["tools"], final["no_tools"])
    out["tools_minus_no_tools"]["final"] = ci.to_dict()
    return out


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, color, label in (("tools", "C0", "calculator (tools:calc)"), ("no_tools", "C3", "no tools")):
        rs = [r for r in runs if r["arm"] == arm]
        steps = sorted({int(k) for r in rs for k in r["curve"]})
        for r in rs:
            ax.plot(steps, [r["curve"][s] for s in steps], color=color, alpha=0.25, lw=1)
        mean = [sum(r["curve"][s] for r in rs) / len(rs) for s in steps]
        ax.plot(steps, mean, color=color, lw=2.5, label=f"{label}, mean of {len(rs)} seeds")
    ax.set(xlabel="RL step (after the warm start)", ylabel="held-out accuracy (greedy)", ylim=(-0.02, 1.02))
    ax.set_title("add_long: 4-digit sums, tiny-dense", fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4", help="a range a-b or a comma list")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs-dir", default="/tmp/gspo-multiturn-learn")
    ap.add_argument("--out", default=str(HERE))
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition("-")
    seeds = list(range(int(lo), int(hi) + 1)) if hi else [int(s) for s in a.seeds.split(",")]
    runs = run_all(seeds, a.runs_dir, a.workers)
    summary = summarize(runs)
    out = Path(a.out)
    for r in runs:  # JSON keys are strings
        r["curve"] = {str(k): v for k, v in r["curve"].items()}
    (out / "results.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")
    for r in runs:
        r["curve"] = {int(k): v for k, v in r["curve"].items()}
    plot(runs, out / "curves.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
