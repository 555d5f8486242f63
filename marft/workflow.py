"""Agent programs of your own as marft episodes: run a workflow per episode against the team's
endpoint (:mod:`marft.serve`) and build the rollout the learner trains on from its calls.

A workflow is ``workflow(problem, client) -> answer`` (a plain function or ``async def``):
``problem`` a dict (the problem's record; ``problem["prompt"]`` its text), ``client`` an
``openai.OpenAI`` client (``openai.AsyncOpenAI`` for an ``async def``) whose base URL records the
calls under this episode; each agent is the model named as the agent. The workflow decides who is
called, how often, in which order, with which messages. Its answer is scored by
``reward(answer, problem)``: a number for the team, ``{agent: number}`` per agent, or a
:class:`marft.envs.Grade` (an environment's verdict).

From the recorded calls (:func:`calls_to_rollout`), Flex-MG's micro-steps in call order: calls
fill a step in the team's agent order, and a call to an agent that already acted in the step, or
comes earlier in the team's order, starts the next step (planner, planner, solver: the planner at
step 0, then planner and solver at step 1); the last call must be to the team's last agent (an
episode that ends otherwise fails, saying so), and the answer graded is what the workflow returns
(:func:`answer_text`); the centralised critic's state
before a call is the problem and every earlier reply of the episode (``"Problem: ..."`` then one
``"[step t] agent: reply"`` line each, the shape of :meth:`marft.envs.base.TurnBasedEnv.state`);
the reward comes at the episode's last step; a step's agents that were not called are no
micro-steps (the advantages pass over them: :func:`marft.advantages.fold_skipped`). An episode whose workflow raises, runs past
``timeout_s`` or calls no agent is left out (``failed``) and counted; the others go on.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Callable

import torch

from .engines.base import Reply, pack
from .envs.base import Grade
from .envs.dataset import DatasetEnv
from .errors import UserError
from .turns import Rollout, Turn


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
    (:func:`marft.rollout.rollout`) sees ``workflow_fn`` and calls :func:`workflow_rollout`. The
    reward function scores the workflow's answer: ``reward(answer, record)``, a number for the team or
    ``{agent: number}`` per agent (:meth:`score_answer`)."""

    def __init__(self, agents: list[str], answering: list[str], horizon: int = 1, *, workflow: str = "", **kwargs):
        super().__init__(agents, answering, horizon, **kwargs)
        if not workflow:
            raise UserError("task.kind workflow needs task.workflow: 'package.module:function' or "
                            "'path/to/file.py:function', called as workflow(problem, client) -> answer")
        from .envs.check import import_user_module

        module_name, _, attr = workflow.rpartition(":")
        if not module_name or not attr:
            raise UserError(f"task.workflow {workflow!r} must look like 'package.module:function' or 'path/to/file.py:function'")
        fn = getattr(import_user_module(module_name, "marft_user_workflow_"), attr, None)
        if not callable(fn):
            raise UserError(f"task.workflow {workflow!r}: module {module_name!r} has no function {attr!r}")
        check_workflow(fn, workflow)
        self.workflow_fn = fn

    def score_answer(self, answer: str) -> Grade | dict[str, float]:
        """The reward function on the workflow's answer: a :class:`Grade` of a number (the team's
        reward), or ``{agent: number}`` when it returns per-agent rewards (agents it leaves out get 0)."""
        from .envs.dataset import score_reply

        where = f"record {self.problem.meta['index']} of the {self.problem.meta['split']} split"
        score = score_reply(self.reward_fn, self.reward, answer, dict(self.problem.meta["record"]), where,
                            agents=self.possible_agents)
        if isinstance(score, dict):
            return score
        return Grade(correct=score >= self.success_threshold, extracted=bool((answer or "").strip()), score=score)


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


def workflow_rollout(team, engine, envs: list[WorkflowEnv], resets: list, sampling, generator, timeout_s: float) -> Rollout:
    """The rollout of a workflow task: each environment reset to its problem, the workflow run on
    every problem against a :class:`marft.serve.TeamServer` on ``engine`` sampling with
    ``generator`` (so a workflow that asks as the built-in team does gets the same replies)."""
    from .serve import serve_team

    problems = []
    for env, (seed, options) in zip(envs, resets):
        env.reset(seed=seed, options=options)
        problems.append({**env.problem.meta["record"], "prompt": env.problem.prompt, "_episode": len(problems)})
    models = getattr(engine, "models", None)
    if models is None:
        raise UserError(f"task.kind workflow needs an engine with the team's models (hf or vllm), not {engine.name}")

    def grade(answer, problem):
        return envs[problem["_episode"]].score_answer(answer_text(answer))

    with serve_team(models, team, engine, sampling, fixed_sampling=True) as server:
        server.generator = generator if generator is not None else server.generator
        out = play_workflows(team, server, envs[0].workflow_fn, problems, grade, timeout_s, envs[0].success_threshold)
        out.gen_seconds, out.gen_flops = server.gen_seconds, server.gen_flops
        return out


def play_workflows(team, server, workflow: Callable, problems: list[dict], reward: Callable,
                   timeout_s: float = 300.0, success_threshold: float = 1.0) -> Rollout:
    """Run ``workflow`` once per problem, all at once, against ``server`` (a started
    :class:`marft.serve.TeamServer`); return the rollout of their calls."""
    import openai

    E = len(problems)
    ids = [f"{e:06d}" for e in range(E)]  # sorted as numbers: the batches keep episode order
    answers: list = [None] * E
    errors: list[str | None] = [None] * E
    running = {"n": E}
    lock = threading.Lock()
    server.ready = lambda n: n >= running["n"]
    server.patience_s = min(server.patience_s, timeout_s / 4)  # an episode busy elsewhere holds the rest back at most this
    is_async = inspect.iscoroutinefunction(workflow)

    def finish() -> None:
        with lock:
            running["n"] -= 1
        server.poke()

    def one(e: int) -> None:
        try:
            if is_async:
                async def go():
                    async with openai.AsyncOpenAI(base_url=server.base_url(ids[e]), api_key=server.api_key,
                                                  max_retries=0, timeout=timeout_s) as client:
                        return await workflow(problems[e], client)
                answers[e] = asyncio.run(go())
            else:  # one connection pool for every episode (building one takes about 20 ms of CPU)
                client = openai.OpenAI(base_url=server.base_url(ids[e]), api_key=server.api_key, max_retries=0,
                                       timeout=timeout_s, http_client=shared)
                answers[e] = workflow(problems[e], client)
        except BaseException as err:  # noqa: BLE001 - the user's program failed (sys.exit() too): this episode only
            errors[e] = f"the workflow raised {type(err).__name__}: {err}"
        finally:
            finish()

    start = time.perf_counter()
    shared = None if is_async else openai.DefaultHttpxClient()
    threads = [threading.Thread(target=one, args=(e,), daemon=True, name=f"marft-workflow-{e}") for e in range(E)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    # the batches are generated here, in the thread that also runs the learner (TeamServer.pump)
    server.pump(lambda: running["n"] <= 0 or time.monotonic() >= deadline)
    for e, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():  # abandoned: it no longer holds the batches back
            errors[e] = f"the workflow ran past {timeout_s:g} s (timeout)"
            finish()
    seconds = time.perf_counter() - start
    if shared is not None:
        shared.close()  # an abandoned episode's next request fails (it is left out already)
    calls = [server.calls(i) for i in ids]
    for i in ids:
        server.forget(i)
    scores = []
    for e in range(E):
        if errors[e] is None and not calls[e]:
            errors[e] = "the workflow called no agent"
        elif errors[e] is None and calls[e][-1].agent != team.names[-1]:
            errors[e] = (f"the workflow's last call was to {calls[e][-1].agent}, not to {team.names[-1]}: the team's "
                         "last agent must give the answer (list the agents in the order they act, the answering one last)")
        score = None
        if errors[e] is None:
            try:
                score = reward(answers[e], problems[e])
            except Exception as err:  # noqa: BLE001
                errors[e] = f"the reward function raised {type(err).__name__}: {err}"
        scores.append(score)
    out = calls_to_rollout(team, problems, calls, scores, errors, success_threshold, answers)
    out.seconds = seconds
    return out


def calls_to_rollout(team, problems: list[dict], calls: list[list], scores: list, errors: list[str | None],
                     success_threshold: float = 1.0, answers: list | None = None) -> Rollout:
    """The rollout of recorded calls (:class:`marft.serve.Call`, one list per episode in call
    order): one :class:`Turn` per (step, agent) with that micro-step's episodes in episode order;
    ``scores[e]`` the episode's reward (a number, or ``{agent: number}``), given at its last step."""
    names = team.names
    E, N = len(problems), len(names)
    failed = torch.tensor([err is not None for err in errors], dtype=torch.bool)
    rows: dict[tuple[int, str], list[tuple[int, Reply, str, list[dict]]]] = {}
    steps = torch.zeros(E, dtype=torch.long)
    order = {a: i for i, a in enumerate(names)}
    for e in range(E):
        if failed[e]:
            steps[e] = 1
            continue
        t, prev = 0, -1
        state = f"Problem: {problems[e].get('prompt', '')}"
        for c in calls[e]:
            i = order[c.agent]
            if i <= prev:  # an agent again, or one earlier in the team's order: the next step
                t += 1
            prev = i
            rows.setdefault((t, c.agent), []).append(
                (e, Reply(c.prompt_ids, c.response_ids, c.logprobs, c.truncated, c.text), state, c.messages))
            state += f"\n[step {t}] {c.agent}: {c.text}"
        steps[e] = t + 1
    H = max(int(steps.max()) if E else 1, 1)
    rewards, agent_rewards = torch.zeros(E, H), torch.zeros(E, H, N)
    dones = torch.zeros(E, H, dtype=torch.bool)
    success, extracted = torch.zeros(E, dtype=torch.bool), torch.zeros(E, dtype=torch.bool)
    infos: list[dict] = []
    for e in range(E):
        last = int(steps[e]) - 1
        dones[e, last] = True
        if failed[e]:
            infos.append({"success": False, "extracted": False, "error": errors[e]})
            continue
        s = scores[e]
        if isinstance(s, Grade):  # an environment's verdict: its score, success and extraction
            value = float(s.correct) if s.score is None else float(s.score)
            per = [value] * N
        else:
            per = [float(s.get(a, 0.0)) for a in names] if isinstance(s, dict) else [float(s)] * N
        agent_rewards[e, last] = torch.tensor(per)
        rewards[e, last] = sum(per) / N
        success[e] = s.correct if isinstance(s, Grade) else rewards[e, last] >= success_threshold
        extracted[e] = s.extracted if isinstance(s, Grade) else answers is None or answers[e] is not None
        infos.append({"success": bool(success[e]), "extracted": bool(extracted[e]),
                      "answer": None if answers is None else answers[e]})
    turns = []
    for (t, agent) in sorted(rows, key=lambda k: (k[0], order[k[1]])):
        got = sorted(rows[(t, agent)], key=lambda x: x[0])
        out = pack([r for _, r, _, _ in got], 0)
        turns.append(Turn(t, agent, torch.tensor([e for e, *_ in got], dtype=torch.long), out.prompt_ids,
                          out.prompt_mask, out.response_ids, out.response_mask, out.logprobs, out.truncated,
                          out.texts, [s for _, _, s, _ in got], [m for *_, m in got]))
    return Rollout(turns, rewards, agent_rewards, dones, steps, success, extracted, infos=infos, failed=failed)
