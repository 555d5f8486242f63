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

from typing import Protocol

from ..engines import Engine
from ..turns import Rollout
from .config import RunConfig


def iteration_seed(cfg: RunConfig, iteration: int, salt: int = 0) -> int:
    """The seed of one random choice of ``iteration``. Salts: 0 the problems, 1 the rollout's
    sampler, 2 the critic's minibatches, 3 the policy update's orders, 4 a mixture's tasks,
    1000 + k the sampler of Ray rollout shard k > 0."""
    return (cfg.seed * 1_000_003 + iteration * 7_919 + salt) % 2**63


class EpisodeSource(Protocol):
    """What a trainer needs from where its episodes come from."""

    engine: Engine
    """The engine that evaluates the team (and, in one process, plays its episodes)."""

    def play(self, iteration: int, resets: list[tuple[int, dict]]) -> Rollout:
        """The episodes ``resets`` (seed, options) of ``iteration``, played with the current adapters."""

    def before_update(self) -> None:
        """Called before the policy update (an engine that holds memory frees it)."""

    def publish(self, adapters: list[str]) -> None:
        """The team's models hold new weights of ``adapters``: play with them from now on."""

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

    def publish(self, adapters: list[str]) -> None:
        self.engine.update()  # an engine with its own weights (vllm) gets the new adapters

    def metrics(self, iteration: dict, seconds: float) -> dict:
        return {}

    def close(self) -> None:
        self.engine.close()
