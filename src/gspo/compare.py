"""``gspo compare``: GSPO, GSPO-token, GRPO and GRPO + Routing Replay on the same seeds, with statistics.

Per seed the supervised warm start runs once and every variant starts RL from that same model, so
the variants differ only in the RL algorithm, and they are compared *paired by seed*: the verdict on a
claim is read from the 95% confidence interval of the per-seed difference, never from one number.

Runs go to a pool of worker processes (``workers``, default 2 from the command line, one torch thread
each). A named *preset* (``src/gspo/presets/<name>.yaml``) fixes a regime: the model, the staleness
(optimizer steps per rollout batch), the learning rate, the precision, the seeds and variants.

Writes ``<out>/report.md`` (tables of means and CIs, paired differences, the claims with their
verdicts, plots with confidence bands), ``<out>/summary.json`` and ``<out>/per_seed.csv``.
:func:`write_study` combines several compare folders into one cross-regime report.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gspo.config import Config, coerce, make_config
from gspo.errors import GspoError
from gspo.train.logger import read_metrics

VARIANTS: dict[str, dict[str, Any]] = {
    "gspo": {"algo": "gspo", "routing_replay": False},
    "gspo_token": {"algo": "gspo_token", "routing_replay": False},
    "grpo": {"algo": "grpo", "routing_replay": False},
    "grpo_replay": {"algo": "grpo", "routing_replay": True},
    # the other losses (not in the default set; --variants sapo,cispo,gmpo)
    "sapo": {"algo": "sapo", "routing_replay": False},
    "sapo_token": {"algo": "sapo_token", "routing_replay": False},
    "cispo": {"algo": "cispo", "routing_replay": False},
    "gmpo": {"algo": "gmpo", "routing_replay": False},
}
DEFAULT_VARIANTS = ["gspo", "gspo_token", "grpo", "grpo_replay"]
DEFAULT_SEEDS = [0, 1, 2, 3, 4]
PRESETS_DIR = Path(__file__).parent / "presets"
PAPER_VOLATILITY = 0.10  # GSPO paper, sec. 5.3: ~10% of activated experts change per update (48 layers)

# config fields that steer a run but do not change what it computes: a finished run with other
# values of these is still reused
_STEERING = {"progress", "threads", "save_every", "wandb", "resume", "overwrite", "output_dir", "name"}
# the fields a warm start depends on (its folder is reused only when they match)
_WARM_FIELDS = (
    "model",
    "tokenizer",
    "task",
    "eval_task",
    "reward",
    "prompt_field",
    "answer_field",
    "eval_size",
    "chat_template",
    "system_prompt",
    "max_prompt_tokens",
    "sft_steps",
    "sft_lr",
    "sft_batch_size",
    "logp_chunk_size",
)


# ================================================================================================
# statistics


# two-sided 95% Student t quantiles t_{0.975, df}; df beyond the table uses the nearest smaller entry
# (a slightly wider, conservative interval) and 1.96 past 120
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
    18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
    26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip


def t_quantile(df: int) -> float:
    """t_{0.975} for ``df`` degrees of freedom (the 95% two-sided interval's multiplier)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df > 120:
        return 1.960
    return _T975[max(k for k in _T975 if k <= df)]


@dataclass
class Interval:
    """A sample mean with its 95% confidence interval (``lo``/``hi`` None with fewer than 2 values)."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: int

    @property
    def known(self) -> bool:
        return self.lo is not None and self.hi is not None

    def fmt(self, pct: bool | str = False, digits: int = 3) -> str:
        """``pct``: True for percent, ``"sci"`` for scientific notation."""
        if self.mean is None:
            return "n/a"

        def f(x: float) -> str:
            if pct == "sci":
                return f"{x:.1e}"
            return f"{100 * x:.{max(digits - 2, 1)}f}%" if pct else f"{x:.{digits}f}"

        return (
            f"{f(self.mean)} [{f(self.lo)}, {f(self.hi)}]" if self.known else f"{f(self.mean)} (n={self.n})"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _clean(xs: Sequence[float | None]) -> list[float]:
    return [float(x) for x in xs if x is not None and math.isfinite(x)]


def t_interval(xs: Sequence[float | None]) -> Interval:
    """Mean and 95% Student-t interval ``mean +- t_{0.975,n-1} * sd / sqrt(n)`` (None/NaN dropped)."""
    v = _clean(xs)
    if not v:
        return Interval(None, None, None, 0)
    m = statistics.fmean(v)
    if len(v) < 2:
        return Interval(m, None, None, len(v))
    half = t_quantile(len(v) - 1) * statistics.stdev(v) / math.sqrt(len(v))
    return Interval(m, m - half, m + half, len(v))


def bootstrap_interval(xs: Sequence[float | None], n_boot: int = 10_000, seed: int = 0) -> Interval:
    """Mean and 95% percentile-bootstrap interval (resampling the values with replacement). With few
    seeds it is narrower than the t interval (it ignores that the sd itself is estimated)."""
    import numpy as np

    v = np.asarray(_clean(xs), dtype=np.float64)
    if v.size == 0:
        return Interval(None, None, None, 0)
    if v.size < 2:
        return Interval(float(v[0]), None, None, 1)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return Interval(float(v.mean()), float(lo), float(hi), int(v.size))


def interval(xs: Sequence[float | None], method: str = "t") -> Interval:
    if method == "t":
        return t_interval(xs)
    if method == "bootstrap":
        return bootstrap_interval(xs)
    raise GspoError(f"--ci: expected t or bootstrap, got {method!r}")


def paired_interval(
    a: dict[int, float | None], b: dict[int, float | None], method: str = "t"
) -> tuple[Interval, int, int]:
    """CI of the per-seed difference ``a[s] - b[s]`` over the seeds both have; also how many seeds
    have a > b and a < b."""
    diffs = [
        a[s] - b[s]  # type: ignore[operator]
        for s in sorted(set(a) & set(b))
        if a[s] is not None and b[s] is not None and math.isfinite(a[s]) and math.isfinite(b[s])  # type: ignore[arg-type]
    ]
    return interval(diffs, method), sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)


CONSISTENT, INCONSISTENT, INCONCLUSIVE = "consistent", "inconsistent", "inconclusive"


def verdict_greater(ci: Interval, margin: float = 0.0) -> str:
    """Claim "difference > margin": consistent when the whole CI is above ``margin``, inconsistent
    when it is wholly below, inconclusive when it straddles it (or is unknown). ``margin = -delta``
    reads as non-inferiority: "not worse by more than delta"."""
    if not ci.known:
        return INCONCLUSIVE
    if ci.lo > margin:  # type: ignore[operator]
        return CONSISTENT
    if ci.hi < margin:  # type: ignore[operator]
        return INCONSISTENT
    return INCONCLUSIVE


def verdict_equivalent(ci: Interval, delta: float) -> str:
    """Claim "|difference| <= delta": consistent when the CI lies inside [-delta, delta], inconsistent
    when it lies wholly outside, inconclusive otherwise."""
    if not ci.known:
        return INCONCLUSIVE
    if -delta <= ci.lo and ci.hi <= delta:  # type: ignore[operator]
        return CONSISTENT
    if ci.lo > delta or ci.hi < -delta:  # type: ignore[operator]
        return INCONSISTENT
    return INCONCLUSIVE


# ------------------------------------------------------------------------------------------------
# per-run numbers


@dataclass
class Criteria:
    """What counts as a collapse or a spike (stated in every report)."""

    acc_margin: float = 0.15
    """Accuracy collapse: from some eval on, held-out accuracy stays more than this (absolute) below
    the best it had reached before, to the end of the run."""
    reward_margin: float = 0.15
    """Reward collapse: the same rule on the training reward, smoothed over ``reward_window`` steps."""
    reward_window: int = 10
    spike_factor: float = 10.0
    """A grad-norm spike: a step whose grad norm exceeds ``spike_factor`` x the median of the
    previous ``spike_window`` steps. A ratio spike: the same rule on log(max importance ratio)."""
    spike_window: int = 20
    spike_min_history: int = 5
    ratio_spike_floor: float = 2.0
    """A ratio spike must also exceed this max ratio (a 10x jump of a 1.001 ratio is no spike)."""


def collapse_index(values: Sequence[float], margin: float) -> int | None:
    """First index ``i >= 1`` from which every value stays more than ``margin`` below the best of the
    values before ``i`` (a fall that does not recover by the end); None if there is none.
    Equivalent to: the last value is more than ``margin`` below the best before it."""
    n = len(values)
    if n < 2:
        return None
    suffix_max = list(values)
    for j in range(n - 2, -1, -1):
        suffix_max[j] = max(values[j], suffix_max[j + 1])
    best = values[0]
    for i in range(1, n):
        if suffix_max[i] < best - margin:
            return i
        best = max(best, values[i])
    return None


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def spike_indices(
    values: Sequence[float], factor: float, window: int, min_history: int = 5, floor: float = -math.inf
) -> list[int]:
    """Indices whose value exceeds ``factor`` x the median of the previous ``window`` values (with at
    least ``min_history`` of them) and ``floor``."""
    out = []
    for t, v in enumerate(values):
        hist = values[max(0, t - window) : t]
        if len(hist) >= min_history and v > floor and v > factor * statistics.median(hist):
            out.append(t)
    return out


def auc(steps: Sequence[int], values: Sequence[float]) -> float | None:
    """Area under the curve (trapezoids) divided by its step span: the run's time-averaged value."""
    if len(steps) < 2:
        return values[0] if values else None
    area = sum((steps[i + 1] - steps[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(steps) - 1))
    return area / (steps[-1] - steps[0])


def _col(rows: list[dict[str, Any]], key: str, skip_step0: bool = True) -> tuple[list[int], list[float]]:
    pts = [
        (r["step"], float(r[key]))
        for r in rows
        if r.get(key) is not None and math.isfinite(r[key]) and not (skip_step0 and r["step"] == 0)
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def run_stats(rows: list[dict[str, Any]], crit: Criteria) -> dict[str, Any]:
    """One run's numbers from its metrics.jsonl rows."""
    es, acc = _col(rows, "eval/accuracy", skip_step0=False)
    out: dict[str, Any] = {
        "acc_start": acc[0] if acc else None,
        "acc_final": acc[-1] if acc else None,
        "acc_best": max(acc) if acc else None,
        "acc_auc": auc(es, acc) if acc else None,
    }
    out["acc_gain"] = None if not acc else acc[-1] - acc[0]
    out["drawdown"] = None if not acc else max(acc) - acc[-1]
    i = collapse_index(acc, crit.acc_margin)
    out["acc_collapse_step"] = es[i] if i is not None else None
    rs, rew = _col(rows, "rollout/reward_mean")
    sm = moving_average(rew, crit.reward_window)
    j = collapse_index(sm, crit.reward_margin)
    out["reward_collapse_step"] = rs[j] if j is not None else None
    out["reward_last20"] = statistics.fmean(rew[-20:]) if rew else None
    gs, gn = _col(rows, "loss/grad_norm")
    out["grad_spike_steps"] = [
        gs[k] for k in spike_indices(gn, crit.spike_factor, crit.spike_window, crit.spike_min_history)
    ]
    qs, rmax = _col(rows, "loss/ratio_max")
    logr = [math.log(max(r, 1e-12)) for r in rmax]
    out["ratio_spike_steps"] = [
        qs[k]
        for k in spike_indices(
            logr,
            crit.spike_factor,
            crit.spike_window,
            crit.spike_min_history,
            math.log(crit.ratio_spike_floor),
        )
    ]
    out["ratio_max_max"] = max(rmax) if rmax else None
    out["grad_norm_max"] = max(gn) if gn else None
    for key, name in [
        ("loss/clip_frac_tok", "clip_tok"),
        ("loss/clip_frac_seq", "clip_seq"),
        ("moe/volatility", "volatility"),
        ("loss/approx_kl", "approx_kl"),
        ("time/step_s", "step_s"),
        ("mismatch/token_abs_logp_diff", "mismatch_tok"),
    ]:
        _, v = _col(rows, key)
        out[name] = statistics.fmean(v) if v else None
    out["collapsed"] = out["acc_collapse_step"] is not None
    out["spikes"] = len(out["grad_spike_steps"]) + len(out["ratio_spike_steps"])
    out["events"] = (
        int(out["acc_collapse_step"] is not None)
        + int(out["reward_collapse_step"] is not None)
        + len(out["grad_spike_steps"])
        + len(out["ratio_spike_steps"])
    )
    return out


# numbers summarised per variant (mean and CI over seeds): key, label, shown as percent
SUMMARY_KEYS = [
    ("acc_start", "start acc", False),
    ("acc_final", "final acc", False),
    ("acc_best", "best acc", False),
    ("acc_auc", "acc AUC", False),
    ("drawdown", "best - final", False),
    ("clip_tok", "clipped tokens", True),
    ("volatility", "expert volatility", True),
    ("mismatch_tok", "sampler mismatch", "sci"),
    ("step_s", "s/step", False),
]
# paired comparisons: (a, b) -> per-seed a - b
PAIRS = [("gspo", "grpo"), ("grpo_replay", "grpo"), ("gspo", "grpo_replay"), ("gspo", "gspo_token")]
PAIR_KEYS = [
    ("acc_final", "final acc"),
    ("acc_auc", "acc AUC"),
    ("drawdown", "best - final"),
    ("spikes", "spikes per run"),
]


# ================================================================================================
# presets


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
    unknown = set(data) - {"description", "config", "seeds", "variants", "runtime", "warm_target"}
    if unknown:
        raise GspoError(f"{path}: unknown preset key(s) {', '.join(sorted(unknown))}")
    cfg = data.get("config") or {}
    if not isinstance(cfg, dict):
        raise GspoError(f"{path}: 'config' must be a mapping of config keys")
    conf = {k.replace("-", "_"): coerce(k.replace("-", "_"), v, str(path)) for k, v in cfg.items()}
    return Preset(
        name=path.stem,
        description=" ".join(str(data.get("description", "")).split()),
        config=conf,
        seeds=[int(s) for s in data.get("seeds", DEFAULT_SEEDS)],
        variants=[str(v) for v in data.get("variants", DEFAULT_VARIANTS)],
        runtime=" ".join(str(data.get("runtime", "")).split()),
        warm_target=None if data.get("warm_target") is None else float(data["warm_target"]),
        path=path,
    )


# ================================================================================================
# running


def _warm_key(cfg: Config) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in _WARM_FIELDS} | {"seed": cfg.seed}


WARM_CHECK_EVERY, WARM_CHECK_AFTER, WARM_CHECK_PROMPTS = 10, 50, 200


def warm_start_folder(base: Config, seed: int, target: float | None, warm_dir: Path) -> Path:
    """Where the warm start of these settings and ``seed`` lives: ``<warm_dir>/<model>-<hash>/s<seed>``,
    so presets that differ only in their RL settings (staleness, lr...) share their warm starts."""
    import hashlib

    key = _warm_key(dataclasses.replace(base, seed=0)) | {"target": target}
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = Path(base.model.replace("embedded:", "")).name
    return warm_dir / f"{name}-{h}" / f"s{seed}"


def _warm_start_job(
    base: Config, seed: int, out: Path, target: float | None = None, warm_dir: Path | None = None
) -> tuple[int, str | None, float]:
    """Run only the supervised warm start for ``seed`` (float32) and save it; returns
    ``(seed, model folder, seconds)``. Reused when a folder with the same warm-start settings exists
    (:func:`warm_start_folder`; ``warm_dir`` defaults to ``<out>/../warm-starts``).

    With ``target``, the warm start stops early, at the first check (every 10 steps from step 50) where
    greedy accuracy on 200 prompts like the held-out ones (:func:`_gate_examples`) reaches ``target``;
    ``sft_steps`` is then the most it runs. Accuracy jumps steeply during a warm start and where depends on the seed, so a fixed step
    count leaves some seeds near 0 and others near 1; a target starts every seed (and model) from
    partial accuracy."""
    t0 = time.time()
    if base.sft_steps == 0:
        return seed, None, 0.0
    import torch
    import transformers

    from gspo.model.load import load_model_and_tokenizer, save_pretrained
    from gspo.tasks import build_task
    from gspo.train.rollout import encode_prompts
    from gspo.train.sft import warm_start

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    cfg = dataclasses.replace(base, seed=seed)
    folder = warm_start_folder(base, seed, target, warm_dir or out.parent / "warm-starts")
    key_file = folder / "warm_start.json"
    key = _warm_key(cfg) | {"target": target}
    if (folder / "config.json").exists():
        if key_file.exists() and json.loads(key_file.read_text()).get("key") == key:
            return seed, str(folder), 0.0
        shutil.rmtree(folder)  # made with other settings (or by an older gspo): redo
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(seed)
    model, tok = load_model_and_tokenizer(cfg.model, cfg.tokenizer, "float32", seed)
    task = build_task(
        cfg.task, cfg.reward, seed, cfg.eval_size, cfg.eval_task, cfg.prompt_field, cfg.answer_field
    )
    train_ids = encode_prompts(tok, task.train, cfg)
    gate_examples = _gate_examples(cfg, task) if target is not None else []
    done, reached, accs = 0, False, []

    def gate() -> bool:  # polled before every warm-start step; True ends it (see warm_start)
        nonlocal done, reached
        if target is not None and done >= WARM_CHECK_AFTER and done % WARM_CHECK_EVERY == 0:
            acc = _gate_accuracy(model, tok, task, gate_examples, cfg)
            accs.append((done, acc))
            model.train()
            reached = acc >= target
        done += 1
        return reached

    try:
        warm_start(model, tok, task.train, train_ids, cfg, torch.device("cpu"), cfg.progress, gate)
    except KeyboardInterrupt:
        if not reached:  # a real Ctrl-C
            raise
    steps = done - 1 if reached else done
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")  # written whole, then renamed
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(model, tok, tmp)
    info = {"key": key, "steps": steps, "reached_target": reached, "gate_acc": accs[-1][1] if accs else None}
    (tmp / "warm_start.json").write_text(json.dumps(info))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return seed, str(folder), time.time() - t0


def _gate_examples(cfg: Config, task: Any) -> list[Any]:
    """Prompts the warm start's gate measures: like the held-out set but disjoint from it. Embedded
    tasks: fresh prompts outside the training set (whose short prompts are all "seen", so the held-out
    set has none; measuring on training prompts would overstate accuracy); datasets: the first
    training examples (the held-out set is a random split of the same data)."""
    from gspo.tasks.synthetic import SYNTHETIC_TASKS, synthetic_examples

    n = WARM_CHECK_PROMPTS
    if cfg.task in SYNTHETIC_TASKS:
        taken = {e.prompt for e in task.train} | {e.prompt for e in task.eval}
        pool = synthetic_examples(cfg.task, 8 * n, cfg.seed + 2_000_003)
        fresh = [e for e in pool if e.prompt not in taken][:n]
        if len(fresh) >= n // 2:
            return fresh
    return task.train[:n]


def _gate_accuracy(model: Any, tok: Any, task: Any, examples: list[Any], cfg: Config) -> float:
    """Greedy accuracy on the gate's prompts."""
    import torch

    from gspo.rollout.hf import HFRolloutEngine
    from gspo.train.rollout import encode_prompts, evaluate

    model.eval()
    engine = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    sub = dataclasses.replace(task, eval=examples)
    return evaluate(engine, tok, sub, encode_prompts(tok, examples, cfg), cfg)["eval/accuracy"]


def _train_job(cfg: Config) -> tuple[str, float, float | None, float | None]:
    """Train one (variant, seed) run; returns ``(name, seconds, initial acc, final acc)``."""
    from gspo.train.loop import train

    t0 = time.time()
    res = train(cfg)
    shutil.rmtree(cfg.run_dir / "checkpoints", ignore_errors=True)  # finished: final/ and metrics stay
    return cfg.run_name, time.time() - t0, res.initial_accuracy, res.final_accuracy


def _differs(cfg: Config) -> str | None:
    """The first setting the run folder's saved config has otherwise than ``cfg`` ("key: old, now new";
    settings that only steer the run are ignored; a field the saved config lacks, added by a newer
    gspo, counts as its default); None when they agree."""
    saved_file = cfg.run_dir / "config.yaml"
    saved = (yaml.safe_load(saved_file.read_text()) or {}) if saved_file.exists() else {}
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for k, v in cfg.to_dict().items():
        if k not in _STEERING and saved.get(k, defaults.get(k)) != v:
            return f"{k}: {saved.get(k)!r}, now {v!r}"
    return None


def _plan(cfg: Config) -> Config | None:
    """What to run for ``cfg``: None when a finished run of it exists (a finished one made with other
    settings is an error, never deleted); an unfinished run with a complete checkpoint and the same
    settings continues from it (``resume``); anything else in the folder is removed to start fresh."""
    from gspo.train.checkpoint import newest_complete

    run = cfg.run_dir
    if not run.exists():
        return cfg
    if (run / "final" / "config.json").exists() and (run / "config.yaml").exists():
        diff = _differs(cfg)
        if diff:
            raise GspoError(
                f"{run} is a finished run made with other settings ({diff}); pass another --out, or "
                "delete the folder to redo it"
            )
        return None
    if (run / "config.yaml").exists() and _differs(cfg) is None and newest_complete(run)[0] is not None:
        return dataclasses.replace(cfg, resume=True)
    shutil.rmtree(run)
    return cfg


def run_compare(
    config_path: str | None,
    overrides: dict[str, Any],
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    out_dir: str | None = None,
    preset: str | None = None,
    workers: int = 1,
    ci: str = "t",
    criteria: Criteria | None = None,
    command: str | None = None,
    warm_target: float | None = None,
    warm_dir: str | None = None,
) -> Path:
    """Train every (variant, seed) from one warm start per seed, then write the report; returns its path.

    Config values: defaults <- ``preset``'s config <- ``config_path`` YAML <- ``overrides``. Seeds and
    variants default to the preset's (without a preset: seeds 0-4, all four variants). ``workers``
    processes run side by side (each with one torch thread unless ``threads`` is set).
    ``warm_target`` (default: the preset's): warm start each seed until this greedy accuracy on
    held-out-like prompts, at most ``sft_steps`` steps (see :func:`_warm_start_job`). Warm starts are
    kept under ``warm_dir`` (default ``<out>/../warm-starts``) and shared by compares that need the
    same one."""
    p = load_preset(preset) if preset else Preset(name="custom")
    seeds = list(p.seeds if seeds is None else seeds)
    variants = list(p.variants if variants is None else variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise GspoError(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    if not seeds or not variants:
        raise GspoError("--seeds and --variants must name at least one each")
    if len(set(seeds)) != len(seeds):
        raise GspoError(f"--seeds: repeated seed in {seeds}")
    if workers < 1:
        raise GspoError(f"--workers: must be >= 1 (got {workers})")
    target = p.warm_target if warm_target is None else warm_target
    if target is not None and not 0 < target <= 1:
        raise GspoError(f"--warm-target: must be in (0, 1] (got {target})")
    from gspo.config import load_yaml

    values = dict(p.config)
    if config_path:
        values |= load_yaml(config_path)
    values |= overrides
    base = make_config(None, values)
    if workers > 1:  # side-by-side processes: one thread each, no interleaved progress bars
        base = dataclasses.replace(base, threads=base.threads or 1, progress=False)
    out = Path(out_dir or f"runs/compare-{p.name}")
    out.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = _command_line(p, config_path, overrides, seeds, variants, out, workers, warm_target)

    def run_cfg(v: str, seed: int, warm: str | None) -> Config:
        kw = dict(name=f"{v}-s{seed}", output_dir=str(out), seed=seed, **VARIANTS[v])
        if warm is not None:
            kw.update(model=warm, sft_steps=0)
            if base.tokenizer is None:
                kw.update(tokenizer=warm)
        return dataclasses.replace(base, **kw).validate()

    wdir = Path(warm_dir) if warm_dir else out.parent / "warm-starts"
    t_start = time.time()
    timing: dict[str, float] = {}
    warm_folders: dict[str, str | None] = {}
    load = _LoadSampler()
    with _continue_hint(command):
        if workers == 1:
            _run_serial(base, seeds, variants, out, run_cfg, timing, target, wdir, warm_folders)
        else:
            _run_pool(base, seeds, variants, out, workers, run_cfg, timing, target, wdir, warm_folders)
    wall = time.time() - t_start
    load.stop()
    (out / "warm_starts.json").write_text(json.dumps(warm_folders, indent=1))
    timing_file = out / "timing.json"
    old = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    sessions = old.get("sessions", [])
    if sum(timing.values()) > 0:  # this call trained something: it counts toward the wall time
        sessions.append({"wall_s": wall, "workers": workers, "mean_load_1min": load.mean()})
    record = {
        "wall_s": sum(x["wall_s"] for x in sessions),
        "workers": workers,
        "mean_load_1min": statistics.fmean([x["mean_load_1min"] for x in sessions if x["mean_load_1min"]])
        if any(x["mean_load_1min"] for x in sessions)
        else None,
        "cpus": os.cpu_count(),
        "sessions": sessions,
        "jobs_s": {**old.get("jobs_s", {}), **{k: v for k, v in timing.items() if v > 0}},
        "command": command,
    }
    timing_file.write_text(json.dumps(record, indent=1))
    return write_report(out, variants, seeds, base, preset=p, ci=ci, criteria=criteria or Criteria())


class _LoadSampler:
    """The 1-minute load average every 20 s while the compare runs (others' jobs on a shared machine
    slow it: the report states the load next to the wall time)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(20.0):
            try:
                self.samples.append(os.getloadavg()[0])
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()

    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def _run_serial(base, seeds, variants, out, run_cfg, timing, target, wdir, warm_folders) -> None:  # noqa
    """One seed after the other in this process: its warm start, then its runs."""
    for seed in seeds:
        _, warm, dt = _warm_start_job(base, seed, out, target, wdir)
        timing[f"warm-start-s{seed}"] = dt
        warm_folders[str(seed)] = warm
        for v in variants:
            cfg = _plan(run_cfg(v, seed, warm))
            if cfg is None:
                print(f"[compare] {v} seed {seed}: done already, reusing {out / f'{v}-s{seed}'}")
                continue
            print(f"[compare] {v} seed {seed} -> {cfg.run_dir}", flush=True)
            name, dt, a0, a1 = _train_job(cfg)
            timing[name] = dt


def _run_pool(base, seeds, variants, out, workers, run_cfg, timing, target, wdir, warm_folders) -> None:  # noqa: ANN001
    """Warm starts first, then each seed's runs as soon as its warm start is there; ``workers``
    processes (spawned: a clean torch in each)."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ex = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=mp.get_context("spawn"),
        initializer=_die_with,
        initargs=(os.getpid(),),
    )
    try:
        pending = {ex.submit(_warm_start_job, base, s, out, target, wdir): ("warm", s) for s in seeds}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                kind, what = pending.pop(fut)
                res = fut.result()  # re-raises a worker's GspoError here
                if kind == "warm":
                    seed, warm, dt = res
                    timing[f"warm-start-s{seed}"] = dt
                    warm_folders[str(seed)] = warm
                    if dt:
                        print(f"[compare] warm start seed {seed}: {dt:.0f} s", flush=True)
                    for v in variants:
                        cfg = _plan(run_cfg(v, seed, warm))
                        if cfg is None:
                            print(f"[compare] {v} seed {seed}: done already, reusing {out / f'{v}-s{seed}'}")
                            continue
                        pending[ex.submit(_train_job, cfg)] = ("train", cfg.run_name)
                else:
                    name, dt, a0, a1 = res
                    timing[name] = dt
                    acc = f"held-out acc {a0:.3f} -> {a1:.3f}" if a0 is not None and a1 is not None else ""
                    print(f"[compare] {name}: {dt:.0f} s {acc}", flush=True)
    except BaseException:
        # a Ctrl-C, SIGTERM or a failed run: end the workers now (an unfinished run continues from its
        # last checkpoint next time); the resource tracker exits once they are gone
        for proc in list((getattr(ex, "_processes", None) or {}).values()):
            proc.kill()
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown(wait=True)


def _die_with(parent: int) -> None:
    """A compare worker: killed when the compare process dies, even by kill -9 (Linux)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


@contextmanager
def _continue_hint(command: str) -> Iterator[None]:
    """SIGTERM stops the compare like Ctrl-C; either way the message names the command that continues it."""
    import signal
    import threading

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_term) if main else None
    again = (
        "run the same command again (finished runs are reused, unfinished ones go on from their last "
        "checkpoint)"
    )
    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"finished runs are kept; to continue, {again}: {command}") from None
    except GspoError as e:  # a run's own hint names `gspo train`'s flag
        raise GspoError(str(e).replace("continue with --resume", f"to continue, {again}")) from None
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _command_line(p: Preset, config_path, overrides, seeds, variants, out, workers, warm_target) -> str:  # noqa: ANN001
    parts = ["gspo", "compare"]
    if p.path is not None:
        parts += ["--preset", p.name]
    if config_path:
        parts += ["--config", config_path]
    if seeds != p.seeds:
        parts += ["--seeds", ",".join(map(str, seeds))]
    if variants != p.variants:
        parts += ["--variants", ",".join(variants)]
    if warm_target is not None:
        parts += ["--warm-target", str(warm_target)]
    parts += ["--out", str(out), "--workers", str(workers)]
    for k, v in overrides.items():
        parts += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(parts)


# ================================================================================================
# the report


PLOTS = [
    ("eval/accuracy", "held-out accuracy (greedy)", "accuracy.png", 1),
    ("rollout/reward_mean", "training reward (10-step mean)", "reward.png", 10),
    ("loss/clip_frac_tok", "clipped-token fraction", "clip_fraction.png", 5),
    ("moe/volatility", "expert-activation volatility per update", "volatility.png", 5),
    ("loss/grad_norm", "grad norm (before clipping)", "grad_norm.png", 1),
    ("loss/ratio_max", "max importance ratio per step", "ratio_max.png", 1),
]


def _curves(out: Path, variant: str, seeds: list[int], key: str, smooth: int) -> dict[int, dict[int, float]]:
    """seed -> {step: value} (trailing mean over ``smooth`` steps)."""
    res = {}
    for s in seeds:
        path = out / f"{variant}-s{s}" / "metrics.jsonl"
        if not path.exists():
            continue
        st, v = _col(read_metrics(path), key, skip_step0=key != "eval/accuracy")
        if st:
            res[s] = dict(zip(st, moving_average(v, smooth) if smooth > 1 else v, strict=True))
    return res


def _band_plot(out: Path, variants: list[str], seeds: list[int], ci: str, name: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []
    for key, title, fname, smooth in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        drawn = False
        curves = {v: _curves(out, v, seeds, key, smooth) for v in variants}
        # heavy-tailed: geometric mean, CI of logs (when there is any positive value to take a log of)
        geo = key in ("loss/ratio_max", "loss/grad_norm") and any(
            x > 0 for cur in curves.values() for c in cur.values() for x in c.values()
        )
        for v, cur in curves.items():
            if not cur:
                continue
            steps = sorted({st for c in cur.values() for st in c})
            if geo:
                logs = [[math.log(c[st]) for c in cur.values() if c.get(st, 0) > 0] for st in steps]
                iv = [
                    Interval(*(None if x is None else math.exp(x) for x in (i.mean, i.lo, i.hi)), i.n)
                    for i in (interval(xs, ci) for xs in logs)
                ]
            else:
                iv = [interval([c.get(st) for c in cur.values()], ci) for st in steps]
            # a step where no seed has a value (e.g. every grad norm 0 on a geometric axis) is left out
            kept = [(st, i) for st, i in zip(steps, iv, strict=True) if i.mean is not None]
            if not kept:
                continue
            steps, iv = [st for st, _ in kept], [i for _, i in kept]
            m = [i.mean for i in iv]
            (line,) = ax.plot(steps, m, label=f"{v} (n={len(cur)})", marker="." if len(steps) < 30 else None)
            lo = [i.lo if i.known else i.mean for i in iv]
            hi = [i.hi if i.known else i.mean for i in iv]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
            drawn = True
        if drawn:
            what = "geometric mean" if geo else "mean"
            ax.set_title(f"{title}: {what}, 95% CI over seeds", fontsize=10)
            ax.set_xlabel("RL step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if key in ("loss/clip_frac_tok",):
                ax.set_yscale("symlog", linthresh=1e-3)
            if geo:
                ax.set_yscale("log")
            if key in ("eval/accuracy", "rollout/reward_mean"):
                ax.set_ylim(-0.02, 1.02)
            fig.tight_layout()
            fig.savefig(out / fname, dpi=100)
            images.append((title, fname))
        plt.close(fig)

    # paired: each variant's held-out accuracy minus the reference's, seed by seed
    ref = "grpo" if "grpo" in variants else variants[0]
    base = _curves(out, ref, seeds, "eval/accuracy", 1)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    drawn = False
    for v in variants:
        if v == ref:
            continue
        cur = _curves(out, v, seeds, "eval/accuracy", 1)
        common = sorted(set(cur) & set(base))
        if not common:
            continue
        steps = sorted({st for s in common for st in cur[s]} & {st for s in common for st in base[s]})
        iv = [
            interval([cur[s][st] - base[s][st] for s in common if st in cur[s] and st in base[s]], ci)
            for st in steps
        ]
        (line,) = ax.plot(steps, [i.mean for i in iv], label=f"{v} - {ref} (n={len(common)})", marker=".")
        ax.fill_between(
            steps,
            [i.lo if i.known else i.mean for i in iv],
            [i.hi if i.known else i.mean for i in iv],
            color=line.get_color(),
            alpha=0.18,
            linewidth=0,
        )
        drawn = True
    if drawn:
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(f"held-out accuracy minus {ref}'s, paired by seed: mean, 95% CI", fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "accuracy_paired.png", dpi=100)
        images.insert(1, (f"held-out accuracy minus {ref}'s (paired by seed)", "accuracy_paired.png"))
    plt.close(fig)
    return images


def _claims(
    per: dict[str, dict[int, dict[str, Any]]], ci: str, crit: Criteria
) -> list[tuple[str, str, str, str]]:
    """(claim, measured, how the verdict is read, verdict) rows, each verdict from a paired CI."""

    def col(v: str, key: str) -> dict[int, float | None]:
        return {s: r.get(key) for s, r in per.get(v, {}).items()}

    def have(*vs: str) -> bool:
        return all(v in per for v in vs)

    def pair(a: str, b: str, key: str) -> tuple[Interval, int, int]:
        return paired_interval(col(a, key), col(b, key), ci)

    def seeds_txt(n_pos: int, n_neg: int, iv: Interval) -> str:
        return f"; {n_pos} of {iv.n} seeds >0, {n_neg} <0"

    rows = []
    if have("gspo", "grpo"):
        logr = {
            s: math.log10(r["clip_tok"] / per["grpo"][s]["clip_tok"])
            for s, r in per["gspo"].items()
            if s in per["grpo"] and r.get("clip_tok") and per["grpo"][s].get("clip_tok")
        }
        iv = interval(list(logr.values()), ci)
        ratio = (
            f"{10**iv.mean:.0f}x [{10**iv.lo:.0f}x, {10**iv.hi:.0f}x]"
            if iv.known
            else (f"{10**iv.mean:.0f}x" if iv.mean is not None else "n/a")
        )
        rows.append(
            (
                "GSPO clips far more tokens than GRPO (paper: ~15% vs ~0.13%, ~100x)",
                f"per-seed ratio GSPO/GRPO clipped tokens {ratio}",
                "CI of log10 ratio > log10(10)",
                verdict_greater(iv, 1.0),
            )
        )
        for key, what in [("acc_final", "final held-out accuracy"), ("acc_auc", "accuracy AUC")]:
            iv, n_pos, n_neg = pair("gspo", "grpo", key)
            rows.append(
                (
                    f"GSPO trains more efficiently than GRPO ({what})",
                    f"GSPO - GRPO {iv.fmt()}{seeds_txt(n_pos, n_neg, iv)}",
                    "CI of paired difference > 0",
                    verdict_greater(iv),
                )
            )
        iv, n_pos, n_neg = pair("grpo", "gspo", "drawdown")
        c_g = sum(bool(r.get("collapsed")) for r in per["grpo"].values())
        c_s = sum(bool(r.get("collapsed")) for r in per["gspo"].values())
        rows.append(
            (
                "GRPO is less stable than GSPO (falls further from its best)",
                f"drawdown GRPO - GSPO {iv.fmt()}{seeds_txt(n_pos, n_neg, iv)}; accuracy collapses "
                f"GRPO {c_g}/{len(per['grpo'])}, GSPO {c_s}/{len(per['gspo'])}",
                "CI of paired difference of (best - final) > 0",
                verdict_greater(iv),
            )
        )
        iv, n_pos, n_neg = pair("grpo", "gspo", "spikes")
        rows.append(
            (
                "GRPO's updates are spikier than GSPO's",
                f"grad-norm + ratio spikes per run, GRPO - GSPO {iv.fmt(digits=1)}{seeds_txt(n_pos, n_neg, iv)}",
                "CI of paired difference > 0",
                verdict_greater(iv),
            )
        )
    if have("grpo_replay", "grpo"):
        iv, n_pos, n_neg = pair("grpo_replay", "grpo", "acc_final")
        rows.append(
            (
                "GRPO on MoE needs Routing Replay (replay improves GRPO)",
                f"final acc GRPO+replay - GRPO {iv.fmt()}{seeds_txt(n_pos, n_neg, iv)}",
                "CI of paired difference > 0",
                verdict_greater(iv),
            )
        )
    if have("gspo", "grpo_replay"):
        delta = 0.02
        iv, n_pos, n_neg = pair("gspo", "grpo_replay", "acc_final")
        rows.append(
            (
                "GSPO does not need Routing Replay (matches or beats GRPO+replay without it)",
                f"final acc GSPO - GRPO+replay {iv.fmt()}{seeds_txt(n_pos, n_neg, iv)}",
                f"non-inferiority: CI > -{delta}",
                verdict_greater(iv, -delta),
            )
        )
    if have("gspo", "gspo_token"):
        delta = 0.05
        iv, n_pos, n_neg = pair("gspo", "gspo_token", "acc_final")
        rows.append(
            (
                "GSPO-token equals GSPO when all tokens share the sequence advantage",
                f"final acc GSPO - GSPO-token {iv.fmt()}{seeds_txt(n_pos, n_neg, iv)} (identical in exact "
                "arithmetic; rounding lets trajectories drift)",
                f"equivalence: CI inside +-{delta}",
                verdict_equivalent(iv, delta),
            )
        )
    vols = [r["volatility"] for v in per.values() for r in v.values() if r.get("volatility") is not None]
    if vols:
        iv = interval(vols, ci)
        rows.append(
            (
                "About 10% of activated experts change per update (48-layer Qwen3-30B-A3B)",
                f"{iv.fmt(pct=True)} of response tokens change their top-k expert set after one "
                "optimizer step (all runs)",
                "measured (different scale)",
                "measured",
            )
        )
    return rows


def collect(out: Path, variants: list[str], seeds: list[int], crit: Criteria) -> dict[str, dict[int, dict]]:
    """variant -> seed -> run_stats, for the runs that have metrics."""
    per: dict[str, dict[int, dict]] = {}
    for v in variants:
        for s in seeds:
            path = out / f"{v}-s{s}" / "metrics.jsonl"
            if path.exists():
                per.setdefault(v, {})[s] = run_stats(read_metrics(path), crit)
    return per


def _warm_text(out: Path, seeds: list[int], base: Config) -> str:
    where = out / "warm_starts.json"
    folders = json.loads(where.read_text()) if where.exists() else {}
    target = None
    for s in seeds:
        f = Path(folders.get(str(s)) or out / "missing") / "warm_start.json"
        if f.exists():
            target = json.loads(f.read_text()).get("key", {}).get("target")
            break
    if target is None:
        return f"warm start {base.sft_steps} steps at lr {base.sft_lr}"
    return (
        f"warm start at lr {base.sft_lr} until greedy accuracy on 200 held-out-like prompts reaches "
        f"{target} (checked every {WARM_CHECK_EVERY} steps, at most {base.sft_steps})"
    )


def _warm_info(out: Path, seed: int) -> str:
    where = out / "warm_starts.json"
    folders = json.loads(where.read_text()) if where.exists() else {}
    f = Path(folders.get(str(seed)) or out / "missing") / "warm_start.json"
    if not f.exists():
        return f"s{seed} -"
    info = json.loads(f.read_text())
    acc = info.get("gate_acc")
    return f"s{seed} {info.get('steps')}" + (f" ({acc:.2f})" if acc is not None else "")


def _sampler_dtype(c: dict[str, Any]) -> str:
    r = c.get("rollout_dtype")
    return f" (sampler {r})" if r and r != c.get("dtype") else ""


def _fmt_load(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _minutes(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds / 60:.1f} min"


def write_report(
    out: Path,
    variants: list[str],
    seeds: list[int],
    base: Config,
    preset: Preset | None = None,
    ci: str = "t",
    criteria: Criteria | None = None,
) -> Path:
    crit = criteria or Criteria()
    preset = preset or Preset(name="custom")
    per = collect(out, variants, seeds, crit)
    images = _band_plot(out, variants, seeds, ci, preset.name)
    summary = {
        v: {k: interval([r.get(k) for r in per[v].values()], ci) for k, _, _ in SUMMARY_KEYS} for v in per
    }
    pairs = {
        (a, b, key): paired_interval(
            {s: r.get(key) for s, r in per[a].items()}, {s: r.get(key) for s, r in per[b].items()}, ci
        )
        for a, b in PAIRS
        if a in per and b in per
        for key, _ in PAIR_KEYS
    }
    claims = _claims(per, ci, crit)
    timing_file = out / "timing.json"
    timing = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    ci_name = "Student t" if ci == "t" else "percentile bootstrap"

    lines = [
        f"# GSPO vs GRPO: preset `{preset.name}`",
        "",
        preset.description,
        "",
        f"Task `{base.task}`, model `{base.model}`, {_warm_text(out, seeds, base)}, "
        f"{base.steps} RL steps of {base.prompts_per_step} prompts x {base.group_size} responses, "
        f"**{base.num_minibatches} optimizer steps per rollout batch**, lr {base.lr}, dtype {base.dtype}"
        f"{_sampler_dtype(base.to_dict())}, "
        f"pi_old `{base.resolved_old_logp()}`, held-out eval of {base.eval_size} prompts every "
        f"{base.eval_every} steps. Seeds {seeds}; per seed one warm start shared by every variant, so "
        "variants are compared paired by seed.",
        "",
        "Warm start per seed (steps; the gate's greedy accuracy when it stopped): "
        + ", ".join(_warm_info(out, s) for s in seeds)
        + ".",
        "",
        f"Command: `{timing.get('command', 'n/a')}`  ",
        f"Wall time: {_minutes(timing.get('wall_s'))} with {timing.get('workers', '?')} worker process(es) "
        f"on {timing.get('cpus', '?')} CPUs, mean 1-min load average {_fmt_load(timing.get('mean_load_1min'))}"
        + (f" (documented for this preset: {preset.runtime})" if preset.runtime else ""),
        "",
        f"## Per variant: mean [95% CI over seeds, {ci_name}]",
        "",
        "| variant | n | " + " | ".join(lbl for _, lbl, _ in SUMMARY_KEYS) + " | acc collapses | reward "
        "collapses | grad-norm spikes | ratio spikes |",
        "|---" * (len(SUMMARY_KEYS) + 6) + "|",
    ]
    for v in per:
        rs = per[v].values()
        ev = [
            f"{sum(r['acc_collapse_step'] is not None for r in rs)}/{len(rs)}",
            f"{sum(r['reward_collapse_step'] is not None for r in rs)}/{len(rs)}",
            str(sum(len(r["grad_spike_steps"]) for r in rs)),
            str(sum(len(r["ratio_spike_steps"]) for r in rs)),
        ]
        cells = [summary[v][k].fmt(pct) for k, _, pct in SUMMARY_KEYS]
        lines.append(f"| {v} | {len(rs)} | " + " | ".join(cells + ev) + " |")
    lines += [
        "",
        f"Collapse events (per run): **accuracy collapse**: from some eval on, held-out accuracy stays "
        f"more than {crit.acc_margin} below the best it had reached before, to the end of the run; "
        f"**reward collapse**: the same with margin {crit.reward_margin} on the training reward "
        f"({crit.reward_window}-step trailing mean); **grad-norm spike**: a step whose grad norm exceeds "
        f"{crit.spike_factor:g}x the median of the previous {crit.spike_window} steps; **ratio spike**: "
        f"the same on log(max importance ratio), with a max ratio above {crit.ratio_spike_floor:g}. "
        "AUC: area under the held-out accuracy curve divided by the steps (the run's time-averaged "
        "accuracy). Volatility: fraction of response tokens whose top-k expert set changes over one "
        f"optimizer step (paper: ~{PAPER_VOLATILITY:.0%} on 48 layers). Sampler mismatch: mean "
        "|log pi_trainer - log pi_sampler| per response token at pi_old.",
        "",
        f"## Paired by seed: mean difference [95% CI, {ci_name}], seeds with a > b / a < b",
        "",
        "| a - b | " + " | ".join(lbl for _, lbl in PAIR_KEYS) + " |",
        "|---" * (len(PAIR_KEYS) + 1) + "|",
    ]
    for a, b in PAIRS:
        if (a, b, PAIR_KEYS[0][0]) not in pairs:
            continue
        cells = []
        for key, _ in PAIR_KEYS:
            iv, npos, nneg = pairs[(a, b, key)]
            cells.append(f"{iv.fmt()} ({npos}/{nneg})")
        lines.append(f"| {a} - {b} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## The paper's claims and this run",
        "",
        "Verdicts come from the 95% CI of the paired per-seed difference: **consistent** (the CI lies on "
        "the claim's side), **inconsistent** (it lies on the other side), **inconclusive** (it straddles "
        "the line: the difference is within run-to-run noise).",
        "",
        "| claim (arXiv 2507.18071) | measured here | read as | verdict |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c} | {m} | {r} | {v} |" for c, m, r, v in claims]
    lines += ["", "## Per seed", ""]
    cols = [
        ("acc_start", "start"),
        ("acc_final", "final"),
        ("acc_best", "best"),
        ("acc_auc", "AUC"),
        ("volatility", "volatility"),
        ("clip_tok", "clip tok"),
        ("acc_collapse_step", "acc collapse at"),
        ("reward_collapse_step", "reward collapse at"),
        ("grad_spike_steps", "grad spikes at"),
        ("ratio_spike_steps", "ratio spikes at"),
    ]
    lines += ["| variant | seed | " + " | ".join(c for _, c in cols) + " |", "|---" * (len(cols) + 2) + "|"]

    def cell(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, list):
            return ",".join(map(str, x[:6])) + ("..." if len(x) > 6 else "") if x else "-"
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    for v in per:
        for s, r in sorted(per[v].items()):
            lines.append(f"| {v} | {s} | " + " | ".join(cell(r.get(k)) for k, _ in cols) + " |")
    lines += [""]
    for title, fname in images:
        lines += [f"### {title}", "", f"![{title}]({fname})", ""]
    report = out / "report.md"
    report.write_text("\n".join(lines))

    # machine-readable: per-seed numbers and the intervals
    data = {
        "preset": preset.name,
        "description": preset.description,
        "config": base.to_dict(),
        "seeds": seeds,
        "variants": variants,
        "ci": ci,
        "criteria": dataclasses.asdict(crit),
        "timing": timing,
        "per_seed": {v: {str(s): r for s, r in per[v].items()} for v in per},
        "summary": {v: {k: iv.to_dict() for k, iv in summary[v].items()} for v in summary},
        "paired": {
            f"{a}-{b}:{key}": {**iv.to_dict(), "n_pos": npos, "n_neg": nneg}
            for (a, b, key), (iv, npos, nneg) in pairs.items()
        },
        "claims": [dict(claim=c, measured=m, read_as=r, verdict=v) for c, m, r, v in claims],
        # held-out accuracy curves (the study's plots need no metrics.jsonl)
        "curves": {
            v: {str(s): sorted(c.items()) for s, c in _curves(out, v, seeds, "eval/accuracy", 1).items()}
            for v in variants
        },
    }
    (out / "summary.json").write_text(json.dumps(data, indent=1))
    with (out / "per_seed.csv").open("w", newline="") as f:
        keys = [k for k in next(iter(next(iter(per.values())).values()))] if per else []
        w = csv.writer(f)
        w.writerow(["variant", "seed", *keys])
        for v in per:
            for s, r in sorted(per[v].items()):
                w.writerow(
                    [v, s, *[";".join(map(str, r[k])) if isinstance(r[k], list) else r[k] for k in keys]]
                )
    return report


# ================================================================================================
# the study: several compare folders (regimes) side by side


def welch_interval(a: Sequence[float | None], b: Sequence[float | None]) -> Interval:
    """95% CI of mean(a) - mean(b) for independent samples (Welch: unequal variances)."""
    x, y = _clean(a), _clean(b)
    if not x or not y:
        return Interval(None, None, None, 0)
    d = statistics.fmean(x) - statistics.fmean(y)
    if len(x) < 2 or len(y) < 2:
        return Interval(d, None, None, min(len(x), len(y)))
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        return Interval(d, d, d, min(len(x), len(y)))
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    half = t_quantile(max(1, int(math.floor(df)))) * se
    return Interval(d, d - half, d + half, min(len(x), len(y)))


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


def _load_summary(d: str | Path) -> dict[str, Any]:
    path = Path(d) / "summary.json"
    if not path.exists():
        raise GspoError(f"--study: {d} has no summary.json (run gspo compare --out {d} first)")
    data = json.loads(path.read_text())
    data["dir"] = str(d)
    return data


def _per_seed(data: dict[str, Any], v: str, key: str) -> dict[int, float | None]:
    return {int(s): r.get(key) for s, r in data["per_seed"].get(v, {}).items()}


def write_study(dirs: list[str], out_dir: str | Path, ci: str = "t") -> Path:
    """One report over several compare folders: per regime the expert volatility next to the paper's
    ~10%, the paired GSPO - GRPO and replay differences with verdicts, collapse counts and run time;
    MoE vs its dense twin when both are there. Writes ``<out>/study.md``, ``study.json`` and plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    regs = [_load_summary(d) for d in dirs]
    rows, table = [], []
    for r in regs:
        c = r["config"]
        vol = interval([x.get("volatility") for v in r["per_seed"].values() for x in v.values()], ci)
        row: dict[str, Any] = {
            "preset": r["preset"],
            "dir": r["dir"],
            "model": c["model"],
            "num_minibatches": c["num_minibatches"],
            "lr": c["lr"],
            "dtype": c["dtype"] + _sampler_dtype(c),
            "old_logp": Config(
                **{k: v for k, v in c.items() if k in Config.__dataclass_fields__}
            ).resolved_old_logp(),
            "seeds": len(r["seeds"]),
            "wall_s": r.get("timing", {}).get("wall_s"),
            "volatility": vol.to_dict(),
        }
        for a, b, key in [
            ("gspo", "grpo", "acc_final"),
            ("gspo", "grpo", "acc_auc"),
            ("grpo", "gspo", "drawdown"),
            ("grpo", "gspo", "spikes"),
            ("grpo_replay", "grpo", "acc_final"),
            ("gspo", "grpo_replay", "acc_final"),
        ]:
            if a in r["per_seed"] and b in r["per_seed"]:
                iv, npos, nneg = paired_interval(_per_seed(r, a, key), _per_seed(r, b, key), ci)
                delta = -0.02 if (a, b) == ("gspo", "grpo_replay") else 0.0
                row[f"{a}-{b}:{key}"] = {**iv.to_dict(), "verdict": verdict_greater(iv, delta)}
        row["final"] = {
            v: interval(list(_per_seed(r, v, "acc_final").values()), ci).to_dict() for v in r["per_seed"]
        }
        row["collapses"] = {
            v: f"{sum(x.get('acc_collapse_step') is not None for x in s.values())}/{len(s)}"
            for v, s in r["per_seed"].items()
        }
        row["spikes"] = {
            v: sum(
                len(x.get("grad_spike_steps", [])) + len(x.get("ratio_spike_steps", [])) for x in s.values()
            )
            for v, s in r["per_seed"].items()
        }
        rows.append(row)

    def iv_of(d: dict[str, Any] | None, pct: bool = False) -> str:
        if not d:
            return "-"
        iv = Interval(d["mean"], d["lo"], d["hi"], d["n"])
        return iv.fmt(pct) + (f" **{d['verdict']}**" if "verdict" in d else "")

    lines = [
        "# Stability study: GSPO vs GRPO across regimes",
        "",
        "Each regime is one `gspo compare` preset (its own report linked below). Differences are paired "
        f"by seed; intervals are 95% ({'Student t' if ci == 't' else 'percentile bootstrap'}) over seeds. "
        "Verdicts: consistent / inconsistent / inconclusive with the claim, read from the CI.",
        "",
        "## Regimes",
        "",
        "| regime | model | opt. steps / rollout | lr | dtype, pi_old | seeds | wall time | expert "
        f"volatility per update (paper ~{PAPER_VOLATILITY:.0%}) | final acc | accuracy collapses | "
        "grad/ratio spikes |",
        "|---" * 11 + "|",
    ]
    for row in rows:
        lines.append(
            f"| [{row['preset']}]({os.path.relpath(Path(row['dir']) / 'report.md', out)}) | {row['model']} | "
            f"{row['num_minibatches']} | {row['lr']:g} | {row['dtype']}, {row['old_logp']} | {row['seeds']} | "
            f"{_minutes(row['wall_s'])} | {iv_of(row['volatility'], True)} | "
            + "<br>".join(f"{v} {iv_of(d)}" for v, d in row["final"].items())
            + " | "
            + ", ".join(f"{v} {c}" for v, c in row["collapses"].items())
            + " | "
            + ", ".join(f"{v} {c}" for v, c in row["spikes"].items())
            + " |"
        )
        table.append(row)
    lines += [
        "",
        "## Paired differences (a - b per seed): mean [95% CI], verdict on the claim that a - b > 0 "
        "(GSPO vs GRPO+replay: non-inferiority, > -0.02)",
        "",
        "| regime | GSPO - GRPO final acc | GSPO - GRPO acc AUC | GRPO - GSPO drawdown (best - final) | "
        "GRPO - GSPO spikes per run | GRPO+replay - GRPO final acc | GSPO - GRPO+replay final acc |",
        "|---" * 7 + "|",
    ]
    for row in rows:
        lines.append(
            f"| {row['preset']} | {iv_of(row.get('gspo-grpo:acc_final'))} | "
            f"{iv_of(row.get('gspo-grpo:acc_auc'))} | {iv_of(row.get('grpo-gspo:drawdown'))} | "
            f"{iv_of(row.get('grpo-gspo:spikes'))} | "
            f"{iv_of(row.get('grpo_replay-grpo:acc_final'))} | {iv_of(row.get('gspo-grpo_replay:acc_final'))} |"
        )

    # MoE vs its dense twin (same RL settings): is GRPO's gap MoE-specific?
    for m, d in _twins(regs):
        lines += [
            "",
            f"## Is GRPO's problem MoE-specific? `{m['preset']}` (MoE) vs `{d['preset']}` (dense twin)",
            "",
            "| per-seed difference | MoE | dense twin | MoE - dense (Welch) |",
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
            w = welch_interval(gm, gd)
            what = f"{a} - {b} {key}" if b else f"{a} {key} (final - start)"
            lines.append(f"| {what} | {interval(gm, ci).fmt()} | {interval(gd, ci).fmt()} | {w.fmt()} |")
        coll = {
            r["preset"]: ", ".join(
                f"{v} {sum(x.get('acc_collapse_step') is not None for x in s.values())}/{len(s)}"
                for v, s in r["per_seed"].items()
            )
            for r in (m, d)
        }
        lines += ["", f"Accuracy collapses: MoE {coll[m['preset']]}; dense {coll[d['preset']]}."]

    # plots: volatility per regime; paired GSPO - GRPO per regime; accuracy curves per regime
    names = [row["preset"] for row in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    for i, row in enumerate(rows):
        vd = row["volatility"]
        if vd["mean"] is not None:
            lo = vd["lo"] if vd["lo"] is not None else vd["mean"]
            hi = vd["hi"] if vd["hi"] is not None else vd["mean"]
            yerr = [[100 * (vd["mean"] - lo)], [100 * (hi - vd["mean"])]]
            ax.errorbar([i], [100 * vd["mean"]], yerr=yerr, fmt="o", capsize=4)
    ax.axhline(100 * PAPER_VOLATILITY, color="red", ls="--", label="paper (48 layers)")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% tokens whose experts change")
    ax.set_title("expert volatility per update (95% CI)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    for j, (key, lbl) in enumerate([("gspo-grpo:acc_final", "final acc"), ("gspo-grpo:acc_auc", "acc AUC")]):
        xs, ms, lo, hi = [], [], [], []
        for i, row in enumerate(rows):
            d = row.get(key)
            if d and d["mean"] is not None:
                xs.append(i + (j - 0.5) * 0.2)
                ms.append(d["mean"])
                lo.append(d["mean"] - (d["lo"] if d["lo"] is not None else d["mean"]))
                hi.append((d["hi"] if d["hi"] is not None else d["mean"]) - d["mean"])
        ax.errorbar(xs, ms, yerr=[lo, hi], fmt="o", capsize=4, label=lbl)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_title("GSPO - GRPO, paired by seed (95% CI)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "regimes.png", dpi=100)
    plt.close(fig)

    n = len(regs)
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    for k, r in enumerate(regs):
        ax = axes[k // cols][k % cols]
        for v in r["variants"]:
            cur = {s: dict(map(tuple, pts)) for s, pts in r.get("curves", {}).get(v, {}).items()}
            if not cur:
                continue
            steps = sorted({st for c in cur.values() for st in c})
            iv = [interval([c.get(st) for c in cur.values()], ci) for st in steps]
            (line,) = ax.plot(steps, [i.mean for i in iv], label=v)
            ax.fill_between(
                steps,
                [i.lo if i.known else i.mean for i in iv],
                [i.hi if i.known else i.mean for i in iv],
                color=line.get_color(),
                alpha=0.18,
                linewidth=0,
            )
        ax.set_title(r["preset"], fontsize=9)
        ax.grid(alpha=0.3)
        if k == 0 and ax.get_lines():
            ax.legend(fontsize=7)
    for k in range(n, nrows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle("held-out accuracy per regime: mean and 95% CI over seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "accuracy_by_regime.png", dpi=100)
    plt.close(fig)

    lines += [
        "",
        "![volatility and GSPO - GRPO per regime](regimes.png)",
        "",
        "![held-out accuracy per regime](accuracy_by_regime.png)",
        "",
    ]
    report = out / "study.md"
    report.write_text("\n".join(lines))
    (out / "study.json").write_text(json.dumps(table, indent=1))
    return report
