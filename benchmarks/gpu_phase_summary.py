"""Summarise a `gspo train` run's per-phase memory and speed beside `gspo plan`'s output (gpu_check.sh).

    python benchmarks/gpu_phase_summary.py RUN_DIR plan.txt

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


def main() -> None:
    import yaml

    run = Path(sys.argv[1])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    plan = Path(sys.argv[2]).read_text() if len(sys.argv) > 2 and Path(sys.argv[2]).exists() else ""
    lines = summary(rows, int(cfg["prompts_per_step"]) * int(cfg["group_size"]), plan)
    if plan:
        lines += ["", "gspo plan for the same config:", "", plan]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
