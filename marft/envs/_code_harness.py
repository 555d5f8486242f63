"""Test harness that runs inside the sandbox: load the solution, run each test, report.

Run as ``python -I harness.py`` in the sandbox's working directory with ``solution.py`` (the
agent's program) and ``spec.json`` (``tests``: list of test sources, ``setup``: code run after
the solution and before the tests, ``nonce``, ``entry``: the function under test,
``test_timeout_s``). Standard library only.

It reports one line per test, ``<nonce>{"test": i, "passed": bool, "error": str}``, on a copy of
stdout taken before the solution runs; the grader counts only such lines, so a program that exits
early (``sys.exit(0)``, ``os._exit(0)``) or prints "passed" scores nothing for the tests it skipped.

Against programs that pass tests by tampering rather than by being right:
- every ``assert`` in a test is rewritten so that its comparison runs here, on values whose
  comparison methods come from built-in or standard types (an object whose ``__eq__`` always
  returns True fails);
- tests see pristine built-ins (a solution that rebinds ``sorted``, ``isinstance`` or
  ``builtins.AssertionError`` changes nothing for them), and module attributes the solution
  patched (``math.isclose = lambda *a: True``) are restored before every test;
- a test that raises anything, including ``SystemExit``, fails; each test has its own timeout.
A program that walks the interpreter's frames or memory can still forge results: this guards
against accidents and simple reward hacking, not a determined adversary.
"""
import builtins as _builtins_module

__builtins__ = dict(vars(_builtins_module))  # this module's functions keep the pristine built-ins

import ast  # noqa: E402
import collections  # noqa: E402
import decimal  # noqa: E402
import fractions  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

# modules solutions commonly use, imported now so that their pristine state can be restored
for _name in ("math", "re", "itertools", "functools", "heapq", "bisect", "operator", "string", "cmath",
              "statistics", "random", "copy", "typing", "array", "datetime"):
    __import__(_name)

PRISTINE = dict(__builtins__)
_write, _dumps, _type, _id = os.write, json.dumps, type, id
OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
       ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
_op = __import__("operator")
APPLY = {"==": _op.eq, "!=": _op.ne, "<": _op.lt, "<=": _op.le, ">": _op.gt, ">=": _op.ge,
         "is": _op.is_, "is not": _op.is_not, "in": lambda a, b: _op.contains(b, a),
         "not in": lambda a, b: not _op.contains(b, a)}
TRUSTED = {object, int, float, complex, str, bytes, bytearray, bool, tuple, list, dict, set, frozenset,
           type(None), range, slice, type, collections.OrderedDict, collections.Counter, collections.deque,
           collections.defaultdict, decimal.Decimal, fractions.Fraction, type(NotImplemented), type(...)}
METHODS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__", "__contains__",
           "__iter__", "__hash__", "__abs__", "__sub__", "__float__", "__round__")
CONTAINERS = (list, tuple, set, frozenset, collections.deque)
_mro_ok: dict = {}


def _type_trusted(t) -> bool:
    ok = _mro_ok.get(t)
    if ok is None:
        ok = True
        for m in METHODS:
            for k in t.__mro__:
                if m in k.__dict__:
                    ok = ok and k in TRUSTED
                    break
        _mro_ok[t] = ok
    return ok


def trusted(value, budget: int = 100_000) -> bool:
    """The value and everything inside it compare with built-in or standard-library methods."""
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return False
        v = stack.pop()
        t = _type(v)
        if not _type_trusted(t):
            return False
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, CONTAINERS):
            stack.extend(v)
    return True


class Failed(AssertionError):
    pass


_last_false = [None]  # the last comparison that came out False: (text, repr of its left side)


def check_value(text: str, value):
    if not trusted(value):
        raise Failed(f"{text}: a value of type {_type(value).__name__} with its own comparison or truth "
                     "methods is not accepted")
    return value


def check_compare(text: str, left, ops: tuple, *rights) -> bool:
    values = (left, *rights)
    for v in values:
        check_value(text, v)
    for a, op, b in zip(values, ops, values[1:]):
        if not APPLY[op](a, b):
            _last_false[0] = (text, repr(left))
            return False
    return True


def check_truth(text: str, value) -> bool:
    check_value(text, value)
    if not value:
        detail = ""
        if _last_false[0] is not None:
            sub, shown = _last_false[0]
            cut = shown[:200] + ("..." if len(shown) > 200 else "")
            detail = f" (the left side is {cut})" if sub == text else f" ({sub}: the left side is {cut})"
        raise Failed(text + detail)
    return True


def _call(name: str, *args):
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


class Rewrite(ast.NodeTransformer):
    """Every ``assert`` is judged here: comparisons inside it run in :func:`check_compare`, operands
    of ``not``/``and``/``or`` pass :func:`check_value`, and the whole test :func:`check_truth`."""

    def visit_Assert(self, node):
        text = ast.unparse(node.test)
        call = _call("__marft_truth__", ast.Constant(text), _Inside().visit(node.test))
        return ast.copy_location(ast.Assert(call, None), node)


class _Inside(ast.NodeTransformer):
    def visit_Compare(self, node):
        text = ast.unparse(node)
        self.generic_visit(node)
        if not all(_type(o) in OPS for o in node.ops):
            return node
        return _call("__marft_compare__", ast.Constant(text), node.left,
                     ast.Constant(tuple(OPS[_type(o)] for o in node.ops)), *node.comparators)

    def visit_UnaryOp(self, node):
        text = ast.unparse(node.operand)
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            node.operand = _call("__marft_value__", ast.Constant(text), node.operand)
        return node

    def visit_BoolOp(self, node):
        texts = [ast.unparse(v) for v in node.values]
        self.generic_visit(node)
        node.values = [_call("__marft_value__", ast.Constant(t), v) for t, v in zip(texts, node.values)]
        return node


class TestTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise TestTimeout()


def snapshot() -> dict:
    return {name: dict(vars(m)) for name, m in list(sys.modules.items()) if m is not None and hasattr(m, "__dict__")}


def restore(snap: dict) -> None:
    for name, saved in snap.items():
        m = sys.modules.get(name)
        if m is None:
            continue
        d = vars(m)
        for k, v in saved.items():
            if d.get(k, d) is not v:
                try:
                    d[k] = v
                except TypeError:
                    pass


def short_error(e: BaseException) -> str:
    if isinstance(e, Failed):
        return f"AssertionError: {e}"
    if isinstance(e, TestTimeout):
        return "the test timed out"
    if isinstance(e, SystemExit):
        return "the program exited during the test"
    lines = traceback.format_exception_only(_type(e), e)
    return "".join(lines).strip()[-400:]


def main() -> None:
    with open("spec.json", encoding="utf-8") as f:
        spec = json.load(f)
    os.remove("spec.json")
    nonce = spec["nonce"]
    report_fd = os.dup(1)

    def report(obj):
        _write(report_fd, (nonce + _dumps(obj) + "\n").encode())

    tests = []
    for i, src in enumerate(spec["tests"]):
        tree = Rewrite().visit(ast.parse(src))
        ast.fix_missing_locations(tree)
        tests.append(compile(tree, f"<test {i}>", "exec"))
    with open("solution.py", encoding="utf-8") as f:
        solution = f.read()
    snap = snapshot()
    ns = {"__name__": "solution", "__builtins__": _builtins_module}
    signal.signal(signal.SIGALRM, _alarm)
    load_error = None
    try:
        signal.setitimer(signal.ITIMER_REAL, spec["test_timeout_s"])
        exec(compile(solution, "solution.py", "exec"), ns)
        if spec.get("setup"):  # MBPP's test_setup_code builds inputs with the solution's classes
            exec(compile(spec["setup"], "<test setup>", "exec"), ns)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:  # noqa: BLE001 - anything the solution does is its failure
        signal.setitimer(signal.ITIMER_REAL, 0)
        load_error = ("the program exited while loading" if isinstance(e, SystemExit)
                      else "the program does not run: " + short_error(e))
    for i, code in enumerate(tests):
        if load_error:
            report({"test": i, "passed": False, "error": load_error})
            continue
        restore(snap)
        _last_false[0] = None
        g = {k: v for k, v in ns.items() if k not in PRISTINE or k == spec["entry"]}
        g.update(__builtins__=dict(PRISTINE), __marft_compare__=check_compare, __marft_truth__=check_truth,
                 __marft_value__=check_value)
        passed, error = False, ""
        try:
            signal.setitimer(signal.ITIMER_REAL, spec["test_timeout_s"])
            exec(code, g)
            signal.setitimer(signal.ITIMER_REAL, 0)
            passed = True
        except BaseException as e:  # noqa: BLE001
            signal.setitimer(signal.ITIMER_REAL, 0)
            error = short_error(e)
        report({"test": i, "passed": passed, "error": error})


if __name__ == "__main__":
    main()
