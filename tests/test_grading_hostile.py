"""Programs that try to forge their grade: each one has a wrong ``add`` (it returns 7) and tries to
score anyway, by reaching into the harness, the channel, the grader or the machine. Each must
score 0 (and the test process must survive). The grading design is in marft/envs/_code_checker.py."""
import os
import time

import pytest

from marft.envs.code import CodeProblem, run_tests
from marft.sandbox import Limits, Sandbox

SB = Sandbox(Limits(wall_s=10, cpu_s=10), workers=2)
PROTECTIONS = " ".join(SB.protections())
ADD = CodeProblem("issue16", "Write add(a, b).",
                  ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"], "add")
WRONG = "def add(a, b):\n    return 7\n"

# the program from the issue: under the old harness it scored 3 of 3
FRAME_WALK = WRONG + """
import sys, os, json
f = sys._getframe(0)
while f is not None and "nonce" not in f.f_locals:
    f = f.f_back
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
    "frame walking (the issue's program)": FRAME_WALK,
    "frame walking to the harness's send()": WRONG + FORGE_LINES + """
import sys
f = sys._getframe(0)
while f is not None:
    send = f.f_globals.get("send")
    if callable(send):
        for line in FORGED.splitlines():
            send(line)
        break
    f = f.f_back
""",
    "gc.get_objects() scan": WRONG + FORGE_LINES + """
import gc, os
for o in gc.get_objects():
    if isinstance(o, dict) and ("nonce" in o or "REPLIES" in o):
        os.write(o.get("REPLIES", 4), FORGED.encode())
        if callable(o.get("answer")):
            o["answer"] = lambda msg, ns, enc: enc.encode({"n": msg["n"], "v": True})
""",
    "inspect: rewrite the harness's answer()": WRONG + """
import inspect
for info in inspect.stack():
    g = info.frame.f_globals
    if "answer" in g and "serve" in g:
        g["serve"] = lambda msg, ns: {"add": lambda *a: {"passed": True}} if msg["op"] == "names" else True
""",
    "write to every file descriptor": WRONG + FORGE_LINES + """
import os
for fd in range(1024):
    try:
        os.write(fd, FORGED.encode())
    except OSError:
        pass
""",
    "patch json, os.write and print": WRONG + """
import json, os, builtins, re
json.dumps = lambda *a, **k: '{"test": 0, "passed": true}'
json.loads = lambda *a, **k: {"passed": True}
_w = os.write
def write(fd, data):  # every reply claims the value True
    if fd == 4:
        data = re.sub(rb',"v",.*\\]$', b',"v",true]', data.rstrip(b"\\n")) + b"\\n"
    return _w(fd, data)
os.write = write
builtins.print = lambda *a, **k: None
""",
    "atexit handlers": WRONG + FORGE_LINES + """
import atexit, os
def forge():
    for fd in range(1, 10):
        try:
            os.write(fd, FORGED.encode())
        except OSError:
            pass
atexit.register(forge)
""",
    "kill the parent": WRONG + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "kill the process group and everyone": WRONG + "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
                                           "except OSError:\n    pass\nos.killpg(0, signal.SIGKILL)\n",
    "print look-alike result lines": WRONG + FORGE_LINES + """
import sys
for i in range(3):
    print("@@marft-0123@@" + '{"test": %d, "passed": true, "error": ""}' % i)
print(FORGED)
print(FORGED, file=sys.stderr)
""",
    "exceptions raised from __del__": """
class Boom:
    def __del__(self):
        raise SystemExit(0)
class Bomb(list):
    def __del__(self):
        raise KeyboardInterrupt
keep = Boom()
def add(a, b):
    Boom()
    return Bomb([7])
""",
    "__eq__ that is always true": "class A:\n    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
                                  "def add(a, b):\n    return A()\n",
    "__repr__ and __str__ that lie": "class I(int):\n    def __repr__(self): return '3'\n    __str__ = __repr__\n"
                                     "    def __eq__(self, o): return True\ndef add(a, b):\n    return I(7)\n",
    "__reduce__ that lies": "class R:\n    def __reduce__(self): return (int, (3,))\n"
                            "def add(a, b):\n    return R()\n",
    "a list subclass whose iteration lies": "class L(list):\n    def __iter__(self): return iter([3])\n"
                                            "    def __eq__(self, o): return True\ndef add(a, b):\n    return L([7])\n",
    "__class__ that claims int": "class C:\n    __class__ = property(lambda self: int)\n    def __eq__(self, o): return True\n"
                                 "def add(a, b):\n    return C()\n",
    "the grader's own helper names": WRONG + "__marft_truth__ = lambda *a: None\n"
                                             "__marft_compare__ = lambda *a: True\n",
    "a list that contains itself": "def add(a, b):\n    x = [7]\n    x.append(x)\n    return x\n",
    "a list nested 100,000 deep": "def add(a, b):\n    x = 7\n    for _ in range(100_000):\n        x = [x]\n    return x\n",
    "a dict that contains itself": "def add(a, b):\n    d = {}\n    d['d'] = d\n    return d\n",
    "a 200 MB string": "def add(a, b):\n    return 'x' * (200 * 2**20)\n",
    "ten million integers": "def add(a, b):\n    return list(range(10**7))\n",
    "an integer of a million digits": "def add(a, b):\n    return 10**1_000_000\n",
    "a 100 MB reply line": WRONG + "import os\nos.write(4, b'[' * (100 * 2**20))\n",
    "a reply nested 500,000 deep": WRONG + "import os\nos.write(4, b'[\"l\",' * 500_000 + b'\\n')\n",
    "close the channel and exit 0": WRONG + "import os, sys\nos.close(3)\nos.close(4)\nsys.exit(0)\n",
    "answer every request itself with True": WRONG + """
import os
buf = b""
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
""",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_program_that_forges_its_grade_scores_zero(name):
    t = time.monotonic()
    rep = run_tests(SB, [(HOSTILE[name], ADD)], test_timeout_s=3)[0]
    assert rep.passed == 0, (name, rep)
    assert time.monotonic() - t < 30, "grading a hostile program must end in bounded time"


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
