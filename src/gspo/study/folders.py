"""Which folders ``gspo compare`` may write its report files into: never over a file it did not write.

A compare (or ``--study``) folder carries a marker (``.gspo-compare`` / ``.gspo-study``) from the first
time the command writes there. A folder without it that already holds one of the command's file names
(a user's ``report.md``, ``summary.json``...) is refused in one line before any work, and left as it
is. Folders written before the marker existed are recognised by their own ``summary.json`` /
``study.json`` (the command's keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gspo.errors import GspoError
from gspo.study.plots import PLOTS

COMPARE_FILES = (
    "report.md", "summary.json", "per_seed.csv", "timing.json", "warm_starts.json", "accuracy_paired.png",
    *(fname for _, _, fname, _ in PLOTS),
)  # fmt: skip
STUDY_FILES = ("study.md", "study.json", "regimes.png", "accuracy_by_regime.png")
_KINDS = {
    "compare": (".gspo-compare", COMPARE_FILES, "summary.json", ("per_seed", "preregistration")),
    "study": (".gspo-study", STUDY_FILES, "study.json", ("regimes", "families")),
}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def claim_folder(out: Path, kind: str, flag: str = "--out") -> None:
    """Mark ``out`` as written by ``gspo compare`` (``kind``: "compare" or "study"), or refuse it (a
    one-line GspoError, nothing written) when it holds a file of the command's names that the command
    did not write."""
    marker, files, summary, keys = _KINDS[kind]
    if (out / marker).is_file():
        return
    data = _json(out / summary)
    legacy = isinstance(data, dict) and all(k in data for k in keys)  # from before the marker
    there = [] if legacy else [f for f in files if (out / f).exists() or (out / f).is_symlink()]
    if there:
        raise GspoError(
            f"{flag} {out}: holds {', '.join(there[:3])}{' ...' if len(there) > 3 else ''}, which gspo "
            f"compare{' --study' if kind == 'study' else ''} did not write (no {marker} marker); it "
            "never overwrites them: move them away or pass another --out"
        )
    try:
        (out / marker).write_text(f"gspo {kind}: this folder's report files are written by gspo\n")
    except OSError as e:
        raise GspoError(f"{flag} {out}: cannot write {marker} ({e.strerror or e})") from None
