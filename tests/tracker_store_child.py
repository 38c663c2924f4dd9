"""A child process for tests/test_trackers_failure.py: a MetricsLogger with the trackers named in
argv[1] logs 8 steps into run folder argv[2]; before step 2 it fills every folder of argv[3:] (each
a small tmpfs the test mounted) until the disk is full, as a disk filling up mid-run would. Prints
``FILLED`` on stderr after filling and ``LOGGED <step>`` after each step; the trackers' stores are read back by the test's own asserts on
stderr and on metrics.jsonl (a tmpfs ends with the test's mount namespace)."""

import sys
from pathlib import Path

from gspo.training.logger import MetricsLogger


def fill(folder: Path) -> None:
    try:
        with open(folder / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass


def main() -> None:
    names, run, full = sys.argv[1], Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]]
    logger = MetricsLogger(run, config={"report_to": names, "lr": 1e-3, "steps": 8})
    for step in range(8):
        if step == 2:
            for folder in full:
                fill(folder)
            print("FILLED", file=sys.stderr, flush=True)
        # 200 scalars (TensorBoard: ~10 kB a step, past what the last page of its file has room for)
        logger.log(step, {f"m/{k}": float(step + k) for k in range(200)})
        print(f"LOGGED {step}", file=sys.stderr, flush=True)
    logger.close()
    print("CLOSED " + ",".join(t.name for t in logger.trackers), file=sys.stderr, flush=True)


_calls = [0]


def fill_on_second_call(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """A reward (``--reward tests/tracker_store_child.py:fill_on_second_call``) that, at its second
    call, fills every folder of ``GSPO_TEST_FILL`` (``:``-separated, when set); it scores a completion's length,
    so the weights move."""
    import os

    _calls[0] += 1
    if _calls[0] == 2 and "GSPO_TEST_FILL" in os.environ:
        for folder in os.environ["GSPO_TEST_FILL"].split(":"):
            fill(Path(folder))
        print("FILLED", file=sys.stderr, flush=True)
    if _calls[0] == 3 and "GSPO_TEST_FILL" in os.environ:  # the step after the one that filled them
        print("NEXT STEP", file=sys.stderr, flush=True)
    return [len(c) / 10 for c in completions]


if __name__ == "__main__":
    main()
