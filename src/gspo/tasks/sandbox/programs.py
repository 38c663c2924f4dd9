"""What the launcher and the program run: code objects compiled once here from this package's
modules (shipped marshalled on a descriptor, read by ``boot.py``), the tests compiled with their
comparisons rewritten, and the program's command line."""

from __future__ import annotations

import ast
import functools
import marshal
import os
import sys
from types import CodeType

from gspo import procs
from gspo.compat import cpython_threads
from gspo.tasks.sandbox import host


@functools.cache
def module_code(name: str, path: str | None = None) -> CodeType:
    """The code of this package's module ``name`` (launcher, confine, harness, protected, shim), or of
    the file ``path``, named after its file so that tracebacks point at it."""
    path = path or os.path.join(host.PACKAGE_DIR, f"{name}.py")
    with open(path, encoding="utf-8") as f:
        return compile(f.read(), path, "exec", dont_inherit=True)


@functools.lru_cache(maxsize=1)
def launcher_payload() -> bytes:
    """The launcher's code, then what it runs: confine.py, and gspo.procs (the parent-death signal)."""
    procs_code = module_code("procs", procs.__file__)
    return marshal.dumps((module_code("launcher"), module_code("confine"), procs_code))


_CMP_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}


class _RewriteCompares(ast.NodeTransformer):
    """``a == b`` -> ``__gspo_cmp__(("==",), a, b)`` (chains: all operators, all operands)."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        ops = ast.Tuple([ast.Constant(_CMP_OPS[type(op)]) for op in node.ops], ast.Load())
        call = ast.Call(ast.Name("__gspo_cmp__", ast.Load()), [ops, node.left, *node.comparators], [])
        return ast.copy_location(call, node)


@functools.lru_cache(maxsize=256)
def compile_tests(tests: str) -> bytes:
    """The harness's payload (marshal): its own code, the modules the tests import, the tests.

    Compiled here, once per distinct test string (a group's G samples share it), with asserts kept
    and comparisons rewritten. A syntax error becomes a test that raises it (scores 0).
    """
    if not cpython_threads.applies():  # the harness's running-thread check needs _thread._count
        raise RuntimeError(f"the sandbox's test harness is written for CPython 3.10-3.14, not {sys.version}")
    try:
        tree = ast.parse(tests, "tests.py")
    except (SyntaxError, ValueError) as e:
        tree = ast.parse(f"raise SyntaxError({f'tests.py: {e}'!r})")
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
    tree = ast.fix_missing_locations(_RewriteCompares().visit(tree))
    code = compile(tree, "tests.py", "exec", dont_inherit=True, optimize=0)
    harness = (module_code("harness"), module_code("protected"), module_code("shim"))
    return marshal.dumps((*harness, tuple(sorted(modules)), code))


def program_argv(tests: str | None, fs: bool, to_close: list[int]) -> tuple[list, list, list, int, bytes]:
    """The program's argv (with a network namespace; in shim mode), the fds it inherits, the read end
    of the verdict pipe (-1 without tests) and the nonce the harness must write there. New fds are
    appended to ``to_close``."""
    py = [sys.executable, "-I", "-B", "-X", "utf8"]
    if tests is None:
        return [*py, "main.py"], [*py, host.SHIM], [], -1, b""
    nonce = os.urandom(32).hex().encode()
    nonce_fd = host.payload_fd(nonce)
    to_close.append(nonce_fd)
    cfg_fd = host.payload_fd(compile_tests(tests))
    to_close.append(cfg_fd)
    verdict_r, verdict_w = os.pipe()
    to_close += [verdict_r, verdict_w]
    argv = [*py, host.BOOT, str(nonce_fd), str(cfg_fd), str(verdict_w), "0", "1" if fs else "0"]
    return argv, [*argv[:-2], "1", argv[-1]], [nonce_fd, cfg_fd, verdict_w], verdict_r, nonce
