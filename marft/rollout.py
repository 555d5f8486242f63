"""Rollout: the team plays a batch of episodes and returns a typed batch of tensors.

For every environment step t, and every agent i in the team's acting order, the prompts of all
episodes still running are built (environment observation + the replies of i's predecessors,
through the tokenizer's chat template) and generated in one batched call with i's adapter active.
Each (t, i) is one micro-step k of MARFT and becomes one :class:`Turn`.

Rollout only reads the team's current weights; a distributed worker wraps :func:`rollout` after
loading adapter weights with :meth:`marft.models.TeamModel.load_adapter_state`.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from .envs.base import TeamEnv
from .generation import Sampling, generate
from .models import TeamModel, stop_token_ids
from .team import Team, agent_messages


@dataclass
class Turn:
    """One agent's replies at one step, for every episode that was still running: micro-step (t, i).

    ``b`` rows (b <= number of episodes); P, R prompt and response lengths."""

    step: int  # t
    agent: str
    episodes: torch.Tensor  # [b] long: which episode each row belongs to
    prompt_ids: torch.Tensor  # [b, P] left-padded
    prompt_mask: torch.Tensor  # [b, P] bool
    response_ids: torch.Tensor  # [b, R] right-padded, with the end-of-turn token
    response_mask: torch.Tensor  # [b, R] bool
    logprobs: torch.Tensor  # [b, R] float32 rollout log-probabilities, 0 where masked
    truncated: torch.Tensor  # [b] bool: cut at max_new_tokens
    texts: list[str]  # decoded replies
    states: list[str]  # global state (whole transcript) before the agent acted, for a centralised critic


@dataclass
class Rollout:
    """A batch of E episodes of at most H steps; N agents."""

    turns: list[Turn]  # in execution order: (0, agent 0), (0, agent 1), ..., (1, agent 0), ...
    rewards: torch.Tensor  # [E, H] team reward r_t of each step (0 after the episode ended)
    agent_rewards: torch.Tensor  # [E, H, N] each agent's reward, team order
    dones: torch.Tensor  # [E, H] bool: the episode ended after step t
    steps: torch.Tensor  # [E] long: steps the episode took
    success: torch.Tensor  # [E] bool: the team's final answer was right
    extracted: torch.Tensor  # [E] bool: an answer could be read from the final graded reply
    seconds: float = 0.0  # wall time of the rollout
    gen_seconds: float = 0.0  # of which in generation
    infos: list[dict] = field(default_factory=list)  # the last info of each episode

    @property
    def generated_tokens(self) -> int:
        return int(sum(t.response_mask.sum() for t in self.turns))


def _step_all(envs: list[TeamEnv], texts: list[str]) -> None:
    """``env.step(text)`` for each pair; in threads when the environment allows it (code tasks
    spend the step waiting for their sandboxed programs)."""
    if len(envs) > 1 and getattr(envs[0], "concurrent_steps", False):
        with ThreadPoolExecutor(min(len(envs), 16)) as pool:
            list(pool.map(lambda pair: pair[0].step(pair[1]), zip(envs, texts)))
    else:
        for env, text in zip(envs, texts):
            env.step(text)


def rollout(team: Team, models: TeamModel, make_env: Callable[[], TeamEnv], resets: list[tuple[int, dict]],
            sampling: Sampling, horizon: int, generator: torch.Generator | None = None,
            on_turn: Callable[[Turn], None] | None = None) -> Rollout:
    """Play one episode per ``(seed, options)`` in ``resets``, all concurrently.

    ``horizon`` bounds the steps (the environment normally ends its episodes itself). ``on_turn`` is
    called after every batched agent turn (progress display)."""
    start = time.perf_counter()
    envs = [make_env() for _ in resets]
    for env, (seed, options) in zip(envs, resets):
        env.reset(seed=seed, options=options)
    E, H, N = len(envs), horizon, len(team.agents)
    rewards = torch.zeros(E, H)
    agent_rewards = torch.zeros(E, H, N)
    dones = torch.zeros(E, H, dtype=torch.bool)
    steps = torch.zeros(E, dtype=torch.long)
    success = torch.zeros(E, dtype=torch.bool)
    extracted = torch.zeros(E, dtype=torch.bool)
    infos: list[dict] = [{} for _ in range(E)]
    turns: list[Turn] = []
    gen_seconds = 0.0
    for t in range(H):
        active = [e for e in range(E) if envs[e].agents]
        if not active:
            break
        replies: list[dict[str, str]] = [{} for _ in range(E)]
        for agent in team.agents:
            for e in active:
                if envs[e].agent_selection != agent.name:
                    raise RuntimeError(
                        f"environment expected agent {envs[e].agent_selection!r} but the team's turn is {agent.name!r}; "
                        "environments must follow the agent order they were built with (check with marft env-check)")
            states = [envs[e].state() for e in active]
            chats = [agent_messages(agent, envs[e].observe(agent.name), replies[e]) for e in active]
            g0 = time.perf_counter()
            with models.acting(agent.name) as (model, tok):
                out = generate(model, tok, chats, sampling, stop_token_ids(model, tok), generator)
            gen_seconds += time.perf_counter() - g0
            for e, text in zip(active, out.texts):
                replies[e][agent.name] = text
            _step_all([envs[e] for e in active], out.texts)
            turn = Turn(t, agent.name, torch.tensor(active), out.prompt_ids.cpu(), out.prompt_mask.cpu(),
                        out.response_ids.cpu(), out.response_mask.cpu(), out.logprobs.cpu(),
                        out.truncated.cpu(), out.texts, states)
            turns.append(turn)
            if on_turn:
                on_turn(turn)
        for e in active:
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
    # an episode still running at the horizon ends there
    for e in range(E):
        if steps[e] > 0:
            dones[e, steps[e] - 1] = True
    return Rollout(turns, rewards, agent_rewards, dones, steps, success, extracted,
                   time.perf_counter() - start, gen_seconds, infos)
