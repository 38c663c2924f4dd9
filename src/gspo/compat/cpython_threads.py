"""CPython's ``_thread._count()``: the threads started through ``_thread`` (so through ``threading``
too) that are still running. The sandbox's test harness calls it after the program and after each
test: a verdict is refused while a thread the program started still runs (it could change the
result after the check). ``threading.active_count()`` misses threads started with
``_thread.start_new_thread`` directly, so the private counter is the one that holds.

The harness runs in the sandbox's own interpreter, where gspo cannot be imported (``python -I``), so
it names ``_thread._count`` itself; this module is where that dependency is declared and guarded:
:func:`gspo.tasks.sandbox.programs.compile_tests` refuses to build a harness where ``applies()`` is
false, and tests/test_compat.py checks the name on the installed Python.
"""

from __future__ import annotations

import sys

UPSTREAM = [("_thread", "_count")]


def applies() -> bool:
    """``_thread._count`` exists from CPython 3.2; written against 3.10 to 3.14."""
    return sys.implementation.name == "cpython" and (3, 10) <= sys.version_info[:2] <= (3, 14)
