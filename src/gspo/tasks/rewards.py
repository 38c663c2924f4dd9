"""Reward functions: ``fn(prompts, completions, answers) -> list[float]``, one score per sample.

The batch signature lets a reward share work across a group (parse the reference once, run code in
parallel). Built-ins are looked up by :func:`load_reward`; user functions are loaded from
``package.module:function`` or ``path/to/file.py:function`` and run under a time limit
(:func:`with_timeout`). :func:`safe_rewards` is the only way the trainer calls a reward: it turns
exceptions, NaN/inf, non-numbers and wrong lengths into either a one-line :class:`GspoError` or zero
scores plus a count, and gives rewards string prompts (chat-message prompts become the text of their
last user message, :func:`gspo.tasks.datasets.prompt_text`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import itertools
import math
import os
import re
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

from gspo.errors import GspoError, one_line
from gspo.tasks.timelimit import (  # noqa: F401 (re-exported: callers import them from here)
    DEFAULT_REWARD_TIMEOUT_S,
    call_with_timeout,
    with_timeout,
)
from gspo.tasks.timelimit import RewardTimeout as _RewardTimeout  # public there; local names here
from gspo.tasks.timelimit import timeout_error as _timeout_error

RewardFn = Callable[[list[str], list[str], list[str]], list[float]]

_BUILTINS = "exact_match, math, boxed, code, format:<regex>"


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = fn.__qualname__ = name
    return fn


# ------------------------------------------------------------------------------------------------
# exact match


def exact_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion equals the answer up to surrounding whitespace."""
    return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answers, strict=True)]


# ------------------------------------------------------------------------------------------------
# math: boxed / final-number string match, and math-verify


def _reference(answer: str) -> str:
    """The final answer of a reference: after GSM8K's ``####`` when present."""
    return answer.rsplit("####", 1)[1].strip() if "####" in answer else answer.strip()


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    idx, tag = max((text.rfind(t), t) for t in ("\\boxed", "\\fbox"))
    if idx < 0:
        return None
    j = idx + len(tag)
    if j < len(text) and text[j] == " ":  # \boxed 5
        m = re.match(r" +([^\s$]+)", text[j:])
        return m.group(1) if m else None
    if j >= len(text) or text[j] != "{":
        return None
    depth = 0
    for k in range(j, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1 : k]
    return None  # unbalanced: truncated generation


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _normalize(s: str) -> str:
    """Canonical string for comparison: TeX spacing/wrappers dropped, numbers as reduced fractions."""
    s = s.strip()
    while len(s) >= 2 and s[0] == "$" and s[-1] == "$":
        s = s[1:-1].strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    for tok in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ "):
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", r"\1/\2", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,000 -> 1000
    try:
        if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
            return str(Fraction(s))  # 3.50 == 7/2 == 3.5
        m = re.fullmatch(r"([-+]?\d+)/(\d+)", s)
        if m and int(m.group(2)) != 0:
            return str(Fraction(int(m.group(1)), int(m.group(2))))
    except (ValueError, ZeroDivisionError):
        pass
    return s


def _final_answer(completion: str) -> str | None:
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def boxed_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the last ``\\boxed{}`` of the completion (else its last number) matches the reference
    after normalization (whitespace, ``$``, TeX spacing, ``1,000``, ``0.5 == 1/2 == \\frac{1}{2}``).
    No dependency; :func:`math_verify_reward` is the symbolic, more forgiving version."""
    out = []
    for c, a in zip(completions, answers, strict=True):
        pred = _final_answer(c)
        ref = _reference(a)
        ref = extract_boxed(ref) or ref
        out.append(1.0 if pred is not None and _normalize(pred) == _normalize(ref) else 0.0)
    return out


def _math_verify() -> tuple[Any, Any]:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise GspoError("reward 'math' needs the math-verify package: pip install gspo[math]") from None
    return parse, verify


def math_verify_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when math-verify judges the completion's final answer equal to the reference (symbolic:
    ``\\frac{1}{2}`` == ``0.5``, ``1+x^2`` == ``x^2+1``, sets, intervals)."""
    parse, verify = _math_verify()
    # math-verify's timeouts use SIGALRM, which only works in the main thread; elsewhere run without.
    t = 5 if threading.current_thread() is threading.main_thread() else None
    golds: dict[str, Any] = {}  # the G completions of a group share one reference
    out = []
    for c, a in zip(completions, answers, strict=True):
        if a not in golds:
            ref = _reference(a)
            wrapped = ref if ("$" in ref or "\\boxed" in ref or "\\(" in ref) else f"${ref}$"
            golds[a] = parse(wrapped, parsing_timeout=t) or parse(ref, parsing_timeout=t)
        gold = golds[a]
        ok = bool(gold) and verify(gold, parse(c, parsing_timeout=t), timeout_seconds=t)
        out.append(1.0 if ok else 0.0)
    return out


# ------------------------------------------------------------------------------------------------
# format


def format_reward(pattern: str, timeout_s: float | None = None) -> RewardFn:
    """1.0 when the whole completion matches ``pattern`` (``re.fullmatch``, DOTALL so ``.`` spans
    lines, e.g. ``<think>.*</think>\\s*<answer>.*</answer>``), else 0.0.

    ``timeout_s`` limits one call (all completions): ``re`` runs in C without releasing the GIL, so
    no watchdog can stop a catastrophically backtracking pattern; matching uses the ``regex``
    package (a transformers dependency, same syntax), whose matcher takes a timeout."""
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise GspoError(f"reward 'format:{pattern}': invalid regex: {e}") from None
    name = f"format:{pattern}"
    timed = _timed_regex(pattern) if timeout_s else None
    if timed is None:

        def reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
            return [1.0 if rx.fullmatch(c) else 0.0 for c in completions]

        return _named(reward, name)
    limit = float(timeout_s)  # type: ignore[arg-type]

    def timed_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        deadline, out = time.monotonic() + limit, []
        for c in completions:
            try:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                out.append(1.0 if timed.fullmatch(c, timeout=left) else 0.0)
            except TimeoutError:
                raise _timeout_error(name, limit, abandoned=False) from None
        return out

    return _named(timed_reward, name)


def _timed_regex(pattern: str) -> Any:
    """``pattern`` compiled by the ``regex`` package (None without it, or if it reads it otherwise)."""
    if "[:" in pattern:  # POSIX classes: regex reads [[:alpha:]] as one, re as a plain set
        return None
    try:
        import regex
    except ImportError:
        return None
    try:
        return regex.compile(pattern, regex.DOTALL | regex.VERSION0)
    except Exception:  # noqa: BLE001 (regex.error: a pattern only re accepts)
        return None


# ------------------------------------------------------------------------------------------------
# code execution

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced ```python block (else the last untagged ``` block; an unterminated final
    block counts), or the whole completion when there is no fence."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    for wanted in (("python", "py", "python3"), ("",)):
        bodies = [body for lang, body in blocks if lang in wanted]
        if bodies:
            return bodies[-1]
    return completion


def make_code_reward(
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    workers: int | None = None,
    require_fs_isolation: bool | None = None,
) -> RewardFn:
    """Reward running ``extract_code(completion)`` and then the answer's tests (asserts) in
    :func:`gspo.tasks.sandbox.run_untrusted`: 1.0 only when the sandbox harness reports, on a channel
    the program cannot forge, that every test ran and passed (an early ``sys.exit(0)``, a lying
    ``__eq__``, patched builtins and the like score 0), else 0.0. Programs run in parallel threads
    (each one a subprocess), ``workers`` default: CPU count. ``require_fs_isolation``: see
    :func:`~gspo.tasks.sandbox.run_untrusted` (default: refuse to run without Landlock)."""
    from gspo.tasks.sandbox import run_untrusted

    def run(pair: tuple[str, str]) -> float:
        code, tests = pair
        result = run_untrusted(
            code,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            tests=tests,
            require_fs_isolation=require_fs_isolation,
        )
        return 1.0 if result.passed else 0.0

    def reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        pairs = [(extract_code(c), a) for c, a in zip(completions, answers, strict=True)]
        n = min(len(pairs), workers or os.cpu_count() or 1)
        if n <= 1:
            return [run(p) for p in pairs]
        with ThreadPoolExecutor(n, thread_name_prefix="gspo-sandbox") as pool:
            return list(pool.map(run, pairs))

    return _named(reward, "code_execution_reward")


code_execution_reward: RewardFn = make_code_reward()


# ------------------------------------------------------------------------------------------------
# loading and combining


def _load_builtin(name: str, timeout_s: float | None = None) -> RewardFn | None:
    if name == "exact_match":
        return exact_match
    if name in ("math", "math_verify"):
        _math_verify()  # fail at startup, not at the first reward call
        return math_verify_reward
    if name == "boxed":
        return boxed_match
    if name == "code":
        from gspo.tasks.sandbox import check_filesystem_isolation

        check_filesystem_isolation()  # no Landlock: fail at startup, not at the first reward call
        return code_execution_reward
    if name.startswith("format:"):
        if not name[len("format:") :]:
            raise GspoError("reward 'format:': empty regex (use format:<regex>)")
        return format_reward(name[len("format:") :], timeout_s)
    return None


def is_instant_reward(spec: str | None) -> bool:
    """Whether the reward ``spec`` names a built-in of :func:`_load_builtin` that answers at once (all
    but ``code``, which runs a sandbox): an environment scoring with it may run its steps inside the
    decode loop."""
    spec = (spec or "").strip()
    return spec in ("exact_match", "math", "math_verify", "boxed") or spec.startswith("format:")


def import_file(spec: str, file: str, kind: str = "reward") -> Any:
    """The module of a user's ``file`` (``kind``: what the file holds, "reward" or "environment", for
    the one-line errors: not found, or its import raised anything, ``SystemExit`` included)."""
    path = os.path.abspath(os.path.expanduser(file))
    if not os.path.isfile(path):
        raise GspoError(f"{kind} {spec!r}: file not found: {file}")
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    mod_name = f"gspo_user_reward_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    assert mspec is not None and mspec.loader is not None
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module  # dataclasses / pickling look the module up by name
    sys.path.insert(0, os.path.dirname(path))  # so the file can import its sibling helpers
    try:
        mspec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 (a SystemExit at import is the file's error, not ours)
        del sys.modules[mod_name]
        if is_interrupt(e):
            raise
        raise GspoError(f"{kind} {spec!r}: importing {file} failed: {one_line(e)}") from None
    finally:
        if os.path.dirname(path) in sys.path:
            sys.path.remove(os.path.dirname(path))
    return module


def _load_user(spec: str) -> RewardFn:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise GspoError(f"reward {spec!r}: expected module:function or path/to/file.py:function")
    if target.endswith(".py"):
        module = import_file(spec, target)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            # `gspo` runs from a console script, so the cwd is not on sys.path: load my_rewards.py
            # (or pkg/mod.py) from the cwd when that is what "my_rewards:fn" names.
            file = target.replace(".", os.sep) + ".py"
            if e.name != target.split(".")[0] or not os.path.isfile(file):
                raise GspoError(f"reward {spec!r}: cannot import module {target!r}: {one_line(e)}") from None
            module = import_file(spec, file)
        except BaseException as e:  # noqa: BLE001 (SystemExit at import included)
            if is_interrupt(e):
                raise
            raise GspoError(f"reward {spec!r}: cannot import module {target!r}: {one_line(e)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise GspoError(f"reward {spec!r}: {target} has no attribute {attr!r}")
    if not callable(fn):
        raise GspoError(f"reward {spec!r}: {attr} is not callable (got {type(fn).__name__})")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins / C callables: no signature to check
        return fn
    try:
        sig.bind([], [], [])
    except TypeError:
        raise GspoError(
            f"reward {spec!r}: {attr}{sig} cannot be called as fn(prompts, completions, "
            "answers) -> list[float]"
        ) from None
    return fn


def load_reward(spec: str, timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S) -> RewardFn:
    """A reward by spec: a built-in (``exact_match``, ``math``, ``boxed``, ``code``,
    ``format:<regex>``) or a user function ``package.module:function`` / ``path/to/file.py:function``
    called as ``fn(prompts, completions, answers) -> list[float]``.

    ``timeout_s`` limits each call (None or 0: no limit; see :func:`with_timeout`): past it the call
    is interrupted and a one-line :class:`GspoError` names the spec and the limit. That holds for the
    built-ins too (a pathological completion or ``format:`` regex), except ``code``, whose programs
    each have their own limits in the sandbox, and ``exact_match``, a strip and a compare: linear in
    the completion, it cannot hang, so the default step runs no watchdog thread for it."""
    spec = spec.strip()
    fn = _load_builtin(spec, timeout_s)
    if fn is not None:
        return fn if spec in ("code", "exact_match") else with_timeout(fn, spec, timeout_s)
    if ":" not in spec:
        raise GspoError(
            f"unknown reward {spec!r} (built-in: {_BUILTINS}; or module:function, path/to/file.py:function)"
        )
    return with_timeout(_load_user(spec), spec, timeout_s)


def combine(rewards: list[tuple[RewardFn, float]]) -> RewardFn:
    """Weighted sum ``sum_k w_k * r_k`` of rewards (e.g. correctness + 0.1 * format)."""
    if not rewards:
        raise ValueError("combine() needs at least one (reward, weight) pair")
    parts = list(rewards)

    def combined(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        total = [0.0] * len(completions)
        for fn, w in parts:
            values = list(fn(prompts, completions, answers))
            if len(values) != len(total):
                raise ValueError(f"{_fn_name(fn)} returned {len(values)} values for {len(total)} samples")
            for i, v in enumerate(values):
                total[i] += w * float(v)
        return total

    return _named(combined, "+".join(f"{w:g}*{_fn_name(fn)}" for fn, w in parts))


# ------------------------------------------------------------------------------------------------
# calling a reward safely


class _BadBatch(Exception):
    """The whole return value is unusable (not a list, wrong length)."""


class RewardFailure(GspoError):
    """What :func:`safe_rewards` raises when the reward itself failed (raised, or returned something
    that is not one finite number per sample), as opposed to a setup error or a time limit: a caller
    under ``reward_on_error zero`` (an environment's step) may score the sample 0 instead."""


def reward_value(v: Any) -> float | str:
    """The float for a returned reward, or a description of why it is not one (not a number, not
    finite, an int past float64, a value past float32); also what an environment's step reward is
    checked with."""
    if v is None or isinstance(v, (str, bytes)):
        return f"{_type_name(v)} {v!r:.40}" if v is not None else "None"
    try:
        f = float(v)
    except OverflowError:  # an int past float64, e.g. 10**400
        return f"{_type_name(v)} too large for a float"
    except (TypeError, ValueError):
        return f"{_type_name(v)} {v!r:.40}"
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    # rewards train as float32: a finite float64 such as 1e39 becomes inf there
    if math.isinf(struct.unpack("f", struct.pack("f", f))[0]):
        return f"{f:g}, which overflows float32 (the rewards' training dtype; |reward| < 3.4e38)"
    return f


def is_interrupt(e: BaseException) -> bool:
    """A BaseException the reward must let through: its time limit, or a real Ctrl-C / SIGTERM. Under
    ``gspo train`` signals never raise a plain KeyboardInterrupt (the trainer's handler defers the
    first and raises its own subclass for the second), so a plain one is the reward's own, unless
    Python's default SIGINT handler is installed (then a real Ctrl-C looks the same)."""
    if isinstance(e, _RewardTimeout):
        return True
    if not isinstance(e, KeyboardInterrupt):
        return False
    return type(e) is not KeyboardInterrupt or signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _type_name(v: Any) -> str:
    return type(v).__name__


def _scores(out: Any, n: int) -> list[float | str]:
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise _BadBatch(f"returned {_type_name(out)} instead of a list of {n} floats")
    values = list(itertools.islice(out, n + 1))  # an endless generator must not hang the trainer
    if len(values) != n:
        raise _BadBatch(f"returned {len(values)} values for {n} samples")
    return [reward_value(v) for v in values]


def safe_rewards(
    fn: RewardFn,
    prompts: list[Any],
    completions: list[str],
    answers: list[str],
    on_error: str = "error",
    name: str = "reward",
) -> tuple[list[float], int]:
    """Call ``fn`` and check it returned ``len(completions)`` finite numbers (bools count).

    ``on_error="error"``: any problem raises a one-line :class:`GspoError` naming ``name`` (e.g. the
    reward spec) and the sample. ``on_error="zero"``: bad samples score 0.0; when the whole call fails
    (raises, wrong length, not a list) each sample is retried alone to isolate the bad ones. Returns
    ``(scores, n_bad)`` for the caller to log. When *every* sample of the batch fails, zeros would
    train on nothing, silently: that is a one-line :class:`GspoError` in both modes. A
    :class:`GspoError` from ``fn`` (a setup problem such as a missing package, or a time limit, see
    :func:`with_timeout`: retrying each sample would multiply the wait) always propagates.

    Prompts that are chat messages (a list of ``{"role", "content"}``) reach ``fn`` as the text of
    their last user message (:func:`gspo.tasks.datasets.prompt_text`), so rewards always get strings.
    """
    from gspo.tasks.datasets import prompt_text

    if on_error not in ("error", "zero"):
        raise ValueError(f"on_error must be 'error' or 'zero', got {on_error!r}")
    n = len(completions)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(f"got {len(prompts)} prompts, {n} completions, {len(answers)} answers")
    if n == 0:
        return [], 0
    prompts = [p if isinstance(p, str) else prompt_text(p) for p in prompts]
    try:
        scores = _scores(fn(prompts, completions, answers), n)
    except BaseException as e:  # SystemExit, KeyboardInterrupt from the reward: its error, not ours
        return _failed_call(e, fn, prompts, completions, answers, on_error, name)
    if any(isinstance(s, str) for s in scores):  # the failure paths live apart: a step runs none
        return _bad_scores(scores, completions, on_error, name)
    return scores, 0  # type: ignore[return-value] (no str among them)


def _failure(name: str, what: str, completions: list[str], i: int | None = None) -> RewardFailure:
    where = f" for sample {i} (completion {completions[i][:60]!r})" if i is not None else ""
    return RewardFailure(f"reward function {name} {what}{where}")


def _checked(out: list[float], bad: int, first: str, name: str) -> tuple[list[float], int]:
    if bad == len(out):
        raise GspoError(
            f"reward function {name} failed on all {bad} samples of the batch ({first}); "
            "--reward-on-error zero would train on all-zero rewards"
        )
    return out, bad


def _failed_call(
    e: BaseException,
    fn: RewardFn,
    prompts: list[str],
    completions: list[str],
    answers: list[str],
    on_error: str,
    name: str,
) -> tuple[list[float], int]:
    """:func:`safe_rewards` where the whole call failed with ``e`` (called inside its ``except``)."""
    if isinstance(e, GspoError) or is_interrupt(e):
        raise e
    if on_error == "error":
        if isinstance(e, _BadBatch):
            raise _failure(name, str(e), completions) from None
        cause = e if isinstance(e, Exception) else None  # a BaseException's traceback is noise
        raise _failure(name, f"raised {one_line(e)}", completions) from cause
    return _checked(*_per_sample(fn, prompts, completions, answers), name)


def _bad_scores(
    scores: list[float | str], completions: list[str], on_error: str, name: str
) -> tuple[list[float], int]:
    """:func:`safe_rewards` where some returned values are not rewards (their descriptions)."""
    out, bad, first = [], 0, ""
    for i, s in enumerate(scores):
        if isinstance(s, str):
            if on_error == "error":
                raise _failure(name, f"returned {s}", completions, i)
            out.append(0.0)
            bad += 1
            first = first or f"sample {i}: returned {s}"
        else:
            out.append(s)
    return _checked(out, bad, first, name)


def _per_sample(
    fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str]
) -> tuple[list[float], int, str]:
    out, bad, first = [], 0, ""
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True)):
        try:
            s = _scores(fn([p], [c], [a]), 1)[0]
        except GspoError:
            raise
        except _BadBatch as e:
            s = str(e)
        except BaseException as e:
            if is_interrupt(e):
                raise
            s = f"raised {one_line(e)}"
        if isinstance(s, str):
            out.append(0.0)
            bad += 1
            first = first or f"sample {i}: {s}"
        else:
            out.append(s)
    return out, bad, first
