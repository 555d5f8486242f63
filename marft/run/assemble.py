"""Assembling a run from its config: seeds and threads, the team, the models, the environment
factory (one task or a mixture), the run folder and its record of where the run ran. The Python API
(:mod:`marft.api`), the command line and the Ray actors (:mod:`marft.distributed`) build runs with it."""
from __future__ import annotations

import json
import random
from pathlib import Path

from .config import RunConfig
from ..errors import UserError


def _quiet_libraries() -> None:
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

    _quiet_libraries()
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


def _machine(models) -> dict:
    """:func:`marft.engines.machine.describe_machine` of a team's (first) base model."""
    from ..engines.machine import describe_machine

    return describe_machine(next(iter(models.bases.values())))


def _record_machine(run_dir: Path, models, iteration: int) -> None:
    """Append where this attempt of the run ran (CPU, GPU, device, dtype, versions) to
    ``<run>/machine.json``: one record per start or resume, with the iteration it started from."""
    from .evaluation import write_json

    path = run_dir / "machine.json"
    try:
        records = json.loads(path.read_text()) if path.is_file() else []
    except ValueError:
        records = []
    records = [r for r in records if r.get("from_iteration", 0) < iteration]  # a resume replaces later ones
    write_json([*records, {"from_iteration": iteration, **_machine(models)}], path)


def make_dir(path: Path, key: str) -> Path:
    """Create the folder ``path`` named by config key ``key``, or say why not (a UserError)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the folder {path} for {key} ({e.strerror}); choose another {key}=...") from None
    return path


def config_file(path: str, command: str) -> str:
    """``path``, the config file of ``marft COMMAND``; a folder is a one-line error saying what to
    give instead (a run folder's own config, or ``--resume``)."""
    p = Path(path)
    if not p.is_dir():
        return path  # a missing file or a bad one: load_config says so
    hint = ""
    if (p / "config.yaml").is_file():
        hint = (f" (a run folder: continue it with marft train --resume {p})" if command == "train" else
                f" (a run folder: marft {command} {p / 'config.yaml'} --adapters {p} uses its config and trained adapters)")
    raise UserError(f"config file {p} is a folder; give the path of a YAML file such as configs/duo_arithmetic.yaml{hint}")


def output_file(path: Path, key: str) -> Path:
    """Check, before any work, that a result can be written to the file ``path`` (config key
    ``key``): its folder is created, and ``path`` is not itself a folder."""
    make_dir(path.parent, key)
    if path.is_dir():
        if key == "output_dir":  # the default file in output_dir
            raise UserError(f"{path}, the result file in output_dir, is a folder; choose another output_dir=... "
                            "or give a file: eval.output=path/to/result.json")
        raise UserError(f"{key} {path} is a folder; give the path of a file to write, e.g. {key}={path / 'eval.json'}")
    return path


# what marft train writes into its run folder, most valuable first: a new run refuses a folder that
# holds any of RUN_FILES (a tracker's files alone, left by a tracker that failed to start before the
# run wrote anything, do not count); a sweep moves all of them of a failed attempt aside
RUN_FILES = ("eval_final.json", "metrics.jsonl", "eval_untrained.json", "eval_iter_*.json", "eval_final_without_*.json",
             "checkpoints", "config.yaml", "machine.json")
TRACKER_FILES = ("tensorboard", "wandb_id", "mlflow_run_id")


def earlier_run_files(run_dir: Path, trackers: bool = False) -> list[Path]:
    """The files and folders of an earlier ``marft train`` run in ``run_dir`` (:data:`RUN_FILES`,
    and with ``trackers`` :data:`TRACKER_FILES`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found: list[Path] = []
    for pattern in RUN_FILES + (TRACKER_FILES if trackers else ()):
        for p in sorted(run_dir.glob(pattern)):
            if p.is_dir() and not any(p.iterdir()):
                continue  # an empty folder holds nothing to lose
            if p not in found:
                found.append(p)
    return found


def check_new_run_dir(run_dir: Path, config_file: str | Path | None = None) -> None:
    """A new (not resumed) run in ``run_dir`` must not overwrite anything: not an earlier run's
    checkpoints, results or config, nor ``config_file``, the config it was started from. A
    :class:`UserError` naming the file otherwise."""
    from .checkpoints import latest_checkpoint

    run_dir = Path(run_dir)
    if latest_checkpoint(run_dir) is not None:
        raise UserError(f"run folder {run_dir} already has checkpoints; continue it with --resume {run_dir} "
                        f"(in Python: MarftTrainer.resume({str(run_dir)!r})) or choose another output_dir=...")
    if config_file is not None and (run_dir / "config.yaml").exists():
        try:
            same = Path(config_file).resolve() == (run_dir / "config.yaml").resolve()
        except OSError:
            same = False
        if same:
            raise UserError(f"output_dir {run_dir} holds {config_file}, the config file you gave, which marft train would "
                            "overwrite with its own config.yaml; choose another output_dir=...")
    found = earlier_run_files(run_dir)
    if found:
        what = found[0].name + ("/" if found[0].is_dir() else "")
        raise UserError(f"output_dir {run_dir} already holds {what} of an earlier run, which a new run would overwrite, and no "
                        f"checkpoint to resume from; choose another output_dir=..., or move that run's files away first")


def task_label(cfg: RunConfig) -> str:
    from .config import task_label as label, task_list

    return " + ".join(label(t) for t in task_list(cfg))


def _num_problems(make_env) -> int | None:
    probe = make_env()
    return probe.num_problems("test") if hasattr(probe, "num_problems") else None  # optional for a raw TeamEnv
