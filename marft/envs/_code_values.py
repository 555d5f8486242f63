"""Values as data: the only form in which anything crosses between a graded program and the grader.

Both sides of grading import this module: the harness inside the sandbox (as ``values.py``) and
the checker outside it (:mod:`marft.envs._code_checker`). A message is one line of JSON text;
decoding it can build nothing but the plain types below, so a frame that a hostile program forges
can at most describe a value, never run code or carry an object with methods of its own. There is
no pickle or marshal on this path (both rebuild objects that a sender chooses).

The format: ``None``, ``bool``, ``int``, finite ``float`` and ``str`` are themselves; everything
else is a JSON array whose first element is a tag:

    ["l", x, ...] list      ["t", x, ...] tuple      ["s", x, ...] set      ["z", x, ...] frozenset
    ["d", k, v, ...] dict   ["o", k, v, ...] OrderedDict                    ["q", x, ...] deque
    ["f", "nan" | "inf" | "-inf"] float              ["c", re, im] complex
    ["b", hex] bytes        ["y", hex] bytearray     ["g", start, stop, step] range
    ["D", text] Decimal     ["F", numerator, denominator] Fraction
    ["B", name] one of the built-in data types themselves (``int``, ``str``, ``list``, ...)
    ["r", id, type name] an object that stays in the program (the grader may call it or pass it back)

Subclasses of these types travel as the base type, read through the base type's own methods (an
``int`` subclass whose ``__eq__`` or ``__repr__`` lies arrives as the plain number it holds).
Limits, on both sides: nesting at most ``MAX_DEPTH`` levels (a list that contains itself is refused),
at most ``MAX_NODES`` values in one message, frames of at most ``MAX_FRAME`` characters, and
integers of at most 4300 digits (Python's own limit for converting integers to text). Standard
library only, and cheap to import (no ``json``, ``re`` or ``ast``): the harness and the checker
each start once per graded program.
"""
import sys

try:
    from _json import encode_basestring_ascii as _quote, make_scanner as _make_scanner
except ImportError:  # another Python implementation: the pure-Python versions
    from json.encoder import py_encode_basestring_ascii as _quote
    from json.scanner import py_make_scanner as _make_scanner

MAX_DEPTH = 100
MAX_NODES = 200_000
MAX_FRAME = 4 * 2**20


def _no_constant(name):
    raise ValueError(f"{name} is not part of the format")


class _Context:  # what the JSON scanner reads: strict JSON, plain ints and floats, no NaN tokens
    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int, parse_constant = float, int, staticmethod(_no_constant)
    memo: dict = {}


_scan = _make_scanner(_Context)
_FLOAT_TAGS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
_DICT, _LIST, _TUPLE, _SET, _FROZENSET = dict, list, tuple, set, frozenset
_TYPES = {t.__name__: t for t in (int, float, complex, str, bytes, bytearray, bool, list, tuple, dict, set,
                                  frozenset, range)}  # MBPP passes types: remove_datatype(xs, int)
_TYPE_NAMES = {id(t): name for name, t in _TYPES.items()}


class Encoder:
    """``encode(value)`` -> one line of text; ``ref(obj)`` -> ``(id, type name)`` for what is not
    data (None: such a value is refused with TypeError). Raises ValueError past the limits."""

    def __init__(self, ref=None):
        self.ref = ref

    def encode(self, value) -> str:
        self.nodes = self.chars = 0
        parts: list[str] = []
        self._put(value, parts, 0)
        text = "".join(parts)
        if len(text) > MAX_FRAME:
            raise ValueError(f"the value takes more than {MAX_FRAME // 2**20} MiB as data")
        return text

    def _put(self, v, out, depth):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ValueError(f"the value holds more than {MAX_NODES} items")
        t = type(v)
        if v is None or t is bool:
            out.append("null" if v is None else "true" if v else "false")
        elif issubclass(t, int) and t is not bool:
            try:
                out.append(int.__repr__(v))
            except ValueError:
                raise ValueError("the value holds an integer of more than 4300 digits") from None
        elif issubclass(t, float):
            r = float.__repr__(v)
            out.append(f'["f","{r}"]' if r in _FLOAT_TAGS else r)
        elif issubclass(t, str):
            self._count(str.__len__(v))  # before quoting: a 200 MB string is refused, not copied
            out.append(_quote(v))
        elif depth >= MAX_DEPTH:
            raise ValueError(f"the value is nested more than {MAX_DEPTH} levels deep")
        elif issubclass(t, complex):
            self._seq("c", (complex.real.__get__(v), complex.imag.__get__(v)), out, depth)
        elif issubclass(t, bytes):
            self._count(2 * bytes.__len__(v))
            out.append(f'["b","{bytes.hex(v)}"]')
        elif issubclass(t, bytearray):
            self._count(2 * bytearray.__len__(v))
            out.append(f'["y","{bytearray.hex(v)}"]')
        elif issubclass(t, _DICT):
            tag = "o" if _collections() and issubclass(t, _collections().OrderedDict) else "d"
            items = [x for kv in _DICT.items(v) for x in kv]
            self._seq(tag, items, out, depth)
        elif issubclass(t, _LIST):
            self._seq("l", _LIST.__iter__(v), out, depth)
        elif issubclass(t, _TUPLE):
            self._seq("t", _TUPLE.__iter__(v), out, depth)
        elif issubclass(t, _FROZENSET):
            self._seq("z", _FROZENSET.__iter__(v), out, depth)
        elif issubclass(t, _SET):
            self._seq("s", _SET.__iter__(v), out, depth)
        elif issubclass(t, range):
            self._seq("g", (v.start, v.stop, v.step), out, depth)
        elif _collections() and issubclass(t, _collections().deque):
            self._seq("q", _collections().deque.__iter__(v), out, depth)
        elif "decimal" in sys.modules and issubclass(t, sys.modules["decimal"].Decimal):
            out.append('["D",' + _quote(sys.modules["decimal"].Decimal.__str__(v)) + "]")
        elif "fractions" in sys.modules and issubclass(t, sys.modules["fractions"].Fraction):
            f = sys.modules["fractions"].Fraction
            self._seq("F", (f.numerator.fget(v), f.denominator.fget(v)), out, depth)
        elif t is type and _TYPE_NAMES.get(id(v)) and _TYPES[_TYPE_NAMES[id(v)]] is v:
            out.append(f'["B","{_TYPE_NAMES[id(v)]}"]')
        elif self.ref is not None:
            ident, name = self.ref(v)
            out.append(f'["r",{int(ident)},{_quote(str(name)[:80])}]')
        else:
            raise TypeError(f"{t.__name__!r} objects are not values that can be sent as data")

    def _count(self, n: int) -> None:
        self.chars += n
        if self.chars > MAX_FRAME:
            raise ValueError(f"the value takes more than {MAX_FRAME // 2**20} MiB as data")

    def _seq(self, tag, items, out, depth):
        out.append(f'["{tag}"')
        for x in items:
            out.append(",")
            self._put(x, out, depth + 1)
        out.append("]")


def _collections():
    return sys.modules.get("collections")  # only values of an imported module's types can exist


def loads(text: str, ref=None):
    """The value in one frame. ``ref(id, type name)`` builds references (None: refused). Raises
    ValueError for anything malformed or past the limits; builds only the types of the format."""
    if len(text) > MAX_FRAME:
        raise ValueError("the frame is too long")
    try:
        raw, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("the frame is not JSON") from None
    except RecursionError:
        raise ValueError("the frame is nested too deeply") from None
    if text[end:].strip():
        raise ValueError("the frame holds more than one value")
    try:
        return _Builder(ref).build(raw, 0)
    except ValueError:
        raise
    except Exception as e:  # unhashable set items or keys, a bad Decimal or Fraction, ...
        raise ValueError(f"a value in the frame cannot be built ({type(e).__name__})") from None


class _Builder:
    def __init__(self, ref):
        self.ref, self.nodes = ref, 0

    def build(self, x, depth):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise ValueError(f"the frame holds more than {MAX_NODES} values")
        t = type(x)
        if x is None or t in (bool, int, float, str):
            return x
        if t is not list or not x or type(x[0]) is not str or depth >= MAX_DEPTH:
            raise ValueError("a value in the frame is not in the format (or nested too deeply)")
        tag, body = x[0], x[1:]
        if tag == "f" and len(body) == 1 and body[0] in _FLOAT_TAGS:
            return _FLOAT_TAGS[body[0]]
        if tag in ("b", "y") and len(body) == 1 and type(body[0]) is str:
            return (bytes if tag == "b" else bytearray).fromhex(body[0])
        if tag == "r" and len(body) == 2 and type(body[0]) is int and type(body[1]) is str and self.ref is not None:
            return self.ref(body[0], body[1][:80])
        if tag == "B" and len(body) == 1 and body[0] in _TYPES:
            return _TYPES[body[0]]
        if tag == "D" and len(body) == 1 and type(body[0]) is str:
            import decimal
            return decimal.Decimal(body[0])
        items = [self.build(y, depth + 1) for y in body]
        if tag == "l":
            return items
        if tag == "t":
            return tuple(items)
        if tag in ("s", "z"):
            # built the way Python builds a set display of constants, so that the iteration order (which
            # some tests depend on) usually matches the sender's; TypeError for unhashable items
            return set(frozenset(items)) if tag == "s" else frozenset(items)
        if tag in ("d", "o") and len(items) % 2 == 0:
            pairs = zip(items[::2], items[1::2])
            if tag == "d":
                return dict(pairs)
            import collections
            return collections.OrderedDict(pairs)
        if tag == "q":
            import collections
            return collections.deque(items)
        if tag == "c" and len(items) == 2 and all(type(y) is float for y in items):
            return complex(*items)
        if tag == "g" and len(items) == 3 and all(type(y) is int for y in items):
            return range(*items)
        if tag == "F" and len(items) == 2 and all(type(y) is int for y in items):
            import fractions
            return fractions.Fraction(*items)
        raise ValueError(f"a value in the frame has an unknown tag or shape ({tag[:10]!r})")
