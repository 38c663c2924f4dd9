"""The ``code`` reward cannot be gamed: every early-exit / forgery route scores 0, honest code scores 1.

Each attack defines a *wrong* ``add`` (or none) plus the exploit, so the only way to 1.0 would be
the exploit working. Tests are the answer field, as in a dataset row.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gspo.tasks import sandbox
from gspo.tasks.rewards import make_code_reward

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX only"),
    # without Landlock the code reward refuses to run (and a child could read the harness via /proc)
    pytest.mark.skipif(sandbox.landlock_abi() == 0, reason="kernel without Landlock"),
]

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 5) != 14\n"
WRONG = "def add(a, b):\n    return 0\n"

# A 64-hex string in the shape of the nonce, and every "success" marker we could think of.
FORGE = (
    "import os\n"
    "msgs = [b'0' * 64, b'ok', b'OK', b'PASS', b'passed', b'1', b'True', b'success', b'\\n']\n"
    "for fd in range(1, 256):\n"
    "    for m in msgs:\n"
    "        try:\n"
    "            os.write(fd, m)\n"
    "        except OSError:\n"
    "            pass\n"
)

ATTACKS = {
    # ---- ending the interpreter early --------------------------------------------------------
    "sys_exit_0": WRONG + "import sys\nsys.exit(0)\n",
    "raise_SystemExit": WRONG + "raise SystemExit\n",
    "os__exit_0": WRONG + "import os\nos._exit(0)\n",
    "builtin_exit": WRONG + "exit()\n",
    "builtin_quit": WRONG + "quit(0)\n",
    "os_abort": WRONG + "import os\nos.abort()\n",
    "kill_self_sigkill": WRONG + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "kill_self_sigterm": WRONG + "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n",
    "kill_parent": WRONG + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "killpg_own_group": WRONG + "import os, signal\nos.killpg(0, signal.SIGKILL)\n",
    "atexit_os_exit": WRONG + "import atexit, os\natexit.register(os._exit, 0)\n",
    "atexit_sys_exit": WRONG + "import atexit, sys\natexit.register(sys.exit, 0)\n",
    "atexit_raise_systemexit": WRONG
    + "import atexit\ndef bye():\n    raise SystemExit(0)\natexit.register(bye)\n",
    "excepthook_exit_0": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "unraisablehook_exit_0": WRONG + "import os, sys\nsys.unraisablehook = lambda *a: os._exit(0)\n",
    "keyboard_interrupt": WRONG + "raise KeyboardInterrupt\n",
    "fork_parent_exits_0": WRONG + "import os\nif os.fork():\n    os._exit(0)\n",
    "exit_inside_function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "systemexit_inside_function": "def add(a, b):\n    raise SystemExit(0)\n",
    "exit_in_finally": WRONG + "import os\ntry:\n    pass\nfinally:\n    os._exit(0)\n",
    "timer_exit_during_tests": (
        "import os, threading, time\n"
        "def add(a, b):\n    time.sleep(0.3)\n    return 0\n"
        "threading.Timer(0.1, os._exit, (0,)).start()\n"
    ),
    # ---- lying objects -------------------------------------------------------------------------
    "eq_always_true": "class A:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
    "        return True\ndef add(a, b):\n    return A()\n",
    "eq_true_for_builtin_types": (
        "class A:\n    def __eq__(self, o):\n        return isinstance(o, (int, float, str, list, tuple))\n"
        "    def __ne__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return A()\n"
    ),
    "eq_true_first_call_per_value": (
        "class A:\n    seen = set()\n    def __eq__(self, o):\n        k = repr(o)\n"
        "        if k in A.seen:\n            return False\n        A.seen.add(k)\n        return True\n"
        "    def __ne__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return A()\n"
    ),
    "int_subclass_lying_eq": (
        "class I(int):\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
        "        return True\n    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n"
    ),
    "str_subclass_from___str__": (
        "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
        "class A:\n    def __str__(self):\n        return S('x')\n"
        "def add(a, b):\n    return A()\n"
    ),
    "mock_ANY": "from unittest.mock import ANY\ndef add(a, b):\n    return ANY\n",
    "lying_metaclass_eq": (
        "class M(type):\n    def __eq__(cls, o):\n        return True\n    __hash__ = type.__hash__\n"
        "class A(metaclass=M):\n    def __eq__(self, o):\n        return True\n"
        "def add(a, b):\n    return A()\n"
    ),
    "list_of_liars": (
        "class A:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
        "        return True\ndef add(a, b):\n    return A()\n"
    ),
    # ---- patching what the tests use ------------------------------------------------------------
    "patch_builtins_all": WRONG + "import builtins\nbuiltins.all = lambda *a: True\n",
    "shadow_all_in_globals": WRONG + "def all(*a):\n    return True\n",
    "patch_builtins_len": "import builtins\nbuiltins.len = lambda x: 2\ndef add(a, b):\n    return []\n",
    "patch_AssertionError": WRONG + "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
    "AssertionError = None\n",
    "patch_builtins_exec_compile": WRONG + "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
    "builtins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n",
    "patch_import": (
        WRONG + "import builtins, types\nreal = builtins.__import__\nfake = types.SimpleNamespace("
        "isclose=lambda *a, **k: True)\n"
        "builtins.__import__ = lambda n, *a, **k: fake if n == 'math' else real(n, *a, **k)\n"
    ),
    "patch_sys_modules": WRONG
    + "import sys, types\nsys.modules['math'] = types.SimpleNamespace(isclose=lambda *a, **k: True)\n",
    "patch_module_attribute": WRONG + "import math\nmath.isclose = lambda *a, **k: True\n",
    "redefine_check": WRONG + "def check(candidate):\n    pass\nimport builtins\nbuiltins.check = check\n",
    "define_cmp_helper": WRONG
    + "__gspo_cmp__ = lambda *a: True\nimport builtins\nbuiltins.__gspo_cmp__ = __gspo_cmp__\n",
    "patch_test_globals_class": WRONG
    + (  # a dict subclass as test namespace would be reachable here
        "for c in dict.__subclasses__():\n    try:\n        old = c.__getitem__\n"
        "        c.__getitem__ = lambda self, k, old=old: (lambda *a: True) if k == '__gspo_cmp__' else old(self, k)\n"
        "    except Exception:\n        pass\n"
    ),
    "replace_helper_code": WRONG
    + (
        "import gc\ncmps = [o for o in gc.get_objects() if getattr(o, '__name__', '') == 'cmp']\n"
        "for c in cmps:\n    c.__code__ = (lambda *a, **k: True).__code__\n"
    ),
    "patch_helper_via_test_callable": (  # the tests pass their own lambda: its __globals__ is theirs
        "def add(a, b, key=None):\n    if key is not None:\n        g = key.__globals__\n"
        "        cmp = g['__gspo_cmp__']\n        cmp.__kwdefaults__['_h'][5] = lambda a, b, d: True\n"
        "    return 0\n"
    ),
    "stat_result_patch": WRONG
    + (  # harmless: the token is only written after the tests passed
        "import os\nos.stat_result.st_ino = property(lambda s: 0)\n"
        "os.stat_result.__getitem__ = lambda s, k: 0\n"
    ),
    "patch_operator": WRONG + "import operator, _operator\noperator.eq = _operator.eq = lambda a, b: True\n",
    "patch_thread_count": (
        "import _thread, threading, time\n_thread._count = lambda: 0\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n" + WRONG
    ),
    "settrace_skip_lines": WRONG + "import sys\ndef t(*a):\n    return t\nsys.settrace(t)\n",
    "setprofile": WRONG + "import sys\nsys.setprofile(lambda *a: None)\n",
    # ---- forging the verdict --------------------------------------------------------------------
    "write_markers_everywhere": WRONG + FORGE,
    "write_markers_then_exit_0": WRONG + FORGE + "os._exit(0)\n",
    "echo_argv_env_files": WRONG
    + (
        "import os, sys\nblob = ' '.join(sys.argv + sys.orig_argv + list(os.environ.values())).encode()\n"
        "for name in os.listdir('.'):\n    blob += open(name, 'rb').read()\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, blob)\n    except OSError:\n        pass\n"
    ),
    "read_every_fd": WRONG
    + (
        "import os\ngot = b''\nfor fd in range(0, 256):\n    try:\n        os.lseek(fd, 0, 0)\n"
        "    except OSError:\n        pass\n    try:\n        got += os.read(fd, 4096)\n    except OSError:\n"
        "        pass\nfor fd in range(3, 256):\n    try:\n        os.write(fd, got)\n    except OSError:\n"
        "        pass\n"
    ),
    "proc_cmdline_and_fds": WRONG
    + (
        "import os\nfor p in ('/proc/self/cmdline', '/proc/self/environ', '/proc/1/cmdline'):\n"
        "    try:\n        open(p, 'rb').read()\n    except OSError:\n        pass\n"
        "got = b''\nfor fd in range(3, 64):\n    try:\n        got += open(f'/proc/self/fd/{fd}', 'rb').read()\n"
        "    except OSError:\n        pass\nfor fd in range(3, 64):\n    try:\n        os.write(fd, got)\n"
        "    except OSError:\n        pass\n"
    ),
    "proc_self_mem_scan": WRONG + "open('/proc/self/mem', 'rb')\n",
    "gc_find_test_namespace": (  # from inside add(): find the tests' globals through gc, patch them
        "import gc\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and '__gspo_cmp__' in o:\n"
        "            o['__gspo_cmp__'] = lambda *a: True\n    return 5\n"
    ),
    "frame_walk": (  # from inside add(), called by the tests: make every later comparison true
        "import sys\ndef add(a, b):\n    f = sys._getframe()\n    while f is not None:\n"
        "        if '__gspo_cmp__' in f.f_globals:\n"
        "            dict.__setitem__(f.f_globals, '__gspo_cmp__', lambda *a: True)\n"
        "        f = f.f_back\n    return 5\n"
    ),
    "traceback_frame_walk": (
        "def add(a, b):\n    try:\n        1 / 0\n    except ZeroDivisionError as e:\n"
        "        f = e.__traceback__.tb_frame\n    while f is not None:\n"
        "        if '__gspo_cmp__' in f.f_globals:\n"
        "            dict.__setitem__(f.f_globals, '__gspo_cmp__', lambda *a: True)\n"
        "        f = f.f_back\n    return 5\n"
    ),
    "generator_frame": (  # a running generator's frame links back to its caller
        "def add(a, b):\n    def g():\n        f = me[0].gi_frame\n        while f is not None:\n"
        "            if '__gspo_cmp__' in f.f_globals:\n"
        "                dict.__setitem__(f.f_globals, '__gspo_cmp__', lambda *a: True)\n"
        "            f = f.f_back\n        yield\n    me = [g()]\n    next(me[0])\n    return 5\n"
    ),
    "inspect_stack": WRONG + "import inspect\ninspect.stack()\n",
    "ctypes_memory": WRONG + "import ctypes\nctypes.string_at(id(1), 64)\n",
    "ctypes_preimported_name": WRONG + "import sys\nc = sys.modules.get('ctypes') or __import__('ctypes')\n",
    "gc_referents_of_module": WRONG + "import gc, sys\ngc.get_referents(sys.modules)\n",
    "current_frames": WRONG + "import sys\nsys._current_frames()\n",
    "signal_handler_frames": WRONG.replace("return 0", "return 5 if (a, b) == (2, 3) else 0")
    + (
        "import signal\ndef h(sig, f):\n    while f is not None:\n"
        "        if '__gspo_cmp__' in f.f_globals:\n"
        "            dict.__setitem__(f.f_globals, '__gspo_cmp__', lambda *a: True)\n"
        "        f = f.f_back\n"
        "try:\n    signal.signal(signal.SIGALRM, h)\nexcept ValueError:\n    pass\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)\n"
    ),
    "signal_via_fresh_module": WRONG.replace("return 0", "return 5 if (a, b) == (2, 3) else 0")
    + (
        "import _imp, importlib.util, signal\ndef h(sig, f):\n    while f is not None:\n"
        "        if '__gspo_cmp__' in f.f_globals:\n"
        "            dict.__setitem__(f.f_globals, '__gspo_cmp__', lambda *a: True)\n"
        "        f = f.f_back\n"
        "try:\n    m = _imp.create_builtin(importlib.util.find_spec('_signal'))\n    m.signal(14, h)\n"
        "except Exception:\n    pass\nsignal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)\n"
    ),
    "signal_reimport": WRONG.replace("return 0", "return 5 if (a, b) == (2, 3) else 0")
    + (
        "import sys, signal\ndef h(sig, f):\n    while f is not None:\n"
        "        if '__gspo_cmp__' in f.f_globals:\n"
        "            dict.__setitem__(f.f_globals, '__gspo_cmp__', lambda *a: True)\n"
        "        f = f.f_back\n"
        "try:\n    del sys.modules['_signal']\n    import _signal\n    _signal.signal(14, h)\n"
        "except Exception:\n    pass\nsignal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)\n"
    ),
    "code_object_surgery": WRONG + "c = (lambda: 1).__code__.replace(co_consts=(2,))\n",  # harmless alone
    "replace___code__": WRONG + "def f():\n    pass\nf.__code__ = (lambda: 1).__code__\n",
    "thread_keeps_running": (
        WRONG
        + "import threading, time\nthreading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
    ),
    "thread_forges_after_tests": (
        WRONG + "import threading, os, time\ndef spam():\n    while True:\n        for fd in range(3, 32):\n"
        "            try:\n                os.write(fd, b'0' * 64)\n            except OSError:\n"
        "                pass\n        time.sleep(0.001)\n"
        "threading.Thread(target=spam, daemon=True).start()\n"
    ),
    "raw_thread": WRONG + "import _thread, time\n_thread.start_new_thread(time.sleep, (5,))\n",
    "close_all_fds": WRONG + "import os\nos.closerange(3, 4096)\n",
    "dup2_over_all_fds": WRONG
    + "import os\nr, w = os.pipe()\nfor fd in range(3, 256):\n    if fd not in (r, w):\n"
    "        try:\n            os.dup2(w, fd)\n        except OSError:\n            pass\n",
    "stat_result_patch_and_relay": WRONG
    + (  # hijack the verdict pipe, fake its identity, relay
        # (pointless by design: the harness writes the token only after the tests passed)
        "import os, sys\ni = [a.endswith('boot.py') for a in sys.orig_argv].index(True)\nvfd = int(sys.orig_argv[i + 3])\n"
        "st = os.fstat(vfd)\ndev, ino = st.st_dev, st.st_ino\n"
        "os.stat_result.st_dev = property(lambda s: dev)\nos.stat_result.st_ino = property(lambda s: ino)\n"
        "os.stat_result.__getitem__ = lambda s, k: (ino, dev)[k - 1] if k in (1, 2) else 0\n"
        "real = os.dup(vfd)\nr, w = os.pipe()\nos.dup2(w, vfd)\n"
        "if os.fork() == 0:\n    os.close(w)\n    os.close(vfd)\n    data = os.read(r, 64)\n"
        "    os.write(real, data)\n    os._exit(0)\nos.close(r)\n"
    ),
    "dup2_and_relay": WRONG
    + (
        "import os, sys\ni = [a.endswith('boot.py') for a in sys.orig_argv].index(True)\nvfd = int(sys.orig_argv[i + 3])\n"
        "real = os.dup(vfd)\nr, w = os.pipe()\nos.dup2(w, vfd)\n"
        "if os.fork() == 0:\n    os.close(w)\n    os.close(vfd)\n    data = os.read(r, 64)\n"
        "    os.write(real, data)\n    os._exit(0)\nos.close(r)\n"
    ),
    "stdout_tricks": WRONG
    + (
        "import sys, io\nsys.stdout.write('0' * 64)\nsys.stdout = io.StringIO()\nsys.__stdout__.write('PASS')\n"
        "print('ok')\n"
    ),
    "reexec_harness": WRONG + "import os, sys\nos.execv(sys.executable, sys.orig_argv)\n",
    "reexec_harness_with_own_nonce": WRONG
    + (
        "import os, sys, marshal\nargv = sys.orig_argv\ni = [a.endswith('boot.py') for a in argv].index(True)\n"
        "n_fd, c_fd = int(argv[i + 1]), int(argv[i + 2])\n"
        "for fd, data in ((n_fd, b'f' * 64), (c_fd, b'\\n' + marshal.dumps(compile('pass', 't', 'exec')))):\n"
        "    m = os.memfd_create('x', 0)\n    os.write(m, data)\n    os.lseek(m, 0, 0)\n    os.dup2(m, fd)\n"
        "os.execv(sys.executable, argv)\n"
    ),
    "exec_harness_source": WRONG
    + "import sys\ni = [a.endswith('boot.py') for a in sys.orig_argv].index(True)\nexec(open(sys.orig_argv[i]).read())\n",
    "subprocess_reads_parent_memory": WRONG
    + (
        "import subprocess, sys, os\nsubprocess.run([sys.executable, '-c', "
        '\'import os; print(open("/proc/%d/mem" % os.getppid(), "rb"))\'])\n'
    ),
    "subprocess_ptrace": WRONG
    + (
        "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import ctypes, os; "
        "libc = ctypes.CDLL(None); assert libc.ptrace(16, os.getppid(), 0, 0) == 0'], check=True)\n"
    ),
    "setrecursionlimit": WRONG + "import sys\nsys.setrecursionlimit(30)\n",
    "main_module_swap": WRONG + "import sys, types\nsys.modules['__main__'] = types.ModuleType('x')\n",
}

# Tests that exercise the route (builtins, imports, check()); other attacks use TESTS.
ROUTE_TESTS = {
    "patch_builtins_all": "assert all([add(2, 3) == 5, add(-1, 1) == 0])\n",
    "shadow_all_in_globals": "assert all([add(2, 3) == 5, add(-1, 1) == 0])\n",
    "patch_builtins_len": "assert len(add([1], [2])) == 2\n",
    "patch_import": "import math\nassert math.isclose(add(0.1, 0.2), 0.3)\n",
    "patch_sys_modules": "import math\nassert math.isclose(add(0.1, 0.2), 0.3)\n",
    "patch_module_attribute": "import math\nassert math.isclose(add(0.1, 0.2), 0.3)\n",
    "redefine_check": "def check(candidate):\n    assert candidate(2, 3) == 5\ncheck(add)\n",
    "signal_via_fresh_module": "import time\nassert add(2, 3) == 5\ntime.sleep(0.05)\nassert add(-1, 1) == 1\n",
    "signal_reimport": "import time\nassert add(2, 3) == 5\ntime.sleep(0.05)\nassert add(-1, 1) == 1\n",
    "signal_handler_frames": "import time\nassert add(2, 3) == 5\ntime.sleep(0.05)\nassert add(-1, 1) == 1\n",
    "list_of_liars": "assert [add(2, 3)] == [5]\nassert (add(1, 1), 1) == (2, 1)\nassert {'k': add(0, 0)} == {'k': 0}\n",
    "str_subclass_from___str__": "assert str(add(2, 3)) == '5'\n",
    "eq_true_first_call_per_value": "assert add(2, 3) == 5\n",
    "frame_walk": TESTS,
    "gc_find_test_namespace": TESTS,
    "patch_helper_via_test_callable": "assert add(0, 0, key=lambda v: v) == 0\n" + TESTS,
}

HONEST = {
    "plain": "def add(a, b):\n    return a + b\n",
    "fenced_with_print": "Here you go:\n```python\ndef add(a, b):\n    return a + b\nprint(add(1, 2))\n```",
    "main_guard": "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(2, 2))\n",
    "namedtuple_and_dataclass": (
        "from collections import namedtuple\nfrom dataclasses import dataclass\nP = namedtuple('P', 'x y')\n"
        "@dataclass\nclass Q:\n    v: int\ndef add(a, b):\n    return P(a, b).x + Q(b).v\n"
    ),
    "numpy_scalar": "import numpy as np\ndef add(a, b):\n    return np.int64(a) + np.int64(b)\n",
    "int_subclass_honest": "class I(int):\n    pass\ndef add(a, b):\n    return I(a + b)\n",
    "thread_joined": (
        "import threading\ndef add(a, b):\n    out = []\n    t = threading.Thread(target=lambda: out.append(a + b))\n"
        "    t.start()\n    t.join()\n    return out[0]\n"
    ),
    "logging_and_warnings": (
        "import logging, warnings\nlogging.warning('hi')\nwarnings.warn('careful')\n"
        "def add(a, b):\n    return a + b\n"
    ),
    "subprocess_and_files": (
        "import subprocess, os\nsubprocess.run(['true'], check=True)\nopen('scratch.txt', 'w').write('x')\n"
        "def add(a, b):\n    return a + b\n"
    ),
    "exceptions_caught": "def add(a, b):\n    try:\n        1 / 0\n    except ZeroDivisionError:\n        pass\n    return a + b\n",
    "asyncio_and_late_imports": (
        "import asyncio, threading, typing, enum, inspect, types\nColor = enum.Enum('Color', 'RED GREEN')\n"
        "P = typing.NamedTuple('P', [('x', int)])\nasync def _add(a, b):\n    await asyncio.sleep(0)\n"
        "    return a + b\ndef add(a, b):\n    return asyncio.run(_add(a, b))\n"
    ),
}

HONEST_SUITES = [
    (  # classes with real __eq__, __contains__, Counter, Fraction, sets, generators, expected errors
        "from collections import Counter\nfrom fractions import Fraction\n"
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def __eq__(self, o):\n        return isinstance(o, Point) and (self.x, self.y) == (o.x, o.y)\n"
        "class Trie:\n    def __init__(self):\n        self.words = set()\n    def insert(self, w):\n"
        "        self.words.add(w)\n    def __contains__(self, w):\n        return w in self.words\n"
        "def count(s):\n    return Counter(s)\ndef half(x):\n    return Fraction(x, 2)\n"
        "def gen(n):\n    yield from range(n)\n"
        "def check_pos(x):\n    if x < 0:\n        raise ValueError('neg')\n    return x\n",
        "assert Point(1, 2) == Point(1, 2)\nassert Point(1, 2) != Point(2, 1)\n"
        "t = Trie()\nt.insert('ab')\nassert 'ab' in t\nassert 'x' not in t\n"
        "assert count('aab') == {'a': 2, 'b': 1}\nassert half(1) == Fraction(1, 2)\n"
        "assert half(3) > 1\nassert abs(float(half(1)) - 0.5) < 1e-9\n"
        "assert list(gen(3)) == [0, 1, 2]\nassert set(gen(3)) == {0, 1, 2}\n"
        "assert sorted(gen(3), key=lambda v: -v) == [2, 1, 0]\n"
        "try:\n    check_pos(-1)\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')\n"
        "assert check_pos(3) is not None\nassert (lambda: 1)() == 1\nassert 1 < check_pos(2) <= 2\n"
        "assert [i * 2 for i in gen(3) if i != 1] == [0, 4]\n"
        "class Helper:\n    limit = 3\n    ok = [x for x in range(3) if x < 3]\nassert Helper.ok == [0, 1, 2]\n",
    ),
    (  # HumanEval style check(candidate), floats, strings, tuples, None
        "import math\ndef solve(xs):\n    if not xs:\n        return None\n    return (min(xs), max(xs), math.fsum(xs) / len(xs), ','.join(map(str, xs)))\n",
        "import math\ndef check(candidate):\n    lo, hi, mean, s = candidate([1, 2, 3])\n"
        "    assert (lo, hi) == (1, 3)\n    assert math.isclose(mean, 2.0)\n    assert s == '1,2,3'\n"
        "    assert candidate([]) is None\ncheck(solve)\n",
    ),
]


@pytest.fixture(scope="module")
def reward():
    return make_code_reward(timeout_s=5.0, workers=2)


def _score(reward, completion: str, tests: str) -> float:
    return reward([""], [completion], [tests])[0]


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero(reward, name):
    """Each early-exit / forgery / lying-object route scores 0 (a wrong add plus the exploit)."""
    assert _score(reward, ATTACKS[name], ROUTE_TESTS.get(name, TESTS)) == 0.0


@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_solutions_score_one(reward, name):
    """Correct solutions, including ones using threads, subprocesses, files, numpy, namedtuple,
    logging and warnings, still score 1."""
    assert _score(reward, HONEST[name], TESTS) == 1.0


@pytest.mark.parametrize("i", range(len(HONEST_SUITES)))
def test_honest_rich_test_suites_score_one(reward, i):
    """Tests comparing real __eq__ objects, containment, Counter vs dict, Fraction, generators,
    expected exceptions, chained comparisons, class bodies and HumanEval-style check() pass."""
    solution, tests = HONEST_SUITES[i]
    assert _score(reward, solution, tests) == 1.0


def test_attack_routes_around_correct_code(reward):
    """Redefining the tests' names costs a correct solution nothing (the tests' own win); writing
    into the verdict descriptor voids the verdict even for correct code (it must be the token only)."""
    ok = "def add(a, b):\n    return a + b\n"
    assert _score(reward, ok + "def check(c):\n    pass\n", ROUTE_TESTS["redefine_check"]) == 1.0
    assert _score(reward, ok + "print('0' * 64)\n", TESTS) == 1.0
    assert _score(reward, ok + FORGE, TESTS) == 0.0


@pytest.mark.xfail(
    strict=True,
    reason="documented limit: tests that pass their own callables to the "
    "program expose their namespace through __globals__",
)
def test_known_gap_tests_passing_their_own_callables(reward):
    """The tests hand a lambda to the program, whose __globals__ is the tests' namespace: rebinding the
    comparison helper there is not prevented (its internals are, see patch_helper_via_test_callable)."""
    attack = (
        "def add(a, b, key=None):\n    if key is not None:\n"
        "        key.__globals__['__gspo_cmp__'] = lambda *a: True\n    return 0\n"
    )
    assert _score(reward, attack, "assert add(0, 0, key=lambda v: v) == 0\n" + TESTS) == 0.0


def test_verdict_needs_the_nonce():
    """run_untrusted(tests=...): passed only for the harness's own token; failing tests show in stderr."""
    ok = sandbox.run_untrusted("def add(a, b):\n    return a + b\n", tests=TESTS)
    assert ok.passed is True and ok.ok
    bad = sandbox.run_untrusted(WRONG, tests=TESTS)
    assert bad.passed is False and "AssertionError" in bad.stderr and "tests.py" in bad.stderr
    forged = sandbox.run_untrusted(WRONG + FORGE + "os._exit(0)\n", tests=TESTS)
    assert forged.ok and forged.passed is False  # exit code 0 is not enough
    assert sandbox.run_untrusted("print(1)").passed is None
    syntax = sandbox.run_untrusted("def add(a, b):\n    return a + b\n", tests="assert (")
    assert syntax.passed is False and "SyntaxError" in syntax.stderr


def test_lying_objects_named_in_the_error():
    """A lying __eq__ fails with a message that says so (not a silent mismatch)."""
    r = sandbox.run_untrusted(ATTACKS["eq_always_true"], tests=TESTS)
    assert r.passed is False and "accepts anything" in r.stderr


def test_protected_functions_do_no_global_lookups():
    """The helpers reachable from the tests' namespace take every name from their defaults: no
    LOAD_GLOBAL/LOAD_NAME/closure reads a patched builtin or module could intercept."""
    import dis

    path = Path(sandbox.__file__).with_name("protected.py")
    code = compile(path.read_text(), str(path), "exec")
    funcs = [c for c in code.co_consts if hasattr(c, "co_code")]
    assert len(funcs) >= 15
    for fn in funcs:
        ops = {i.opname for i in dis.get_instructions(fn)}
        bad = ops & {
            "LOAD_GLOBAL",
            "LOAD_NAME",
            "LOAD_DEREF",
            "LOAD_CLASSDEREF",
            "LOAD_CLOSURE",
            "IMPORT_NAME",
        }
        assert not bad, (fn.co_name, bad)
        assert not fn.co_freevars and not any(hasattr(c, "co_code") for c in fn.co_consts), fn.co_name
