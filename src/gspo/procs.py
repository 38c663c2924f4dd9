"""Child processes that end with their parent (ground floor: standard library only).

The sandbox launcher runs this module's code too (shipped compiled, like ``confine.py``: see
``tasks/sandbox/programs.py``), in an isolated interpreter that cannot import gspo; so nothing here
imports gspo, and nothing beyond the standard library.
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None, exit_code: int = 1) -> None:
    """Linux: get ``sig`` when the parent process dies, even by ``kill -9`` (elsewhere, or without
    ctypes: nothing). ``parent``: the PID the caller expects as its parent; if it is no longer the
    parent, the parent died before the signal was set up (no signal will come): exit with
    ``exit_code`` at once. Also a ``preexec_fn`` / pool ``initializer`` (SIGTERM by default: a rank's
    handler then checkpoints the finished step and stops)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
        except (ImportError, OSError):  # no ctypes (a stripped interpreter): no parent-death signal
            pass
    if parent is not None and os.getppid() != parent:
        os._exit(exit_code)
