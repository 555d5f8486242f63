"""Environments: the protocol (:mod:`marft.envs.base`), the shipped tasks and the conformance check.

- ``reasoning_gym`` (:class:`~marft.envs.gym.ReasoningGymEnv`): procedural problems, no files.
- ``math`` (:class:`~marft.envs.math.MathEnv`): GSM8K / MATH / MATH-500, from files or the Hub
  (``hf:openai/gsm8k:main:train``; local copies in ``MARFT_DATA_DIR``: :mod:`marft.envs.sources`).
- ``code`` (:class:`~marft.envs.code.CodeEnv`): MBPP / HumanEval programs run in a sandbox.
- ``coop`` (:class:`~marft.envs.coop.CoopEnv`): cooperative tasks split between the agents (``sum``,
  ``lookup``): no agent can solve them alone.
- ``dataset`` (:class:`~marft.envs.dataset.DatasetEnv`): any data set ``datasets`` loads (a Hub id,
  a local file or folder) and a reward function ``reward(reply, record) -> float``.
- ``custom``: the user's class, named ``"package.module:Class"`` or ``"path/to/file.py:Class"``;
  run ``marft env-check`` on it (:func:`~marft.envs.check.check_env`).
- ``workflow`` (:class:`~marft.envs.workflow.WorkflowEnv`): a data set task played by the user's
  agent program (run by :mod:`marft.serving.workflow`).

Code runs in :mod:`.sandbox`. May import: :mod:`marft.errors`, :mod:`marft.team`; never the engines,
the run or the front doors. A new task goes here: a :class:`TurnBasedEnv` subclass and a kind in
:func:`make_env_factory` (or, for a user's own, ``task.kind: custom``).
"""
from __future__ import annotations

from functools import partial
from typing import Callable

from marft.envs.base import Grade, Problem, TeamEnv, TurnBasedEnv
from marft.errors import UserError

KINDS = ("reasoning_gym", "math", "code", "dataset", "coop", "workflow", "custom")
# the task.* keys of kind "dataset" (keyword arguments of DatasetEnv, passed in ``dataset``)
DATASET_KEYS = ("dataset", "dataset_config", "train_split", "test_split", "prompt_column", "answer_column",
                "reward", "success_threshold")
# and of kind "workflow": the same plus the workflow function
WORKFLOW_KEYS = (*DATASET_KEYS, "workflow")

__all__ = ["Grade", "Problem", "TeamEnv", "TurnBasedEnv", "make_env_factory", "KINDS", "DATASET_KEYS", "option_clash"]

# keyword arguments marft passes to every environment itself, and what to do instead
_OWN = {"agents": "is set by marft from team.agents (the agents' names); remove it from {w}.options",
        "answering": "is set by marft from team.agents (the agents with answers: true); remove it from {w}.options",
        "horizon": "is a key of its own: set {w}.horizon instead"}
_OWN_BY_KIND = {  # and those of each kind (make_env_factory passes them from task.*)
    "reasoning_gym": ("name",), "math": ("train_path", "test_path"), "code": ("name", "train_path", "test_path"),
    "coop": ("name",), "dataset": DATASET_KEYS, "workflow": WORKFLOW_KEYS, "custom": ()}


def option_clash(kind: str, options: dict, where: str = "task") -> str | None:
    """The one-line problem with ``options`` (``task.options``) of a task of ``kind``: a key that
    marft sets itself (the team, the horizon, a key of the task's own such as ``task.name``), which
    the environment would get twice; None if there is none. ``where`` is the task's place in the
    config (``task`` or ``tasks.1``)."""
    for key in options if isinstance(options, dict) else ():
        if key in _OWN:
            return f"{where}.options {key} {_OWN[key].format(w=where)}"
        if key == "team" and kind == "coop":
            return (f"{where}.options team is set by marft from team.agents (the whole team, in acting order); "
                    f"remove it from {where}.options")
        if key in _OWN_BY_KIND.get(kind, ()):
            only = f" (task.options of the {kind} task takes only instruction)" if kind in ("dataset", "workflow") else ""
            return f"{where}.options {key} is a key of its own: set {where}.{key} instead{only}"
    return None


def make_env_factory(kind: str, agents: list[str], answering: list[str], horizon: int, name: str,
                     options: dict, train_path: str, test_path: str, env: str,
                     dataset: dict | None = None, team: list[str] | None = None) -> Callable[[], TeamEnv]:
    """A zero-argument function that builds a fresh environment for one episode slot.

    ``kind`` picks the task: "reasoning_gym" uses ``name`` and ``options``; "math" uses
    ``train_path``/``test_path`` (and ``options``, which it rejects if any); "coop" uses ``name``
    (sum | lookup) and ``options``; "code" uses ``name``
    (mbpp | humaneval), the MBPP file in ``test_path``/``train_path`` and ``options``; "custom" loads the
    class ``env`` and passes it ``options``; "dataset" uses ``dataset`` (the ``task.*`` values of
    :data:`DATASET_KEYS` by name) and ``options`` (``instruction``). ``team`` is the whole team where
    ``agents`` is a part of it (an ablation): a coop task still deals every agent's part. One environment is built and reset on both splits
    here, so a missing file, an unknown dataset or a bad option fails now with a :class:`UserError`.
    """
    clash = option_clash(kind, options)
    if clash:
        raise UserError(clash)
    if kind == "reasoning_gym":
        from marft.envs.gym import ReasoningGymEnv
        cls, kwargs = ReasoningGymEnv, {"name": name, **options}
    elif kind == "math":
        from marft.envs.math import MathEnv
        cls, kwargs = MathEnv, {"train_path": train_path, "test_path": test_path, **options}
    elif kind == "code":
        from marft.envs.code import CodeEnv
        cls, kwargs = CodeEnv, {"name": name, "train_path": train_path, "test_path": test_path, **options}
    elif kind == "coop":
        from marft.envs.coop import CoopEnv
        cls, kwargs = CoopEnv, {"name": name, **options, "team": list(team or agents)}
    elif kind in ("dataset", "workflow"):  # a workflow task is a data set task played by the user's program
        if kind == "dataset":
            from marft.envs.dataset import DatasetEnv as cls
        else:
            from marft.envs.workflow import WorkflowEnv as cls
        kwargs = {**(dataset or {}), **options}
    elif kind == "custom":
        from marft.envs.check import load_env_class
        if not env:
            raise UserError("task kind 'custom' needs env: 'package.module:Class' or 'path/to/file.py:Class'")
        cls, kwargs = load_env_class(env), dict(options)
    else:
        raise UserError(f"unknown task kind {kind!r}; expected one of {', '.join(KINDS)}")
    factory = partial(cls, agents=list(agents), answering=list(answering), horizon=horizon, **kwargs)
    try:
        probe = factory()
    except (TypeError, ValueError) as e:  # an unknown option, answering agents not in the team
        raise UserError(f"cannot build the {kind} environment {getattr(cls, '__name__', cls)} "
                        f"with options {options}: {e}") from e
    probe.reset(seed=0)
    probe.reset(seed=0, options={"split": "test", "index": 0})
    return factory
