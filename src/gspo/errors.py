"""User-facing errors: the CLI prints these as one line (no traceback) and exits with code 2."""


class GspoError(Exception):
    """Bad input from the user (config, dataset, reward function, model path). Message is one line
    naming the problem: file, line, field."""


def one_line(e: BaseException, max_len: int = 200, typed: bool = True) -> str:
    """``Type: first line of the message`` (cut at ``max_len``; the type alone when the message is
    empty): how an exception from user code (a reward, a dataset, an environment) or from a library
    is named in a GspoError's one line. ``typed=False`` leaves the type out where the line says enough."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return f"{type(e).__name__}: {lines[0][:max_len]}" if typed else lines[0].strip()[:max_len]


_warned: set[str] = set()


def warn(message: str) -> None:
    """One line on stderr, ``gspo: warning: ...``, once per message (for input that is legal but
    probably not what the user meant)."""
    import sys

    if message not in _warned:
        _warned.add(message)
        print(f"gspo: warning: {message}", file=sys.stderr, flush=True)


# multiprocessing's "spawn" (the async sampler's process) re-runs the parent's main script as
# ``__mp_main__`` before anything else: a script calling gspo.train without an ``if __name__ ==
# "__main__":`` guard would train a second time there. gspo.train stops such a process with this exit
# status (said in one line by the sampler's parent, which knows its process by this name).
REIMPORTED_MAIN_EXIT = 86
SAMPLER_PROCESS = "gspo-async-sampler"


def reimported_main(script: str) -> str:
    """The one line for a process that re-ran ``script`` into gspo.train (see REIMPORTED_MAIN_EXIT)."""
    return (
        f"{script} calls gspo.train when imported, and the process multiprocessing started for "
        'gspo (async_staleness > 0: the sampler) re-ran it: put the call under `if __name__ == "__main__":`'
    )
