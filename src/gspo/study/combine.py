"""The study: several compare folders (regimes) in one report, ``study.md`` and ``study.json``.

Verdicts come only from pre-registered endpoints, Holm-adjusted over *all* endpoints of their family
across the folders (a family's endpoints that no folder holds yet count as p = 1). The regime tables
are exploratory: raw (unadjusted) intervals, no verdicts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gspo.config import Config
from gspo.errors import GspoError
from gspo.resolve import pi_old_source
from gspo.study.folders import claim_folder
from gspo.study.metrics import PAPER_VOLATILITY, seed_means
from gspo.study.plots import accuracy_by_regime_plot, regimes_plot
from gspo.study.report import sampler_dtype
from gspo.study.statistics import (
    Interval,
    endpoint_p,
    fmt_p,
    holm,
    interval,
    paired_interval,
    verdict,
    welch_interval,
)

# the regime table's paired differences: (a, b, metric)
STUDY_PAIRS = [
    ("gspo", "grpo", "acc_final"),
    ("gspo", "grpo", "acc_auc"),
    ("grpo", "gspo", "drawdown"),
    ("grpo", "gspo", "spikes"),
    ("grpo_replay", "grpo", "acc_final"),
    ("gspo", "grpo_replay", "acc_final"),
]


def _load_summary(d: str | Path) -> dict[str, Any]:
    path = Path(d) / "summary.json"
    if not path.exists():
        raise GspoError(f"--study: {d} has no summary.json (run gspo compare --out {d} first)")
    data = json.loads(path.read_text())
    data["dir"] = str(d)
    return data


def _per_seed(data: dict[str, Any], v: str, key: str) -> dict[int, float | None]:
    return {int(s): r.get(key) for s, r in data["per_seed"].get(v, {}).items()}


def _twins(regs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(MoE regime, dense regime) pairs: models ``X-moe`` / ``X-dense`` with the same RL settings."""
    same = ("num_minibatches", "lr", "dtype", "rollout_dtype", "steps", "old_logp", "task")
    out = []
    for d in regs:
        md = str(d["config"]["model"])
        if "dense" not in md:
            continue
        for m in regs:
            if str(m["config"]["model"]) == md.replace("dense", "moe") and all(
                m["config"].get(k) == d["config"].get(k) for k in same
            ):
                out.append((m, d))
                break
    return out


def _regime_row(r: dict[str, Any], ci: str) -> dict[str, Any]:
    c = r["config"]
    vol = interval(seed_means(r["per_seed"], "volatility"), ci)
    cfg = Config(**{k: v for k, v in c.items() if k in Config.__dataclass_fields__})
    row: dict[str, Any] = {
        "preset": r["preset"],
        "dir": r["dir"],
        "model": c["model"],
        "num_minibatches": c["num_minibatches"],
        "lr": c["lr"],
        "dtype": c["dtype"] + sampler_dtype(c),
        "old_logp": pi_old_source(cfg),
        "seeds": len(r["seeds"]),
        "wall_s": r.get("timing", {}).get("wall_s"),
        "volatility": vol.to_dict(),
    }
    for a, b, key in STUDY_PAIRS:
        if a in r["per_seed"] and b in r["per_seed"]:
            iv, npos, nneg = paired_interval(_per_seed(r, a, key), _per_seed(r, b, key), ci)
            row[f"{a}-{b}:{key}"] = iv.to_dict()
    row["final"] = {
        v: interval(list(_per_seed(r, v, "acc_final").values()), ci).to_dict() for v in r["per_seed"]
    }
    row["collapses"] = {
        v: f"{sum(x.get('acc_collapse_step') is not None for x in s.values())}/{len(s)}"
        for v, s in r["per_seed"].items()
    }
    row["spikes"] = {
        v: sum(len(x.get("grad_spike_steps", [])) + len(x.get("ratio_spike_steps", [])) for x in s.values())
        for v, s in r["per_seed"].items()
    }
    return row


def _iv(d: dict[str, Any] | None, pct: bool = False) -> str:
    return Interval(d["mean"], d["lo"], d["hi"], d["n"]).fmt(pct) if d else "-"


def family_results(regs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per declared family: its size and every endpoint the folders hold, Holm-adjusted over the
    family (the verdicts of the study)."""
    fams: dict[str, dict[str, Any]] = {}
    for r in regs:
        pre = r.get("preregistration") or {}
        fam = pre.get("family")
        for res in pre.get("results", []):
            f = fams.setdefault(
                fam["name"], {"size": 0, "alpha": fam["alpha"], "test": fam["test"], "endpoints": []}
            )
            f["size"] = max(f["size"], fam["size"])
            p = endpoint_p(res)
            f["endpoints"].append(
                {
                    **res,
                    "preset": r["preset"],
                    "p": p,
                    "declared_at": pre.get("file_commit"),
                    "level": pre.get("level"),
                }
            )
    for f in fams.values():
        eps = f["endpoints"]
        f["size"] = max(f["size"], len(eps))
        for e, p_adj in zip(eps, holm([e["p"] for e in eps], f["size"]), strict=True):
            e["p_adj_study"] = p_adj
            level = e.get("level") or f["alpha"]  # a declared interim look's nominal level
            e["verdict_study"] = verdict(e["interval"]["mean"], p_adj, e["direction"], e["margin"], level)
    return fams


def _family_lines(fams: dict[str, dict[str, Any]]) -> list[str]:
    if not fams:
        return [
            "## Pre-registered endpoints",
            "",
            "None of these regimes declared a primary endpoint before it ran: **every number below is "
            "exploratory** (raw, unadjusted intervals; no verdicts).",
            "",
        ]
    lines = ["## Pre-registered endpoints (the only verdicts of this study)", ""]
    for name, f in fams.items():
        lines += [
            f"Family `{name}`: {f['size']} hypotheses ({len(f['endpoints'])} measured here; the rest count "
            f"as p = 1), Holm at family-wise {f['alpha']}, test: {f['test']} (two-sided; verdict by sign).",
            "",
            "| regime | endpoint | n | mean [raw 95% CI] | p | Holm p (family) | verdict | declared at |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for e in f["endpoints"]:
            side = ">" if e["direction"] == "greater" else "<"
            what = f"{e['metric']}: {e['a']} - {e['b']} {side} {e['margin']:g}"
            lines.append(
                f"| {e['preset']} | {what} | {e['interval']['n']} | {_iv(e['interval'])} | {fmt_p(e['p'])} | "
                f"{fmt_p(e['p_adj_study'])} | **{e['verdict_study']}** | {e.get('declared_at') or '-'} |"
            )
        lines.append("")
    return lines


def _regime_lines(rows: list[dict[str, Any]], out: Path) -> list[str]:
    lines = [
        "## Regimes (exploratory)",
        "",
        "| regime | model | opt. steps / rollout | lr | dtype, pi_old | seeds | wall time | expert "
        f"volatility per update (paper ~{PAPER_VOLATILITY:.0%}) | final acc | accuracy collapses | "
        "grad/ratio spikes |",
        "|---" * 11 + "|",
    ]
    for row in rows:
        wall = "n/a" if row["wall_s"] is None else f"{row['wall_s'] / 60:.1f} min"
        lines.append(
            f"| [{row['preset']}]({os.path.relpath(Path(row['dir']) / 'report.md', out)}) | {row['model']} | "
            f"{row['num_minibatches']} | {row['lr']:g} | {row['dtype']}, {row['old_logp']} | {row['seeds']} | "
            f"{wall} | {_iv(row['volatility'], True)} | "
            + "<br>".join(f"{v} {_iv(d)}" for v, d in row["final"].items())
            + " | "
            + ", ".join(f"{v} {c}" for v, c in row["collapses"].items())
            + " | "
            + ", ".join(f"{v} {c}" for v, c in row["spikes"].items())
            + " |"
        )
    lines += [
        "",
        "## Paired differences (a - b per seed), exploratory: mean [raw (unadjusted) 95% CI], no verdicts",
        "",
        "| regime | " + " | ".join(f"{a} - {b} {key}" for a, b, key in STUDY_PAIRS) + " |",
        "|---" * (len(STUDY_PAIRS) + 1) + "|",
    ]
    for row in rows:
        cells = [_iv(row.get(f"{a}-{b}:{key}")) for a, b, key in STUDY_PAIRS]
        lines.append(f"| {row['preset']} | " + " | ".join(cells) + " |")
    return lines


def _twin_lines(m: dict[str, Any], d: dict[str, Any], ci: str) -> list[str]:
    """MoE vs its dense twin (same RL settings): is GRPO's gap MoE-specific? (Welch, exploratory)"""
    lines = [
        "",
        f"## Is GRPO's problem MoE-specific? `{m['preset']}` (MoE) vs `{d['preset']}` (dense twin), exploratory",
        "",
        "| per-seed difference | MoE | dense twin | MoE - dense (Welch, raw) |",
        "|---|---|---|---|",
    ]
    for a, b, key in [
        ("gspo", "grpo", "acc_final"),
        ("gspo", "grpo", "acc_auc"),
        ("grpo", "gspo", "drawdown"),
        ("grpo", None, "acc_gain"),
        ("gspo", None, "acc_gain"),
    ]:
        if not all(v in x["per_seed"] for x in (m, d) for v in (a, b) if v is not None):
            continue

        def gaps(r: dict[str, Any], a: str = a, b: str | None = b, key: str = key) -> list[float]:
            xa = _per_seed(r, a, key)
            if b is None:
                return [x for x in xa.values() if x is not None]
            xb = _per_seed(r, b, key)
            return [x - xb[s] for s, x in xa.items() if x is not None and xb.get(s) is not None]

        gm, gd = gaps(m), gaps(d)
        what = f"{a} - {b} {key}" if b else f"{a} {key} (final - start)"
        lines.append(
            f"| {what} | {interval(gm, ci).fmt()} | {interval(gd, ci).fmt()} | {welch_interval(gm, gd).fmt()} |"
        )
    coll = {
        r["preset"]: ", ".join(
            f"{v} {sum(x.get('acc_collapse_step') is not None for x in s.values())}/{len(s)}"
            for v, s in r["per_seed"].items()
        )
        for r in (m, d)
    }
    return lines + ["", f"Accuracy collapses: MoE {coll[m['preset']]}; dense {coll[d['preset']]}."]


def write_study(dirs: list[str], out_dir: str | Path, ci: str = "t") -> Path:
    """One report over several compare folders: the pre-registered endpoints with verdicts from Holm
    over each declared family; per regime (exploratory) the expert volatility next to the paper's ~10%,
    the paired GSPO - GRPO and replay differences, collapse counts and run time; MoE vs its dense twin
    when both are there. Writes ``<out>/study.md``, ``study.json`` and plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    regs = [_load_summary(d) for d in dirs]
    claim_folder(out, "study")  # never over a study.json or study.md the command did not write
    rows = [_regime_row(r, ci) for r in regs]
    fams = family_results(regs)
    lines = [
        "# Stability study: GSPO vs GRPO across regimes",
        "",
        "Each regime is one `gspo compare` preset (its own report linked below). Differences are paired "
        f"by seed; intervals are 95% ({'Student t' if ci == 't' else 'percentile bootstrap'}) over seeds. "
        "Verdicts (consistent / inconsistent / inconclusive) only for endpoints declared before the runs, "
        "from Holm-adjusted p-values over their family; everything else is exploratory.",
        "",
    ]
    lines += _family_lines(fams) + _regime_lines(rows, out)
    for m, d in _twins(regs):
        lines += _twin_lines(m, d, ci)
    regimes_plot(out, rows)
    accuracy_by_regime_plot(out, regs, ci)
    lines += [
        "",
        "![volatility and GSPO - GRPO per regime](regimes.png)",
        "",
        "![held-out accuracy per regime](accuracy_by_regime.png)",
        "",
    ]
    report = out / "study.md"
    report.write_text("\n".join(lines))
    (out / "study.json").write_text(json.dumps({"regimes": rows, "families": fams}, indent=1))
    return report
