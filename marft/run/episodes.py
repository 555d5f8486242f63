"""Where an iteration's episodes come from: the first part of a trainer (:mod:`marft.run.trainer`).

An episode source plays the episodes the trainer asks for (their reset seeds and options) and hands
back one :class:`marft.turns.Rollout`; after each policy update it publishes the new adapters to
whatever plays them. :class:`LocalEpisodes` plays them in this process, on the run's engine, with
the team loop or the user's agent program (:func:`marft.run.rollout.play` picks by task kind); the
Ray rollout workers are the other source (:class:`marft.distributed.RayEpisodes`).

Every random choice of iteration ``i`` is seeded from (``seed``, ``i``, a salt naming the choice):
:func:`iteration_seed`; so a resumed run repeats an uninterrupted one.
"""
from __future__ import annotations

import random
from typing import Protocol

from ..engines import Engine
from ..envs.mixture import draw_tasks, weight_at
from ..maths.algorithms import ALGORITHMS
from ..turns import Rollout
from .config import RunConfig, task_label


def iteration_seed(cfg: RunConfig, iteration: int, salt: int = 0) -> int:
    """The seed of one random choice of ``iteration``. Salts: 0 the problems, 1 the rollout's
    sampler, 2 the critic's minibatches, 3 the policy update's orders, 4 a mixture's tasks,
    1000 + k the sampler of Ray rollout shard k > 0."""
    return (cfg.seed * 1_000_003 + iteration * 7_919 + salt) % 2**63


def episode_resets(cfg: RunConfig, it: int) -> list[tuple[int, dict]]:
    """The (seed, options) of each training episode of iteration ``it`` (grouped algorithms:
    ``train.group_size`` episodes of each problem, one after another; a mixture: each problem's task
    drawn by the tasks' weights at ``it``)."""
    tr = cfg.train
    rng = random.Random(iteration_seed(cfg, it))
    size = tr.group_size if ALGORITHMS[tr.algorithm].grouped else 1
    seeds = [rng.randrange(2**62) for _ in range(cfg.rollout.episodes // size)]
    if not cfg.tasks:
        return [(p, {"split": "train"}) for p in seeds for _ in range(size)]
    # a mixture: each problem's task drawn by the tasks' weights at this iteration, from its own stream
    labels = [task_label(t) for t in cfg.tasks]
    drawn = draw_tasks(labels, [weight_at(t.weight, it) for t in cfg.tasks], len(seeds),
                       random.Random(iteration_seed(cfg, it, 4)))
    return [(p, {"split": "train", "task": task}) for p, task in zip(seeds, drawn) for _ in range(size)]


class EpisodeSource(Protocol):
    """What a trainer needs from where its episodes come from."""

    engine: Engine
    """The engine that evaluates the team (and, in one process, plays its episodes)."""

    def play(self, iteration: int, resets: list[tuple[int, dict]]) -> Rollout:
        """The episodes ``resets`` (seed, options) of ``iteration``, played with the current adapters."""

    def before_update(self) -> None:
        """Called before the policy update (an engine that holds memory frees it)."""

    def publish(self, adapters: list[str], version: int) -> None:
        """The team's models hold new weights of ``adapters``, ``version`` policy updates into the run
        (a resumed run's checkpoint: its iteration): play with them from now on."""

    def state(self) -> dict:
        """What a checkpoint keeps of this source ({}: nothing; an asynchronous source: the
        adapter versions it still plays with)."""

    def load(self, state: dict) -> None:
        """A checkpoint's :meth:`state`, before the resumed run's first :meth:`publish`."""

    def metrics(self, iteration: dict, seconds: float) -> dict:
        """Metrics of this source for the iteration (``iteration``: the trainer's own, ``seconds`` its time)."""

    def close(self) -> None:
        """Free the engine and whatever else plays."""


class LocalEpisodes:
    """Episodes played in this process on ``engine``, the team's models' own weights."""

    def __init__(self, cfg: RunConfig, team, engine: Engine, make_env):
        self.cfg, self.team, self.engine, self.make_env = cfg, team, engine, make_env

    def play(self, iteration: int, resets: list[tuple[int, dict]]) -> Rollout:
        from .rollout import play

        return play(self.cfg, self.team, self.engine, self.make_env, resets, iteration_seed(self.cfg, iteration, 1))

    def before_update(self) -> None:
        self.engine.before_update()

    def publish(self, adapters: list[str], version: int) -> None:
        self.engine.update()  # an engine with its own weights (vllm) gets the new adapters

    def state(self) -> dict:
        return {}

    def load(self, state: dict) -> None:
        pass

    def metrics(self, iteration: dict, seconds: float) -> dict:
        return {}

    def close(self) -> None:
        self.engine.close()
