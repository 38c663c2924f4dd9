"""Summarise a `gspo train` run's per-phase memory and speed beside `gspo plan`'s output (gpu_check.sh).

    python benchmarks/gpu_phase_summary.py RUN_DIR plan.txt [--max-over-plan 0.15]

Medians over the RL steps after the first (the first allocates AdamW's state and warms kernels):
peak memory of the rollout, update and sync phases (GPU: allocated and reserved; CPU: peak RSS),
beside the start-up's peak (the step-0 row's ``memory/startup_peak_gib``, a fresh run), each with
the plan's estimate for that phase; step time, and tokens per second of the rollout (response
tokens / generate time) and of the update (prompt + response tokens / update time). The plan's text
follows.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

PLAN_LINES = {  # the phase -> the label of its peak in `gspo plan`'s output
    "start-up": "start-up peak, fresh", "rollout": "rollout peak", "update": "update peak",
    "sync": "sync peak",
}  # fmt: skip


def plan_peaks(plan: str) -> dict[str, float]:
    """GiB per phase from `gspo plan`'s text (absent phases left out)."""
    out = {}
    for phase, label in PLAN_LINES.items():
        found = re.search(rf"^\s*{re.escape(label)}\s+([\d.]+) GiB", plan, re.M)
        if found:
            out[phase] = float(found.group(1))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def summary(rows: list[dict], n_seq: int, plan: str = "") -> list[str]:
    """The table and speeds; ``n_seq``: sequences per step (prompts_per_step x group_size)."""
    steps = [r for r in rows if r.get("step", 0) > 1 and "time/step_s" in r] or [
        r for r in rows if "time/step_s" in r
    ]
    if not steps:
        return ["no RL step was logged"]

    def med(key: str) -> float | None:
        xs = [r[key] for r in steps if isinstance(r.get(key), int | float)]
        return statistics.median(xs) if xs else None

    planned = plan_peaks(plan)
    out = [
        f"{len(steps)} steps (medians)",
        "",
        "| phase | peak GiB | reserved GiB | plan GiB |",
        "|---|---|---|---|",
    ]
    first = next((r for r in rows if r.get("step") == 0), {})
    out.append(
        f"| start-up | {_fmt(first.get('memory/startup_peak_gib'))} | "
        f"{_fmt(first.get('memory/startup_reserved_gib'))} | {_fmt(planned.get('start-up'))} |"
    )
    for phase in ("rollout", "update", "sync"):
        peak = med(f"memory/{phase}_peak_gib") or med(f"memory/{phase}_peak_rss_gib")
        res = med(f"memory/{phase}_reserved_gib")
        out.append(f"| {phase} | {_fmt(peak)} | {_fmt(res)} | {_fmt(planned.get(phase))} |")
    n_resp = [r["rollout/response_len"] * n_seq for r in steps]
    gen, upd, step = med("time/generate_s"), med("time/update_s"), med("time/step_s")
    out += ["", f"step {step:.1f} s; generate {gen:.1f} s; update {upd:.1f} s"]
    if any(n_resp) and gen and upd:
        tok = statistics.median(n_resp)
        out.append(f"rollout {tok / gen:.0f} response tokens/s; update {tok / upd:.0f} response tokens/s")
    return out


def measured_peaks(rows: list[dict]) -> dict[str, float]:
    """GiB per phase as the run measured it (allocated): the start-up's from the step-0 row, each other
    phase's median over the RL steps after the first (absent phases left out)."""
    steps = [r for r in rows if r.get("step", 0) > 1 and "time/step_s" in r] or [
        r for r in rows if "time/step_s" in r
    ]
    out = {}
    first = next((r for r in rows if r.get("step") == 0), {})
    if isinstance(first.get("memory/startup_peak_gib"), int | float):
        out["start-up"] = float(first["memory/startup_peak_gib"])
    for phase in ("rollout", "update", "sync"):
        xs = [
            r[f"memory/{phase}_peak_gib"]
            for r in steps
            if isinstance(r.get(f"memory/{phase}_peak_gib"), int | float)
        ]
        if xs:
            out[phase] = statistics.median(xs)
    return out


def over_plan(rows: list[dict], plan: str, margin: float) -> list[str]:
    """Each phase whose measured peak exceeds the plan's estimate by more than ``margin`` (a
    fraction), one line each; a plan or a run that has no phase to compare is a failure too."""
    planned, measured = plan_peaks(plan), measured_peaks(rows)
    common = sorted(set(planned) & set(measured))
    if not common:
        return [f"no phase to compare (plan: {sorted(planned)}, run: {sorted(measured)})"]
    return [
        f"{phase}: measured {measured[phase]:.2f} GiB is {measured[phase] / planned[phase] - 1:+.1%} over the "
        f"plan's {planned[phase]:.2f} GiB (allowed {margin:.0%})"
        for phase in common
        if measured[phase] > planned[phase] * (1 + margin)
    ]


def main() -> None:
    import argparse

    import yaml

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("plan", type=Path, nargs="?")
    ap.add_argument(
        "--max-over-plan", type=float, default=None,
        help="exit 1 when a phase's measured peak exceeds the plan's by more than this fraction",
    )  # fmt: skip
    a = ap.parse_args()
    rows = [json.loads(x) for x in (a.run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    cfg = yaml.safe_load((a.run / "config.yaml").read_text())
    plan = a.plan.read_text() if a.plan is not None and a.plan.exists() else ""
    lines = summary(rows, int(cfg["prompts_per_step"]) * int(cfg["group_size"]), plan)
    bad = over_plan(rows, plan, a.max_over_plan) if a.max_over_plan is not None else []
    if a.max_over_plan is not None:
        lines += ["", f"measured against the plan (allowed {a.max_over_plan:.0%} over it): "
                  + ("; ".join(bad) if bad else "every phase within")]  # fmt: skip
    if plan:
        lines += ["", "gspo plan for the same config:", "", plan]
    print("\n".join(lines))
    if bad:
        print(f"gpu_phase_summary: over the plan: {'; '.join(bad)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
