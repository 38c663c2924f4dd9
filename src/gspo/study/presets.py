"""Presets: a named regime (``src/gspo/presets/<name>.yaml``) and its pre-registered hypotheses.

A preset fixes the config overrides, seeds and variants, and may *declare before it runs* what it
tests (keys ``primary``, ``family``, ``declared_at``)::

    primary:                      # the confirmatory endpoints: only these get a verdict
      - {metric: acc_final, contrast: gspo - grpo_replay, direction: greater}
      - {metric: acc_final, contrast: gspo - grpo, direction: greater, margin: -0.02}
    family: {name: issue21-confirm, size: 4, alpha: 0.05, test: permutation}
    declared_at: 1a2b3c4          # optional: the commit the declaration was made at (checked with git)

``family`` groups endpoints over presets: Holm's adjustment runs over its ``size`` hypotheses
(default: this preset's endpoints). A preset without ``primary`` is wholly exploratory.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gspo.config import coerce
from gspo.errors import GspoError
from gspo.study.metrics import Criteria, run_stats
from gspo.study.statistics import ALPHA

VARIANTS: dict[str, dict[str, Any]] = {
    "gspo": {"algo": "gspo", "routing_replay": False},
    "gspo_token": {"algo": "gspo_token", "routing_replay": False},
    "grpo": {"algo": "grpo", "routing_replay": False},
    "grpo_replay": {"algo": "grpo", "routing_replay": True},
    # the other losses (not in the default set; --variants sapo,cispo,gmpo,luspo,vespo)
    "sapo": {"algo": "sapo", "routing_replay": False},
    "sapo_token": {"algo": "sapo_token", "routing_replay": False},
    "cispo": {"algo": "cispo", "routing_replay": False},
    "gmpo": {"algo": "gmpo", "routing_replay": False},
    "luspo": {"algo": "luspo", "routing_replay": False},
    "vespo": {"algo": "vespo", "routing_replay": False},
}
DEFAULT_VARIANTS = ["gspo", "gspo_token", "grpo", "grpo_replay"]
DEFAULT_SEEDS = [0, 1, 2, 3, 4]
PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
_KEYS = {
    "description",
    "config",
    "seeds",
    "variants",
    "runtime",
    "warm_target",
    "primary",
    "family",
    "declared_at",
}
# a warm_target is checked every 10 warm-start steps from step 50, on 200 held-out-like prompts
WARM_CHECK_EVERY, WARM_CHECK_AFTER, WARM_CHECK_PROMPTS = 10, 50, 200
_DIRECTIONS = ("greater", "less")
_TESTS = ("permutation", "t")


@dataclass(frozen=True)
class Endpoint:
    """A declared hypothesis: ``a - b`` of ``metric`` (a :func:`run_stats` key) is above (``greater``)
    or below (``less``) ``margin``; ``margin < 0`` with ``greater`` reads as non-inferiority."""

    metric: str
    a: str
    b: str
    direction: str = "greater"
    margin: float = 0.0

    @property
    def contrast(self) -> str:
        return f"{self.a} - {self.b}"

    def text(self) -> str:
        side = ">" if self.direction == "greater" else "<"
        return f"{self.metric}: {self.contrast} {side} {self.margin:g}"


@dataclass(frozen=True)
class Family:
    """The hypotheses one error rate is controlled over (Holm, family-wise at ``alpha``)."""

    name: str
    size: int
    alpha: float = ALPHA
    test: str = "permutation"  # which p-value enters Holm: the sign-flip test or the paired t test


@dataclass
class Preset:
    name: str
    description: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # Config overrides (coerced)
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))
    variants: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    runtime: str = ""  # the documented wall time of the whole compare
    warm_target: float | None = None  # warm start until this training accuracy (sft_steps: the most)
    path: Path | None = None
    primary: list[Endpoint] = field(default_factory=list)  # empty: everything exploratory
    family: Family | None = None
    declared_at: str | None = None


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(spec: str) -> Preset:
    """A shipped preset by name (``default``, ``staleness-16``...) or a preset YAML file path."""
    path = Path(spec) if spec.endswith((".yaml", ".yml")) else PRESETS_DIR / f"{spec}.yaml"
    if not path.is_file():
        raise GspoError(f"--preset: unknown preset {spec!r} (known: {', '.join(list_presets())})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise GspoError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise GspoError(f"{path}: expected a mapping")
    unknown = set(data) - _KEYS
    if unknown:
        raise GspoError(f"{path}: unknown preset key(s) {', '.join(sorted(unknown))}")
    cfg = data.get("config") or {}
    if not isinstance(cfg, dict):
        raise GspoError(f"{path}: 'config' must be a mapping of config keys")
    conf = {k.replace("-", "_"): coerce(k.replace("-", "_"), v, str(path)) for k, v in cfg.items()}
    variants = [str(v) for v in data.get("variants", DEFAULT_VARIANTS)]
    primary = [_endpoint(e, variants, path) for e in data.get("primary") or []]
    return Preset(
        name=path.stem,
        description=" ".join(str(data.get("description", "")).split()),
        config=conf,
        seeds=[int(s) for s in data.get("seeds", DEFAULT_SEEDS)],
        variants=variants,
        runtime=" ".join(str(data.get("runtime", "")).split()),
        warm_target=None if data.get("warm_target") is None else float(data["warm_target"]),
        path=path,
        primary=primary,
        family=_family(data.get("family"), path.stem, len(primary), path) if primary else None,
        declared_at=None if data.get("declared_at") is None else str(data["declared_at"]),
    )


_METRICS = set(run_stats([], Criteria()))  # what an endpoint may name: every per-run number


def _endpoint(e: Any, variants: list[str], path: Path) -> Endpoint:
    where = f"{path}: primary endpoint {e!r}"
    if not isinstance(e, dict) or set(e) - {"metric", "contrast", "direction", "margin"}:
        raise GspoError(f"{where}: expected {{metric, contrast: 'a - b', direction, margin}}")
    a, _, b = str(e.get("contrast", "")).partition(" - ")
    if not a or not b or a not in variants or b not in variants:
        raise GspoError(f"{where}: contrast must be 'a - b' of this preset's variants {variants}")
    if e.get("metric") not in _METRICS:
        raise GspoError(f"{where}: unknown metric (known: {', '.join(sorted(_METRICS))})")
    if e.get("direction", "greater") not in _DIRECTIONS:
        raise GspoError(f"{where}: direction must be one of {', '.join(_DIRECTIONS)}")
    return Endpoint(
        str(e["metric"]), a.strip(), b.strip(), e.get("direction", "greater"), float(e.get("margin", 0))
    )


def _family(f: Any, default_name: str, n: int, path: Path) -> Family:
    f = f or {}
    if not isinstance(f, dict) or set(f) - {"name", "size", "alpha", "test"}:
        raise GspoError(f"{path}: 'family' must be a mapping of name, size, alpha, test")
    fam = Family(
        str(f.get("name", default_name)), int(f.get("size", n)), float(f.get("alpha", ALPHA)),
        str(f.get("test", "permutation")),
    )  # fmt: skip
    if fam.size < n:
        raise GspoError(f"{path}: family size {fam.size} is smaller than its {n} primary endpoint(s)")
    if fam.test not in _TESTS or not 0 < fam.alpha < 1:
        raise GspoError(f"{path}: family test must be one of {', '.join(_TESTS)}, alpha in (0, 1)")
    return fam


def declaration(preset: Preset) -> dict[str, Any]:
    """Where the declaration comes from: the commit the preset file was last changed in and whether
    the file differs from it (a declaration that is not committed is not yet a pre-registration);
    ``declared_at`` when the preset names one, and whether that commit holds the same declaration."""
    out: dict[str, Any] = {"declared_at": preset.declared_at, "file_commit": None, "committed": None}
    if preset.path is None or not preset.primary:
        return out
    here = preset.path.resolve().parent

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    name = preset.path.resolve().name
    log = git("log", "-1", "--format=%h", "--", name)
    if log is None:  # no git, or not a checkout: unknown, never invented
        return out
    out["file_commit"] = log or None
    out["committed"] = bool(log) and git("diff", "--quiet", "HEAD", "--", name) is not None
    if preset.declared_at:
        text = git("show", f"{preset.declared_at}:./{name}")
        old = yaml.safe_load(text) if text else None
        now = yaml.safe_load(preset.path.read_text())
        out["declared_at_matches"] = (
            None if old is None else all(old.get(k) == now.get(k) for k in ("primary", "family", "seeds"))
        )
    return out
