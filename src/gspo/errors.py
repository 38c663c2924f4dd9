"""User-facing errors: the CLI prints these as one line (no traceback) and exits with code 2."""


class GspoError(Exception):
    """Bad input from the user (config, dataset, reward function, model path). Message is one line
    naming the problem: file, line, field."""


_warned: set[str] = set()


def warn(message: str) -> None:
    """One line on stderr, ``gspo: warning: ...``, once per message (for input that is legal but
    probably not what the user meant)."""
    import sys

    if message not in _warned:
        _warned.add(message)
        print(f"gspo: warning: {message}", file=sys.stderr, flush=True)
