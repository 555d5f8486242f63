"""Math word problems from files shaped like GSM8K, MATH and MATH-500, graded with ``math-verify``.

A file is a JSON list of records (``.json``) or one record per line (``.jsonl``). A record has a
``problem`` (the text shown to the team) and its answer in ``final_answer`` (GSM8K, MATH train) or
``answer`` (MATH-500); other fields are ignored. Files are parsed once per path and process (the 32
environment instances of a rollout share one list).

Grading (:func:`grade_math`): the gold answer is parsed as if it were written ``\\boxed{gold}``, so
plain numbers ("72", "1,234") and LaTeX ("\\frac{1}{2}") both work; the reply is parsed by
``math_verify.parse`` (``\\boxed{}`` first, then the last expression it can read), and the two are
compared with ``math_verify.verify``. A known limit of math-verify: ratios such as "3:1" parse as the
number 3.

Timeouts: math-verify guards parsing and comparison (sympy can take forever on a reply such as
``\\boxed{9^{9^{9^9}}}``) with ``signal.alarm``, which only works in the main thread and raises
there otherwise. We pass a timeout of ``TIMEOUT_S`` seconds when grading runs in the main thread and
no timeout in any other thread. A rollout steps environments in worker threads (marft/rollout.py),
where ``rollout.env_timeout_s`` bounds a grading instead: past it the episode fails and the grading
is stopped. Note that the alarm also cancels any SIGALRM the caller has scheduled.
"""
from __future__ import annotations

import functools
import json
import os
import random
import threading

from math_verify import parse, verify

from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.errors import UserError

TIMEOUT_S = 2  # per parse and per comparison, main thread only (see the module docstring)

_FILES: dict[tuple, list[dict]] = {}  # (absolute path, mtime, size) -> records, shared by instances


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def _parse_gold(gold: str) -> list:
    text = gold if ("\\boxed" in gold or "$" in gold) else f"\\boxed{{{gold}}}"
    return parse(text, parsing_timeout=_timeout())


def grade_math(reply: str, gold: str) -> Grade:
    """Grade one reply against a gold answer string ("72", "1,234", "\\frac{1}{2}", ...).

    ``extracted`` is True when math-verify found any answer in the reply; ``answer`` is what it read.
    """
    pred = parse(reply or "", parsing_timeout=_timeout())
    if not pred:
        return Grade(False, False, None, "No final answer was found. Give the final answer in \\boxed{}.")
    answer = str(pred[-1])  # parse returns [sympy object, the matched string]
    correct = bool(verify(_parse_gold(str(gold)), pred, timeout_seconds=_timeout()))
    return Grade(correct, True, answer, "" if correct else f"The answer {answer} is wrong.")


def load_records(path: str) -> list[dict]:
    """Read and check a ``.json``/``.jsonl`` problem file; cached per path (and modification time).

    Returns records ``{"problem": str, "answer": str}``. Raises :class:`UserError` naming the file
    for a missing, empty or malformed file or a record without a problem or an answer.
    """
    if not os.path.isfile(path):
        raise UserError(f"math data file {path!r} does not exist; set train_path/test_path to a .json or .jsonl file")
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _FILES:
        _FILES[key] = _read(path)
    return _FILES[key]


def _read(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise UserError(f"math data file {path!r} is empty; give a file with at least one record")
    raw: list[tuple[str, object]] = []  # (where, record)
    if path.endswith(".jsonl"):
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    raw.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}: line {n} is not valid JSON ({e.msg}); fix or remove that line") from e
    elif path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); fix the file") from e
        if not isinstance(data, list):
            raise UserError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        raw = [(f"record {i}", r) for i, r in enumerate(data)]
    else:
        raise UserError(f"math data file {path!r} must end in .json (a list of records) or .jsonl (one per line)")
    if not raw:
        raise UserError(f"math data file {path!r} has no records; give a file with at least one record")
    records = []
    for where, r in raw:
        if not isinstance(r, dict) or not isinstance(r.get("problem"), str) or not r["problem"].strip():
            raise UserError(f"{path}: {where} has no 'problem' field (a non-empty string); fix the record")
        gold = r.get("final_answer", r.get("answer"))
        if gold is None or str(gold).strip() == "":
            raise UserError(f"{path}: {where} has no 'final_answer' or 'answer' field; add the gold answer")
        records.append({"problem": r["problem"], "answer": str(gold)})
    return records


class MathEnv(TurnBasedEnv):
    """A team solves one math problem per episode (GSM8K, MATH, MATH-500 or any file of that shape).

    ``train_path``/``test_path`` name the files of the two splits. If one is empty, that split uses
    the other's file (e.g. only ``test_path`` for evaluation-only runs). ``reset`` with
    ``options={"split": s, "index": i}`` gives record ``i`` of split ``s``; without an index the
    record is drawn with the reset seed. Reward and success follow :class:`TurnBasedEnv`.
    """

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1,
                 train_path: str = "", test_path: str = ""):
        super().__init__(agents, answering, horizon)
        if not train_path and not test_path:
            raise UserError("the math task needs a data file: set train_path and/or test_path (.json or .jsonl)")
        self.paths = {"train": train_path or test_path, "test": test_path or train_path}

    def _records(self, split: str) -> tuple[str, list[dict]]:
        if split not in self.paths:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        path = self.paths[split]
        return path, load_records(path)

    def num_problems(self, split: str) -> int | None:
        """How many records the split's file holds."""
        return len(self._records(split)[1])

    def new_problem(self, rng: random.Random, split: str, index: int | None) -> Problem:
        path, records = self._records(split)
        if index is None:
            index = rng.randrange(len(records))
        elif not 0 <= index < len(records):
            raise UserError(f"problem index {index} is out of range: {path} has {len(records)} problems")
        r = records[index]
        return Problem(prompt=r["problem"], answer=r["answer"], meta={"split": split, "index": index})

    def grade(self, problem: Problem, reply: str) -> Grade:
        return grade_math(reply, problem.answer)
