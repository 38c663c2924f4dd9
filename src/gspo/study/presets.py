"""Presets: a named regime (``src/gspo/presets/<name>.yaml``) and its pre-registered hypotheses.

A preset fixes the config overrides, seeds and variants, and may *declare before it runs* what it
tests (keys ``primary``, ``family``, ``declared_at``)::

    primary:                      # the confirmatory endpoints: only these get a verdict
      - {metric: acc_final, contrast: gspo - grpo_replay, direction: greater}
      - {metric: acc_final, contrast: gspo - grpo, direction: greater, margin: -0.02}
    family: {name: issue21-confirm, size: 4, alpha: 0.05, test: permutation}
    declared_at: 1a2b3c4          # optional: the commit the declaration was made at (checked with git)
    interim: {seeds: 14, spending: obrien-fleming}   # optional: one look after the first 14 seeds
    resolved_sha256: "3f1c..."    # every default the runs will use (python -m gspo.study.binding PRESET)

``family`` groups endpoints over presets: Holm's adjustment runs over its ``size`` hypotheses
(default: this preset's endpoints), the ones run elsewhere counting as p = 1 in one compare's report
(the combined study adjusts over every folder it is given). A preset without ``primary`` is wholly
exploratory. The declaration binds (:mod:`gspo.study.binding`): the analysed seeds must be the
declared ``seeds`` (or, with ``interim``, their first ``interim.seeds``), every setting as declared,
every default too (the runs' resolved config hashes to ``resolved_sha256``), every run from a clean
checkout, the preset committed (by the later of author and committer date) before every run started
and an ancestor of the checkout every run ran from.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.config import coerce
from gspo.config.parse import read_yaml
from gspo.errors import GspoError
from gspo.study.metrics import Criteria, run_stats
from gspo.study.statistics import ALPHA

VARIANTS: dict[str, dict[str, Any]] = {
    "gspo": {"algo": "gspo", "routing_replay": False},
    "gspo_token": {"algo": "gspo_token", "routing_replay": False},
    "grpo": {"algo": "grpo", "routing_replay": False},
    "grpo_replay": {"algo": "grpo", "routing_replay": True},
    # GRPO's token ratios under GSPO's sequence mask and range (an ablation; gspo.losses)
    "grpo_seq_mask": {"algo": "grpo_seq_mask", "routing_replay": False},
    # the other losses (not in the default set; --variants sapo,cispo,gmpo,luspo,vespo)
    "sapo": {"algo": "sapo", "routing_replay": False},
    "sapo_token": {"algo": "sapo_token", "routing_replay": False},
    "cispo": {"algo": "cispo", "routing_replay": False},
    "gmpo": {"algo": "gmpo", "routing_replay": False},
    "luspo": {"algo": "luspo", "routing_replay": False},
    "vespo": {"algo": "vespo", "routing_replay": False},
    # issue 58: the trust-region family and the entropy controls (gspo.losses_trust), and MaxRL's
    # advantage scale on GRPO's loss (as TRL's and the paper's) and on GSPO's
    "dppo_tv": {"algo": "dppo_tv", "routing_replay": False},
    "dppo_kl": {"algo": "dppo_kl", "routing_replay": False},
    "clip_cov": {"algo": "clip_cov", "routing_replay": False},
    "kl_cov": {"algo": "kl_cov", "routing_replay": False},
    "maxrl": {"algo": "grpo", "adv_scale": "maxrl", "routing_replay": False},
    "gspo_maxrl": {"algo": "gspo", "adv_scale": "maxrl", "routing_replay": False},
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
    "arms",
    "interim",
    "secondary",
    "secondary_family",
    "pairs",
    "resolved_sha256",
}
SPENDING = ("obrien-fleming",)  # the one declared interim look's alpha-spending rule
# a warm_target is checked every 10 warm-start steps from step 50, on 200 held-out-like prompts
WARM_CHECK_EVERY, WARM_CHECK_AFTER, WARM_CHECK_PROMPTS = 10, 50, 200
_DIRECTIONS = ("greater", "less")
_TESTS = ("permutation", "t")


@dataclass(frozen=True)
class Endpoint:
    """A declared hypothesis: ``a - b`` of ``metric`` (a :func:`run_stats` key) is above (``greater``)
    or below (``less``) ``margin``; ``margin < 0`` with ``greater`` reads as non-inferiority. With
    ``c`` and ``d`` an interaction: ``(a - b) - (c - d)``, paired by seed."""

    metric: str
    a: str
    b: str
    direction: str = "greater"
    margin: float = 0.0
    c: str = ""
    d: str = ""

    @property
    def contrast(self) -> str:
        return f"({self.a} - {self.b}) - ({self.c} - {self.d})" if self.c else f"{self.a} - {self.b}"

    @property
    def arms(self) -> tuple[str, ...]:
        return (self.a, self.b, self.c, self.d) if self.c else (self.a, self.b)

    def record(self) -> dict[str, Any]:
        """As run records store it (an endpoint of two arms without the interaction's keys, as before)."""
        out = dataclasses.asdict(self)
        return out if self.c else {k: v for k, v in out.items() if k not in ("c", "d")}

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
    interim: int | None = None  # seeds at the one declared interim look (O'Brien-Fleming-type spending)
    secondary: list[Endpoint] = field(default_factory=list)  # their own declared family (Holm)
    secondary_family: Family | None = None
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)  # the preset's own variants
    pairs: list[tuple[str, str]] = field(default_factory=list)  # exploratory a - b beyond metrics.PAIRS
    resolved_sha256: str | None = None  # the declared resolved config (gspo.study.binding)

    def settings(self) -> dict[str, dict[str, Any]]:
        """Every variant this preset can run: the built-in :data:`VARIANTS` and its own ``arms``."""
        return VARIANTS | self.arms


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(spec: str) -> Preset:
    """A shipped preset by name (``default``, ``staleness-16``...) or a preset YAML file path. Every
    problem is one GspoError line naming the file, the key's line and the key."""
    path = Path(spec) if spec.endswith((".yaml", ".yml")) else PRESETS_DIR / f"{spec}.yaml"
    if not path.is_file():
        raise GspoError(f"--preset: unknown preset {spec!r} (known: {', '.join(list_presets())})")
    data, lines = read_yaml(path, "preset file")
    if data is None or data == {}:  # an empty file (or comments only) declares nothing: a mistake
        raise GspoError(f"{path}: the preset file is empty (expected keys such as config, seeds, variants)")
    if not isinstance(data, dict):
        raise GspoError(f"{path}: expected a mapping of preset keys, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in _KEYS)
    if unknown:
        raise GspoError(
            f"{path}: unknown preset key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})"
        )
    at = lambda key: f"{path}:{lines[key]}" if key in lines else str(path)  # noqa: E731
    cfg = data.get("config") or {}
    if not isinstance(cfg, dict) or not all(isinstance(k, str) for k in cfg):
        raise GspoError(f"{at('config')}: 'config' must be a mapping of config keys (got {cfg!r:.60})")
    conf = {k.replace("-", "_"): coerce(k.replace("-", "_"), v, at("config")) for k, v in cfg.items()}
    variants = _names(data.get("variants", DEFAULT_VARIANTS), at("variants"), "variants")
    arms = _arms(data.get("arms"), at("arms"))
    primary_list = data.get("primary") or []
    if not isinstance(primary_list, list):
        raise GspoError(f"{at('primary')}: 'primary' must be a list of endpoints (got {primary_list!r:.60})")
    primary = [_endpoint(e, variants, at("primary")) for e in primary_list]
    warm = data.get("warm_target")
    seeds = _seeds(data.get("seeds", DEFAULT_SEEDS), at("seeds"))
    return Preset(
        name=path.stem,
        description=_text(data.get("description"), at("description"), "description"),
        config=conf,
        seeds=seeds,
        variants=variants,
        runtime=_text(data.get("runtime"), at("runtime"), "runtime"),
        warm_target=None if warm is None else _number(warm, at("warm_target"), "warm_target"),
        path=path,
        primary=primary,
        family=_family(data.get("family"), path.stem, len(primary), at("family")) if primary else None,
        declared_at=_text(data.get("declared_at"), at("declared_at"), "declared_at") or None,
        interim=_interim(data.get("interim"), seeds, bool(primary), at("interim")),
        **_secondary(data, variants, bool(primary), path.stem, at),
        arms=arms,
        pairs=_pairs(data.get("pairs", []), variants, at("pairs")),
        resolved_sha256=_sha256(data.get("resolved_sha256"), at("resolved_sha256")),
    )


def _secondary(
    data: dict[str, Any], variants: list[str], primary: bool, stem: str, at: Any
) -> dict[str, Any]:
    """``secondary`` endpoints (after a primary one) and their own ``secondary_family``."""
    v = data.get("secondary")
    if v is None:
        if data.get("secondary_family") is not None:
            raise GspoError(f"{at('secondary_family')}: 'secondary_family' without 'secondary' endpoints")
        return {}
    if not isinstance(v, list) or not v or not primary:
        raise GspoError(
            f"{at('secondary')}: 'secondary' must be a non-empty list of endpoints after 'primary'"
        )
    eps = [_endpoint(e, variants, at("secondary")) for e in v]
    fam = _family(data.get("secondary_family"), f"{stem}-secondary", len(eps), at("secondary_family"))
    return {"secondary": eps, "secondary_family": fam}


def _interim(v: Any, seeds: list[int], primary: bool, where: str) -> int | None:
    """The one interim look a preset may declare: after its first ``seeds`` seeds, with its spending
    rule named (O'Brien-Fleming type: :func:`gspo.study.statistics.interim_levels`)."""
    if v is None:
        return None
    ok = isinstance(v, dict) and set(v) == {"seeds", "spending"} and v["spending"] in SPENDING
    k = v.get("seeds") if isinstance(v, dict) else None
    if not ok or type(k) is not int or not 2 <= k < len(seeds) or not primary:
        raise GspoError(
            f"{where}: 'interim' must be {{seeds: k, spending: {SPENDING[0]}}} with 2 <= k < the "
            f"{len(seeds)} declared seeds, in a preset with primary endpoints (got {v!r:.60})"
        )
    return k


def _arms(v: Any, where: str) -> dict[str, dict[str, Any]]:
    """A preset's own variants: name -> config overrides (e.g. GRPO with another clip range). Each
    names its ``algo``; a built-in variant's name cannot be redefined."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise GspoError(f"{where}: 'arms' must be a mapping of name -> config overrides (got {v!r:.60})")
    arms = {}
    for name, conf in v.items():
        if not isinstance(name, str) or not name.strip() or name in VARIANTS:
            raise GspoError(f"{where}: arm {name!r:.40} must be a new name (built-in: {', '.join(VARIANTS)})")
        if not isinstance(conf, dict) or "algo" not in conf:
            raise GspoError(f"{where}: arm {name!r}: expected a mapping of config keys with 'algo'")
        arms[name] = {"routing_replay": False} | {
            k.replace("-", "_"): coerce(k.replace("-", "_"), x, f"{where}: arm {name!r}")
            for k, x in conf.items()
        }
    return arms


def _text(v: Any, where: str, key: str) -> str:
    """A scalar as one line of text (None: empty); a list or mapping is refused."""
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        raise GspoError(f"{where}: '{key}' must be text, got a {type(v).__name__}")
    return " ".join(str(v).split())


def _sha256(v: Any, where: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise GspoError(f"{where}: 'resolved_sha256' must be 64 lowercase hex digits (got {v!r:.80})")
    return v


def _number(v: Any, where: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise GspoError(f"{where}: '{key}' must be a finite number (got {v!r:.60})")
    return float(v)


def _seeds(v: Any, where: str) -> list[int]:
    ok = isinstance(v, list) and v and all(type(s) is int and 0 <= s < 2**32 for s in v)
    if not ok:
        raise GspoError(
            f"{where}: 'seeds' must be a non-empty list of integers in [0, 2**32) (got {v!r:.60})"
        )
    return list(v)


def _names(v: Any, where: str, key: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
        raise GspoError(f"{where}: '{key}' must be a non-empty list of names (got {v!r:.60})")
    return [x.strip() for x in v]


def _pairs(v: Any, variants: list[str], where: str) -> list[tuple[str, str]]:
    """``pairs: ["a - b", ...]``: more exploratory paired differences for the report (no verdicts)."""
    split = [tuple(x.strip() for x in p.split(" - ")) if isinstance(p, str) else () for p in v or []]
    if not isinstance(v, list) or any(len(p) != 2 or not set(p) <= set(variants) for p in split):
        raise GspoError(f"{where}: 'pairs' must be a list of 'a - b' of this preset's variants {variants}")
    return split  # type: ignore[return-value]


_INTERACTION = re.compile(r"\(\s*(\S+)\s+-\s+(\S+)\s*\)\s+-\s+\(\s*(\S+)\s+-\s+(\S+)\s*\)")
_METRICS = set(run_stats([], Criteria()))  # what an endpoint may name: every per-run number


def _endpoint(e: Any, variants: list[str], where: str) -> Endpoint:
    where = f"{where}: primary endpoint {e!r:.80}"
    if not isinstance(e, dict) or set(e) - {"metric", "contrast", "direction", "margin"}:
        raise GspoError(f"{where}: expected {{metric, contrast: 'a - b', direction, margin}}")
    contrast, metric, direction = e.get("contrast", ""), e.get("metric"), e.get("direction", "greater")
    text = contrast if isinstance(contrast, str) else ""
    both = _INTERACTION.fullmatch(text.strip())
    a, _, b = text.partition(" - ")
    arms = list(both.groups()) if both else [a.strip(), b.strip()]
    if not all(arms) or any(x not in variants for x in arms):
        raise GspoError(
            f"{where}: contrast must be 'a - b' or '(a - b) - (c - d)' of this preset's variants {variants}"
        )
    if not isinstance(metric, str) or metric not in _METRICS:
        raise GspoError(f"{where}: unknown metric (known: {', '.join(sorted(_METRICS))})")
    if not isinstance(direction, str) or direction not in _DIRECTIONS:
        raise GspoError(f"{where}: direction must be one of {', '.join(_DIRECTIONS)}")
    c, d = arms[2:] if both else ("", "")
    return Endpoint(metric, arms[0], arms[1], direction, _number(e.get("margin", 0), where, "margin"), c, d)


def _family(f: Any, default_name: str, n: int, where: str) -> Family:
    f = f or {}
    if not isinstance(f, dict) or set(f) - {"name", "size", "alpha", "test"}:
        raise GspoError(f"{where}: 'family' must be a mapping of name, size, alpha, test")
    size, test = f.get("size", n), f.get("test", "permutation")
    if type(size) is not int or size < n:
        raise GspoError(
            f"{where}: family size must be an integer >= its {n} primary endpoint(s) (got {size!r:.40})"
        )
    alpha = _number(f.get("alpha", ALPHA), where, "family alpha")
    if not isinstance(test, str) or test not in _TESTS or not 0 < alpha < 1:
        raise GspoError(f"{where}: family test must be one of {', '.join(_TESTS)}, alpha in (0, 1)")
    return Family(_text(f.get("name", default_name), where, "family name") or default_name, size, alpha, test)


RUN_RECORD = "declaration.json"  # in every run folder gspo compare starts: what the run was run for
