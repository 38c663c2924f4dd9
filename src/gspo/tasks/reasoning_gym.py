"""reasoning-gym tasks: ``--task rg:NAME`` trains on any procedural dataset of the `reasoning-gym
<https://github.com/open-thought/reasoning-gym>`_ library (``pip install "gspo[rg]"``), scored by
that dataset's own ``score_answer``.

Spec: ``rg:NAME`` or ``rg:NAME:key=value,key=value`` where ``size`` is the number of train examples
(default :data:`TRAIN_SIZE`) and every other key is a field of the dataset's config dataclass
(difficulty knobs such as ``min_terms``; values are read as YAML scalars: ``3``, ``0.5``, ``true``).
Examples: ``rg:leg_counting``, ``rg:chain_sum:size=2000,min_terms=2,max_terms=3``.

Data: entry ``i`` of the train split is the dataset's item ``i`` under seed ``train_seed(seed)``; the
held-out split is drawn under a seed ``2**31`` above it (most reasoning-gym datasets seed item ``i``
with ``seed + i``, so the two index ranges never meet) and drops any question that also occurs in
train. The same run seed gives the same examples. Generation runs when the task is built (on every
rank); most datasets make 10,000 items in seconds, the slowest (search-based puzzles such as
``knight_swap``, ``zebra_puzzles``) take minutes: a warning line says so, ``size=N`` shortens it.
Each :class:`Example` holds the question as ``prompt``, the reference answer as ``answer`` (``""``
for datasets whose questions have many valid answers, e.g. ``graph_color``: there the scorer checks
the completion itself and the supervised warm start has nothing to imitate) and, in ``meta``, the
dataset name, seed, index and the entry's ``metadata``.

Reward: ``rg`` (also what the config default ``exact_match`` means for an ``rg:`` task) looks up the
entry of each ``(prompt, answer)`` pair in a table built with the task (every train and held-out
entry; a pair not in it is a one-line error) and returns ``dataset.score_answer(answer=...,
entry=entry)`` on the completion's last ``<answer>...</answer>`` (reasoning-gym's answer format,
``reasoning_gym.utils.extract_answer``; its ``SYSTEM_PROMPTS["default"]`` asks for it, pass it as
``--system-prompt`` to instruct models), or on the whole stripped completion when it has no such
tag; clipped to [0, 1]. A scorer that raises on a malformed completion scores it 0. Any other
``--reward`` (``math``, ``boxed``, ``pkg.mod:fn``...) gets the reference answer strings like any
dataset's.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import yaml

from gspo.errors import GspoError, one_line, warn
from gspo.tasks.datasets import Example
from gspo.tasks.rewards import RewardFn, load_reward
from gspo.tasks.task import Task

PREFIX = "rg:"
TRAIN_SIZE = 10_000
"""Train examples of an ``rg:`` task unless its spec says ``size=N``."""
REWARD = "rg"
"""Reward spec of the dataset's own scorer."""
INSTALL = 'pip install "gspo[rg]"  (or: pip install reasoning-gym)'
_EVAL_OFFSET = 2**31
_SLOW_S = 20.0
_NONSENSE = "<answer>zq</answer>"  # probes scorers that accept anything


def is_rg_task(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(PREFIX)  # type: ignore[union-attr]


@dataclass(frozen=True)
class RGSpec:
    name: str
    size: int
    params: dict[str, Any]
    spec: str


def train_seed(seed: int) -> int:
    """reasoning-gym seed of the train split for run seed ``seed`` (spread so that seeds 0 and 1
    do not share all but one item; held-out is ``train_seed + 2**31``)."""
    return (seed * 1_000_003) % _EVAL_OFFSET


def _import() -> Any:
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS  # noqa: F401
    except ImportError as e:
        raise GspoError(f"rg: tasks need the reasoning-gym package ({e.name or e}): {INSTALL}") from None
    return reasoning_gym


def _close_names(name: str, names: list[str]) -> list[str]:
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    close += [n for n in names if name and (name in n or n in name) and n not in close]
    return close[:5]


def parse_spec(spec: str, field: str = "task") -> RGSpec:
    """``rg:NAME[:key=value,...]`` -> :class:`RGSpec`, checked against the installed reasoning-gym:
    unknown dataset names and config keys are one-line errors naming close matches."""
    where = f"config field '{field}'"
    if not spec.startswith(PREFIX):
        raise GspoError(f"{where}: not a reasoning-gym spec (expected rg:NAME), got {spec!r}")
    name, _, rest = spec[len(PREFIX) :].partition(":")
    name = name.strip()
    _import()
    from reasoning_gym.factory import DATASETS

    names = sorted(DATASETS)
    if name not in DATASETS:
        close = _close_names(name, names)
        hint = f"close: {', '.join(close)}; " if close else ""
        raise GspoError(
            f"{where}: unknown reasoning-gym dataset {name!r} ({hint}{len(names)} datasets, e.g. "
            f'{", ".join(names[:4])}; list: python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))")'
        )
    config_cls = DATASETS[name][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    size, params = TRAIN_SIZE, {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise GspoError(f"{where}: {spec!r}: expected key=value after the dataset name, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw.strip()
        if key == "size":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GspoError(f"{where}: {spec!r}: size must be an integer >= 1, got {raw!r}")
            size = value
        elif key == "seed":
            raise GspoError(f"{where}: {spec!r}: the seed comes from the run's 'seed' field, not the spec")
        elif key not in fields:
            close = difflib.get_close_matches(key, fields, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise GspoError(
                f"{where}: {spec!r}: {name} has no config key {key!r} ({hint}keys: size, "
                f"{', '.join(fields) or '(none)'})"
            )
        else:
            params[key] = value
    return RGSpec(name=name, size=size, params=params, spec=spec)


def make_dataset(spec: RGSpec, seed: int, size: int, field: str = "task") -> Any:
    """The reasoning-gym dataset object for ``spec`` (its own config validation as a one-line error)."""
    rg = _import()
    try:
        return rg.create_dataset(spec.name, seed=seed, size=size, **spec.params)
    except Exception as e:
        raise GspoError(
            f"config field '{field}': {spec.spec!r}: reasoning-gym rejected the config ({one_line(e)})"
        ) from None


def _entry(ds: Any, spec: RGSpec, seed: int, i: int) -> tuple[Example, dict[str, Any]]:
    try:
        entry = ds[i]
    except Exception as e:
        raise GspoError(
            f"{spec.spec}: reasoning-gym failed to generate item {i} (seed {seed}): {one_line(e)}"
        ) from None
    question, answer = entry.get("question"), entry.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise GspoError(f"{spec.spec}: item {i} (seed {seed}) has no question text")
    answer = "" if answer is None else answer if isinstance(answer, str) else str(answer)
    meta = {"rg_dataset": spec.name, "rg_seed": seed, "rg_index": i, "metadata": entry.get("metadata", {})}
    return Example(question, answer, meta), entry


def _generate(spec: RGSpec, seed: int, size: int, field: str) -> tuple[Any, list[tuple[Example, dict]]]:
    ds = make_dataset(spec, seed, size, field)
    t0, out, warned = time.perf_counter(), [], False
    for i in range(size):
        out.append(_entry(ds, spec, seed, i))
        if not warned and time.perf_counter() - t0 > _SLOW_S and i + 1 < size:
            rate = (i + 1) / (time.perf_counter() - t0)
            warn(
                f"{spec.spec}: generating {size} examples at {rate:.0f}/s (~{(size - i - 1) / rate:.0f}s more);"
                f" a smaller train set: rg:{spec.name}:size=N"
            )
            warned = True
    return ds, out


def score_completion(dataset: Any, entry: dict[str, Any], completion: str) -> float:
    """The dataset's own score of one completion: its last ``<answer>`` tag, else the whole text."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion) if "</answer>" in completion else None
    text = tagged if tagged is not None else completion.strip()
    try:
        score = float(dataset.score_answer(answer=text, entry=entry))
    except Exception:  # some scorers raise on malformed answers (e.g. prime_factorization)
        return 0.0
    # Scores are meant to lie in [0, 1]; float sums can overshoot (spell_backward: 1.0000000000000002).
    return min(max(score, 0.0), 1.0) if math.isfinite(score) else score


def make_reward(table: dict[tuple[str, str], tuple[Any, dict[str, Any]]], label: str) -> RewardFn:
    """The ``rg`` reward over ``table``: (prompt, reference answer) -> (dataset, entry)."""

    def rg_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        scores = []
        for p, c, a in zip(prompts, completions, answers, strict=True):
            hit = table.get((p, a))
            if hit is None:
                raise GspoError(
                    f"reward {REWARD}: prompt is not an example of {label} (the rg reward scores only "
                    f"its own task's questions): {p[:60]!r}"
                )
            scores.append(score_completion(hit[0], hit[1], c))
        return scores

    rg_reward.__name__ = rg_reward.__qualname__ = f"rg_reward[{label}]"
    return rg_reward


def build_rg_task(
    task: str,
    reward: str,
    seed: int,
    eval_size: int,
    eval_task: str | None = None,
    **reward_kwargs: Any,
) -> Task:
    """Train/held-out examples of a reasoning-gym spec and its reward (see the module docstring).
    ``reward_kwargs`` go to :func:`~gspo.tasks.rewards.load_reward` for rewards other than ``rg``."""
    spec = parse_spec(task, "task")
    if eval_task and not is_rg_task(eval_task):
        raise GspoError(
            f"config field 'eval_task': with an rg: task the held-out set is an rg: spec too "
            f"(default: the same dataset under a disjoint seed), got {eval_task!r}"
        )
    eval_spec = parse_spec(eval_task, "eval_task") if eval_task else spec
    s_train = train_seed(seed)
    s_eval = s_train + _EVAL_OFFSET
    train_ds, train = _generate(spec, s_train, spec.size, "task")
    seen = {ex.prompt for ex, _ in train}
    # Draw up to 4x eval_size items so questions that also occur in train can be skipped.
    eval_ds = make_dataset(eval_spec, s_eval, eval_size * 4, "eval_task" if eval_task else "task")
    held_out: list[tuple[Example, dict]] = []
    for i in range(eval_size * 4):
        ex, entry = _entry(eval_ds, eval_spec, s_eval, i)
        if ex.prompt not in seen:
            held_out.append((ex, entry))
            if len(held_out) == eval_size:
                break
    if not held_out:
        raise GspoError(
            f"{eval_spec.spec}: every held-out question also occurs in the {spec.size} train examples "
            f"(few distinct questions): use a smaller train set, rg:{spec.name}:size=N"
        )
    if len(held_out) < eval_size:
        warnings.warn(
            f"held-out set has {len(held_out)} examples, fewer than eval_size={eval_size} "
            f"({eval_spec.spec} has few questions outside the {spec.size} training ones): "
            "eval accuracy is noisier than asked for",
            UserWarning,
            stacklevel=3,
        )
    table: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
    for ds, pairs in ((train_ds, train), (eval_ds, held_out)):
        for ex, entry in pairs:
            table.setdefault((ex.prompt, ex.answer), (ds, entry))
    if reward in (REWARD, "exact_match"):
        label = task if not eval_task or eval_task == task else f"{task} (held-out {eval_task})"
        for sp, ds, pairs in ((spec, train_ds, train), (eval_spec, eval_ds, held_out)):
            if all(score_completion(ds, entry, _NONSENSE) >= 1.0 for _, entry in pairs[:4]):
                warn(
                    f"{sp.spec}: reasoning-gym's scorer gives full marks to a nonsense answer "
                    f"({_NONSENSE!r}): the policy can collect reward without solving anything"
                )
        fn, name = make_reward(table, label), f"{REWARD} ({spec.name} score_answer)"
    else:
        fn, name = load_reward(reward, **reward_kwargs), reward
    return Task(train=[ex for ex, _ in train], eval=[ex for ex, _ in held_out], reward=fn, reward_name=name)
