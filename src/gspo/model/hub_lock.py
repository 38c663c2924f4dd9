"""One download of a hub model at a time in a cache that several nodes or jobs share.

Each node's local rank 0 fetches a hub model's snapshot (:func:`gspo.training.distributed.node_snapshot`);
with ``HF_HUB_CACHE`` on a filesystem every node sees, they would all download the same files at
once. :func:`cache_lock` makes them take turns: an exclusive ``fcntl.flock`` on a file beside the
cache's own locks, held while one downloads; the next finds the files in place. The kernel drops a
``flock`` when its process dies, however it dies, so a job killed mid-download leaves nothing that
blocks the next start (a lock *file* would: a killed job never deletes it). The wait is bounded
(the run's ``dist_timeout_min``, for which the node's other ranks wait too) and said in one line.

A filesystem without ``flock`` (some network filesystems) cannot take the lock: that is said in one
line and the download goes ahead unlocked. huggingface_hub itself falls back there to lock files of
its own (``<cache>/.locks``), which a killed download leaves behind; the line names them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from gspo.errors import GspoError

#: errors of ``flock`` on a filesystem that does not support it (NFS without a lock manager, Lustre
#: mounted without ``flock``, some FUSE filesystems)
UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})
POLL_S = 1.0  # how often a waiting node tries the lock again


def lock_path(repo_id: str, cache: Path) -> Path:
    """The lock file of ``repo_id`` in ``cache`` (beside huggingface_hub's own ``.locks``)."""
    return cache / ".locks" / "gspo" / f"models--{repo_id.replace('/', '--')}.lock"


def _say(line: str) -> None:
    print(f"gspo: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def cache_lock(
    repo_id: str, timeout_s: float | None, cache: Path | None = None, poll_s: float = POLL_S
) -> Iterator[bool]:
    """Hold the cache's lock on ``repo_id`` (waiting at most ``timeout_s`` seconds for another holder;
    None: no limit) while the body runs; yields whether it is held (False: the filesystem has no
    ``flock`` and the body runs unlocked). ``cache``: default huggingface_hub's ``HF_HUB_CACHE``."""
    if cache is None:
        from huggingface_hub import constants

        cache = Path(constants.HF_HUB_CACHE)
    path = lock_path(repo_id, cache)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # CLOEXEC: a process started later (a sampler, vLLM's workers) must not inherit the lock
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o664)
    except OSError as e:
        _say(f"cannot open the hub cache's lock {path} ({e.strerror or e}); downloading {repo_id} unlocked")
        yield False
        return
    try:
        yield _acquire(fd, path, repo_id, cache, timeout_s, poll_s)
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, path: Path, repo_id: str, cache: Path, timeout_s: float | None, poll_s: float) -> bool:
    t0, said = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno not in UNSUPPORTED:
                raise GspoError(f"cannot lock the hub cache's {path}: {e.strerror or e}") from None
            _say(
                f"the hub cache {cache} is on a filesystem without flock ({e.strerror}): {repo_id} is "
                "downloaded without gspo's lock, and huggingface_hub falls back to lock files "
                f"({cache / '.locks'}) that a killed download leaves behind: delete them if a start waits "
                "on them, or put HF_HUB_CACHE on a local disk"
            )
            return False
        waited = time.monotonic() - t0
        if timeout_s is not None and waited >= timeout_s:
            raise GspoError(
                f"{repo_id}: another process has held the hub cache's lock {path} for {waited:.0f} s "
                f"(more than the {timeout_s:.0f} s the run waits: dist_timeout_min); is another job "
                "downloading it? (a killed job's lock goes with its process)"
            )
        if not said:
            limit = f"up to {timeout_s:.0f} s" if timeout_s is not None else "with no limit"
            _say(f"another node or job is downloading {repo_id} into {cache}; waiting for it ({limit})")
            said = True
        time.sleep(poll_s)
