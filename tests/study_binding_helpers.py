"""Binding constructed runs to a preset's declaration: a tiny git repo holding the preset (declaring
its resolved config), committed at a chosen time, and each run folder's record of what it was run for
(as gspo compare writes it, from a clean checkout unless a test says otherwise)."""

import json
import os
import subprocess
import time
from pathlib import Path

from gspo.study.binding import resolved_settings, resolved_sha256, run_record
from gspo.study.presets import RUN_RECORD, load_preset


def commit(repo: Path, path: Path, when: float, committed: float | None = None) -> None:
    """Commit ``path`` in ``repo`` (created if need be) with author time ``when`` and committer time
    ``committed`` (default ``when``; a rebase moves only the committer's)."""
    env = {
        **os.environ,
        "GIT_AUTHOR_DATE": f"@{int(when)} +0000",
        "GIT_COMMITTER_DATE": f"@{int(when if committed is None else committed)} +0000",
    }
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    if not (repo / ".git").exists():
        subprocess.run([*git, "init", "-q", str(repo)], check=True, env=env)
    subprocess.run([*git, "add", str(path)], cwd=repo, check=True, env=env)
    subprocess.run([*git, "commit", "-q", "-m", "declare", "--", str(path)], cwd=repo, check=True, env=env)


def declare(path: Path) -> None:
    """Add the preset's ``resolved_sha256`` (this checkout's resolution of it) to its file."""
    here = resolved_sha256(resolved_settings(load_preset(str(path))))
    path.write_text(path.read_text() + f'resolved_sha256: "{here}"\n')


def record_runs(
    out: Path, preset_path: Path, started: float | dict[str, float] | None = None, **fields: object
) -> None:
    """Every run folder under ``out`` records the preset as it is now, started at ``started`` (one
    time, or run name -> its own), from a clean checkout, with ``fields`` replacing what gspo
    compare would record."""
    rec = run_record(load_preset(str(preset_path))) | {"gspo_dirty": False} | fields
    for run in out.iterdir():
        if (run / "metrics.jsonl").exists():
            t = started.get(run.name) if isinstance(started, dict) else started
            t = time.time() if t is None else t
            (run / RUN_RECORD).write_text(json.dumps({**rec, "run": run.name, "started_at": t}))


def bind(out: Path, preset_path: Path) -> None:
    """A declaration (its resolved config included) committed an hour before the runs, which record
    it: pre-registered."""
    declare(preset_path)
    commit(preset_path.parent, preset_path, time.time() - 3600)
    record_runs(out, preset_path)
