"""A run's pieces from its config: seeds and threads, the team, the models, the environment factory
(one task or a mixture). The assembly (:mod:`marft.assemble`), the Python API, the command line and
the Ray actors (:mod:`marft.distributed`) build runs from them; the run folder is :mod:`marft.run.folder`'s."""
from __future__ import annotations

import random

from .config import RunConfig
from ..errors import UserError


def quiet_libraries() -> None:
    """Transformers' progress bars and advice, tokenizers' fork warning and FutureWarnings off."""
    import os
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def prepare(cfg: RunConfig):
    """Seed, threads, team, models and environment factory for a run: ``(team, models, make_env)``."""
    import torch

    from ..engines.models import TeamModel
    from ..team import build_team

    quiet_libraries()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    team = build_team(cfg.team)
    make_env = env_factory(cfg, team)
    models = TeamModel(team, cfg.model)
    return team, models, make_env


def env_factory(cfg: RunConfig, team):
    """The environment factory of ``cfg.task`` for ``team`` (the whole team or a part of it); of a
    mixture (``cfg.tasks``, or one task whose rewards are scaled), a
    :class:`marft.envs.mixture.MixtureFactory` over each task's own."""
    from .config import task_label, task_list
    from ..envs import DATASET_KEYS, WORKFLOW_KEYS, make_env_factory
    from ..envs.mixture import MixtureFactory

    def one(t):
        keys = WORKFLOW_KEYS if t.kind == "workflow" else DATASET_KEYS
        return make_env_factory(t.kind, team.names, team.answering, t.horizon, t.name, dict(t.options),
                                t.train_path, t.test_path, t.env, {k: getattr(t, k) for k in keys}, team.whole)

    tasks = task_list(cfg)
    if len(tasks) == 1 and tasks[0].reward_scale == 1:
        return one(tasks[0])
    labels = [task_label(t) for t in tasks]
    factories = {}
    for i, (label, t) in enumerate(zip(labels, tasks)):
        try:
            factories[label] = one(t)
        except UserError as e:
            raise UserError(f"tasks.{i} ({label}): {e}") from None
    return MixtureFactory(factories, {k: t.weight for k, t in zip(labels, tasks)},
                          {k: t.reward_scale for k, t in zip(labels, tasks)}, {k: t.horizon for k, t in zip(labels, tasks)})


def task_label(cfg: RunConfig) -> str:
    from .config import task_label as label, task_list

    return " + ".join(label(t) for t in task_list(cfg))


def num_problems(make_env) -> int | None:
    """The held-out problems of the task (None: an environment that does not say)."""
    probe = make_env()
    return probe.num_problems("test") if hasattr(probe, "num_problems") else None  # optional for a raw TeamEnv


def describe(models) -> dict:
    """:func:`marft.engines.machine.describe_machine` of a team's (first) base model."""
    from ..engines.machine import describe_machine

    return describe_machine(next(iter(models.bases.values())))
