"""Several tasks in one run (``tasks:`` in the config): one environment that plays, per episode,
the task its reset names.

    make_env = MixtureFactory({"add": make_add_env, "count": make_count_env}, {"add": 1.0, "count": 1.0})
    env = make_env()
    env.reset(seed=7, options={"split": "train", "task": "count"})   # an episode of task "count"

Each task keeps its own environment (built from its own ``task`` settings by
:func:`marft.envs.make_env_factory`): its problems, answer instruction, horizon, grading and
held-out split. The mixture adds three things:

- the task of an episode comes from ``options["task"]`` at reset (the trainer draws it by weight,
  :func:`draw_tasks`; evaluation names it); without one, the reset's seed draws it by the weights;
- ``state()`` (what the centralised critic reads) starts with ``Task: <name>``, so one critic
  values every task knowing which it is (a "mixture" of one task, built to scale its rewards,
  keeps its own state); the agents' observations are the task's own;
- every reward of a task is multiplied by its ``reward_scale`` (1 by default: each task's own
  reward as it is, 0/1 for a right answer, a code task's share of passing tests with ``reward:
  fraction``).

A mixture of one task with scale 1 is never built: that run is the single-task run, unchanged.
"""
from __future__ import annotations

import random
from typing import Callable

from marft.envs.base import TeamEnv


def weight_at(weight, iteration: int) -> float:
    """A task's weight at ``iteration``: ``weight`` is a number (constant) or a schedule, a mapping
    ``{iteration: weight}`` read piecewise linearly between its points and constant outside them
    (``{0: 1.0, 20: 0.0}`` fades a task out over the first 20 iterations)."""
    if not isinstance(weight, dict):
        return float(weight)
    points = sorted((int(k), float(v)) for k, v in weight.items())
    if iteration <= points[0][0]:
        return points[0][1]
    for (i0, w0), (i1, w1) in zip(points, points[1:]):
        if iteration <= i1:
            return w0 + (w1 - w0) * (iteration - i0) / (i1 - i0)
    return points[-1][1]


def schedule_points(weights: list) -> list[int]:
    """Every iteration where some task's schedule has a point, and 0: the sum of the weights is
    linear between them and constant after the last, so its least value is at one of them."""
    return sorted({0, *(max(int(k), 0) for w in weights if isinstance(w, dict) for k in w)})


def draw_tasks(labels: list[str], weights: list[float], n: int, rng: random.Random) -> list[str]:
    """The tasks of ``n`` draws (episodes, or groups of one problem) in proportion to ``weights``:
    systematic sampling (n evenly spaced points, one random offset, along the cumulative weights),
    so task j gets ``floor(n p_j)`` or ``ceil(n p_j)`` draws with expectation exactly ``n p_j``, in
    a shuffled order. Deterministic in ``rng``."""
    total = sum(weights)
    if not total > 0:
        raise ValueError(f"the task weights {weights} sum to {total}; at least one must be positive")
    cum, acc = [], 0.0
    for w in weights:
        acc += w / total
        cum.append(acc)
    offset = rng.random()
    out, j = [], 0
    for k in range(n):
        x = (k + offset) / n
        while j < len(cum) - 1 and x >= cum[j]:
            j += 1
        out.append(labels[j])
    rng.shuffle(out)
    return out


class MixtureFactory:
    """A zero-argument function (as :func:`marft.envs.make_env_factory` returns) building a
    :class:`MixtureEnv` over ``factories`` (task name -> that task's environment factory);
    ``weights`` (name -> weight or schedule) draws a task for a reset that names none;
    ``scales`` (name -> reward_scale); ``horizons`` (name -> the task's horizon)."""

    def __init__(self, factories: dict[str, Callable[[], TeamEnv]], weights: dict | None = None,
                 scales: dict[str, float] | None = None, horizons: dict[str, int] | None = None):
        self.factories = dict(factories)
        self.labels = list(self.factories)
        self.weights = {k: (weights or {}).get(k, 1.0) for k in self.labels}
        self.scales = {k: float((scales or {}).get(k, 1.0)) for k in self.labels}
        self.horizons = {k: int((horizons or {}).get(k, 1)) for k in self.labels}
        probes = {k: f() for k, f in self.factories.items()}
        self.concurrent_steps = all(getattr(p, "concurrent_steps", False) for p in probes.values())
        self.problems = {k: (p.num_problems("test") if hasattr(p, "num_problems") else None) for k, p in probes.items()}

    def __call__(self) -> "MixtureEnv":
        return MixtureEnv(self)


class MixtureEnv(TeamEnv):
    """One episode slot of a mixture: the environment of the task the last reset chose (see the
    module docstring). Everything of the AEC protocol is that environment's, the rewards scaled."""

    def __init__(self, mixture: MixtureFactory):
        self.mixture = mixture
        self.concurrent_steps = mixture.concurrent_steps
        self._envs: dict[str, TeamEnv] = {}  # one per task, built the first time the task is played
        self.task: str | None = None
        self.env: TeamEnv | None = None

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        options = dict(options or {})
        task = options.pop("task", None)
        m = self.mixture
        if task is None and len(m.labels) == 1:  # one task (with its rewards scaled)
            task = m.labels[0]
        elif task is None:  # nobody chose: the seed draws by the weights at iteration 0
            task = draw_tasks(m.labels, [weight_at(m.weights[k], 0) for k in m.labels], 1, random.Random(seed))[0]
        if task not in m.factories:
            raise ValueError(f"unknown task {task!r}; the mixture's tasks are {', '.join(m.labels)}")
        if task not in self._envs:
            self._envs[task] = m.factories[task]()
        self.task, self.env = task, self._envs[task]
        self.env.reset(seed=seed, options=options)

    def _current(self) -> TeamEnv:
        if self.env is None:
            raise RuntimeError("reset() the mixture's environment first")
        return self.env

    # the protocol, delegated
    possible_agents = property(lambda self: self._current().possible_agents)
    agents = property(lambda self: self._current().agents if self.env is not None else [])
    agent_selection = property(lambda self: self._current().agent_selection)
    terminations = property(lambda self: self._current().terminations)
    truncations = property(lambda self: self._current().truncations)
    infos = property(lambda self: self._current().infos)

    @property
    def rewards(self) -> dict[str, float]:
        scale = self.mixture.scales[self.task]
        return {a: r * scale for a, r in self._current().rewards.items()}

    def observe(self, agent: str) -> str:
        return self._current().observe(agent)

    def step(self, action: str) -> None:
        self._current().step(action)

    def last(self):
        obs, reward, term, trunc, info = self._current().last()
        return obs, reward * self.mixture.scales[self.task], term, trunc, info

    def state(self) -> str:
        if len(self.mixture.labels) == 1:  # one task with its rewards scaled: its own state
            return self._current().state()
        return f"Task: {self.task}\n{self._current().state()}"

    def num_problems(self, split: str) -> int | None:
        if self.env is not None and hasattr(self.env, "num_problems"):
            return self.env.num_problems(split)
        return None

    def __getattr__(self, name: str):  # a task's own attributes (``problem``, ``answering``), if any
        if name in ("env", "mixture", "_envs") or self.__dict__.get("env") is None:
            raise AttributeError(name)
        return getattr(self.__dict__["env"], name)

