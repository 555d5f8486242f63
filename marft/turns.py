"""The rollout's typed batch: one :class:`Turn` per micro-step (t, i) (agent i's replies at
environment step t, for every episode still running) and one :class:`Rollout` per batch of
episodes; :func:`merge_rollouts` joins the shards that rollout workers played. Made by
:func:`marft.run.rollout.rollout` and by a workflow rollout (:mod:`marft.serving.workflow`), read by the
algorithms and the learner."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    messages: list[list[dict]] | None = None  # an agent program's turns: the chat messages it sent (None: marft's team loop)
    versions: torch.Tensor | None = None  # [b] long: the adapter version (policy updates so far) that generated each reply; None: the current one (a synchronous run)


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
    failed: torch.Tensor | None = None  # [E] bool: the environment raised or timed out (see the module docstring)
    gen_flops: float = 0.0  # FLOPs the generation needed (marft.engines.flops: prefill + decode, no padding)
    tasks: list[str] | None = None  # [E] the task of each episode in a mixture (its reset's options["task"]); "" otherwise

    def __post_init__(self):
        if self.failed is None:
            self.failed = torch.zeros(len(self.steps), dtype=torch.bool)
        if self.tasks is None:
            self.tasks = [""] * len(self.steps)

    def select(self, keep: torch.Tensor) -> "Rollout":
        """The rollout restricted to the episodes where ``keep`` [E] is True, renumbered in order."""
        new_index = torch.full((len(keep),), -1, dtype=torch.long)
        new_index[keep] = torch.arange(int(keep.sum()))
        turns = []
        for t in self.turns:
            rows = keep[t.episodes].nonzero().flatten()
            if len(rows) == 0:
                continue
            r = rows.tolist()
            turns.append(Turn(t.step, t.agent, new_index[t.episodes[rows]], t.prompt_ids[rows], t.prompt_mask[rows],
                              t.response_ids[rows], t.response_mask[rows], t.logprobs[rows], t.truncated[rows],
                              [t.texts[i] for i in r], [t.states[i] for i in r],
                              None if t.messages is None else [t.messages[i] for i in r],
                              None if t.versions is None else t.versions[rows]))
        idx = keep.nonzero().flatten().tolist()
        return Rollout(turns, self.rewards[keep], self.agent_rewards[keep], self.dones[keep], self.steps[keep],
                       self.success[keep], self.extracted[keep], self.seconds, self.gen_seconds,
                       [self.infos[i] for i in idx], self.failed[keep], self.gen_flops, [self.tasks[i] for i in idx])

    @property
    def generated_tokens(self) -> int:
        return int(sum(t.response_mask.sum() for t in self.turns))


def _pad_rows(tensors: list[torch.Tensor], width: int, left: bool) -> torch.Tensor:
    """[b_k, w_k] tensors stacked to [sum b_k, width], zero-padded on the left or the right."""
    pad = lambda x: torch.nn.functional.pad(x, (width - x.shape[1], 0) if left else (0, width - x.shape[1]))  # noqa: E731
    return torch.cat([pad(x) for x in tensors])


def merge_rollouts(parts: list[Rollout], agents: list[str]) -> Rollout:
    """Rollouts of consecutive shards of one batch of episodes (the rollout workers' shares) as one:
    episodes renumbered in shard order, each micro-step's rows side by side (prompts left-padded,
    replies right-padded to the widest shard); ``agents`` gives the acting order. Wall times are the
    slowest shard's (the shards ran at once); FLOPs add up. One part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += len(part.steps)
    by_key: dict[tuple[int, str], list[tuple[int, Turn]]] = {}
    for k, part in enumerate(parts):
        for t in part.turns:
            by_key.setdefault((t.step, t.agent), []).append((offsets[k], t))
    turns = []
    for step, agent in sorted(by_key, key=lambda key: (key[0], agents.index(key[1]))):
        got = by_key[(step, agent)]
        ts = [t for _, t in got]
        P = max(t.prompt_ids.shape[1] for t in ts)
        R = max(t.response_ids.shape[1] for t in ts)
        turns.append(Turn(step, agent, torch.cat([t.episodes + off for off, t in got]),
                          _pad_rows([t.prompt_ids for t in ts], P, True), _pad_rows([t.prompt_mask for t in ts], P, True),
                          _pad_rows([t.response_ids for t in ts], R, False), _pad_rows([t.response_mask for t in ts], R, False),
                          _pad_rows([t.logprobs for t in ts], R, False), torch.cat([t.truncated for t in ts]),
                          [x for t in ts for x in t.texts], [x for t in ts for x in t.states],
                          None if all(t.messages is None for t in ts) else
                          [x for t in ts for x in (t.messages or [None] * len(t.texts))],
                          None if all(t.versions is None for t in ts) else
                          torch.cat([t.versions if t.versions is not None else torch.full((len(t.texts),), -1) for t in ts])))
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return Rollout(turns, cat("rewards"), cat("agent_rewards"), cat("dones"), cat("steps"), cat("success"),
                   cat("extracted"), max(p.seconds for p in parts), max(p.gen_seconds for p in parts),
                   [i for p in parts for i in p.infos], cat("failed"), sum(p.gen_flops for p in parts),
                   [x for p in parts for x in p.tasks])
