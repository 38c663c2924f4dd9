"""User-facing errors: the CLI prints these as one line (no traceback) and exits with code 2."""


class GspoError(Exception):
    """Bad input from the user (config, dataset, reward function, model path). Message is one line
    naming the problem: file, line, field."""


def one_line(e: BaseException, max_len: int = 200) -> str:
    """``Type: first line of the message`` (the message cut at ``max_len``): how an exception from
    user code (a reward, a dataset, an environment) is named in a GspoError's one line."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:max_len]}" if msg else type(e).__name__


_warned: set[str] = set()


def warn(message: str) -> None:
    """One line on stderr, ``gspo: warning: ...``, once per message (for input that is legal but
    probably not what the user meant)."""
    import sys

    if message not in _warned:
        _warned.add(message)
        print(f"gspo: warning: {message}", file=sys.stderr, flush=True)
