"""Programs that try to forge their grade: each one has a wrong ``add`` (it returns 7) and tries to
score anyway, by reaching into the harness, the channel, the grader or the machine. Each must
score 0 (and the test process must survive), must show that its attack ran (a mark on its stderr),
and each test's recorded failure must be the honest one (the checker's comparison of what it got).
The grading design is in marft/envs/_code_checker.py."""
import os
import re
import time

import pytest

from marft.envs.code import CodeProblem, run_tests
from marft.envs.sandbox import Limits, Sandbox

SB = Sandbox(Limits(wall_s=10, cpu_s=10), workers=2)
PROTECTIONS = " ".join(SB.protections())
ADD = CodeProblem("issue16", "Write add(a, b).",
                  ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"], "add")
WRONG = "def add(a, b):\n    return 7\n"

# Each attack leaves a mark on the program's stderr, "ATTACK: what it did", where the test can read it
# (the sandbox's Result, which the grader ignores): proof that the attack ran and how far it got,
# since a program whose attack never ran would score 0 as well. A mark names what the attack
# reached (the harness's send(), its serve(), descriptor 4...), so an attack that stops reaching
# its target, because the harness changed, fails the test rather than passing unnoticed.
MARK = "import os as _os\n_write = _os.write\ndef mark(text):\n    _write(2, ('ATTACK: ' + text + '\\n').encode())\n"

# the program from the issue: under the old harness it scored 3 of 3
FRAME_WALK = WRONG + """
import sys, os, json
f, walked = sys._getframe(0), 0
while f is not None and "nonce" not in f.f_locals:
    f, walked = f.f_back, walked + 1
if f is not None:
    for i in range(3):
        line = f.f_locals["nonce"] + json.dumps({"test": i, "passed": True, "error": ""}) + "\\n"
        os.write(f.f_locals["report_fd"], line.encode())
"""

# replies that look like the protocol's but claim a verdict, a table of names or a pass
FORGED = ['["d","n",1,"v",["d","add",["r",0,"function"]]]', '["d","n",2,"passed",true]',
          '["d","n",2,"v",true]', '["d","n",3,"v",["d","passed",true]]', '{"test": 0, "passed": true}']
FORGE_LINES = "FORGED = " + repr("\n".join(FORGED) + "\n") + "\n"

HOSTILE = {
    "frame walking (the issue's program)": MARK + FRAME_WALK + "mark(f'walked {walked} frames; a nonce: {f is not None}')\n",
    "frame walking to the harness's send()": MARK + WRONG + FORGE_LINES + """
import sys
f = sys._getframe(0)
while f is not None:
    send = f.f_globals.get("send")
    if callable(send):
        # marked first: the grader may stop reading (a reply out of sequence) before the last line,
        # and the send that follows then fails with a broken pipe
        mark(f"sending {len(FORGED.splitlines())} forged replies through the harness's send()")
        try:
            for line in FORGED.splitlines():
                send(line)
        except BrokenPipeError:
            mark("the grader stopped reading")
        break
    f = f.f_back
""",
    "gc.get_objects() scan": MARK + WRONG + FORGE_LINES + """
import gc, os
for o in gc.get_objects():
    if isinstance(o, dict) and ("nonce" in o or "REPLIES" in o):
        os.write(o.get("REPLIES", 4), FORGED.encode())
        mark("found the harness's globals in gc; wrote the forged replies")
        if callable(o.get("answer")):
            o["answer"] = lambda msg, ns, enc: enc.encode({"n": msg["n"], "v": True})
            mark("replaced the harness's answer()")
""",
    "inspect: rewrite the harness's answer()": MARK + WRONG + """
import inspect
for info in inspect.stack():
    g = info.frame.f_globals
    if "answer" in g and "serve" in g:
        g["serve"] = lambda msg, ns: {"add": lambda *a: {"passed": True}} if msg["op"] == "names" else True
        mark("replaced the harness's serve()")
        break
""",
    "write to every file descriptor": MARK + WRONG + FORGE_LINES + """
import os
wrote = []
for fd in range(1024):
    try:
        os.write(fd, FORGED.encode())
        wrote.append(fd)
    except OSError:
        pass
mark(f"wrote the forged replies to descriptors {wrote}")
""",
    "patch json, os.write and print": MARK + WRONG + """
import json, os, builtins, re
json.dumps = lambda *a, **k: '{"test": 0, "passed": true}'
json.loads = lambda *a, **k: {"passed": True}
_w = os.write
def write(fd, data):  # every reply claims the value True
    if fd == 4:
        data = re.sub(rb',"v",.*\\]$', b',"v",true]', data.rstrip(b"\\n")) + b"\\n"
        mark("rewrote a reply to claim True")
    return _w(fd, data)
os.write = write
builtins.print = lambda *a, **k: None
""",
    "atexit handlers": MARK + WRONG + FORGE_LINES + """
import atexit, os
def forge():
    mark("the atexit handler ran")
    for fd in range(1, 10):
        try:
            os.write(fd, FORGED.encode())
        except OSError:
            pass
atexit.register(forge)
mark("registered an atexit handler")
""",
    "a stdout whose flush() forges at the end": MARK + WRONG + FORGE_LINES + """
import os, sys
class Forger:
    def write(self, text):
        return len(text)
    def flush(self):
        mark("flush() ran; forging")
        os.write(4, FORGED.encode())
sys.stdout = sys.stderr = Forger()
""",
    "kill the parent": MARK + WRONG + "import os, signal\nppid = os.getppid()\nmark(f'sending SIGKILL to the parent ({ppid})')\n"
                       "os.kill(ppid, signal.SIGKILL)\nmark('still running')\n",
    "kill the process group and everyone": MARK + WRONG + "import os, signal\nmark('sending SIGKILL to every process')\ntry:\n"
                                           "    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"
                                           "mark('sending SIGKILL to its process group')\nos.killpg(0, signal.SIGKILL)\n"
                                           "mark('still running')\n",
    "print look-alike result lines": MARK + WRONG + FORGE_LINES + """
import sys
for i in range(3):
    print("@@marft-0123@@" + '{"test": %d, "passed": true, "error": ""}' % i)
print(FORGED)
print(FORGED, file=sys.stderr)
mark("printed the look-alike lines")
""",
    "exceptions raised from __del__": MARK + """
class Boom:
    def __del__(self):
        mark("Boom.__del__ raises SystemExit")
        raise SystemExit(0)
class Bomb(list):
    def __del__(self):
        mark("Bomb.__del__ raises KeyboardInterrupt")
        raise KeyboardInterrupt
keep = Boom()
def add(a, b):
    Boom()
    return Bomb([7])
""",
    "__eq__ that is always true": MARK + "class A:\n    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
                                  "def add(a, b):\n    mark('add returns an A')\n    return A()\n",
    "__repr__ and __str__ that lie": MARK + "class I(int):\n    def __repr__(self): return '3'\n    __str__ = __repr__\n"
                                     "    def __eq__(self, o): return True\n"
                                     "def add(a, b):\n    mark('add returns an I')\n    return I(7)\n",
    "__reduce__ that lies": MARK + "class R:\n    def __reduce__(self): return (int, (3,))\n"
                            "def add(a, b):\n    mark('add returns an R')\n    return R()\n",
    "a list subclass whose iteration lies": MARK + "class L(list):\n    def __iter__(self): return iter([3])\n"
                                            "    def __eq__(self, o): return True\n"
                                            "def add(a, b):\n    mark('add returns an L')\n    return L([7])\n",
    "__class__ that claims int": MARK + "class C:\n    __class__ = property(lambda self: int)\n    def __eq__(self, o): return True\n"
                                 "def add(a, b):\n    mark('add returns a C')\n    return C()\n",
    "the grader's own helper names": MARK + WRONG + "__marft_truth__ = lambda *a: None\n"
                                                    "__marft_compare__ = lambda *a: True\nmark('defined the helpers')\n",
    "a list that contains itself": MARK + "def add(a, b):\n    x = [7]\n    x.append(x)\n    mark('add returns the list')\n    return x\n",
    "a list nested 100,000 deep": MARK + "def add(a, b):\n    x = 7\n    for _ in range(100_000):\n        x = [x]\n"
                                  "    mark('add returns the list')\n    return x\n",
    "a dict that contains itself": MARK + "def add(a, b):\n    d = {}\n    d['d'] = d\n    mark('add returns the dict')\n    return d\n",
    "a 200 MB string": MARK + "def add(a, b):\n    x = 'x' * (200 * 2**20)\n    mark(f'add returns {len(x)} characters')\n    return x\n",
    "ten million integers": MARK + "def add(a, b):\n    x = list(range(10**7))\n    mark(f'add returns {len(x)} integers')\n    return x\n",
    "an integer of a million digits": MARK + "def add(a, b):\n    mark('add returns 10**1000000')\n    return 10**1_000_000\n",
    "a 100 MB reply line": MARK + WRONG + "import os\nmark('writing a 104857600-byte reply')\n"
                                          "mark(f'wrote {os.write(4, b\"[\" * (100 * 2**20))} bytes')\n",
    "a reply nested 500,000 deep": MARK + WRONG + "import os\nos.write(4, b'[\"l\",' * 500_000 + b'\\n')\n"
                                                  "mark('wrote a reply nested 500000 deep')\n",
    "close the channel and exit 0": MARK + WRONG + "import os, sys\nos.close(3)\nos.close(4)\nmark('closed the channel')\nsys.exit(0)\n",
    "answer every request itself with True": MARK + WRONG + """
import os
buf, answered = b"", 0
while True:
    chunk = os.read(3, 65536)
    if not chunk:
        break
    buf += chunk
    while b"\\n" in buf:
        line, buf = buf.split(b"\\n", 1)
        n = line.split(b'"n",')[1].split(b",")[0].rstrip(b"]")
        os.write(4, b'["d","n",' + n + b',"v",["d","add",["r",0,"f"]]]\\n' if b"names" in line
                 else b'["d","n",' + n + b',"v",true]\\n')
        answered += 1
        mark(f"answered request {answered} itself")
""",
}


def each(*texts):
    """The expected error of each of ADD's three tests: one text for all, or one per test with
    {call} and {expected} filled in."""
    calls = [("add(1, 2)", 3), ("add(2, 2)", 4), ("add(0, 0)", 0)]
    return [t.format(call=c, expected=e) for t, (c, e) in zip(texts * 3 if len(texts) == 1 else texts, calls)]


def compared(left):
    """The honest comparison: the test's own assert, on the value the checker received."""
    return each("AssertionError: {call} == {expected} (the left side is %s)" % left)


BROKE = "the program broke the grading protocol ({})".format
NOT_DATA = ("{call} == {expected}: the program gave a value of type '%s', which is not a value the grader can compare or "
            "inspect (values must be built-in data: numbers, strings, lists, tuples, dicts, sets, ...)")
CANNOT_SEND = "the value cannot be sent to the grader: the value {}".format

# name: (marks the attack must leave, in this order, as regular expressions (others may come between);
#        the error of each test)
EXPECTED = {
    "frame walking (the issue's program)": (["walked [2-9] frames; a nonce: False"], compared(7)),
    # the forged names table is taken as the reply to "names"; the checker calls add (reference 0,
    # which the harness never gave out), reads the next forged line as its value (None, compared),
    # and the one after, out of sequence, ends the grading
    "frame walking to the harness's send()": (["sending 5 forged replies through the harness's send"],
                                              [*compared(None)[:1], BROKE("a reply out of sequence"), BROKE("a reply out of sequence")]),
    "gc.get_objects() scan": (["found the harness's globals in gc; wrote the forged replies", "replaced the harness's answer"],
                              [*compared(None)[:1], BROKE("a reply out of sequence"), BROKE("a reply out of sequence")]),
    "inspect: rewrite the harness's answer()": (["replaced the harness's serve"], compared(True)),  # its True is compared
    "write to every file descriptor": ([r"wrote the forged replies to descriptors \[1, 2, 4\]"],
                                       [*compared(None)[:1], BROKE("a reply out of sequence"), BROKE("a reply out of sequence")]),
    "patch json, os.write and print": (["rewrote a reply to claim True"], each(BROKE("the names are not a table"))),
    # the harness ends with os._exit: the handler never runs (and would write after the last verdict)
    "atexit handlers": (["registered an atexit handler"], compared(7)),
    "a stdout whose flush() forges at the end": (["flush\\(\\) ran; forging"], compared(7)),
    "kill the parent": (["sending SIGKILL to the parent", "still running"], compared(7)),
    "kill the process group and everyone": (["sending SIGKILL to every process", "sending SIGKILL to its process group",
                                             "still running"], compared(7)),
    "print look-alike result lines": (["printed the look-alike lines"], compared(7)),
    "exceptions raised from __del__": (["Bomb.__del__ raises KeyboardInterrupt"] * 3, compared([7])),
    "__eq__ that is always true": (["add returns an A"] * 3, each(NOT_DATA % "A")),
    "__repr__ and __str__ that lie": (["add returns an I"] * 3, compared(7)),  # read as the int it holds
    "__reduce__ that lies": (["add returns an R"] * 3, each(NOT_DATA % "R")),
    "a list subclass whose iteration lies": (["add returns an L"] * 3, compared([7])),
    "__class__ that claims int": (["add returns a C"] * 3, each(NOT_DATA % "C")),
    "the grader's own helper names": (["defined the helpers"], compared(7)),
    "a list that contains itself": (["add returns the list"] * 3, each(CANNOT_SEND("is nested more than 100 levels deep"))),
    "a list nested 100,000 deep": (["add returns the list"] * 3, each(CANNOT_SEND("is nested more than 100 levels deep"))),
    "a dict that contains itself": (["add returns the dict"] * 3, each(CANNOT_SEND("is nested more than 100 levels deep"))),
    "a 200 MB string": (["add returns 209715200 characters"] * 3, each(CANNOT_SEND("takes more than 4 MiB as data"))),
    "ten million integers": (["add returns 10000000 integers"] * 3, each(CANNOT_SEND("holds more than 200000 items"))),
    "an integer of a million digits": (["add returns 10\\*\\*1000000"] * 3,
                                       each(CANNOT_SEND("holds an integer of more than 4300 digits"))),
    "a 100 MB reply line": (["writing a 104857600-byte reply"], each(BROKE("a reply longer than the limit"))),
    "a reply nested 500,000 deep": (["wrote a reply nested 500000 deep"], each(BROKE("the frame is nested too deeply"))),
    "close the channel and exit 0": (["closed the channel"],
                                     each("the program stopped before this test (OSError: [Errno 9] Bad file descriptor)")),
    "answer every request itself with True": ([f"answered request {i} itself" for i in (1, 2, 3, 4)], compared(True)),
}
# Where two true reports race: the gc scan's harness kept no object, so the call of test 1 (to the
# forged reference 0) ends the program; test 2's request then either meets the forged reply already
# in the pipe (out of sequence) or, when the program ended first (a busy machine), the closed pipe.
ENDED_FIRST = "the program stopped before this test (ValueError: a value in the frame cannot be built (IndexError))"
ALSO = {"gc.get_objects() scan": [*compared(None)[:1], ENDED_FIRST, ENDED_FIRST]}
KILLERS = ("kill the parent", "kill the process group and everyone")


@pytest.fixture
def sandbox_results(monkeypatch):
    """The sandbox's result of each program graded (its stdout and stderr), which the grader ignores."""
    results = []
    run_many = SB.run_many
    monkeypatch.setattr(SB, "run_many", lambda jobs: results.extend(run_many(jobs)) or results[-len(jobs):])
    return results


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_program_that_forges_its_grade_scores_zero(name, sandbox_results):
    """Each attack runs (its marks), gets nowhere (0 of 3), and each test's recorded failure is the
    checker's own comparison of the values it received, or the named reason it received none."""
    t = time.monotonic()
    rep = run_tests(SB, [(HOSTILE[name], ADD)], test_timeout_s=3)[0]
    assert rep.passed == 0, (name, rep)
    assert time.monotonic() - t < 30, "grading a hostile program must end in bounded time"
    marks, errors = EXPECTED[name]
    if name in KILLERS and "pid namespace" not in PROTECTIONS:
        return  # without a PID namespace the kill reaches the launcher, and with it the marks
    left = iter([line[len("ATTACK: "):] for line in sandbox_results[0].stderr.splitlines() if line.startswith("ATTACK: ")])
    assert all(any(re.match(m, x) for x in left) for m in marks), (name, sandbox_results[0].stderr[-2000:])
    assert rep.errors in (errors, ALSO.get(name)), (name, rep.errors)
    if name == "print look-alike result lines":  # printed where the grader does not look
        assert sandbox_results[0].stdout.startswith("@@marft-0123@@" + '{"test": 0, "passed": true')


def test_the_right_program_still_passes_and_the_runner_survives():
    reps = run_tests(SB, [(HOSTILE["kill the parent"], ADD), ("def add(a, b):\n    return a + b\n", ADD)])
    assert [r.passed for r in reps] == [0, 3]
    os.kill(os.getpid(), 0)  # we are alive


def test_values_that_cannot_be_sent_fail_with_the_reason():
    names = ("a list that contains itself", "a 200 MB string", "ten million integers",
             "an integer of a million digits", "__eq__ that is always true")
    reps = run_tests(SB, [(HOSTILE[name], ADD) for name in names], test_timeout_s=3)
    errors = {name: r.errors[0] for name, r in zip(names, reps)}
    assert "nested more than 100 levels" in errors["a list that contains itself"]
    assert "MiB" in errors["a 200 MB string"] and "200000 items" in errors["ten million integers"]
    assert "4300 digits" in errors["an integer of a million digits"]
    assert "not a value the grader can compare" in errors["__eq__ that is always true"]
    gen = run_tests(SB, [("def add(a, b):\n    return (x for x in [a + b])\n", ADD)])[0]
    assert gen.passed == 0 and "of type 'generator', which is not a value" in gen.errors[0]


def test_values_that_make_the_test_code_run_away_fail_cleanly():
    """The test code runs in the checker on values the program chose: a loop that never ends hits
    the checker's own timer, a huge allocation its memory limit, and a computation stuck in C the
    trainer's deadline; each fails its test and nothing else."""
    cases = [("for _ in range(add(1, 2)):\n    pass", 10**18), ("assert len([0] * add(1, 2)) == 3", 10**10),
             ("assert sum(range(add(1, 2))) == 3", 10**18)]  # the last one loops in C, deaf to signals
    jobs = [(f"def add(a, b):\n    return {n}\n", CodeProblem("runaway", "", [test], "add")) for test, n in cases]
    t = time.monotonic()
    reps = run_tests(Sandbox(Limits(wall_s=2, cpu_s=2), workers=3), jobs, test_timeout_s=0.5)
    assert [r.passed for r in reps] == [0, 0, 0] and time.monotonic() - t < 20
    assert reps[0].errors == ["the test timed out"] and "MemoryError" in reps[1].errors[0], reps
    assert "could not check this test (checking it took too long)" in reps[2].errors[0], reps


def test_forged_replies_buy_nothing_a_lookup_table_would_not():
    """The honest limit of the guarantee: a program that writes the right values ahead of the
    grader's requests passes exactly like one that returns them from a table. It must know them
    (MBPP shows its tests in the prompt; the expected values never enter the sandbox)."""
    n = {"names": 1, "calls": (2, 3, 4)}
    ahead = WRONG + "import os\nos.write(4, b'" + "".join(
        [f'["d","n",{n["names"]},"v",["d","add",["r",0,"f"]]]\\n'] +
        [f'["d","n",{k},"v",{v}]\\n' for k, v in zip(n["calls"], (3, 4, 0))]) + "')\n"
    table = "def add(a, b):\n    return {(1, 2): 3, (2, 2): 4, (0, 0): 0}[a, b]\n"
    assert [r.passed for r in run_tests(SB, [(ahead, ADD), (table, ADD)])] == [3, 3]
    wrong_ahead = ahead.replace(',"v",3]', ',"v",7]')
    assert run_tests(SB, [(wrong_ahead, ADD)])[0].passed == 2  # the forged 7 is compared like a returned 7


def test_check_functions_run_outside_the_sandbox():
    """HumanEval's shape: ``check(candidate)`` with a loop over random inputs and a helper from the
    prompt. The loop, the helper and every assert run in the checker; the program only answers calls."""
    stub = "def double(x):\n    return 2 * x\n\ndef half(y):\n    \"\"\"Undo double.\"\"\"\n"
    test = ("import random\n\ndef check(candidate):\n    for _ in range(50):\n        x = random.randint(-1000, 1000)\n"
            "        assert candidate(double(x)) == x\n\ncheck(half)\n")
    p = CodeProblem("he", "", [test], "half", stub=stub)
    right = stub + "    return y // 2\n"
    helper_lie = "def double(x):\n    return 0\n\ndef half(y):\n    return 0\n"  # redefines the prompt's helper
    echo = stub + "    return y\n"
    assert [r.passed for r in run_tests(SB, [(right, p), (helper_lie, p), (echo, p), (FRAME_WALK, p)])] == [1, 0, 0, 0]


def test_the_program_cannot_reach_the_checker_process():
    if "landlock" not in PROTECTIONS or "pid namespace" not in PROTECTIONS:
        pytest.skip(f"this machine's sandbox lacks Landlock or a PID namespace ({PROTECTIONS})")
    probe = WRONG + """
import os, signal
reached = []
for pid in os.listdir("/proc"):
    try:
        if b"_code_checker" not in open(f"/proc/{pid}/cmdline", "rb").read():
            continue
    except OSError:
        continue
    for what in ("mem", "fd/0", "fd/1", "fd/3", "fd/4"):
        try:
            os.close(os.open(f"/proc/{pid}/{what}", os.O_WRONLY))
            reached.append(what)
        except OSError:
            pass
    try:
        os.kill(int(pid), signal.SIGKILL)
        reached.append("kill")
    except OSError:
        pass
if reached:
    raise SystemExit("reached the checker: " + ", ".join(reached))
"""
    rep = run_tests(SB, [(probe, ADD)], test_timeout_s=3)[0]
    assert rep.passed == 0 and all("left side is 7" in e for e in rep.errors), rep
