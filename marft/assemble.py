"""The assembly: a run, and its trainer, from the config, with the parts the config asks for
(:mod:`marft.run.trainer`): where episodes come from and how the policy is updated, in this process
(:class:`marft.run.episodes.LocalEpisodes`, :class:`marft.run.updates.LocalPolicy`) or on Ray
(``cluster.rollout_workers`` > 0: :func:`marft.distributed.ray_parts`), and the critic's learner.
The Python API (:mod:`marft.api`) and the command line build trainers with it; it sits above the
run (:mod:`marft.run`) and Ray (:mod:`marft.distributed`), the only module that chooses between them.
"""
from __future__ import annotations

import torch

from .engines import Engine, HFEngine, make_engine
from .engines.models import hidden_size
from .errors import UserError
from .maths.algorithms import ALGORITHMS
from .run.assemble import prepare
from .run.config import RunConfig
from .run.episodes import LocalEpisodes
from .run.folder import RunFolder
from .run.trainer import Trainer
from .run.training import Training
from .run.updates import CriticLearner, LocalPolicy


def build_trainer(cfg: RunConfig, team, models, make_env, log=print, engine: Engine | None = None) -> Trainer:
    """The trainer of ``cfg`` for ``team`` on ``models`` (built by :func:`marft.run.assemble.prepare`).
    ``engine`` plays the rollouts (:mod:`marft.engines`); None: the one ``rollout.engine`` names (on
    Ray, the driver's HF engine, which evaluates). The critic's heads are initialised from ``seed``."""
    ray = cfg.cluster.rollout_workers > 0
    if engine is None:
        engine = (HFEngine(models, fast=cfg.train.fast, merge=cfg.rollout.fold_adapters, compile=cfg.rollout.compile)
                  if ray else make_engine(cfg, models))
    algorithm = ALGORITHMS[cfg.train.algorithm]
    if algorithm.critic == "team" and algorithm.token_level and len(models.bases) > 1:
        raise UserError(f"config: {cfg.train.algorithm}'s critic reads each reply's tokens, which needs the team on one "
                        f"base model (one tokenizer); its agents are on {len(models.bases)}: {', '.join(models.bases)}; "
                        "use train.algorithm=marft (action level), or one base model")
    torch.manual_seed(cfg.seed)
    heads = algorithm.make_heads(team.names, {a: hidden_size(models.for_agent(a)[0]) for a in team.names})
    # train.critic lora: the critic's own adapter, made after the heads (which are then those of a frozen critic)
    adapter = models.add_critic_adapter() if cfg.train.critic == "lora" and heads else None
    critic = CriticLearner(cfg, heads, algorithm.token_level, log=log, models=models, adapter=adapter, algorithm=algorithm)
    if ray:  # Ray: rollout workers and learners as actors (docs/scaling.md)
        from .distributed import ray_parts

        try:
            episodes, policy = ray_parts(cfg, team, models, engine, log=log)
        except BaseException:
            engine.close()
            raise
    else:
        if cfg.train.max_staleness:  # asynchronous training: episodes played ahead of the learner
            from .run.asynchronous import AsyncEpisodes

            episodes = AsyncEpisodes(cfg, team, engine, models, make_env, log=log)
        else:
            episodes = LocalEpisodes(cfg, team, engine, make_env)
        policy = LocalPolicy(cfg, models, team.adapters, log=log)
    return Trainer(cfg, team, models, episodes, policy, critic, log=log)


def build_training(cfg: RunConfig, run: RunFolder, log=print, callbacks=(), owner=None) -> Training:
    """A whole run (:class:`marft.run.training.Training`) of ``cfg`` in ``run``: seeds, team, models
    and tasks (:func:`marft.run.assemble.prepare`), a new run's adapters initialised from trained ones
    (``model.init_adapters``; a resumed run has its checkpoint's), the trainer from its parts
    (:func:`build_trainer`), a new run's critic from a trained one (``model.init_critic``) and a
    resumed run's checkpoint loaded, every check passing before anything in the run folder changes."""
    team, models, make_env = prepare(cfg)
    if not run.resumed:
        models.init_adapters(cfg.model.init_adapters)
    trainer = build_trainer(cfg, team, models, make_env, log=log)
    try:
        if run.resumed:
            trainer.load(run.checkpoint)
        elif cfg.model.init_critic:
            trainer.critic.start_from(cfg.model.init_critic, team.names)
    except BaseException:
        trainer.close()
        raise
    return Training(cfg, run, team, models, make_env, trainer, log, callbacks, owner)
