"""Rollout: the team plays a batch of episodes and returns a typed batch of tensors.

For every environment step t, and every agent i in the team's acting order, each episode still
running builds agent i's prompt (environment observation + the replies of i's predecessors,
through the tokenizer's chat template) and an engine (:mod:`marft.engines`) generates the reply
with i's adapter. Each (t, i) is one micro-step k of MARFT and becomes one :class:`Turn`. Two
schedules: ``barrier`` generates (t, i) for every episode in one batched call, so each waits for
the batch's longest reply; ``async`` lets every episode advance on its own as its replies come back
(engines with a request queue: vLLM), the asynchrony of a Flex-MG.

Rollout only reads the team's current weights; a distributed worker wraps :func:`rollout` after
loading adapter weights with :meth:`marft.engines.models.TeamModel.load_adapter_state`.

Environment faults fail one episode, not the run: an exception from ``reset``, ``observe``,
``state`` or ``step``, or a ``reset``/``step`` that takes longer than ``env_timeout_s``, ends that
episode with ``failed[e] = True`` and the error text in ``infos[e]["error"]``; the trainer leaves
failed episodes out of the update and counts them. A timed-out call is abandoned and an exception
is raised inside it (Python code stops at its next bytecode; a call blocked inside C code, such as
a socket read, stops when that returns). To make this possible every such call runs in a worker
thread: one at a time, or all episodes at once for environments with ``concurrent_steps``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from typing import Callable

import torch

from ..envs.base import TeamEnv
from ..engines.base import Engine, Reply, pack
from ..engines.hf import HFEngine
from ..engines.generation import Sampling
from ..engines.models import TeamModel
from ..team import Team, agent_messages
from ..turns import Rollout, Turn


class EpisodeTimeout(BaseException):
    """Raised inside an environment call that ran past ``env_timeout_s`` (a BaseException, so that
    an environment's own ``except Exception`` does not swallow it)."""


def _raise_in(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(EpisodeTimeout))


def _describe(e: BaseException, timeout: float) -> str:
    if isinstance(e, EpisodeTimeout):
        return f"timed out after {timeout:g} s (rollout.env_timeout_s)"
    return f"{type(e).__name__}: {e}"[:300]


def _call_threads(fns: list, timeout: float) -> list[str | None]:
    """Each ``fn()`` in its own daemon thread, all at once; waits at most ``timeout`` for each."""
    errors: list[str | None] = ["did not finish"] * len(fns)

    def work(i, fn):
        try:
            fn()
            errors[i] = None
        except BaseException as e:  # noqa: BLE001 (EpisodeTimeout included)
            errors[i] = _describe(e, timeout)

    threads = [threading.Thread(target=work, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    result: list[str | None] = []
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            _raise_in(t.ident)  # abandoned: stop it where Python code allows
            result.append(_describe(EpisodeTimeout(), timeout))
        else:
            result.append(errors[i])
    return result


def _guarded(fns: list, concurrent: bool, timeout: float) -> list[str | None]:
    """Run environment calls, each failure confined to its own episode (see the module docstring)."""
    if concurrent:
        return _call_threads(fns, timeout)
    return [_call_threads([fn], timeout)[0] for fn in fns]


def rollout(team: Team, engine: "Engine | TeamModel", make_env: Callable[[], TeamEnv], resets: list[tuple[int, dict]],
            sampling: Sampling, horizon: int, generator: torch.Generator | None = None,
            on_turn: Callable[[Turn], None] | None = None, env_timeout_s: float = 300.0, fast: bool = True,
            schedule: str = "barrier") -> Rollout:
    """Play one episode per ``(seed, options)`` in ``resets``, all concurrently.

    ``engine`` generates the replies (:mod:`marft.engines`; a :class:`TeamModel` is served by the
    HF engine). ``horizon`` bounds the steps (the environment normally ends its episodes itself).
    ``on_turn`` is called with every :class:`Turn` once its replies are in (progress display).
    ``env_timeout_s`` bounds each ``reset`` and ``step`` of an episode's environment. ``fast``
    False (HF engine built here): the plain sampling loop, kept to measure against.

    ``schedule``: ``barrier`` plays agent i of step t for every episode in one batch, so every
    episode waits for the batch's longest reply; ``async`` (engines with a queue, such as vLLM)
    moves each episode to its next agent as soon as its own reply is back. Both return the same
    shape: one :class:`Turn` per (t, i) with that micro-step's episodes in episode order. Each
    request's sampling seed is a function of (``generator``'s first draw, episode, t, i), not of
    the order requests finish in, so an asynchronous rollout is reproducible."""
    if isinstance(engine, TeamModel):
        engine = HFEngine(engine, fast=fast)
    if schedule not in ("barrier", "async"):
        raise ValueError(f"unknown rollout schedule {schedule!r}; expected 'barrier' or 'async'")
    start = time.perf_counter()
    envs = [make_env() for _ in resets]
    if envs and getattr(envs[0], "workflow_fn", None) is not None:  # task.kind workflow: the user's program plays
        from ..serving.workflow import workflow_rollout

        out = workflow_rollout(team, engine, envs, resets, sampling, generator, env_timeout_s)
        out.seconds = time.perf_counter() - start  # gen_seconds, gen_flops: the endpoint's generation
        if on_turn:
            for turn in out.turns:
                on_turn(turn)
        return out
    E, H, N = len(envs), horizon, len(team.agents)
    concurrent = bool(envs) and getattr(envs[0], "concurrent_steps", False)
    failed = torch.zeros(E, dtype=torch.bool)
    infos: list[dict] = [{} for _ in range(E)]

    def fail(e: int, error: str | None) -> bool:
        if error is not None and not failed[e]:
            failed[e] = True
            infos[e] = {"success": False, "extracted": False, "error": error}
        return bool(failed[e])

    for e, err in enumerate(_guarded([lambda env=env, r=r: env.reset(seed=r[0], options=r[1])
                                      for env, r in zip(envs, resets)], concurrent, env_timeout_s)):
        fail(e, err)
    rewards = torch.zeros(E, H)
    agent_rewards = torch.zeros(E, H, N)
    dones = torch.zeros(E, H, dtype=torch.bool)
    steps = torch.zeros(E, dtype=torch.long)
    success = torch.zeros(E, dtype=torch.bool)
    extracted = torch.zeros(E, dtype=torch.bool)
    turns: list[Turn] = []
    gen_seconds = gen_flops = 0.0

    def prompt(e: int, agent) -> tuple[str, list[dict]] | None:
        """The global state and the agent's chat for episode e, or None when its environment fails."""
        env, out = envs[e], []

        def read():
            if env.agent_selection != agent.name:
                raise RuntimeError(
                    f"environment expected agent {env.agent_selection!r} but the team's turn is {agent.name!r}; "
                    "environments must follow the agent order they were built with (check with marft env-check)")
            out.append((env.state(), agent_messages(agent, env.observe(agent.name), replies[e])))

        try:
            read()
        except Exception as err:  # noqa: BLE001
            fail(e, _describe(err, env_timeout_s))
            return None
        return out[0]

    replies: list[dict[str, str]] = [{} for _ in range(E)]  # episode -> this step's replies so far

    def end_step(e: int, t: int) -> None:
        """Every agent has acted at step t of episode e: its rewards and whether it ended."""
        env = envs[e]
        r = [float(env.rewards.get(a, 0.0)) for a in team.names]
        agent_rewards[e, t] = torch.tensor(r)
        rewards[e, t] = sum(r) / N
        info = env.infos.get(team.names[-1], {})
        infos[e] = info
        success[e] = bool(info.get("success", False))
        extracted[e] = bool(info.get("extracted", False))
        steps[e] = t + 1
        dones[e, t] = not env.agents

    if schedule == "async":
        turns, gen_seconds, gen_flops = _play_async(team, engine, envs, sampling, H, generator, on_turn,
                                                    env_timeout_s, prompt, replies, fail, end_step)
    for t in range(H if schedule == "barrier" else 0):
        active = [e for e in range(E) if not failed[e] and envs[e].agents]
        if not active:
            break
        for e in active:
            replies[e] = {}
        for agent in team.agents:
            read = {e: prompt(e, agent) for e in active}
            active = [e for e in active if read[e] is not None]
            if not active:
                break
            states = [read[e][0] for e in active]
            chats = [read[e][1] for e in active]
            g0 = time.perf_counter()
            out = engine.generate(agent.name, chats, _limited(sampling, agent), generator)
            gen_flops += engine.flops(agent.name, out)
            gen_seconds += time.perf_counter() - g0
            for e, text in zip(active, out.texts):
                replies[e][agent.name] = text
            errors = _guarded([lambda env=envs[e], x=text: env.step(x) for e, text in zip(active, out.texts)],
                              concurrent, env_timeout_s)
            turn = _turn(t, agent.name, active, out, states)
            turns.append(turn)
            if on_turn:
                on_turn(turn)
            active = [e for e, err in zip(active, errors) if not fail(e, err)]
        for e in active:
            end_step(e, t)
    # an episode still running at the horizon ends there
    for e in range(E):
        if failed[e]:
            steps[e] = max(int(steps[e]), 1)  # what a failed episode held is not trained on (Rollout.select)
            rewards[e], agent_rewards[e], success[e], extracted[e] = 0.0, 0.0, False, False
        if steps[e] > 0:
            dones[e, steps[e] - 1] = True
    return Rollout(turns, rewards, agent_rewards, dones, steps, success, extracted,
                   time.perf_counter() - start, gen_seconds, infos, failed, gen_flops,
                   [str(r[1].get("task", "")) for r in resets])


def _limited(sampling: Sampling, agent) -> Sampling:
    """The rollout's sampling with the agent's own reply limit, where it has one."""
    return dataclasses.replace(sampling, max_new_tokens=agent.max_new_tokens) if agent.max_new_tokens else sampling


def _turn(t: int, agent: str, episodes: list[int], out, states: list[str]) -> Turn:
    return Turn(t, agent, torch.tensor(episodes, dtype=torch.long), out.prompt_ids.cpu(), out.prompt_mask.cpu(),
                out.response_ids.cpu(), out.response_mask.cpu(), out.logprobs.cpu(), out.truncated.cpu(),
                out.texts, states)


def _request_seed(base: int, e: int, t: int, i: int) -> int:
    return (base * 1_000_003 + e * 7_919 + t * 104_729 + i * 15_485_863) % 2**31


def _play_async(team, engine, envs, sampling, H, generator, on_turn, env_timeout_s, prompt, replies, fail, end_step):
    """The asynchronous schedule: each episode's next request goes to the engine as soon as its
    previous reply is back and its environment has stepped. Returns (turns, generation seconds,
    generation FLOPs); the turns are grouped by micro-step (t, i) as the barrier schedule's."""
    if not getattr(engine, "asynchronous", False):
        raise ValueError(f"rollout.schedule async needs an engine with a request queue (vllm); the {engine.name} engine has none")
    base = int(torch.randint(2**31, (1,), generator=generator))
    agents = team.agents
    rows: dict[tuple[int, int], list[tuple[int, Reply, str]]] = {}  # (t, i) -> (episode, reply, state)
    pending = 0

    def send(e: int, t: int, i: int) -> bool:
        nonlocal pending
        read = prompt(e, agents[i])
        if read is None:
            return False
        state, chat = read
        engine.submit((e, t, i, state), agents[i].name, chat, _limited(sampling, agents[i]), _request_seed(base, e, t, i))
        pending += 1
        return True

    for e, env in enumerate(envs):
        if not fail(e, None) and env.agents and H > 0:
            replies[e] = {}
            send(e, 0, 0)
    gen_seconds = 0.0
    while pending:
        g0 = time.perf_counter()
        done = engine.collect()
        gen_seconds += time.perf_counter() - g0
        for (e, t, i, state), reply in done:
            pending -= 1
            rows.setdefault((t, i), []).append((e, reply, state))
            replies[e][agents[i].name] = reply.text
            error = _guarded([lambda env=envs[e], x=reply.text: env.step(x)], False, env_timeout_s)[0]
            if fail(e, error):
                continue
            if i + 1 < len(agents):
                send(e, t, i + 1)
                continue
            end_step(e, t)
            if envs[e].agents and t + 1 < H:
                replies[e] = {}
                send(e, t + 1, 0)
    turns, gen_flops = [], 0.0
    pad = getattr(engine, "pad_id", 0)
    for (t, i) in sorted(rows):
        got = sorted(rows[(t, i)], key=lambda x: x[0])
        out = pack([r for _, r, _ in got], pad)
        gen_flops += engine.flops(agents[i].name, out)
        turn = _turn(t, agents[i].name, [e for e, _, _ in got], out, [s for _, _, s in got])
        turns.append(turn)
        if on_turn:
            on_turn(turn)
    return turns, gen_seconds, gen_flops
