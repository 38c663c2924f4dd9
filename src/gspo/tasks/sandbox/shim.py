"""Shim mode (no network namespace): refuse new AF_INET/AF_INET6 sockets with a clear message, at the
Python level (seccomp refuses socket() of every family anyway when the program is confined;
socketpair keeps working).

Without tests the program runs as ``python -I -B shim.py``: the shim, then ``main.py`` as ``__main__``
(same file name in tracebacks). With tests the harness calls :func:`install`.
"""


def install() -> None:
    import _socket
    import socket

    inet = (-1, socket.AF_INET, socket.AF_INET6)  # -1: the AF_INET default
    raw = _socket.socket

    def blocked(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in sandbox")

    class GuardedSocket(raw):  # socket.socket.__init__ calls _socket.socket.__init__: this one
        def __init__(
            self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None
        ) -> None:
            if fileno is None and family in inet:
                blocked()
            raw.__init__(self, family, type, proto, fileno)

    _socket.socket = GuardedSocket
    socket.create_connection = blocked


def run_main() -> None:
    """Run main.py in this (the ``__main__``) module, emptied of the shim's own names first."""
    import sys

    import __main__

    install()
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    g = __main__.__dict__
    for k in [k for k in g if k not in ("__name__", "__builtins__", "__doc__", "__spec__")]:
        del g[k]
    g["__doc__"] = None  # as under ``python -c``; main.py's own docstring replaces it
    g["__file__"] = "main.py"
    sys.argv = ["main.py"]
    exec(code, g)


if __name__ == "__main__":
    run_main()
