"""Rollout: the team plays a batch of episodes and returns a typed batch of tensors.

:func:`play` is what training, a distributed rollout worker and ``marft env-check`` call: it
builds the run's sampling and a sampler seeded with the given seed, and hands the episodes to the
episode runner of the run's task kind (:func:`episode_runner`): :func:`rollout`, the team loop, or
for ``task.kind: workflow`` :func:`workflow_episodes`, the user's agent program played against the
team served as an endpoint (:func:`marft.serving.workflow.workflow_rollout`). Both runners take
the same arguments and return a :class:`Rollout`.

The team loop (:func:`rollout`): for every environment step t, and every agent i in the team's
acting order, each episode still running builds agent i's prompt (environment observation + the
replies of i's predecessors, through the tokenizer's chat template) and an engine
(:mod:`marft.engines`) generates the reply with i's adapter. Each (t, i) is one micro-step k of
MARFT and becomes one :class:`Turn`. Its pieces: :class:`_Batch` holds one batch's episodes (their
environments, which failed, this step's replies, rewards, ends and outcomes) with ``fail``,
``prompt`` (agent i's observation), ``end_step`` and ``finish`` (the :class:`Rollout`); two
schedules play it: :func:`_play_barrier` generates (t, i) for every episode in one batched call, so
each waits for the batch's longest reply; :func:`_play_async` lets every episode advance on its own
as its replies come back (engines with a request queue: vLLM), the asynchrony of a Flex-MG.

Rollout only reads the team's current weights; a distributed worker calls :func:`play` after
loading adapter weights with :meth:`marft.engines.models.TeamModel.load_adapter_state`.

Environment faults fail one episode, not the run: an exception from ``reset``, ``observe``,
``state`` or ``step``, or a ``reset``/``step`` that takes longer than ``env_timeout_s``, ends that
episode with ``failed[e] = True`` and the error text in ``infos[e]["error"]``; the trainer leaves
failed episodes out of the update and counts them. A timed-out call is abandoned and an exception
is raised inside it (Python code stops at its next bytecode; a call blocked inside C code, such as
a socket read, stops when that returns). To make this possible every such call runs in a worker
thread (:func:`marft.envs.guard.guarded`): one at a time, or all episodes at once for environments with
``concurrent_steps``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from ..envs.base import TeamEnv
from ..envs.guard import describe, guarded
from ..engines.base import Engine, Reply, pack
from ..engines.hf import HFEngine
from ..engines.generation import Sampling
from ..engines.models import TeamModel
from ..serving.workflow import workflow_rollout
from ..team import Team, agent_messages
from ..turns import Rollout, Turn
from .config import RunConfig, horizon, is_workflow


EpisodeRunner = Callable[..., Rollout]
"""An episode runner: ``runner(team, engine, make_env, resets, sampling, horizon, generator=None,
on_turn=None, env_timeout_s=300.0, fast=True, schedule="barrier") -> Rollout``
(:func:`rollout` or :func:`workflow_episodes`)."""


def play(cfg: RunConfig, team, engine: Engine, make_env, resets: list[tuple[int, dict]], seed: int) -> Rollout:
    """Play the episodes ``resets`` with ``engine`` under ``cfg.rollout``'s sampling, the sampler
    seeded with ``seed``, by the runner of the run's task kind (:func:`episode_runner`): what the
    trainer, a rollout worker of :mod:`marft.distributed` and ``marft env-check`` run."""
    r = cfg.rollout
    sampling = Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens, tuple(r.stop))
    generator = torch.Generator().manual_seed(seed)
    return episode_runner(cfg)(team, engine, make_env, resets, sampling, horizon(cfg), generator,
                               env_timeout_s=r.env_timeout_s, schedule=r.schedule)


def episode_runner(cfg: RunConfig) -> EpisodeRunner:
    """What plays ``cfg``'s episodes: :func:`workflow_episodes` for a workflow task (the user's
    agent program), else :func:`rollout` (the team loop)."""
    return workflow_episodes if is_workflow(cfg) else rollout


def workflow_episodes(team: Team, engine: "Engine | TeamModel", make_env: Callable[[], TeamEnv],
                      resets: list[tuple[int, dict]], sampling: Sampling, horizon: int,
                      generator: torch.Generator | None = None, on_turn: Callable[[Turn], None] | None = None,
                      env_timeout_s: float = 300.0, fast: bool = True, schedule: str = "barrier") -> Rollout:
    """The episodes of a workflow task (``task.kind: workflow``, ``make_env`` building
    :class:`marft.envs.workflow.WorkflowEnv`): the user's program plays each problem against the
    team served on ``engine`` (:func:`marft.serving.workflow.workflow_rollout`); ``env_timeout_s``
    bounds each episode's program. The arguments are :func:`rollout`'s; the program decides its
    own calls, so ``horizon`` and ``schedule`` are not read (``schedule`` is checked). ``on_turn``
    is called with every :class:`Turn` once the batch is played."""
    engine = _engine(engine, fast, schedule)
    start = time.perf_counter()
    envs = [make_env() for _ in resets]
    if not envs:  # no episodes: the empty batch, as the team loop plays it
        return _play_team(team, engine, envs, resets, sampling, horizon, generator, on_turn, env_timeout_s,
                          schedule, start)
    out = workflow_rollout(team, engine, envs, resets, sampling, generator, env_timeout_s)
    out.seconds = time.perf_counter() - start  # gen_seconds, gen_flops: the endpoint's generation
    if on_turn:
        for turn in out.turns:
            on_turn(turn)
    return out


def rollout(team: Team, engine: "Engine | TeamModel", make_env: Callable[[], TeamEnv], resets: list[tuple[int, dict]],
            sampling: Sampling, horizon: int, generator: torch.Generator | None = None,
            on_turn: Callable[[Turn], None] | None = None, env_timeout_s: float = 300.0, fast: bool = True,
            schedule: str = "barrier") -> Rollout:
    """The team loop: play one episode per ``(seed, options)`` in ``resets``, all concurrently.

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
    the order requests finish in, so an asynchronous rollout is reproducible.

    A workflow task's episodes are played by :func:`workflow_episodes` (:func:`episode_runner`
    chooses), not here."""
    engine = _engine(engine, fast, schedule)
    start = time.perf_counter()
    envs = [make_env() for _ in resets]
    return _play_team(team, engine, envs, resets, sampling, horizon, generator, on_turn, env_timeout_s, schedule, start)


def _engine(engine: "Engine | TeamModel", fast: bool, schedule: str) -> Engine:
    """The engine to generate with (a :class:`TeamModel` served by the HF engine), once the
    schedule is known to be one there is."""
    if isinstance(engine, TeamModel):
        engine = HFEngine(engine, fast=fast)
    if schedule not in ("barrier", "async"):
        raise ValueError(f"unknown rollout schedule {schedule!r}; expected 'barrier' or 'async'")
    return engine


def _play_team(team: Team, engine: Engine, envs: list[TeamEnv], resets: list[tuple[int, dict]], sampling: Sampling,
               horizon: int, generator: torch.Generator | None, on_turn: Callable[[Turn], None] | None,
               env_timeout_s: float, schedule: str, start: float) -> Rollout:
    """The team loop on environments already built (``start``: when the rollout began)."""
    batch = _Batch(team, envs, resets, horizon, env_timeout_s)
    batch.reset()
    play_schedule = _play_async if schedule == "async" else _play_barrier
    turns, gen_seconds, gen_flops = play_schedule(batch, engine, sampling, generator, on_turn)
    return batch.finish(turns, start, gen_seconds, gen_flops)


class _Batch:
    """One batch's episodes in the team loop: their environments, which have failed (and why, in
    ``infos``), each episode's replies of the step it is in, and per episode and step the team's and
    each agent's rewards, the steps taken, whether and where it ended, and its outcome."""

    def __init__(self, team: Team, envs: list[TeamEnv], resets: list[tuple[int, dict]], horizon: int,
                 env_timeout_s: float):
        E, H, N = len(envs), horizon, len(team.agents)
        self.team, self.envs, self.resets, self.H, self.timeout = team, envs, resets, H, env_timeout_s
        self.concurrent = bool(envs) and getattr(envs[0], "concurrent_steps", False)
        self.failed = torch.zeros(E, dtype=torch.bool)
        self.infos: list[dict] = [{} for _ in range(E)]
        self.replies: list[dict[str, str]] = [{} for _ in range(E)]  # episode -> this step's replies so far
        self.rewards = torch.zeros(E, H)
        self.agent_rewards = torch.zeros(E, H, N)
        self.dones = torch.zeros(E, H, dtype=torch.bool)
        self.steps = torch.zeros(E, dtype=torch.long)
        self.success = torch.zeros(E, dtype=torch.bool)
        self.extracted = torch.zeros(E, dtype=torch.bool)

    def reset(self) -> None:
        """Every environment reset to its ``(seed, options)``; one that fails fails its episode."""
        errors = guarded([lambda env=env, r=r: env.reset(seed=r[0], options=r[1])
                           for env, r in zip(self.envs, self.resets)], self.concurrent, self.timeout)
        for e, err in enumerate(errors):
            self.fail(e, err)

    def fail(self, e: int, error: str | None) -> bool:
        """Fail episode e with ``error`` (None: no error); whether it has failed."""
        if error is not None and not self.failed[e]:
            self.failed[e] = True
            self.infos[e] = {"success": False, "extracted": False, "error": error}
        return bool(self.failed[e])

    def step(self, episodes: list[int], texts: list[str], concurrent: bool) -> list[str | None]:
        """Each episode's environment stepped with its reply (guarded); each one's error or None."""
        return guarded([lambda env=self.envs[e], x=text: env.step(x) for e, text in zip(episodes, texts)],
                        concurrent, self.timeout)

    def prompt(self, e: int, agent) -> tuple[str, list[dict]] | None:
        """The global state and the agent's chat for episode e, or None when its environment fails."""
        env = self.envs[e]
        try:
            if env.agent_selection != agent.name:
                raise RuntimeError(
                    f"environment expected agent {env.agent_selection!r} but the team's turn is {agent.name!r}; "
                    "environments must follow the agent order they were built with (check with marft env-check)")
            return env.state(), agent_messages(agent, env.observe(agent.name), self.replies[e])
        except Exception as err:  # noqa: BLE001
            self.fail(e, describe(err, self.timeout))
            return None

    def end_step(self, e: int, t: int) -> None:
        """Every agent has acted at step t of episode e: its rewards and whether it ended."""
        env, names = self.envs[e], self.team.names
        r = [float(env.rewards.get(a, 0.0)) for a in names]
        self.agent_rewards[e, t] = torch.tensor(r)
        self.rewards[e, t] = sum(r) / len(self.team.agents)
        info = env.infos.get(names[-1], {})
        self.infos[e] = info
        self.success[e] = bool(info.get("success", False))
        self.extracted[e] = bool(info.get("extracted", False))
        self.steps[e] = t + 1
        self.dones[e, t] = not env.agents

    def finish(self, turns: list[Turn], start: float, gen_seconds: float, gen_flops: float) -> Rollout:
        """The batch as a :class:`Rollout`: an episode still running at the horizon ends there, and
        what a failed episode held is not trained on (:meth:`Rollout.select`)."""
        for e in range(len(self.envs)):
            if self.failed[e]:
                self.steps[e] = max(int(self.steps[e]), 1)
                self.rewards[e], self.agent_rewards[e], self.success[e], self.extracted[e] = 0.0, 0.0, False, False
            if self.steps[e] > 0:
                self.dones[e, self.steps[e] - 1] = True
        return Rollout(turns, self.rewards, self.agent_rewards, self.dones, self.steps, self.success, self.extracted,
                       time.perf_counter() - start, gen_seconds, self.infos, self.failed, gen_flops,
                       [str(r[1].get("task", "")) for r in self.resets])


def _play_barrier(batch: _Batch, engine: Engine, sampling: Sampling, generator: torch.Generator | None,
                  on_turn: Callable[[Turn], None] | None) -> tuple[list[Turn], float, float]:
    """The barrier schedule: agent i of step t generated for every running episode in one batched
    call. Returns (turns, generation seconds, generation FLOPs)."""
    turns: list[Turn] = []
    gen_seconds = gen_flops = 0.0
    for t in range(batch.H):
        active = [e for e in range(len(batch.envs)) if not batch.failed[e] and batch.envs[e].agents]
        if not active:
            break
        for e in active:
            batch.replies[e] = {}
        for agent in batch.team.agents:
            read = {e: batch.prompt(e, agent) for e in active}
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
                batch.replies[e][agent.name] = text
            errors = batch.step(active, out.texts, batch.concurrent)
            turn = _turn(t, agent.name, active, out, states)
            turns.append(turn)
            if on_turn:
                on_turn(turn)
            active = [e for e, err in zip(active, errors) if not batch.fail(e, err)]
        for e in active:
            batch.end_step(e, t)
    return turns, gen_seconds, gen_flops


def _limited(sampling: Sampling, agent) -> Sampling:
    """The rollout's sampling with the agent's own reply limit, where it has one."""
    return dataclasses.replace(sampling, max_new_tokens=agent.max_new_tokens) if agent.max_new_tokens else sampling


def _turn(t: int, agent: str, episodes: list[int], out, states: list[str]) -> Turn:
    """Micro-step (t, agent) of ``episodes`` from the engine's batch ``out``; an engine that stamps
    its batches with the adapter version that generated them (asynchronous training:
    :mod:`marft.run.asynchronous`) has that version recorded on every row."""
    version = getattr(out, "version", None)
    return Turn(t, agent, torch.tensor(episodes, dtype=torch.long), out.prompt_ids.cpu(), out.prompt_mask.cpu(),
                out.response_ids.cpu(), out.response_mask.cpu(), out.logprobs.cpu(), out.truncated.cpu(),
                out.texts, states, versions=None if version is None else torch.full((len(episodes),), version))


def _request_seed(base: int, e: int, t: int, i: int) -> int:
    return (base * 1_000_003 + e * 7_919 + t * 104_729 + i * 15_485_863) % 2**31


def _play_async(batch: _Batch, engine: Engine, sampling: Sampling, generator: torch.Generator | None,
                on_turn: Callable[[Turn], None] | None) -> tuple[list[Turn], float, float]:
    """The asynchronous schedule: each episode's next request goes to the engine as soon as its
    previous reply is back and its environment has stepped. Returns (turns, generation seconds,
    generation FLOPs); the turns are grouped by micro-step (t, i) as the barrier schedule's."""
    if not getattr(engine, "asynchronous", False):
        raise ValueError(f"rollout.schedule async needs an engine with a request queue (vllm); the {engine.name} engine has none")
    base = int(torch.randint(2**31, (1,), generator=generator))
    agents, H = batch.team.agents, batch.H
    rows: dict[tuple[int, int], list[tuple[int, Reply, str]]] = {}  # (t, i) -> (episode, reply, state)
    pending = 0
    for e, env in enumerate(batch.envs):
        if not batch.failed[e] and env.agents and H > 0:
            batch.replies[e] = {}
            pending += _submit(batch, engine, sampling, base, e, 0, 0)
    gen_seconds = 0.0
    while pending:
        g0 = time.perf_counter()
        done = engine.collect()
        gen_seconds += time.perf_counter() - g0
        for (e, t, i, state), reply in done:
            pending -= 1
            rows.setdefault((t, i), []).append((e, reply, state))
            batch.replies[e][agents[i].name] = reply.text
            if batch.fail(e, batch.step([e], [reply.text], False)[0]):
                continue
            if i + 1 < len(agents):
                pending += _submit(batch, engine, sampling, base, e, t, i + 1)
                continue
            batch.end_step(e, t)
            if batch.envs[e].agents and t + 1 < H:
                batch.replies[e] = {}
                pending += _submit(batch, engine, sampling, base, e, t + 1, 0)
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


def _submit(batch: _Batch, engine: Engine, sampling: Sampling, base: int, e: int, t: int, i: int) -> bool:
    """Episode e's request for agent i at step t sent to the engine (its seed from ``base``, e, t,
    i); False when its environment fails reading the prompt (nothing sent)."""
    agent = batch.team.agents[i]
    read = batch.prompt(e, agent)
    if read is None:
        return False
    state, chat = read
    engine.submit((e, t, i, state), agent.name, chat, _limited(sampling, agent), _request_seed(base, e, t, i))
    return True
