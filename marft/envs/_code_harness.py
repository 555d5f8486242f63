"""The sandbox side of grading: load the program, then answer the grader's requests.

Run as ``python -I harness.py LOAD_TIMEOUT_S`` in the sandbox's working directory beside
``solution.py`` (the agent's program) and ``values.py`` (:mod:`marft.envs._code_values`), with
the grader's requests on file descriptor 3 and the replies on 4. Standard library only.

It runs the program, then serves, one line each way, until the grader says ``end``:

- ``names``: the values of the names the tests use from the program (``add``, ``Node``);
- ``call``: call a function of the program (or a method it returned) with the given arguments;
- ``get`` / ``set``: read or set an attribute of an object that lives here (MBPP's tree inputs).

Each reply is a value in the data-only format of ``values.py``, an error text (the exception the
program raised, "the test timed out", a value too large or too deep to send), or, for an object
that is not data (a ``Node``, a function, a generator), a reference the grader can call or pass
back but never compare. Each request carries the time left to its test; a call that takes
longer is interrupted with SIGALRM and answered "the test timed out".

**Nothing in this process is trusted.** The program runs here with all of Python: it can read and
rewrite this module, its frames and its memory, and write anything to descriptor 4. It gains
nothing by doing so: this process never sees a test or an expected value (only the arguments of
the calls the grader makes), never decides whether a test passed, and holds no secret. Whatever it
sends is read by the checker (:mod:`marft.envs._code_checker`, outside the sandbox) as the return
values of those calls, and compared there; see that module for the argument in full.
"""
import os
import signal
import sys

REQUESTS, REPLIES = 3, 4


def _load_codec():
    """``values.py`` from beside this file, without putting this folder on ``sys.path``."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "values.py")
    module = type(sys)("marft_values")
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)
    return module


values = _load_codec()


class TestTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise TestTimeout()


def describe(e: BaseException) -> str:
    """``Type: message`` for an exception of the program, without running much of its code."""
    if isinstance(e, TestTimeout):
        return "the test timed out"
    if isinstance(e, SystemExit):
        return "the program exited during the test"
    try:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except BaseException:  # noqa: BLE001 - an exception whose __str__ fails
        text = type(e).__name__
    return text[-400:]


def frames(fd: int):
    """The lines the grader writes, one request each, until it closes the pipe."""
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        yield line.decode("utf-8")


def send(text: str) -> None:
    data = (text + "\n").encode("utf-8")
    while data:
        data = data[os.write(REPLIES, data):]


def main() -> None:
    objects: list = []  # what the grader holds references to, by index

    def keep(obj):
        objects.append(obj)
        return len(objects) - 1, type(obj).__name__

    encoder = values.Encoder(keep)
    signal.signal(signal.SIGALRM, _alarm)
    ns = {"__name__": "solution"}
    load_error = None
    try:
        signal.setitimer(signal.ITIMER_REAL, float(sys.argv[1]))
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException as e:  # noqa: BLE001 - anything the program does is its failure
        signal.setitimer(signal.ITIMER_REAL, 0)
        load_error = ("the program exited while loading" if isinstance(e, SystemExit)
                      else "the program does not run: " + describe(e))
    for line in frames(REQUESTS):
        msg = values.loads(line, lambda i, name: objects[i])
        if msg["op"] == "end":
            break
        send(encoder.encode({"n": msg["n"], "e": load_error}) if load_error else answer(msg, ns, encoder))
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def answer(msg: dict, ns: dict, encoder) -> str:
    """The reply to one request, as text, within the time the request allows."""
    n = msg["n"]
    try:
        signal.setitimer(signal.ITIMER_REAL, max(float(msg["t"]), 0.001))
        try:
            value = serve(msg, ns)
        except BaseException as e:  # noqa: BLE001 - the program's exception, a timeout or an exit
            return encoder.encode({"n": n, "e": describe(e)})
        try:
            return encoder.encode({"n": n, "v": value})
        except (ValueError, TypeError) as e:  # too deep, too large, not data
            return encoder.encode({"n": n, "e": f"the value cannot be sent to the grader: {e}"})
    except BaseException:  # noqa: BLE001 - the alarm went off while describing or encoding
        return encoder.encode({"n": n, "e": "the test timed out"})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve(msg: dict, ns: dict):
    op = msg["op"]
    if op == "names":
        return {k: ns[k] for k in msg["names"] if k in ns}
    if op == "call":
        return msg["f"](*msg["a"], **msg["k"])
    if op == "get":
        return getattr(msg["o"], msg["name"])
    if op == "set":
        setattr(msg["o"], msg["name"], msg["v"])
        return None
    raise ValueError(f"unknown request {op!r}")


if __name__ == "__main__":
    main()
