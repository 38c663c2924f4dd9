"""A declared endpoint's paired comparison, and a preset's declared secondary endpoints.

An endpoint compares two arms (``a - b``) or, for an interaction, two paired differences
(``(a - b) - (c - d)``), seed by seed. Secondary endpoints form their own declared family (Holm over
``secondary_family.size``); they get verdicts only when the runs are bound to the declaration, and
only at the final look.
"""

from __future__ import annotations

from typing import Any

from gspo.study.presets import Endpoint, Preset
from gspo.study.statistics import Comparison, adjust_family, compare_paired, fmt_p

PerSeed = dict[str, dict[int, dict[str, Any]]]  # variant -> seed -> run_stats


def column(per: PerSeed, v: str, key: str) -> dict[int, float | None]:
    return {s: r.get(key) for s, r in per.get(v, {}).items()}


def _diff(per: PerSeed, a: str, b: str, key: str) -> dict[int, float | None]:
    """seed -> a - b of ``key`` for the seeds both arms have a number for."""
    x, y = column(per, a, key), column(per, b, key)
    return {s: x[s] - y[s] for s in sorted(set(x) & set(y)) if x[s] is not None and y[s] is not None}  # type: ignore[operator]


def endpoint_comparison(per: PerSeed, e: Endpoint, test: str) -> Comparison:
    """The raw paired comparison of declared endpoint ``e`` (its p-values of ``e.margin``)."""
    if e.c:  # an interaction: the per-seed (a - b) against the per-seed (c - d)
        xa, xb = _diff(per, e.a, e.b, e.metric), _diff(per, e.c, e.d, e.metric)
        c = compare_paired(e.metric, f"{e.a} - {e.b}", f"{e.c} - {e.d}", xa, xb, e.margin)
    else:
        c = compare_paired(
            e.metric, e.a, e.b, column(per, e.a, e.metric), column(per, e.b, e.metric), e.margin
        )
    c.direction, c.test = e.direction, test
    return c


def secondary(per: PerSeed, preset: Preset, decl: dict[str, Any]) -> list[Comparison]:
    """The declared secondary endpoints, Holm-adjusted over their family; verdicts only when the runs
    are bound (``decl["preregistered"]``) and at the final look."""
    fam = preset.secondary_family
    if not preset.secondary or fam is None:
        return []
    comps = [endpoint_comparison(per, e, fam.test) for e in preset.secondary]
    adjust_family(comps, fam.size, fam.alpha)
    if not decl.get("preregistered") or decl.get("look") != "final":
        for c in comps:
            c.verdict = None
    return comps


def secondary_lines(preset: Preset, comps: list[Comparison], decl: dict[str, Any]) -> list[str]:
    if not comps or preset.secondary_family is None:
        return []
    f = preset.secondary_family
    lines = [
        "### Secondary endpoints (declared)",
        "",
        f"Family `{f.name}`: {f.size} hypotheses, Holm at {f.alpha}, test {f.test}; "
        + (
            "verdicts as the primary's binding allows."
            if decl.get("preregistered") and decl.get("look") == "final"
            else "**no verdicts** (the runs are not bound to the declaration, or this is an interim look)."
        ),
        "",
        "| endpoint | n | mean [raw 95% CI] | p (t) | p (sign-flip) | Holm-adjusted p | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for e, c in zip(preset.secondary, comps, strict=True):
        v = f"**{c.verdict}**" if c.verdict else "no verdict"
        lines.append(
            f"| {e.text()} | {c.interval.n} | {c.interval.fmt()} | {fmt_p(c.p_t)} | {fmt_p(c.p_perm)} | "
            f"{fmt_p(c.p_adj)} | {v} |"
        )
    return lines + [""]


def secondary_data(preset: Preset, comps: list[Comparison]) -> dict[str, Any]:
    if not comps or preset.secondary_family is None:
        return {}
    return {
        "secondary": [e.record() for e in preset.secondary],
        "secondary_family": dict(vars(preset.secondary_family)),
        "secondary_results": [c.to_dict() for c in comps],
    }
