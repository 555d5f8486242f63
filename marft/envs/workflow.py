"""``task.kind: workflow``'s environment: the problems and reward of a data set task, played by
the user's agent program (``task.workflow``) instead of marft's team loop. The program is run by
:mod:`marft.serving.workflow` against the team served as an OpenAI-compatible endpoint."""
from __future__ import annotations

import inspect
import threading
from typing import Callable

from ..errors import UserError
from .base import Grade
from .dataset import DatasetEnv, score_reply


def answer_text(answer) -> str:
    """What a workflow returned, as the text its task grades: a string as it is, None (nothing
    returned) as no answer (not the text "None"), anything else as ``str(answer)`` (42 -> "42")."""
    if answer is None:
        return ""
    return answer if isinstance(answer, str) else str(answer)


class WorkflowEnv(DatasetEnv):
    """``task.kind: workflow``: the problems and the reward of a data set task (:class:`DatasetEnv`:
    ``task.dataset``, ``task.reward``, ...), played by the user's ``workflow`` (``task.workflow``,
    ``module:function`` or ``path/to/file.py:function``) instead of marft's team loop; the rollout
    (:func:`marft.run.rollout.play`) of a workflow task calls :func:`marft.serving.workflow.workflow_rollout`. The
    reward function scores the workflow's answer: ``reward(answer, record)``, a number for the team or
    ``{agent: number}`` per agent (:meth:`score_answer`)."""

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1, *, workflow: str = "", **kwargs):
        super().__init__(agents, answering, horizon, **kwargs)
        if not workflow:
            raise UserError("task.kind workflow needs task.workflow: 'package.module:function' or "
                            "'path/to/file.py:function', called as workflow(problem, client) -> answer")
        self.workflow_fn = load_workflow(workflow)

    def score_answer(self, answer: str) -> Grade | dict[str, float]:
        """The reward function on the workflow's answer: a :class:`Grade` of a number (the team's
        reward), or ``{agent: number}`` when it returns per-agent rewards (agents it leaves out get 0)."""
        where = f"record {self.problem.meta['index']} of the {self.problem.meta['split']} split"
        score = score_reply(self.reward_fn, self.reward, answer, dict(self.problem.meta["record"]), where,
                            agents=self.possible_agents)
        if isinstance(score, dict):
            return score
        return Grade(correct=score >= self.success_threshold, extracted=bool((answer or "").strip()), score=score)


_WORKFLOWS: dict[tuple, Callable] = {}  # (spec, (path, mtime, size) of a file) -> the function: one import a run
_WORKFLOWS_LOCK = threading.Lock()


def load_workflow(spec: str) -> Callable:
    """The function ``task.workflow`` names (``package.module:function`` or ``path/to/file.py:function``),
    checked (:func:`check_workflow`). A file is imported once per process while it is unchanged, as a
    module is: its module-level state lives across the run's rollouts and episodes."""
    import os

    from ..envs.check import import_user_module

    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UserError(f"task.workflow {spec!r} must look like 'package.module:function' or 'path/to/file.py:function'")
    stamp = ()
    if os.path.isfile(module_name):
        st = os.stat(module_name)
        stamp = (os.path.abspath(module_name), st.st_mtime_ns, st.st_size)
    with _WORKFLOWS_LOCK:
        if (spec, stamp) in _WORKFLOWS:
            return _WORKFLOWS[(spec, stamp)]
        fn = getattr(import_user_module(module_name, "marft_user_workflow_"), attr, None)
        if not callable(fn):
            raise UserError(f"task.workflow {spec!r}: module {module_name!r} has no function {attr!r}")
        check_workflow(fn, spec)
        _WORKFLOWS[(spec, stamp)] = fn
        return fn


def check_workflow(fn: Callable, spec: str) -> None:
    """A :class:`UserError` unless ``fn`` can be called as ``workflow(problem, client)`` (a callable
    without a signature, such as some builtins, passes: its calls will tell)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind("problem", "client")
    except TypeError:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise UserError(f"task.workflow {spec!r} must take two arguments, workflow(problem, client); "
                        f"its signature is {name}{sig}") from None
