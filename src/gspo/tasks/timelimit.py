"""Time limit of one reward call (user functions and the built-ins): :func:`with_timeout`."""

from __future__ import annotations

import functools
import math
import signal
import threading
from collections.abc import Callable
from typing import Any

from gspo.errors import GspoError

RewardFn = Callable[[list[str], list[str], list[str]], list[float]]

DEFAULT_REWARD_TIMEOUT_S = 60.0
"""Default time limit of one call of a reward function (``load_reward(spec, timeout_s=...)``)."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The largest limit (a week: "no limit" in practice; 0 turns it off)."""


# ------------------------------------------------------------------------------------------------
# time limit for reward functions
#
# Mechanism: the function runs in the calling thread; a watchdog thread, at the deadline, sends a
# real-time signal to it whose handler raises RewardTimeout inside the function. A real signal wakes
# blocking calls (time.sleep, I/O waits) and the exception unwinds the function (its finally blocks
# run), so the call is actually interrupted, and the function keeps the main thread, which functions
# that use signals themselves need (math-verify's timeouts, signal.alarm). Off the main thread (no
# handler can be installed there) it runs in a daemon worker thread that is abandoned at the deadline:
# the error is raised on time but the call goes on in the background. Neither can stop C code that
# holds the GIL until it returns. A subprocess could, but would need the function, its arguments and
# its state (a loaded reward model, say) to be picklable and copied for every call.


class RewardTimeout(BaseException):
    """Raised inside a user reward function at its deadline. A BaseException, so that
    ``except Exception`` in the function does not swallow it."""


class _Deadline:
    __slots__ = ("active", "fired")

    def __init__(self) -> None:
        self.active, self.fired = True, False


_TIMEOUT_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
_deadlines: list[_Deadline] = []  # calls running in the main thread, innermost last
_handler_installed = False


def _on_timeout_signal(signum: int, frame: Any) -> None:
    if _deadlines:
        d = _deadlines[-1]
        if d.fired and d.active:
            raise RewardTimeout(d)


def _can_interrupt() -> bool:
    """In the main thread with our handler on the timeout signal (installed once, never removed: a
    late signal then finds a no-op handler rather than the default action, which would kill us)."""
    global _handler_installed
    if _TIMEOUT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return False
    if _handler_installed:
        return True
    try:
        current = signal.getsignal(_TIMEOUT_SIGNAL)
        if current not in (signal.SIG_DFL, None, _on_timeout_signal):
            return False  # someone else uses it: leave it alone
        signal.signal(_TIMEOUT_SIGNAL, _on_timeout_signal)
    except (ValueError, OSError):
        return False
    _handler_installed = True
    return True


class CallTimeout(GspoError):
    """A call ran past its time limit (:func:`call_with_timeout`). Callers tell it from other errors by
    type, never by its text: a user function's own message may well say "timed out". ``name`` is the
    name the call was made under, ``timeout_s`` its limit."""

    def __init__(self, message: str, name: str = "", timeout_s: float = 0.0) -> None:
        super().__init__(message)
        self.name, self.timeout_s = name, timeout_s


def timeout_error(name: str, timeout_s: float, abandoned: bool) -> CallTimeout:
    """The error for reward function ``name`` out of time (``abandoned``: left running in a thread)."""
    tail = "; it is still running in a background thread" if abandoned else ""
    return CallTimeout(
        f"reward function {name} timed out after {timeout_s:g} s (reward timeout_s={timeout_s:g}; raise "
        f"it if the function is legitimately slow){tail}",
        name,
        timeout_s,
    )


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float, name: str) -> Any:
    if not _can_interrupt():
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["out"] = fn(*args)
            except BaseException as e:  # re-raised in the caller
                box["err"] = e

        worker = threading.Thread(target=target, name="gspo-reward", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise timeout_error(name, timeout_s, abandoned=True)
        if "err" in box:
            raise box["err"]
        return box["out"]

    d, done, main = _Deadline(), threading.Event(), threading.get_ident()

    def watchdog() -> None:
        if done.wait(timeout_s):
            return
        for _ in range(60):  # again every second, in case the function swallowed it
            if not d.active:
                return
            d.fired = True
            try:
                signal.pthread_kill(main, _TIMEOUT_SIGNAL)
            except OSError:
                return
            if done.wait(1.0):
                return

    threading.Thread(target=watchdog, name="gspo-reward-timeout", daemon=True).start()
    _deadlines.append(d)
    try:
        try:
            out = fn(*args)
        finally:
            d.active = False  # first: from here on a late signal is a no-op
            done.set()
            if _deadlines and _deadlines[-1] is d:
                _deadlines.pop()
    except RewardTimeout as e:
        if e.args and e.args[0] is d:
            raise timeout_error(name, timeout_s, abandoned=False) from None
        raise
    return out


def with_timeout(fn: RewardFn, name: str, timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S) -> RewardFn:
    """``fn`` limited to ``timeout_s`` seconds per call (None or 0: no limit); past it, a one-line
    :class:`GspoError` naming ``name`` and the limit (which :func:`safe_rewards` never turns into zeros).
    """
    if timeout_s is None or timeout_s == 0:
        return fn
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise GspoError(f"reward {name!r}: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if timeout_s > MAX_TIMEOUT_S:  # threading's waits overflow near 9e9 s (a traceback in the watchdog)
        raise GspoError(
            f"reward {name!r}: timeout_s must be <= {MAX_TIMEOUT_S:g} s (0: no limit), got {timeout_s:g}"
        )
    limit = float(timeout_s)

    @functools.wraps(fn)
    def timed(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return call_with_timeout(fn, (prompts, completions, answers), limit, name)

    timed.timeout_s = limit  # type: ignore[attr-defined]
    return timed
