"""Summarise a `gspo train` run's per-phase memory and speed beside `gspo plan`'s output (gpu_check.sh).

    python benchmarks/gpu_phase_summary.py RUN_DIR plan.txt

Medians over the RL steps after the first (the first allocates AdamW's state and warms kernels):
peak memory of the rollout, update and sync phases (GPU: allocated and reserved; CPU: peak RSS),
step time, and tokens per second of the rollout (response tokens / generate time) and of the update
(prompt + response tokens / update time). The plan's text follows, for the comparison by phase.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summary(rows: list[dict], n_seq: int) -> list[str]:
    """The table and speeds; ``n_seq``: sequences per step (prompts_per_step x group_size)."""
    steps = [r for r in rows if r.get("step", 0) > 1 and "time/step_s" in r] or [
        r for r in rows if "time/step_s" in r
    ]
    if not steps:
        return ["no RL step was logged"]

    def med(key: str) -> float | None:
        xs = [r[key] for r in steps if isinstance(r.get(key), int | float)]
        return statistics.median(xs) if xs else None

    out = [f"{len(steps)} steps (medians)", "", "| phase | peak GiB | reserved GiB |", "|---|---|---|"]
    for phase in ("rollout", "update", "sync"):
        peak = med(f"memory/{phase}_peak_gib") or med(f"memory/{phase}_peak_rss_gib")
        res = med(f"memory/{phase}_reserved_gib")
        out.append(
            f"| {phase} | {peak if peak is None else f'{peak:.2f}'} | {res if res is None else f'{res:.2f}'} |"
        )
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
    lines = summary(rows, int(cfg["prompts_per_step"]) * int(cfg["group_size"]))
    if len(sys.argv) > 2 and Path(sys.argv[2]).exists():
        lines += ["", "gspo plan for the same config:", "", Path(sys.argv[2]).read_text()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
