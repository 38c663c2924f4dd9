"""Entry point of the sandbox's processes: the launcher, and the program when it runs tests.

``python -I -B boot.py ARG FD ...``: FD holds a marshalled tuple whose first item is the code of the
module to run, compiled once in the trainer from this package's files (compiling the launcher per call
cost ~5 ms); that module's ``main(argv, payload)`` gets this process's argv and the tuple. ``-I`` keeps
the script's directory off ``sys.path``: the program cannot import this package's modules.
"""

import marshal
import os
import sys


def _read(fd: int) -> bytes:
    parts = []
    while True:
        b = os.read(fd, 65536)
        if not b:
            break
        parts.append(b)
    os.close(fd)
    return b"".join(parts)


def _boot() -> None:
    payload = marshal.loads(_read(int(sys.argv[2])))
    namespace = {"__builtins__": __builtins__, "__name__": "__gspo_sandbox__"}
    exec(payload[0], namespace)
    namespace["main"](sys.argv, payload)


if __name__ == "__main__":
    _boot()
