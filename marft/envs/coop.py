"""Cooperative tasks: the problem is split between the agents, so no agent can solve it alone.

Each agent's observation (Flex-MG's per-agent observation, ``observe(agent)``) holds only its own
part; the team layer adds the messages of the agents it sees. The centralised critic's state
(``state()``) holds every part. Agents are identified by their place in the acting order, so any
team of the right size plays: the first ``n - 1`` agents hold parts and speak, the last agent
holds its own part and answers (``answering`` agents are graded; make only the last one answer).
An environment built for a part of the team (``team`` names the whole; ``marft eval`` with
``eval.without``) still deals every agent's part and grades the whole team's answer, so the agents
left in play without the others' parts: that is each agent alone.

- ``sum`` (one fact per agent, the same kind of role): every agent holds a number of some item
  (``"You hold 3 shells."``); the last agent must answer the team's total. Knowing only its own
  number, an agent's best guess is right with chance ``1 / (max_value - min_value + 1)`` for a duo
  and less for longer chains.
- ``lookup`` (roles that differ in kind): the first ``n - 1`` agents each hold part of a table of
  code words and their numbers and must pass it on; the last agent holds one code word and must
  answer its number, which only the table says. Alone, the last agent is right with chance
  ``1 / (max_value - min_value + 1)``; the holders never see which word is asked.

Speaking agents are told exactly what to say (``Reply with one sentence: "I hold 3 shells."``):
the 135M model that marft embeds does not discover on its own that it should state its number. In a
probe before this module (a duo adding two one-digit numbers, the main job's settings, 30
iterations), a speaker only asked to tell its number rarely stated it, and held-out accuracy stayed
at chance (6.2% untrained, 7.0% after training); with the sentence prescribed (numbers 0-4) it rose
from 9.4% to 96.1%, while the trained solver alone stayed at chance (20.3%). The foothold is the
prompt, not a tiny problem space.

Splits are disjoint by vocabulary: the held-out problems use item words (sum) or code words (lookup)
that no training problem uses (the last ``test_share`` of each list), so no held-out text was ever
trained on, while numbers stay uniform and independent in both splits (an agent alone is at chance
in either). Test problem ``index`` is the index-th distinct held-out problem of a stream fixed by
``seed``, so an evaluation's problems are distinct texts up to :meth:`CoopEnv.num_problems`.
"""
from __future__ import annotations

import math
import random

from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.envs.gym import extract_answer
from marft.errors import UserError

NAMES = ("sum", "lookup")

ITEMS = ("apples", "shells", "coins", "marbles", "stamps", "pencils", "buttons", "stones", "cards", "beads",
         "books", "keys", "cups", "hats", "rings", "seeds", "boxes", "tickets", "candles", "feathers")
WORDS = ("red", "blue", "green", "gold", "pink", "gray", "white", "black", "brown", "orange", "purple", "silver",
         "lime", "navy", "teal", "rose", "amber", "ivory", "coral", "olive", "plum", "tan", "mint", "ruby")


class CoopEnv(TurnBasedEnv):
    """A cooperative task (see the module docstring).

    Options: ``name`` (sum | lookup), ``min_value``/``max_value`` (the numbers, default 0-9),
    ``items`` (sum: how many item words vary the texts, 2-20, default 20), ``entries`` (lookup:
    table rows per holding agent, default 2), ``relay`` (sum, default false: every speaker after the
    first is told to add its number to the running total it heard and pass that on, and the last
    agent to add its own to it: each agent's part is a sum of two numbers, however long the chain),
    ``test_share`` (the share of the item or code words
    kept for held-out problems, default 0.25), ``seed`` (fixes the held-out stream and shifts the
    training stream).
    """

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1, name: str = "sum",
                 seed: int = 0, min_value: int = 0, max_value: int = 9, items: int = 20, entries: int = 2,
                 test_share: float = 0.25, relay: bool = False, team: list[str] | None = None):
        super().__init__(agents, answering, horizon)
        self.team = list(team or agents)  # the whole team; ``agents`` may be a part of it (an ablation)
        if [a for a in self.team if a in agents] != list(agents):
            raise ValueError(f"agents {agents} are not a part of the team {self.team} in its order")
        if name not in NAMES:
            raise UserError(f"unknown coop task {name!r}; choose one of {', '.join(NAMES)}")
        if len(self.team) < 2:
            raise UserError(f"the coop task {name} needs a team of at least 2 agents (the problem is split between "
                            f"them), got {len(self.team)}")
        for key, v in (("min_value", min_value), ("max_value", max_value), ("items", items), ("entries", entries)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise UserError(f"coop task option {key} must be a whole number, got {v!r}")
        if not 0 <= min_value <= max_value <= 999:
            raise UserError(f"coop task: need 0 <= min_value <= max_value <= 999, got {min_value} and {max_value}")
        if not 2 <= items <= len(ITEMS):
            raise UserError(f"coop task option items must be 2-{len(ITEMS)} (at least one for each split), got {items}")
        if isinstance(test_share, bool) or not isinstance(test_share, (int, float)) or not 0 < test_share < 1:
            raise UserError(f"coop task option test_share must be between 0 and 1, got {test_share!r}")
        if not isinstance(relay, bool):
            raise UserError(f"coop task option relay must be true or false, got {relay!r}")
        if relay and name != "sum":
            raise UserError("coop task option relay is for the sum task (each speaker passes on the running total)")
        self.name, self.seed, self.relay = name, int(seed), relay
        self.lo, self.hi, self.entries = min_value, max_value, entries
        vocab = range(items) if name == "sum" else range(len(WORDS))
        held = min(len(vocab) - 1, max(1, round(test_share * len(vocab))))
        self.vocab = {"train": list(vocab[:-held]), "test": list(vocab[-held:])}
        rows = entries * (len(self.team) - 1)
        if name == "lookup" and entries < 1:
            raise UserError(f"coop task option entries must be at least 1 (code-table rows each holding agent gets), "
                            f"got {entries}")
        if name == "lookup" and not 1 <= rows <= held:
            raise UserError(f"coop lookup: entries x holding agents = {rows} table rows, but the held-out split has "
                            f"{held} code words (test_share {test_share}); use fewer entries or a larger test_share")
        self._test: list[tuple] = []  # held-out problems drawn so far, in index order
        self._test_seen: set[tuple] = set()
        self._test_rng = random.Random(f"coop-test-{self.seed}")

    # --- the problem space -----------------------------------------------------------------
    def _draw(self, rng: random.Random, split: str) -> tuple:
        n, vocab = len(self.team), self.vocab[split]
        if self.name == "sum":
            return (rng.choice(vocab),) + tuple(rng.randint(self.lo, self.hi) for _ in range(n))
        words = rng.sample(vocab, self.entries * (n - 1))
        values = tuple(rng.randint(self.lo, self.hi) for _ in words)
        return (tuple(words), values, rng.randrange(len(words)))

    def num_problems(self, split: str) -> int | None:
        """The number of distinct held-out problems (training problems are drawn, unlimited)."""
        if split != "test":
            return None
        n, v, words = len(self.team), self.hi - self.lo + 1, len(self.vocab["test"])
        if self.name == "sum":
            return words * v ** n
        k = self.entries * (n - 1)
        return math.perm(words, k) * v ** k * k

    def new_problem(self, rng: random.Random, split: str, index: int | None) -> Problem:
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        if index is not None and index < 0:
            raise ValueError(f"problem index must be >= 0, got {index}")
        if split == "test" and index is not None:
            size = self.num_problems("test")
            if index >= size:
                raise ValueError(f"test problem {index} does not exist: this task holds out {size}")
            while len(self._test) <= index:
                key = self._draw(self._test_rng, "test")
                if key not in self._test_seen:
                    self._test_seen.add(key)
                    self._test.append(key)
            key = self._test[index]
        else:
            tag = index if index is not None else rng.getrandbits(64)
            key = self._draw(random.Random(f"coop-{split}-{self.seed}-{tag}"), split)
        return self._problem(key, split, index)

    # --- texts -----------------------------------------------------------------------------
    def _problem(self, key: tuple, split: str, index: int | None) -> Problem:
        names = self.team
        private: dict[str, str] = {}
        if self.name == "sum":
            item, values = ITEMS[key[0]], key[1:]
            goal = f"Your team must find how many {item} the team holds in total."
            held = [f"{v} {item[:-2] if item.endswith('xes') else item[:-1]}" if v == 1 else f"{v} {item}"
                    for v in values]
            for k, a in enumerate(names[:-1]):
                if self.relay and k > 0:  # pass on the running total
                    say = (f"The teammate before you told you how many {item} the team holds so far. Reply with one "
                           f'sentence: "We hold T {item} so far.", where T is their number plus your {values[k]}.')
                else:
                    say = f'Reply with one sentence: "I hold {held[k]}."'
                private[a] = f"{goal} You hold {held[k]}. Only you know this number. {say}"
            if self.relay and len(names) > 2:
                told = (f"The teammate before you told you how many {item} the team holds so far. "
                        f"Add your {values[-1]} to that number.")
            else:
                told = f"Your teammates told you how many {item} they hold. Add your {values[-1]} to their numbers."
            private[names[-1]] = f"{goal} You hold {held[-1]}. {told}"
            answer = sum(values)
            whole = f"{goal} " + "; ".join(f"{a} holds {v}" for a, v in zip(names, values)) + "."
        else:
            words, values, asked = key
            rows = [f"{WORDS[w]}={v}" for w, v in zip(words, values)]
            goal = "Your team must find the number of a code word."
            for k, a in enumerate(names[:-1]):
                part = ", ".join(rows[k * self.entries:(k + 1) * self.entries])
                private[a] = (f"{goal} You hold part of the code table: {part}. Only you can see it. "
                              f'Reply with one sentence: "The table says {part}."')
            private[names[-1]] = (f"{goal} Your code word is {WORDS[words[asked]]}. Your teammates sent you "
                                  f"the code table. Find the number of {WORDS[words[asked]]} in it.")
            answer = values[asked]
            whole = f"{goal} Table: {', '.join(rows)}. Asked: {WORDS[words[asked]]} ({names[-1]})."
        return Problem(prompt=whole, answer=answer,
                       meta={"split": split, "index": index, "key": key, "private": private})

    def problem_text(self, agent: str) -> str:
        return self.problem.meta["private"][agent]

    def grade(self, problem: Problem, reply: str) -> Grade:
        answer = extract_answer(reply)
        if answer is None:
            return Grade(False, False, None, "No final answer was found. Give the final answer in \\boxed{}.")
        try:
            correct = float(answer) == problem.answer
        except ValueError:
            correct = False
        return Grade(correct, True, answer, "" if correct else f"The answer {answer} is wrong.")

    def answer_instruction(self) -> str:
        return "Put your final answer alone in \\boxed{}."
