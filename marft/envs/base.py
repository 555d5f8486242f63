"""The environment API: one episode of a task, played agent by agent (PettingZoo AEC style).

A team of N agents acts on an environment in steps. Within one step the agents act one after
another, in the team's topological order, which is the order of ``possible_agents``. After the
last agent of a step has acted, the environment judges the step, sets every agent's reward and
either ends the episode (success, or the horizon H is reached) or starts the next step, whose
observation usually carries feedback on the previous attempt.

The protocol (what the rollout and ``marft env-check`` rely on)::

    env = MyEnv(agents=["planner", "solver"], answering=["solver"], horizon=1, **options)
    env.reset(seed=0, options={"split": "test", "index": 3})
    while env.agents:                      # empty once the episode has ended
        agent = env.agent_selection        # whose turn it is
        text = env.observe(agent)          # the environment's message to that agent
        env.step(action_text)              # that agent's whole reply
        obs, reward, terminated, truncated, info = env.last()

- ``observe(agent)`` returns only what the *environment* says (the problem, the answer format
  for answering agents, feedback from earlier steps). The team layer adds the messages of the
  agent's predecessors in the dependency graph; environments never see the graph.
- ``rewards[agent]`` holds each agent's reward for the last completed step (0.0 in the middle of
  a step). The team reward r_t of a step is the mean over agents; team tasks give every agent the
  same value.
- ``infos[agent]`` holds, after a completed step, at least ``success`` (bool: the team's answer
  was right) and ``extracted`` (bool: an answer could be read from the graded reply).
- ``state()`` is the global state for a centralised critic: the whole transcript so far as text.
- ``step()`` on a finished episode (``agents`` empty) must raise (for example ``RuntimeError``),
  not start a new episode or return quietly: a caller that keeps stepping has a bug, and
  ``marft env-check`` fails an environment that lets it pass. ``reset()`` starts the next episode.

Environments are constructed with keyword arguments: ``agents`` (names in acting order),
``answering`` (the names whose replies are graded), ``horizon`` (maximum steps) and the task's
own options from the config. ``reset`` accepts ``options={"split": "train" | "test",
"index": i}``; with an index, the episode is problem ``i`` of that split (evaluation); without
one, the problem is drawn with ``seed``.

Most tasks only need :class:`TurnBasedEnv`: implement ``new_problem`` and ``grade`` and it does
the bookkeeping above.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Problem:
    """One task instance: the text shown to the team and whatever grading needs."""

    prompt: str
    answer: Any = None
    meta: dict = field(default_factory=dict)


@dataclass
class Grade:
    """The verdict on one answering agent's reply."""

    correct: bool
    extracted: bool  # an answer could be read from the reply at all
    answer: str | None = None  # what was read, for logs
    feedback: str = ""  # what the team is told before trying again (multi-turn)
    score: float | None = None  # the reward, if not simply 1.0 for correct and 0.0 otherwise


class TeamEnv:
    """The AEC protocol (see the module docstring). Subclass :class:`TurnBasedEnv` instead where
    you can; implement this directly only for environments with their own turn structure."""

    possible_agents: list[str]
    agents: list[str]
    agent_selection: str
    rewards: dict[str, float]
    terminations: dict[str, bool]
    truncations: dict[str, bool]
    infos: dict[str, dict]
    concurrent_steps: bool = False  # True: step() of different instances may run in parallel threads

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        raise NotImplementedError

    def observe(self, agent: str) -> str:
        raise NotImplementedError

    def step(self, action: str) -> None:
        """Act for ``agent_selection`` with its whole reply; raise if the episode has ended."""
        raise NotImplementedError

    def last(self) -> tuple[str, float, bool, bool, dict]:
        a = self.agent_selection
        return self.observe(a), self.rewards[a], self.terminations[a], self.truncations[a], self.infos[a]

    def state(self) -> str:
        raise NotImplementedError


class TurnBasedEnv(TeamEnv):
    """A team answers one problem per episode; answering agents are graded after every step.

    Subclasses implement :meth:`new_problem` and :meth:`grade`, and may override
    :meth:`answer_instruction` (how answering agents must format their answer) and
    :meth:`feedback_text`. Reward of a step = mean over answering agents of their score (1 if correct, else 0, unless
    the grade sets ``score``);
    success = the last answering agent (the team's final word) is correct. The episode ends at
    success or after ``horizon`` steps.
    """

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1):
        if not agents:
            raise ValueError("an environment needs at least one agent")
        unknown = [a for a in answering if a not in agents]
        if unknown:
            raise ValueError(f"answering agents {unknown} are not among the agents {agents}")
        self.possible_agents = list(agents)
        self.answering = list(answering) or [agents[-1]]
        self.horizon = int(horizon)
        self.agents = []
        self.problem: Problem | None = None

    # --- what a task implements -------------------------------------------------------------
    def new_problem(self, rng: random.Random, split: str, index: int | None) -> Problem:
        """Return problem ``index`` of ``split``, or a random one drawn with ``rng``."""
        raise NotImplementedError

    def grade(self, problem: Problem, reply: str) -> Grade:
        """Judge one answering agent's reply."""
        raise NotImplementedError

    def grade_all(self, problem: Problem, replies: dict[str, str]) -> dict[str, Grade]:
        """Judge every answering agent's reply of a step (in acting order); by default one by one
        with :meth:`grade`. Override to grade them together (code tasks run one batch of programs)."""
        return {a: self.grade(problem, r) for a, r in replies.items()}

    def num_problems(self, split: str) -> int | None:
        """How many problems ``split`` holds (evaluation stops there); None = unlimited."""
        return None

    def answer_instruction(self) -> str:
        return "Give the final answer in \\boxed{}."

    def feedback_text(self, grades: dict[str, Grade]) -> str:
        lines = [g.feedback for g in grades.values() if g.feedback]
        return "\n".join(lines) or "The answer was wrong. Try again."

    # --- the protocol -----------------------------------------------------------------------
    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        options = options or {}
        rng = random.Random(seed)
        self.problem = self.new_problem(rng, options.get("split", "train"), options.get("index"))
        self.agents = list(self.possible_agents)
        self.agent_selection = self.agents[0]
        self.step_index = 0
        self._actions: dict[str, str] = {}
        self.history: list[tuple[int, str, str]] = []  # (step, agent, text)
        self.feedback = ""
        self.rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {} for a in self.agents}

    def problem_text(self, agent: str) -> str:
        """What ``agent`` is shown of the problem: by default the whole prompt (cooperative tasks
        show each agent only its own part, :mod:`marft.envs.coop`)."""
        return self.problem.prompt

    def observe(self, agent: str) -> str:
        parts = [self.problem_text(agent)]
        if self.step_index > 0:
            last = [t for s, a, t in self.history if s == self.step_index - 1 and a == self.answering[-1]]
            if last:
                parts.append(f"Your team's previous answer:\n{last[0]}")
            parts.append(f"Feedback: {self.feedback}")
        if agent in self.answering:
            parts.append(self.answer_instruction())
        return "\n\n".join(parts)

    def step(self, action: str) -> None:
        if not self.agents:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        agent = self.agent_selection
        self._actions[agent] = action
        self.history.append((self.step_index, agent, action))
        order = self.possible_agents
        i = order.index(agent)
        if i + 1 < len(order):
            self.agent_selection = order[i + 1]
            self.rewards = {a: 0.0 for a in order}
            return
        grades = self.grade_all(self.problem, {a: self._actions[a] for a in self.answering})
        reward = sum(float(g.correct) if g.score is None else g.score for g in grades.values()) / len(grades)
        final = grades[self.answering[-1]]
        self.rewards = {a: float(reward) for a in order}
        info = {
            "success": bool(final.correct),
            "extracted": bool(final.extracted),
            "answer": final.answer,
            "step": self.step_index,
        }
        self.infos = {a: dict(info) for a in order}
        self.step_index += 1
        done = final.correct
        out_of_time = self.step_index >= self.horizon
        self.terminations = {a: done for a in order}
        self.truncations = {a: out_of_time and not done for a in order}
        self.feedback = self.feedback_text(grades)
        self._actions = {}
        self.agent_selection = order[0]
        if done or out_of_time:
            self.agents = []

    def last(self) -> tuple[str, float, bool, bool, dict]:
        a = self.agent_selection
        obs = self.observe(a) if self.agents else ""
        return obs, self.rewards[a], self.terminations[a], self.truncations[a], self.infos[a]

    def state(self) -> str:
        lines = [f"Problem: {self.problem.prompt}"]
        for s, a, t in self.history:
            lines.append(f"[step {s}] {a}: {t}")
        return "\n".join(lines)
