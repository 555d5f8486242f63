"""The trusted side of grading: the tests run here, outside the sandbox, and only the calls they make
into the agent's program run inside it.

:func:`prepare` (in the trainer, once per problem) compiles a problem's tests and finds the names
they take from the program; the rest runs as its own process, ``python -I -S _code_checker.py``,
started by :func:`marft.envs.code.run_tests` for each program beside the sandboxed harness
(:mod:`marft.envs._code_harness`), the two joined by a pair of pipes and nothing else. The
checker executes the test code itself (MBPP's asserts, its tree-building setup, HumanEval's
``check(candidate)`` with its loops, random inputs and the helpers of its prompt), with built-ins
and standard modules of its own. The names that the tests take from the program (``add``,
``candidate``, ``Node``) are bound to references: calling one sends the arguments, as data, to
the harness, which calls the program's function and sends back the return value, as data
(:mod:`marft.envs._code_values`), or an error, or a reference to an object that is not data.
Every comparison, every ``assert``, the control flow of the test and the count of passed tests
happen here, and each test's verdict goes to the trainer on this process's stdout.

**What this guarantees.** Whatever the program does inside its process (walk the interpreter's
frames, scan ``gc.get_objects()``, patch ``json``, ``os.write`` or ``print``, register ``atexit``
handlers, write to every file descriptor, print look-alike lines, exit or kill itself), the only
thing that reaches the checker is the byte stream on its reply pipe, and that stream is read as
one reply per request, in sequence, each decoded into plain data by a decoder that builds no
object with methods of its own (no pickle). A reply can carry a value, never a verdict; there is
no nonce or secret to steal. So forged replies achieve nothing that a program could not achieve
by returning those values from its functions: a test passes only if the values it gets make the
test's own comparisons true here, with the checker's ``==`` on plain data (a returned object whose
``__eq__``, ``__repr__``, ``__bool__`` or ``__reduce__`` lies is either read as the plain value
it holds or arrives as a reference, which refuses to be compared or tested for truth). The
expected values never enter the sandbox (the harness only sees the arguments of calls), and the
names the tests use from the program are chosen here, from the test source (a program cannot
substitute ``math.isclose`` or ``sorted`` for the tests). A reply that is malformed, out of
sequence, too large (4 MiB) or too deep (100 levels) breaks the channel: that test and the later
ones fail. A program that stops answering fails its remaining tests; values that make the test
code itself slow or large hit this process's own per-test timer, memory limit and the trainer's
deadline, and fail the test, never the trainer.

**What it does not guarantee.** That the program is right beyond the tested inputs: a program that
returns the expected values (for MBPP they are in the prompt) passes, as it would anywhere, and so
does one that writes those values onto the reply pipe ahead of the requests (it is a lookup table
by other means; ``tests/test_grading_hostile.py`` shows both). That it cannot read world-readable
files, use timing or other side channels, or learn the tests' inputs from the calls it receives.
Semantics that copies change: the tests do not see mutations the program makes to its arguments,
the program's exceptions reach the test as :class:`ProgramError`, and a set arrives rebuilt, so
its iteration order usually, not always, matches the sender's. And the checker is only as separate
from the program as the sandbox makes it: the program cannot read or write this process's memory
or file descriptors because Landlock confines it to its own domain (no ptrace of, nor ``/proc``
access to, processes outside it) and it runs in its own PID and user namespace; on a machine
where :func:`marft.envs.sandbox.Sandbox.protections` lacks those layers, a program running as the same
user could reach this process, and the trainer too.
"""
import builtins
import marshal
import operator
import os
import select
import signal
import sys
import time

GRACE_S = 1.0  # how much longer than a test's own time the checker waits for a reply
OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge, "is": operator.is_, "is not": operator.is_not,
       "in": lambda a, b: operator.contains(b, a), "not in": lambda a, b: not operator.contains(b, a)}

if __package__:
    from marft.envs import _code_values as values
else:  # run as a script: load the codec from beside this file without putting marft/envs on sys.path
    values = type(sys)("marft_values")
    _path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_values.py")
    with open(_path, encoding="utf-8") as _f:
        exec(compile(_f.read(), _path, "exec"), values.__dict__)


# --- in the trainer: compile a problem's tests --------------------------------------------------

def prepare(tests: tuple, setup: str, stub: str, entry: str) -> bytes:
    """The checker's job for one problem, marshalled: compiled stub (HumanEval's prompt, whose
    helpers the tests use), setup and tests (each ``assert`` rewritten to report its left side),
    the names to take from the program and the standard modules the tests use without importing."""
    import ast

    def compiled(src: str, name: str, rewrite: bool):
        try:
            tree = ast.parse(src)
        except SyntaxError as e:
            tree = ast.parse(f"raise SyntaxError({f'the test does not parse: {e}'!r})")
        if rewrite:
            tree = ast.fix_missing_locations(_rewriter().visit(tree))
        return tree, compile(tree, name, "exec")

    stub_tree, stub_code = compiled(stub, "<prompt>", False) if stub else (None, None)
    setup_tree, setup_code = compiled(setup, "<test setup>", False) if setup else (None, None)
    parts = [compiled(t, f"<test {i}>", True) for i, t in enumerate(tests)]
    loaded, bound = set(), set()
    for tree in [setup_tree, *(t for t, _ in parts)]:
        if tree is not None:
            _names(tree, loaded, bound)
    trusted = set(dir(builtins)) | bound | (_top_level_names(stub_tree) if stub_tree else set())
    free = loaded - trusted
    modules = sorted(n for n in free - {entry} if n in sys.stdlib_module_names)
    remote = sorted((free - set(modules)) | {entry})
    return marshal.dumps({"stub": stub_code, "setup": setup_code, "tests": [c for _, c in parts],
                          "remote": remote, "modules": modules})


def _names(tree, loaded: set, bound: set) -> None:
    import ast
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.alias):
            bound.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)


def _top_level_names(tree) -> set:
    import ast
    out: set = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                out |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
    return out


def _rewriter():
    """The transformer for test code (defined here so that the checker process never imports ast)."""
    import ast

    class Rewrite(ast.NodeTransformer):
        """``assert test`` -> ``__marft_truth__(text, test)``, each comparison inside it through
        ``__marft_compare__`` (which remembers its left side for the feedback). Not an ``assert``
        any more, so ``python -O`` cannot drop it."""

        def visit_Assert(self, node):
            test = _Compare().visit(node.test)
            call = ast.Call(ast.Name("__marft_truth__", ast.Load()), [ast.Constant(ast.unparse(node.test)), test], [])
            return ast.copy_location(ast.Expr(call), node)

    class _Compare(ast.NodeTransformer):
        def visit_Compare(self, node):
            text = ast.unparse(node)
            self.generic_visit(node)
            ops = tuple({ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
                         ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}[type(o)]
                        for o in node.ops)
            return ast.Call(ast.Name("__marft_compare__", ast.Load()),
                            [ast.Constant(text), node.left, ast.Constant(ops), *node.comparators], [])

    return Rewrite()


# --- in the checker process -------------------------------------------------------------------

class Broken(BaseException):
    """The channel to the program is gone or garbled; this test and the later ones fail."""

    def __init__(self, text: str, ended: bool = False):
        super().__init__(text)
        self.ended = ended  # the program closed its end (it exited or was killed)


class NotData(BaseException):
    """A test needed to compare, inspect or send something that is not data. Not an ``Exception``,
    so that a test's ``except Exception`` cannot turn it into a pass."""


class TimedOut(BaseException):
    pass


class ProgramError(Exception):
    """The program's function raised (the text is the program's ``Type: message``)."""


class Failed(AssertionError):
    pass


class Remote:
    """An object that lives in the program: the tests may call it, read or set its attributes, or
    pass it back to the program; comparing it, testing its truth or looking inside it fails."""

    __slots__ = ("_channel", "_id", "_label")

    def __init__(self, channel, ident: int, label: str):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_id", ident)
        object.__setattr__(self, "_label", label)

    def __call__(self, *args, **kwargs):
        return self._channel.ask({"op": "call", "f": self, "a": list(args), "k": kwargs})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._channel.ask({"op": "get", "o": self, "name": name})

    def __setattr__(self, name, value):
        self._channel.ask({"op": "set", "o": self, "name": name, "v": value})

    def __repr__(self):
        return f"<{self._label} object of the program>"

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def _refuse(self, *args):
        raise NotData(f"the program gave a value of type {self._label!r}, which is not a value the grader can "
                      "compare or inspect (values must be built-in data: numbers, strings, lists, tuples, dicts, "
                      "sets, ...)")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __bool__ = __len__ = __iter__ = _refuse
    __contains__ = __getitem__ = __str__ = __format__ = __index__ = __int__ = __float__ = __reduce_ex__ = _refuse


class Missing:
    """A name the tests take from the program that the program does not define."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NameError(f"name {self.name!r} is not defined by the program")

    __getattr__ = __call__


class Channel:
    """Requests to the program and its replies: one line each way, one reply per request, in order."""

    def __init__(self, to_fd: int, from_fd: int):
        self.to_fd, self.from_fd, self.buf, self.n = to_fd, from_fd, b"", 0
        self.broken: Broken | None = None
        self.deadline = float("inf")  # the current test's
        self.encoder = values.Encoder(self._ref)

    def _ref(self, obj):
        if type(obj) is Remote and obj._channel is self:
            return obj._id, obj._label
        raise TypeError(f"the test would pass a {type(obj).__name__} object to the program, which the grader "
                        "cannot send as data")

    def _remote(self, ident: int, label: str) -> Remote:
        return Remote(self, ident, label)

    def ask(self, msg: dict):
        """Send one request within the current test's time; its value, or raise."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimedOut()
        msg["t"] = left
        return self.request(msg, self.deadline + GRACE_S)

    def request(self, msg: dict, deadline: float):
        if self.broken:
            raise self.broken
        self.n += 1
        msg["n"] = self.n
        try:
            data = (self.encoder.encode(msg) + "\n").encode("utf-8")
        except (TypeError, ValueError) as e:  # an argument that is not data: this test fails, the channel is fine
            raise NotData(str(e)) from None
        try:
            self._write(data, deadline)
            reply = values.loads(self._read_line(deadline).decode("utf-8"), self._remote)
            if type(reply) is not dict or reply.get("n") != self.n:
                raise Broken("the program broke the grading protocol (a reply out of sequence)")
        except Broken as e:
            self._break(e)
            raise
        except ValueError as e:  # not a frame of the format (UnicodeDecodeError included)
            raise self._break(Broken(f"the program broke the grading protocol ({e})")) from None
        except BaseException:  # this test's timer went off mid-exchange: later replies cannot be trusted to match
            self._break(Broken("the program stopped answering"))
            raise
        if "e" in reply:
            raise ProgramError(str(reply["e"])[:400])
        return reply.get("v")

    def _break(self, e: Broken) -> Broken:
        """No more requests: close both pipes, so that a program blocked writing to us ends at once."""
        self.broken = e
        for fd in (self.to_fd, self.from_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        return e

    def _write(self, data: bytes, deadline: float) -> None:
        while data:
            if not select.select([], [self.to_fd], [], max(0.0, deadline - time.monotonic()))[1]:
                raise Broken("the program stopped answering")
            try:
                data = data[os.write(self.to_fd, data[:1 << 16]):]
            except BrokenPipeError:
                raise Broken("the program ended", ended=True) from None

    def _read_line(self, deadline: float) -> bytes:
        while b"\n" not in self.buf:
            if len(self.buf) > values.MAX_FRAME + 16:
                raise Broken("the program broke the grading protocol (a reply longer than the limit)")
            if not select.select([self.from_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise Broken("the program stopped answering")
            chunk = os.read(self.from_fd, 1 << 20)
            if not chunk:
                raise Broken("the program ended", ended=True)
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def close(self) -> None:
        try:
            if not self.broken:
                os.write(self.to_fd, (self.encoder.encode({"op": "end"}) + "\n").encode())
        except OSError:
            pass


_last_false: list = [None]  # the last comparison that came out False: (text, its left side)


def compare(text: str, left, ops: tuple, *rights) -> bool:
    operands = (left, *rights)
    try:
        for a, op, b in zip(operands, ops, operands[1:]):
            if not OPS[op](a, b):
                _last_false[0] = (text, left)
                return False
    except NotData as e:
        raise NotData(f"{text}: {e}") from None
    return True


def truth(text: str, value) -> None:
    try:
        ok = bool(value)
    except NotData as e:
        raise NotData(f"{text}: {e}") from None
    if not ok:
        detail = ""
        if _last_false[0] is not None:
            sub, left = _last_false[0]
            shown = repr(left)
            shown = shown[:200] + ("..." if len(shown) > 200 else "")
            detail = f" (the left side is {shown})" if sub == text else f" ({sub}: the left side is {shown})"
        raise Failed(text + detail)


def describe(e: BaseException) -> str:
    if isinstance(e, Failed):
        return f"AssertionError: {e}"
    if isinstance(e, TimedOut):
        return "the test timed out"
    if isinstance(e, (ProgramError, NotData, Broken)):
        return str(e)
    return f"{type(e).__name__}: {e}"[-400:]


def _alarm(signum, frame):
    raise TimedOut()


def main() -> None:
    to_fd, from_fd = int(sys.argv[1]), int(sys.argv[2])
    test_s, load_s, memory_mb = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 2**20,) * 2)
    job = marshal.loads(sys.stdin.buffer.read())
    out = sys.stdout.buffer

    def verdict(i: int, passed: bool, error: str = "", ended: bool = False) -> None:
        out.write((values.Encoder().encode([i, passed, ended, error]) + "\n").encode())
        out.flush()

    tests, channel = job["tests"], Channel(to_fd, from_fd)
    signal.signal(signal.SIGALRM, _alarm)
    base = {"__name__": "__test__", "__builtins__": builtins}
    try:
        for m in job["modules"]:
            base[m] = __import__(m)
        if job["stub"] is not None:  # the prompt's helpers (HumanEval's poly, encode_cyclic), trusted copies
            exec(job["stub"], base)
        got = channel.request({"op": "names", "names": job["remote"], "t": test_s}, time.monotonic() + load_s + GRACE_S)
        if type(got) is not dict:
            raise Broken("the program broke the grading protocol (the names are not a table)")
        # only the names the tests take from the program; the ones it lacks do not fall back to the
        # prompt's stub or a built-in of the same name
        base.update({k: got[k] if k in got else Missing(k) for k in job["remote"]})
        base.update(__marft_truth__=truth, __marft_compare__=compare)
        if job["setup"] is not None:
            channel.deadline = time.monotonic() + test_s
            signal.setitimer(signal.ITIMER_REAL, test_s + 2 * GRACE_S)
            exec(job["setup"], base)
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:  # noqa: BLE001 - the program does not load, or the setup fails with it
        signal.setitimer(signal.ITIMER_REAL, 0)
        why = describe(e) if isinstance(e, (ProgramError, Broken)) else "the test setup failed: " + describe(e)
        for i in range(len(tests)):
            verdict(i, False, why, isinstance(e, Broken) and e.ended)
        return
    for i, code in enumerate(tests):
        _last_false[0] = None
        channel.deadline = time.monotonic() + test_s
        signal.setitimer(signal.ITIMER_REAL, test_s + 2 * GRACE_S)  # the test code's own time, here
        try:
            exec(code, dict(base))
            signal.setitimer(signal.ITIMER_REAL, 0)
            verdict(i, True)
        except BaseException as e:  # noqa: BLE001 - whatever stops a test fails it
            signal.setitimer(signal.ITIMER_REAL, 0)
            verdict(i, False, describe(e), isinstance(e, Broken) and e.ended)
    channel.close()


if __name__ == "__main__":
    main()
