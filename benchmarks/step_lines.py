"""How much code one default RL step runs: the gspo functions called more often in a 3-step run than
in a 2-step one (no warm start, no periodic eval or save: those happen the same number of times in
both), and the source lines their definitions span, per file (nested definitions counted once).

    python benchmarks/step_lines.py            # the table, largest files first
    python benchmarks/step_lines.py --json     # {"lines": N, "files": {path: lines}, "functions": [...]}

``tests/test_step_lines.py`` holds the total under its bound so the step cannot regrow unnoticed.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import sys
import tempfile
from pathlib import Path

import gspo

SRC = Path(gspo.__file__).resolve().parent


def _calls(steps: int, out: Path, extra: dict) -> collections.Counter:
    """Calls per (file, first line) of every gspo function during ``gspo.train`` of ``steps`` steps."""
    from gspo.config import Config

    base = {"sft_steps": 0, "eval_every": 0, "save_every": 0, "progress": False}
    cfg = Config(**{**base, **extra, "steps": steps, "output_dir": str(out)})
    counts: collections.Counter = collections.Counter()
    src = str(SRC)

    def hook(frame, event, _arg):  # noqa: ANN001, ANN202
        if event == "call" and frame.f_code.co_filename.startswith(src):
            counts[(frame.f_code.co_filename, frame.f_code.co_firstlineno)] += 1

    sys.setprofile(hook)
    try:
        gspo.train(cfg)
    finally:
        sys.setprofile(None)
    return counts


def _spans(path: str) -> dict[int, tuple[str, int, int]]:
    """First line (a decorator's, as the code object records it) -> (name, start, end) of each def."""
    out = {}
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            out[first] = (getattr(node, "name", "<lambda>"), first, node.end_lineno or node.lineno)
    return out


def measure(extra: dict | None = None) -> dict:
    """The step's functions and lines (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        two = _calls(2, Path(tmp) / "two", extra or {})
        three = _calls(3, Path(tmp) / "three", extra or {})
    lines: dict[str, set[int]] = collections.defaultdict(set)
    functions = []
    spans: dict[str, dict] = {}
    for (path, first), n in sorted(three.items()):
        if n <= two.get((path, first), 0):
            continue
        spans.setdefault(path, _spans(path))
        name, start, end = spans[path].get(first, ("<module>", first, first))
        rel = str(Path(path).relative_to(SRC))
        lines[rel] |= set(range(start, end + 1))
        functions.append(f"{rel}:{start} {name} ({end - start + 1})")
    files = {k: len(v) for k, v in sorted(lines.items(), key=lambda kv: -len(kv[1]))}
    return {"lines": sum(files.values()), "files": files, "functions": functions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    got = measure()
    if args.json:
        print(json.dumps(got, indent=1))
        return
    print(
        f"one default RL step: {got['lines']} lines in {len(got['files'])} files, {len(got['functions'])} functions"
    )
    for path, n in got["files"].items():
        print(f"  {n:5d}  {path}")


if __name__ == "__main__":
    main()
