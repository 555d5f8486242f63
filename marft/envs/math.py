"""Math word problems: GSM8K, MATH, MATH-500 or any file of their shape, graded with ``math-verify``.

``train_path``/``test_path`` each name a file, a JSON list of records (``.json``) or one record per
line (``.jsonl``), or a Hub data set, ``hf:REPO[:CONFIG[:SPLIT]]`` such as
``hf:openai/gsm8k:main:test``, read with ``datasets`` or from the local copies in ``MARFT_DATA_DIR``
(:mod:`marft.envs.sources`). Records are read in the Hub's shape or the original releases' (see
:func:`math_record`); other fields are ignored. Data is read once per source and process (the 32
environment instances of a rollout share one list).

Grading (:func:`grade_math`): the gold answer is parsed as if it were written ``\\boxed{gold}``, so
plain numbers ("72", "1,234") and LaTeX ("\\frac{1}{2}") both work; the reply is parsed by
``math_verify.parse`` (``\\boxed{}`` first, then the last expression it can read), and the two are
compared with ``math_verify.verify``. A known limit of math-verify: ratios such as "3:1" parse as the
number 3.

Timeouts: math-verify guards parsing and comparison (sympy can take forever on a reply such as
``\\boxed{9^{9^{9^9}}}``) with ``signal.alarm``, which only works in the main thread and raises
there otherwise. We pass a timeout of ``TIMEOUT_S`` seconds when grading runs in the main thread and
no timeout in any other thread. A rollout steps environments in worker threads (marft/run/rollout.py),
where ``rollout.env_timeout_s`` bounds a grading instead: past it the episode fails and the grading
is stopped. Note that the alarm also cancels any SIGALRM the caller has scheduled.
"""
from __future__ import annotations

import functools
import os
import random
import sys
import threading

from math_verify import parse, verify

from marft.envs import sources
from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.envs.dataset import hub_records
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


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed 5``) in ``text``,
    braces balanced; None if there is none. How MATH's worked solutions give their answer."""
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed", "\\fbox")]
    i, cmd = max(starts)
    if i < 0:
        return None
    rest = text[i + len(cmd):]
    if rest.startswith(" "):
        return rest[1:].split("$")[0].strip() or None
    depth = 0
    for k, ch in enumerate(rest if rest.startswith("{") else ""):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:k].strip() or None
    return None


def math_record(r: object) -> tuple[str | None, str | None]:
    """``(problem, gold answer)`` of a record in any of the shapes of the known data sets, None for
    what it lacks:

    - the problem: ``problem`` (MATH, MATH-500, the original GSM8K release), else ``question``
      (GSM8K on the Hub, ``openai/gsm8k``);
    - the answer: ``final_answer`` (the original releases' shape); else ``answer``: what follows
      ``####`` in a GSM8K worked solution (thousands separators dropped), or the whole of it
      (MATH-500); else the last ``\\boxed{}`` of ``solution`` (MATH on the Hub, e.g.
      ``DigitalLearningGmbH/MATH-lighteval``).
    """
    if not isinstance(r, dict):
        return None, None
    problem = r.get("problem") if isinstance(r.get("problem"), str) and r["problem"].strip() else r.get("question")
    problem = problem if isinstance(problem, str) and problem.strip() else None
    gold = r.get("final_answer")
    if gold is None or str(gold).strip() == "":
        gold = r.get("answer")
        if isinstance(gold, str) and "####" in gold:
            gold = sources.gsm8k_answer(gold)
    if (gold is None or str(gold).strip() == "") and isinstance(r.get("solution"), str):
        gold = last_boxed(r["solution"])
    return problem, (None if gold is None or str(gold).strip() == "" else str(gold))


def load_records(path: str, key: str = "") -> list[dict]:
    """Read and check a ``.json``/``.jsonl`` problem file or an ``hf:`` Hub reference; cached per
    source (and a file's modification time). ``key`` names the config key in messages.

    Returns records ``{"problem": str, "answer": str}``. Raises :class:`UserError` naming the file
    for a missing, empty or malformed file or a record without a problem or an answer.
    """
    ref = sources.parse_hub(path)
    if ref is not None:
        return sources.cached(ref, key, _FILES, lambda: _check(str(ref), hub_records(ref, key), published=True),
                              lambda files: _check(str(ref), [(f"{os.path.basename(f)} {where}", r) for f in files
                                                              for where, r in sources.read_json_records(f, "math data file")],
                                                   published=True))
    if not os.path.isfile(path):
        raise UserError(f"math data file {path!r} does not exist; set train_path/test_path to a .json or .jsonl file")
    stat = os.stat(path)
    cache = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    if cache not in _FILES:
        _FILES[cache] = _read(path)
    return _FILES[cache]


def _read(path: str) -> list[dict]:
    return _check(path, sources.read_json_records(path, "math data file"))


def _check(source: str, raw: list[tuple[str, object]], published: bool = False) -> list[dict]:
    """Records ``{"problem", "answer"}``; a UserError for a record without either. A published data
    set (``published``: an ``hf:`` reference, which the user cannot fix) leaves out the few records
    whose answer cannot be read instead (MATH's training set has 4 of 7,500), saying so once."""
    if not raw:
        raise UserError(f"math data file {source!r} has no records; give a file with at least one record")
    records, skipped = [], []
    for where, r in raw:
        problem, gold = math_record(r)
        if problem is None:
            raise UserError(f"{source}: {where} has no 'problem' or 'question' field (a non-empty string); fix the record")
        if gold is None and published and len(skipped) < len(raw) // 100:
            skipped.append(where)
            continue
        if gold is None:
            raise UserError(f"{source}: {where} has no 'final_answer' or 'answer' field; add the gold answer")
        records.append({"problem": problem, "answer": gold})
    if skipped:
        print(f"marft: warning: {source}: {len(skipped)} of {len(raw)} records have no gold answer that marft can "
              f"read ({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}); they are left out", file=sys.stderr)
    return records


class MathEnv(TurnBasedEnv):
    """A team solves one math problem per episode (GSM8K, MATH, MATH-500 or any file of that shape).

    ``train_path``/``test_path`` name the files (or ``hf:`` Hub data sets) of the two splits. If one
    is empty, that split uses the other's (e.g. only ``test_path`` for evaluation-only runs). ``reset`` with
    ``options={"split": s, "index": i}`` gives record ``i`` of split ``s``; without an index the
    record is drawn with the reset seed. Reward and success follow :class:`TurnBasedEnv`.
    """

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1,
                 train_path: str = "", test_path: str = ""):
        super().__init__(agents, answering, horizon)
        if not train_path and not test_path:
            raise UserError("the math task needs a data file: set train_path and/or test_path (.json or .jsonl)")
        self.paths = {"train": train_path or test_path, "test": test_path or train_path}
        self.keys = {s: f"task.{s}_path" if p else f"task.{'test' if s == 'train' else 'train'}_path"
                     for s, p in (("train", train_path), ("test", test_path))}

    def _records(self, split: str) -> tuple[str, list[dict]]:
        if split not in self.paths:
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        path = self.paths[split]
        return path, load_records(path, self.keys[split])

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
