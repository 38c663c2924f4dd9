"""User-facing errors: the CLI prints these as one line (no traceback) and exits with code 2."""


class GspoError(Exception):
    """Bad input from the user (config, dataset, reward function, model path). Message is one line
    naming the problem: file, line, field."""
