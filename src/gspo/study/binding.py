"""Binding a study's runs to its preset's committed declaration (pre-registration).

Each run folder ``gspo compare`` starts records what it was run for (:func:`run_record`, written as
:data:`RUN_RECORD` before it trains). A report says "pre-registered" only when :func:`_binding` finds
every run bound: the preset's sha256, endpoints and family as declared; no setting changed; the
analysed seeds the declared ones; every run from a clean gspo checkout; the runs' **resolved config**
(every field of every arm's config and the plan gspo resolves from it, defaults included, the
warm-start gate and the analysis criteria: :func:`resolved_settings`) the one the preset declares in
``resolved_sha256``, so a code default changed after the declaration is caught; the preset committed
(by the *later* of its author and committer dates) before the first run started, and that commit an
ancestor of the checkout every run ran from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from gspo.study.metrics import Criteria
from gspo.study.presets import (
    RUN_RECORD,
    WARM_CHECK_AFTER,
    WARM_CHECK_EVERY,
    WARM_CHECK_PROMPTS,
    Preset,
    load_preset,
)
from gspo.study.statistics import ALPHA, interim_levels

__all__ = [
    "RUN_RECORD",
    "STEERING",
    "declaration",
    "resolved_settings",
    "resolved_sha256",
    "run_record",
    "study_values",
]

# config fields that steer a run but do not change what it computes: a finished run with other
# values of these is still reused, and the resolved config takes their defaults
STEERING = {
    "progress",
    "threads",
    "save_every",
    "wandb",
    "report_to",
    "dist_timeout_min",
    "resume",
    "overwrite",
    "output_dir",
    "name",
}


def _git(here: Path, *args: str) -> str | None:
    """``git args`` in ``here``: its stdout, or None without git / outside a checkout / on failure."""
    try:
        r = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def preset_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def study_values(preset: Preset) -> dict[str, Any]:
    """The config values a compare starts each arm from before its own settings: the preset's
    config over studies' own default, the reproducible mode (:mod:`gspo.repro`)."""
    return {"reproducible": True} | dict(preset.config)


def resolved_settings(
    preset: Preset, base: Any | None = None, variants: list[str] | None = None, target: Any = "declared"
) -> dict[str, Any]:
    """What the runs compute with, every default included: per variant the plan gspo resolves from
    its config (:func:`gspo.resolve.resolve`, which holds the whole config too), with the settings
    that only steer a run (:data:`STEERING`) and the run's name, folder and seed at their defaults;
    the warm-start gate (its target and the constants of :mod:`gspo.study.warm`); the analysis
    criteria's defaults. ``base`` (default: the preset's config over gspo's defaults), ``variants``
    and ``target`` (default: the preset's) as a compare runs them."""
    from gspo import resolve
    from gspo.config import Config, make_config

    if base is None:
        base = make_config(None, study_values(preset))
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    fixed = {k: defaults[k] for k in STEERING} | {"seed": defaults["seed"]}
    per = {}
    for v in preset.variants if variants is None else variants:
        cfg = dataclasses.replace(base, **fixed, **preset.settings()[v]).validate()
        per[v] = json.loads(json.dumps(dataclasses.asdict(resolve.resolve(cfg)), default=repr))
    gate = {"target": preset.warm_target if target == "declared" else target}
    gate |= {"check_every": WARM_CHECK_EVERY, "check_after": WARM_CHECK_AFTER, "prompts": WARM_CHECK_PROMPTS}
    return {"variants": per, "warm_gate": gate, "criteria": dataclasses.asdict(Criteria())}


def resolved_sha256(resolved: dict[str, Any]) -> str:
    """The sha256 a preset declares as ``resolved_sha256``: of :func:`resolved_settings`' JSON."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()


def run_record(
    preset: Preset,
    seeds: list[int] | None = None,
    overrides: dict[str, Any] | None = None,
    resolved: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a compare's runs are run for (written to each run folder's :data:`RUN_RECORD` before it
    trains, with its start time): the preset file's sha256, its endpoints, family, declared seeds and
    interim look, the seeds run and every setting changed from the declaration (``overrides``: name
    -> {declared, used}), the resolved config the runs use (``resolved``, default the preset's own:
    :func:`resolved_settings`) and its sha256, the commit that last changed the file, the commit of
    the checkout holding the preset, the gspo checkout's commit and whether its tree was dirty. What
    decided each run's floating-point numbers is the run's own ``environment.json`` (written by the
    process that trains it: :func:`gspo.repro.write_environment`), which the report collects."""
    decl = declaration(preset)
    src = Path(__file__).resolve().parent
    head = _git(src, "rev-parse", "HEAD")
    status = _git(src, "status", "--porcelain", "--untracked-files=no") if head else None
    here = preset.path.resolve().parent if preset.path else None
    resolved = resolved_settings(preset) if resolved is None else resolved
    return {
        "preset": preset.name,
        "preset_file": str(preset.path) if preset.path else None,
        "preset_sha256": preset_hash(preset.path) if preset.path else None,
        "primary": [e.record() for e in preset.primary],
        "family": dataclasses.asdict(preset.family) if preset.family else None,
        **(
            {
                "secondary": [e.record() for e in preset.secondary],
                "secondary_family": vars(preset.secondary_family),
            }
            if preset.secondary_family
            else {}
        ),
        "declared_seeds": list(preset.seeds),
        "interim": preset.interim,
        "seeds": list(preset.seeds if seeds is None else seeds),
        "overrides": dict(overrides or {}),
        "resolved_sha256": resolved_sha256(resolved),
        "resolved": resolved,
        "declared_at": preset.declared_at,
        "declaring_commit": decl.get("commit"),
        "preset_committed": decl.get("committed"),
        "preset_repo_head": _git(here, "rev-parse", "HEAD") if here else None,
        "gspo_commit": head,
        "gspo_dirty": None if status is None else bool(status),
    }


def declaration(
    preset: Preset,
    records: dict[str, Any] | None = None,
    analysed: dict[str, list[int]] | None = None,
    criteria: Criteria | None = None,
) -> dict[str, Any]:
    """Where the declaration comes from: the commit the preset file was last changed in (and its
    time: the later of author and committer date) and whether the file differs from it (a
    declaration that is not committed is not yet a pre-registration); ``declared_at`` when the preset
    names one, and whether that commit holds the same declaration. With ``records`` (run name -> its
    :data:`RUN_RECORD`, None where it has none), ``analysed`` (variant -> the seeds analysed) and the
    analysis ``criteria`` (default: :class:`Criteria`'s): ``preregistered``, when not ``why_not``
    (:func:`_binding`), and when so the look (``interim`` or ``final``) and its nominal ``level``."""
    out: dict[str, Any] = {"declared_at": preset.declared_at, "file_commit": None, "committed": None}
    if preset.path is not None and preset.primary:
        _from_git(preset, preset.path.resolve(), out)
    if records is not None and preset.primary:
        why = _binding(preset, out, records, analysed or {}, criteria or Criteria())
        out |= {"preregistered": why is None, "why_not": why}
        if why is None:
            out["first_start"] = min(r["started_at"] for r in records.values())
            out |= _look(preset, analysed or {})
    return out


def _look(preset: Preset, analysed: dict[str, list[int]]) -> dict[str, Any]:
    """Which declared look the analysed seeds are and its nominal level: the family's alpha without
    an interim look, else the O'Brien-Fleming-type levels of :func:`interim_levels`."""
    alpha = preset.family.alpha if preset.family else ALPHA
    if preset.interim is None:
        return {"look": "final", "level": alpha}
    a1, a2 = interim_levels(alpha, preset.interim / len(preset.seeds))
    n = len(set().union(*map(set, analysed.values()))) if analysed else 0
    look = "interim" if n == preset.interim else "final"
    return {"look": look, "level": a1 if look == "interim" else a2, "levels": [a1, a2]}


def _from_git(preset: Preset, path: Path, out: dict[str, Any]) -> None:
    here, name = path.parent, path.name
    log = _git(here, "log", "-1", "--format=%h %H %at %ct", "--", name)
    if log is None:  # no git, or not a checkout: unknown, never invented
        return
    short, full, at, ct = log.split() if log else (None, None, None, None)
    # the declaration existed by both dates at the latest: an author date can be set to any past
    # time (git commit --date, an amend), a committer date too (GIT_COMMITTER_DATE), so the later one
    when = max(int(at), int(ct)) if at and ct else None
    out |= {"file_commit": short, "commit": full, "commit_time": when}
    out["committed"] = bool(log) and _git(here, "diff", "--quiet", "HEAD", "--", name) is not None
    if preset.declared_at:
        text = _git(here, "show", f"{preset.declared_at}:./{name}")
        old = _safe_yaml(text) if text else None
        now = _safe_yaml(path.read_text())
        out["declared_at_matches"] = (
            None
            if not isinstance(old, dict) or not isinstance(now, dict)
            else all(old.get(k) == now.get(k) for k in ("primary", "family", "seeds"))
        )


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _some(names: Any) -> str:
    names = sorted(names)
    return ", ".join(map(str, names[:3])) + (" ..." if len(names) > 3 else "")


def _binding(
    preset: Preset,
    decl: dict[str, Any],
    records: dict[str, Any],
    analysed: dict[str, list[int]],
    criteria: Criteria,
) -> str | None:
    """Why the runs are not bound to the preset's committed declaration (None: they are): every run
    must record this file's current sha256 and endpoints, no setting changed from it, a clean gspo
    checkout and the resolved config the preset declares; the analysed seeds must be the declared
    ones (or the declared interim look's); the commit that last changed the file must precede every
    run's start and be an ancestor of the checkout every run ran from."""
    if not records:
        return "no run has finished"
    missing = [n for n, r in records.items() if not isinstance(r, dict)]
    if missing:
        return (
            f"runs do not record their declaration (run before this check existed, or not by gspo "
            f"compare): {_some(missing)} have no {RUN_RECORD}"
        )
    now = preset_hash(preset.path) if preset.path and preset.path.is_file() else None
    changed = [n for n, r in records.items() if r.get("preset_sha256") != now]
    if changed:
        return f"the preset changed after the runs: hashes differ ({_some(changed)} ran another preset file)"
    endpoints = [e.record() for e in preset.primary]
    family = dataclasses.asdict(preset.family) if preset.family else None
    second = [e.record() for e in preset.secondary]
    fam2 = dataclasses.asdict(preset.secondary_family) if preset.secondary_family else None
    other = [
        n
        for n, r in records.items()
        if (r.get("primary"), r.get("family"), r.get("secondary", []), r.get("secondary_family"))
        != (endpoints, family, second, fam2)
    ]
    if other:
        return f"runs {_some(other)} record other endpoints or another family than the preset declares"
    checks = (_settings(records), _seeds_analysed(preset, analysed), _clean(records))
    why = "; and ".join(w for w in checks if w) or _resolved(preset, records, criteria)
    if why:
        return why
    return _dated(decl, records) or _ancestry(preset, decl, records)


def _dated(decl: dict[str, Any], records: dict[str, Any]) -> str | None:
    """The declaration committed, before the first run started."""
    if decl.get("commit_time") is None:
        return "the preset file has no commit (no git history): when it was declared is unknown"
    if decl.get("committed") is not True:
        return "the preset file has uncommitted changes: the declaration is not yet registered"
    starts = {n: r.get("started_at") for n, r in records.items()}
    unknown = [n for n, t in starts.items() if not isinstance(t, (int, float))]
    if unknown:
        return f"runs {_some(unknown)} record no start time"
    first = min(starts, key=lambda n: starts[n])
    if decl["commit_time"] >= starts[first]:
        return (
            f"the declaration was committed ({decl['file_commit']}, {_when(decl['commit_time'])}) after run "
            f"{first} started ({_when(starts[first])})"
        )
    return None


def _settings(records: dict[str, Any]) -> str | None:
    """Runs whose record does not say their seeds and settings, or names a setting changed from the
    declaration (each change named: the runs are then exploratory)."""
    blind = [n for n, r in records.items() if not isinstance(r.get("overrides"), dict) or "seeds" not in r]
    if blind:
        return f"runs {_some(blind)} record neither their seeds nor their settings (run before this check)"
    changed: dict[str, Any] = {}
    for r in records.values():
        changed |= r["overrides"]
    if not changed:
        return None
    what = "; ".join(
        f"{k} {c.get('declared')!r} -> {c.get('used')!r}" if isinstance(c, dict) else f"{k} {c!r}"
        for k, c in sorted(changed.items())
    )
    return f"settings changed from the declaration, so every endpoint is exploratory: {what}"


def _clean(records: dict[str, Any]) -> str | None:
    """Every run from a gspo checkout without uncommitted changes (what ran is then a commit)."""
    dirty = [n for n, r in records.items() if r.get("gspo_dirty") is True]
    if dirty:
        return (
            f"runs {_some(dirty)} ran from a gspo checkout with uncommitted changes (gspo_dirty): the code "
            "they ran is in no commit"
        )
    unknown = [n for n, r in records.items() if r.get("gspo_dirty") is not False]
    if unknown:
        return f"runs {_some(unknown)} record no clean gspo checkout (gspo_dirty unknown): the code they ran is unknown"
    return None


def _resolved(preset: Preset, records: dict[str, Any], criteria: Criteria) -> str | None:
    """Every run's resolved config is the one the preset declares (``resolved_sha256``), and the
    analysis uses the criteria it holds."""
    if preset.resolved_sha256 is None:
        here = resolved_sha256(resolved_settings(preset))
        return (
            "the preset does not declare its resolved config, so a default changed after the declaration "
            f"would go unnoticed: add `resolved_sha256: {here}` (this checkout's, `python -m "
            "gspo.study.binding PRESET`) before it runs"
        )
    other = [n for n, r in records.items() if r.get("resolved_sha256") != preset.resolved_sha256]
    if other:
        first = records[sorted(other)[0]]
        fields = _differing(first.get("resolved"), resolved_settings(preset))
        where = f" (against this checkout's resolution: {fields})" if fields else ""
        return (
            f"runs {_some(other)} resolved the preset to another config than the declared resolved_sha256 "
            f"{preset.resolved_sha256[:12]} (a default changed after the declaration){where}"
        )
    crit = (next(iter(records.values())).get("resolved") or {}).get("criteria")
    if crit != dataclasses.asdict(criteria):
        return "the analysis criteria (collapse and spike rules) are not the declared ones"
    return None


def _differing(a: Any, b: Any, path: str = "") -> str:
    """Up to 3 dotted paths where two resolved configs differ ("" when ``a`` is not a mapping)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return ""
    out: list[str] = []

    def walk(x: Any, y: Any, at: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{at}.{k}" if at else k)
        elif x != y:
            out.append(f"{at} {x!r} -> {y!r}")

    walk(a, b, path)
    return "; ".join(out[:3]) + (f"; {len(out) - 3} more" if len(out) > 3 else "")


def _seeds_analysed(preset: Preset, analysed: dict[str, list[int]]) -> str | None:
    """The analysed seeds (every endpoint arm's) against the declared ones, or the declared interim
    look's first ``interim`` seeds: an arm without runs, seeds no arm ran ("missing 4, 5"), seeds one
    arm lacks ("missing 5 of grpo") and undeclared seeds are named."""
    empty = sorted(v for v, s in analysed.items() if not s)
    ran = {v: set(s) for v, s in analysed.items() if s}
    union = set().union(*ran.values()) if ran else set()
    allowed = [set(preset.seeds)] + ([set(preset.seeds[: preset.interim])] if preset.interim else [])
    if not empty and union in allowed and all(s == union for s in ran.values()):
        return None
    target = min(allowed, key=lambda a: len(a ^ union))
    parts = [
        f"declared {_span(preset.seeds)}"
        + (f" (interim look: the first {preset.interim})" if preset.interim else "")
    ]
    if empty:
        parts.append(f"no runs of {', '.join(empty)}")
    if target - union:
        parts.append(f"missing {_some(target - union)}")
    parts += [
        f"missing {_some((target & union) - s)} of {v}"
        for v, s in sorted(ran.items())
        if (target & union) - s
    ]
    if union - target:
        parts.append(f"not declared {_some(union - target)}")
    return "the analysed seeds are not the declared ones (" + "; ".join(parts) + ")"


def _span(seeds: list[int]) -> str:
    """Seeds as runs of consecutive integers: [100, 101, 102, 7] -> "100-102, 7"."""
    runs: list[list[int]] = []
    for x in seeds:
        if runs and x == runs[-1][-1] + 1:
            runs[-1].append(x)
        else:
            runs.append([x])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _ancestry(preset: Preset, decl: dict[str, Any], records: dict[str, Any]) -> str | None:
    """The declaring commit must be in the history of the checkout each run ran from (its recorded
    ``preset_repo_head``: for a shipped preset, gspo's own commit)."""
    here = preset.path.resolve().parent if preset.path else None
    heads = {n: r.get("preset_repo_head") for n, r in records.items()}
    unknown = [n for n, h in heads.items() if not isinstance(h, str) or not h]
    if unknown or here is None:
        return f"runs {_some(unknown)} record no commit of the checkout they ran from"
    outside = [
        n for n, h in heads.items()
        if _git(here, "merge-base", "--is-ancestor", decl["commit"], h) is None
    ]  # fmt: skip
    if outside:
        return (
            f"the declaring commit {decl['file_commit']} is not an ancestor of the commit runs "
            f"{_some(outside)} ran from"
        )
    return None


def _safe_yaml(text: str) -> Any:
    """A preset's text from git, or as it is now: None where it is not YAML (never a traceback)."""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return None


def main(argv: list[str] | None = None) -> int:
    """``python -m gspo.study.binding PRESET``: the ``resolved_sha256`` to declare in PRESET (this
    checkout's resolution of it), to add before it is committed and run."""
    import sys

    from gspo.errors import GspoError

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gspo.study.binding PRESET (a preset name or YAML file)", file=sys.stderr)
        return 2
    try:
        print(resolved_sha256(resolved_settings(load_preset(args[0]))))
    except GspoError as e:
        print(f"gspo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
