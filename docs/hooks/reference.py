"""MkDocs hooks: the configuration and CLI references generated from gspo's own source at build time
(one source: the field docstrings behind ``gspo train --help`` and the YAML keys), and the benchmark
and recipe pages, which live beside the code, mounted into the site."""

from __future__ import annotations

import dataclasses
import html
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# this checkout's gspo, not whichever one the environment has installed
sys.path.insert(0, str(ROOT / "src"))

CONFIG_MARK = "<!-- gspo:config-reference -->"
CLI_MARK = "<!-- gspo:cli-reference -->"
#: ``<!-- gspo:plan ARGS -->``: what ``gspo plan ARGS`` prints, run when the site is built
PLAN_MARK = re.compile(r"<!-- gspo:plan (.+?) -->")
#: the Sphinx roles gspo's docstrings use (``:class:`X```), which Markdown leaves as text before the code
ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj):(?=<code>)")
#: files kept beside the code that the site shows as pages (path in the repo = path in the site)
MOUNTED = (
    "benchmarks/RESULTS.md",
    "benchmarks/RESULTS_async.md",
    "benchmarks/RESULTS_logprobs.md",
    "benchmarks/RESULTS_scale.md",
    "benchmarks/RESULTS_trl.md",
    "benchmarks/bench_realistic_scaling.png",
    "recipes/README.md",
)


def on_files(files: Files, config: Any) -> Files:
    for rel in MOUNTED:
        files.append(File.generated(config, rel, abs_src_path=str(ROOT / rel)))
    return files


def _cell(text: str) -> str:
    """A docstring as one table cell: code spans kept as they are, the rest HTML-escaped."""
    parts = re.split(r"(``.+?``|`[^`]+`)", " ".join(text.split()))
    return "".join(p if i % 2 else html.escape(p).replace("|", "&#124;") for i, p in enumerate(parts))


def config_reference() -> str:
    """One table per config group, in field order: key (YAML) and flag, type, default, the docstring."""
    from gspo.cli import ALIASES
    from gspo.config import GROUPS, Config, field_docs
    from gspo.config.checks import field_kinds

    docs, kinds = field_docs(), field_kinds(Config)
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    out = []
    for group in GROUPS:
        own = [f.name for f in dataclasses.fields(group) if f.name in group.__annotations__]
        if not own:
            continue
        out += [f"## {group.__name__}", ""]
        if group.__doc__ and not group.__doc__.startswith(group.__name__ + "("):
            out += [" ".join(group.__doc__.split()), ""]
        out += ["| key / flag | type | default | meaning |", "|---|---|---|---|"]
        for name in own:
            typ, optional = kinds[name]
            flags = " ".join(f"`{a}`" for a in ("--" + name.replace("_", "-"), *ALIASES.get(name, ())))
            type_ = typ.__name__ + (" or None" if optional else "")
            out.append(
                f"| `{name}`<br>{flags} | {type_} | `{defaults[name]!r}` | {_cell(docs.get(name, ''))} |"
            )
        out.append("")
    return "\n".join(out)


def cli_reference() -> str:
    """``gspo SUBCOMMAND --help`` of every subcommand, as the installed command prints it."""
    import os

    from gspo.cli import build_parser

    os.environ.setdefault("COLUMNS", "100")
    parser = build_parser()
    out = []
    for name, sub in parser._subcommands.items():  # noqa: SLF001 - the parser's own table of subcommands
        out += [f"## gspo {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def plan_output(args: str) -> str:
    """``gspo plan ARGS`` as it prints, a ``--config`` path read from this checkout."""
    import contextlib
    import io
    import shlex

    from gspo.cli import main

    argv = [str(ROOT / a) if a.endswith(".yaml") else a for a in shlex.split(args)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", *argv])
    if rc != 0:
        raise RuntimeError(f"gspo plan {args} exited {rc}")
    text = out.getvalue().replace(f"{ROOT}/", "").rstrip()
    return f"```text\n$ gspo plan {args}\n{text}\n```"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_reference())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    markdown = PLAN_MARK.sub(lambda m: plan_output(m[1]), markdown)
    return markdown


def on_page_content(html_: str, page: Any, config: Any, files: Files) -> str:
    return ROLE.sub("", html_)
