"""Helpers the sandboxed program can reach: the tests' comparisons (``==``, ``<``, ``in``... are
rewritten into calls of :func:`cmp`), the tests' ``__import__``, the audit hook, the signal and
``_imp.create_builtin`` guards.

The harness (``harness.py``) runs this module in a private namespace that already holds the constants
declared below, then empties that namespace. Every function takes each name it uses as a default
argument (no global or closure lookups; ``tests/test_code_reward_hacks.py`` checks the bytecode), and
the audit hook refuses to read or replace their defaults or code, so patching builtins, modules or
their globals changes nothing. ``H`` holds the helpers that call each other (filled by the harness).
"""

# Set by harness.protected_env before this module runs; declared here for linters only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    SCALARS: tuple[type, ...] = ()
    MRO: Callable[[type], tuple[type, ...]] = type.mro
    TDICT: Callable[[type], Any] = vars
    CMP_NAMES: tuple[str, ...] = ()
    CDESC: tuple[type, ...] = ()
    H: list[Callable[..., Any]] = []
    TOKEN, BTOKEN, BIG, INF = "", b"", 0, 0.0
    OPS: dict[str, Callable[[Any, Any], Any]] = {}
    MIRROR: dict[str, str] = {}
    PROXIES: dict[str, Any] = {}
    IMPORT: Callable[..., Any] = __import__
    CREATE_BUILTIN: Callable[[Any], Any] = print
    NAMESPACE: type = object
    REINIT_DENY: frozenset[str] = frozenset()
    STATE: list[int] = []
    DENY_EVENTS: frozenset[str] = frozenset()
    FRAME_ATTRS: frozenset[str] = frozenset()
    CODE_ATTRS: frozenset[str] = frozenset()
    PROT: list[object] = []
    DENY_MODULES: frozenset[str] = frozenset()
    SPAWN_EVENTS: frozenset[str] | None = None
    DENIED: type[Exception] = ValueError


def to_list(x, _l=list, _i=list.__iter__):
    return _l(_i(x))


def to_tuple(x, _t=tuple, _i=tuple.__iter__):
    return _t(_i(x))


def to_dict(x, _d=dict, _i=dict.items):
    return _d(_i(x))


def to_set(x, _s=set, _i=set.__iter__):
    return _s(_i(x))


def to_frozenset(x, _s=frozenset, _i=frozenset.__iter__):
    return _s(_i(x))


CONVS = (
    (int, int.__int__, 0),
    (float, float.__float__, 0),
    (complex, complex.__complex__, 0),
    (str, str.__str__, 0),
    (bytes, bytes.__bytes__, 0),
    (list, to_list, 1),
    (tuple, to_tuple, 2),
    (dict, to_dict, 3),
    (set, to_set, 4),
    (frozenset, to_frozenset, 4),
)


def kind(
    x,
    _type=type,
    _scal=SCALARS,
    _mro=MRO,
    _convs=CONVS,
    _h=H,
    _list=list,
    _tuple=tuple,
    _dict=dict,
    _set=set,
    _fset=frozenset,
):
    """(kind, value): 0 scalar, 1 list, 2 tuple, 3 dict, 4 set; 5 opaque (a Python-level comparison
    method); 6 native (C-level comparisons). Subclasses of builtins become their base value."""
    t = _type(x)
    for s in _scal:
        if t is s:
            return 0, x
    if t is _list:
        return 1, x
    if t is _tuple:
        return 2, x
    if t is _dict:
        return 3, x
    if t is _set or t is _fset:
        return 4, x
    mro = _mro(t)
    for base, conv, k in _convs:
        for c in mro:
            if c is base:
                return k, conv(x)
    if _h[0](t):
        return 5, x
    return 6, x


def opaque(t, _mro=MRO, _tdict=TDICT, _names=CMP_NAMES, _cdesc=CDESC, _type=type):
    """True when one of t's comparison/hash/containment methods is not C code."""
    for name in _names:
        for k in _mro(t):
            d = _tdict(k)
            if name in d:
                tv = _type(d[name])
                for c in _cdesc:
                    if tv is c:
                        break
                else:
                    return True
                break
    return False


def pure(
    x, depth, _type=type, _scal=SCALARS, _list=list, _tuple=tuple, _dict=dict, _set=set, _fset=frozenset, _h=H
):
    """Exact builtin data all the way down (compared by value in C, cannot lie)."""
    if depth > 60:
        return False
    t = _type(x)
    for s in _scal:
        if t is s:
            return True
    if t is _list or t is _tuple or t is _set or t is _fset:
        for e in x:
            if not _h[1](e, depth + 1):
                return False
        return True
    if t is _dict:
        for k in x:
            if not _h[1](k, depth + 1) or not _h[1](x[k], depth + 1):
                return False
        return True
    return False


def perturb(
    v,
    _type=type,
    _tok=TOKEN,
    _btok=BTOKEN,
    _big=BIG,
    _int=int,
    _float=float,
    _complex=complex,
    _str=str,
    _bytes=bytes,
    _list=list,
    _tuple=tuple,
    _dict=dict,
    _set=set,
    _fset=frozenset,
    _bool=bool,
    _abs=abs,
):
    """A value of v's type that no honest object equal to v also equals (None: no such probe)."""
    t = _type(v)
    if t is _bool:
        return not v
    if t is _int:
        return v + _big
    if t is _float:
        if v - v != 0.0:
            return None
        return v + (_abs(v) + 1.0) * 1e9
    if t is _complex:
        return v + _complex(0.0, 1e9)
    if t is _str:
        return v + _tok
    if t is _bytes:
        return v + _btok
    if t is _list:
        return v + [_tok]
    if t is _tuple:
        return v + (_tok,)
    if t is _dict:
        d = _dict(v)
        d[_tok] = _tok
        return d
    if t is _set:
        return v | {_tok}
    if t is _fset:
        return v | _fset((_tok,))
    if v is None:
        return _tok
    return None


def probe_eq(o, v, _bool=bool, _object=object, _h=H, _E=AssertionError):
    """o == v for an object o with a Python-level __eq__, refusing one that equals anything."""
    if not _bool(o == v):
        return False
    if _bool(o == _object()):
        raise _E("gspo: a compared object equals an unrelated probe object (an __eq__ that accepts anything)")
    p = _h[2](v)
    if p is not None and _bool(o == p):
        raise _E("gspo: a compared object equals an unrelated probe value (an __eq__ that accepts anything)")
    return True


def eq(a, b, depth, _h=H, _len=len, _range=range, _bool=bool, _E=AssertionError):
    """a == b with Python's semantics for builtin data, checked element by element."""
    if depth > 60:
        raise _E("gspo: data nested too deeply to compare")
    ka, a = _h[3](a)
    kb, b = _h[3](b)
    if ka == 5 or kb == 5:
        if ka == 5 and kb == 5:
            return a == b
        if ka == 5:
            return _h[4](a, b)
        return _h[4](b, a)
    if ka == 6 or kb == 6 or (ka == 0 and kb == 0):
        return a == b
    if ka != kb:
        return False
    if ka == 1 or ka == 2:
        n = _len(a)
        if n != _len(b):
            return False
        for i in _range(n):
            if not _bool(_h[5](a[i], b[i], depth + 1)):
                return False
        return True
    if _len(a) != _len(b):
        return False
    if _h[1](a, depth) and _h[1](b, depth):
        return a == b
    if ka == 3:
        for k in a:
            for k2 in b:
                if _bool(_h[5](k, k2, depth + 1)):
                    if not _bool(_h[5](a[k], b[k2], depth + 1)):
                        return False
                    break
            else:
                return False
        return True
    for e in a:
        for e2 in b:
            if _bool(_h[5](e, e2, depth + 1)):
                break
        else:
            return False
    return True


def ne(a, b, _h=H, _bool=bool):
    ka, a2 = _h[3](a)
    kb, b2 = _h[3](b)
    if (ka == 5 and kb == 5) or ((ka == 0 or ka == 6) and (kb == 0 or kb == 6)):
        return a2 != b2
    return not _bool(_h[5](a, b, 0))


def order(
    op,
    a,
    b,
    _h=H,
    _ops=OPS,
    _mirror=MIRROR,
    _bool=bool,
    _type=type,
    _int=int,
    _float=float,
    _inf=INF,
    _E=AssertionError,
):
    ka, a = _h[3](a)
    kb, b = _h[3](b)
    r = _ops[op](a, b)
    if (ka == 5) == (kb == 5) or not _bool(r):
        return r
    if ka == 5:
        o, v, rel = a, b, op
    else:
        o, v, rel = b, a, _mirror[op]
    tv = _type(v)
    if tv is _int or tv is _float:
        ext = -_inf if (rel == "<" or rel == "<=") else _inf
        if _bool(_ops[rel](o, ext)):
            raise _E(
                "gspo: a compared object orders before/after everything (an order that accepts anything)"
            )
    return r


def contains(a, b, _h=H, _bool=bool, _object=object, _E=AssertionError, _Exc=Exception):
    kb, b = _h[3](b)
    if kb == 5:
        r = _bool(a in b)
        if r:
            try:
                probe = _bool(_object() in b)
            except _Exc:
                probe = False
            if probe:
                raise _E(
                    "gspo: a container contains an unrelated probe object (a __contains__ that accepts anything)"
                )
        return r
    if kb == 1 or kb == 2 or ((kb == 3 or kb == 4) and not (_h[1](a, 0) and _h[1](b, 0))):
        for e in b:
            if _bool(_h[5](a, e, 1)):
                return True
        return False
    return a in b


def cmp(ops, *xs, _h=H, _len=len, _range=range, _bool=bool, _E=AssertionError):
    """The tests' comparisons (`a == b`, `a < b < c`, `x in y`...) are rewritten into calls of this."""
    n = _len(ops)
    r = True
    for i in _range(n):
        op = ops[i]
        a = xs[i]
        b = xs[i + 1]
        if op == "==":
            r = _h[5](a, b, 0)
        elif op == "!=":
            r = _h[6](a, b)
        elif op == "in":
            r = _h[8](a, b)
        elif op == "not in":
            r = not _h[8](a, b)
        elif op == "is":
            r = a is b
        elif op == "is not":
            r = a is not b
        else:
            r = _h[7](op, a, b)
        if i + 1 < n and not _bool(r):
            return r
    return r


def test_import(
    name, globals=None, locals=None, fromlist=(), level=0, _px=PROXIES, _orig=IMPORT, _type=type, _str=str
):
    """__import__ for the tests: modules they import come from copies taken before the solution ran."""
    if level == 0 and _type(name) is _str:
        if fromlist:
            if name in _px:
                return _px[name]
        else:
            top = name.partition(".")[0]
            if top in _px:
                return _px[top]
    return _orig(name, globals, locals, fromlist, level)


def no_signals(*args, _E=ValueError):
    """signal.signal: ValueError, what CPython raises off the main thread (asyncio.run copes)."""
    raise _E("gspo sandbox: signal handlers are disabled")


def create_builtin(
    spec, _orig=CREATE_BUILTIN, _ns=NAMESPACE, _deny=REINIT_DENY, _type=type, _str=str, _E=ImportError
):
    """_imp.create_builtin minus _signal & co (a fresh _signal would bring back signal handlers).
    The name is read once and handed to the original in a C-level namespace the program cannot
    patch (a ModuleSpec's class could be)."""
    name = spec.name
    if _type(name) is not _str or name in _deny:
        raise _E("gspo sandbox: re-creating this module is not allowed")
    return _orig(_ns(name=name))


def hook(
    ev,
    args,
    _state=STATE,
    _deny=DENY_EVENTS,
    _frames=FRAME_ATTRS,
    _code=CODE_ATTRS,
    _prot=PROT,
    _mods=DENY_MODULES,
    _spawn=SPAWN_EVENTS,
    _E=DENIED,
    _IE=ModuleNotFoundError,
    _type=type,
    _str=str,
    _bytes=bytes,
):
    if not _state[0]:
        return
    if ev in _deny:
        raise _E("gspo sandbox: " + ev + " is not allowed")
    if ev == "object.__getattr__":
        name = args[1]
        if name in _frames:
            raise _E("gspo sandbox: frame access is not allowed")
        if name in _code:
            obj = args[0]
            for p in _prot:
                if obj is p:
                    raise _E("gspo sandbox: not allowed")
        return
    if ev == "object.__setattr__":
        obj = args[0]
        for p in _prot:
            if obj is p:
                raise _E("gspo sandbox: not allowed")
        return
    if ev == "import":
        if args[0] in _mods:  # an ImportError, so that optional imports (numpy's ctypes) fall back
            raise _IE("gspo sandbox: importing " + args[0] + " is not allowed")
        return
    if ev[:7] == "ctypes.":
        raise _E("gspo sandbox: ctypes is not allowed")
    if ev == "open":
        p = args[0]
        if (_type(p) is _str and (p[:5] == "/proc" or p[:7] == "/dev/fd")) or (
            _type(p) is _bytes and (p[:5] == b"/proc" or p[:7] == b"/dev/fd")
        ):
            raise _E("gspo sandbox: /proc is not allowed")
        return
    if _spawn and ev in _spawn:
        raise _E("gspo sandbox: starting programs is not allowed without Landlock")
