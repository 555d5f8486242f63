"""Procedural reasoning tasks from ``reasoning-gym``: unlimited fresh problems, no files.

Every problem is identified by an integer *key* and generated as item 0 of
``reasoning_gym.create_dataset(name, size=1, seed=key, **options)``. We build a one-item dataset per
problem instead of one huge dataset because some datasets do work proportional to ``size`` when they
are built (gsm_symbolic draws a template index per item, acre builds every item); building a one-item
dataset takes well under a millisecond for most datasets (up to ~0.3 s for a few that load word
lists or puzzle files, e.g. arc_agi).

Train and test are disjoint seed spaces, by construction: train keys are odd, test keys even.
Almost every reasoning-gym dataset derives item ``idx`` from ``Random(seed + idx)``, so with
``idx = 0`` a problem is a function of its key alone and a test problem is never generated from a
seed a training episode can draw. (Two different keys can still give the same text when the task's
configuration admits only a few distinct problems, e.g. one-digit sums.)

- train: key = 2 * ((m + seed * 2**20) mod 2**31) + 1, m drawn from the reset rng (2**31 problems).
- test:  key = 2 * ((m + seed * 2**20) mod 2**31), m = the problem index; problem ``index`` of the
  test split is fixed for a given ``seed`` option (an index also fixes a train problem).

Grading: :func:`extract_answer` reads the answer from the reply and the dataset's own
``score_answer(answer, entry)`` scores it. Only a score of 1.0 counts as correct; some datasets give
partial credit (e.g. 0.01 for a wrong number, or len(gold)/len(answer) when the gold is a substring of
the answer), which is not a right answer.
"""
from __future__ import annotations

import dataclasses
import difflib
import random
import re

import reasoning_gym
from reasoning_gym.factory import DATASETS

from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.errors import UserError

SEED_SPACE = 2**31  # keys stay below 2**32: some generators seed numpy, which needs that


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces close (nested braces allowed)."""
    found = None
    for m in re.finditer(r"\\boxed\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end():i - 1]
    return found


def _clean(answer: str) -> str | None:
    answer = answer.strip().strip("*").strip()
    if len(answer) >= 2 and answer[0] == answer[-1] == "$":
        answer = answer[1:-1].strip()
    answer = answer.rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", answer):  # 1,234 -> 1234
        answer = answer.replace(",", "")
    return answer or None


def extract_answer(reply: str) -> str | None:
    """The answer in a reply: the last ``\\boxed{...}``, else the last ``<answer>...</answer>``,
    else the rest of the line after the last "answer is" / "Answer:", else the last number.
    None when there is none."""
    reply = reply or ""
    candidates = [_last_boxed(reply)]
    tags = re.findall(r"<answer>(.*?)</answer>", reply, flags=re.S | re.I)
    candidates.append(tags[-1] if tags else None)
    phrases = re.findall(r"answer(?:\s+is|\s*:)\**\s*:?\s*([^\n]+)", reply, flags=re.I)
    candidates.append(phrases[-1] if phrases else None)
    numbers = re.findall(r"(?:(?<![\d)])-)?\d+(?:,\d{3})*(?:\.\d+)?", reply)
    candidates.append(numbers[-1] if numbers else None)
    for c in candidates:
        if c is not None and _clean(c) is not None:
            return _clean(c)
    return None


def _unknown_name(name: str) -> UserError:
    names = sorted(DATASETS)
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    some = ", ".join(n for n in ("basic_arithmetic", "chain_sum", "gsm_symbolic", "countdown") if n in DATASETS)
    return UserError(f"unknown reasoning_gym dataset {name!r}; {hint}e.g. {some} ({len(names)} in all, "
                     "see reasoning_gym.factory.DATASETS)")


class ReasoningGymEnv(TurnBasedEnv):
    """A team solves one procedurally generated ``reasoning-gym`` problem per episode.

    ``name`` is the dataset (basic_arithmetic, chain_sum, gsm_symbolic, countdown, ...), ``seed``
    chooses the test set and shifts the training stream, ``options`` go to the dataset's config
    (e.g. ``min_terms=2, max_terms=2, max_digits=2``). See the module docstring for splits.
    """

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1,
                 name: str = "basic_arithmetic", seed: int = 0, **options):
        super().__init__(agents, answering, horizon)
        if name not in DATASETS:
            raise _unknown_name(name)
        if "size" in options:
            raise UserError("reasoning_gym option 'size' is not used: problems are unlimited; remove it")
        self.name, self.seed, self.options = name, int(seed), dict(options)
        self._scorer = self._dataset(1)  # validates the options now; scores every answer later

    def _dataset(self, key: int):
        try:
            return reasoning_gym.create_dataset(self.name, size=1, seed=key, **self.options)
        except (TypeError, ValueError, AssertionError) as e:
            fields = [f.name for f in dataclasses.fields(DATASETS[self.name][1]) if f.name not in ("seed", "size")]
            raise UserError(f"bad options {self.options} for reasoning_gym dataset {self.name!r}: {e} "
                            f"(its options: {', '.join(fields)})") from e

    def num_problems(self, split: str) -> int | None:
        """None: procedural tasks have no fixed number of problems."""
        return None

    def new_problem(self, rng: random.Random, split: str, index: int | None) -> Problem:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        if index is not None and index < 0:
            raise ValueError(f"problem index must be >= 0, got {index}")
        m = index if index is not None else rng.randrange(SEED_SPACE)
        key = 2 * ((m + self.seed * 2**20) % SEED_SPACE) + (split == "train")  # odd train, even test
        entry = self._dataset(key)[0]
        return Problem(prompt=entry["question"], answer=entry, meta={"split": split, "index": index, "key": key})

    def grade(self, problem: Problem, reply: str) -> Grade:
        answer = extract_answer(reply)
        if answer is None:
            return Grade(False, False, None, "No final answer was found. Give the final answer in \\boxed{}.")
        score = self._scorer.score_answer(answer, problem.answer)
        correct = score >= 1.0
        return Grade(correct, True, answer, "" if correct else f"The answer {answer} is wrong.")

    def answer_instruction(self) -> str:
        return "Put your final answer alone in \\boxed{}."
