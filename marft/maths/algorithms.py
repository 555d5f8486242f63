"""The training algorithms (``train.algorithm``): one :class:`Algorithm` each, in :data:`ALGORITHMS`.

An algorithm is what the trainer (:mod:`marft.run.trainer`), the learner (:mod:`marft.run.learner`) and
the config's validation need to know about it, in one place:

* ``critic``: ``"team"``, one centralised value head reading the global state (the whole
  transcript); ``"agent"``, one head per agent over its own observation (IPPO); or ``None``,
  critic-free;
* ``token_level``: the policy loss per generated token (advantages [b, R]) or per action ([b]);
* ``grouped``: the episodes of an iteration are drawn ``train.group_size`` at a time from one
  problem (the critic-free group baselines); a failed episode then takes its whole group out of the
  update;
* ``whiten``: how ``train.normalize_advantages`` normalises the advantages before the update:
  ``"batch"`` over the whole batch's turns, ``"agent"`` over each agent's own turns, ``"episode"``
  with the batch's mean and std taken over one turn per episode and agent (where all the turns of
  an episode share its advantage, an episode of more turns would otherwise weigh more);
* ``targets``: steps 2-4 of an iteration, a function ``(TargetInputs, Rollout) -> [TurnTargets]``
  (rewards credited, the critic's values, advantages and returns for every turn); the maths is in
  :mod:`marft.maths.advantages`.

Adding an algorithm is one entry in :data:`ALGORITHMS` (and its maths in :mod:`marft.maths.advantages`):
the config's validation (the names, and ``rollout.episodes`` a multiple of ``train.group_size`` for
a grouped one), the trainer (and through it the Ray driver of :mod:`marft.distributed`) and the
learner read it from there.

The algorithms:

* ``marft``: action-level MARFT, GAE over micro-steps with the centralised critic;
* ``marft-token``: token-level MARFT, every generated token a micro-step;
* ``ippo``: independent PPO, a critic per agent over its own observation, GAE over its own steps;
* ``grpo``: the team's episode return against the others of its group of one problem (GRPO's
  mean and std, or RLOO's leave-one-out mean: ``train.group_baseline``), the same advantage for
  every turn of the episode;
* ``dr-mas``: Dr. MAS (Feng et al., arXiv 2602.08847; code github.com/langfengQ/DrMAS):
  GRPO's group-relative advantage with the mean and std taken per agent, over that agent's own
  turns in the group of one problem, each turn valued at the agent's own episode return
  (:func:`marft.maths.advantages.agent_group_advantages`). As in the paper, an agent's statistics count
  every turn it took, so an episode of two steps weighs twice. Where marft differs: a group of one
  sample gets advantage 0 (as marft's ``grpo``); and ``train.normalize_advantages`` (on by default,
  as for the other algorithms) then whitens each agent's advantages over the batch, per agent, where
  the paper stops at the group normalisation (``train.normalize_advantages=false`` gives exactly the
  paper's advantages).
* ``at-grpo``: AT-GRPO (Zhao et al., arXiv 2510.11062; code github.com/pettingllms-ai/PettingLLMs):
  one group per (problem, agent, step); each turn is credited with its own reward of that step
  (the environment's reward for that agent, which is the team reward in marft's team tasks) and
  compared with the same agent's turns at the same step of the same problem
  (:func:`marft.maths.advantages.turn_group_advantages`). Where marft differs: the paper samples K
  candidate replies from one shared state at every turn (tree sampling) and continues the episode
  from the best; marft samples ``train.group_size`` whole episodes per problem, as ``grpo`` does,
  with no branching from a shared state. So at step t > 0 the members of a group have each their
  own history (their own earlier attempts and feedback), an agent after the first of a step reads
  its own predecessors' replies, and groups shrink as episodes end: a step that only one episode of
  the group reached gives that turn advantage 0. The paper's mixing of a team and a local reward
  (alpha * team + local) is left to the environment, whose per-agent rewards are used as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import advantages as adv_fns
from . import losses
from .critic import ValueHead, prompt_features, state_features, token_features

if TYPE_CHECKING:
    from ..engines.models import TeamModel
    from ..engines.packing import PassWork
    from ..turns import Rollout, Turn


@dataclass
class TurnTargets:
    """What the update needs for one :class:`marft.run.rollout.Turn`, row-aligned with it."""

    features: torch.Tensor  # [b, H] or [b, R, H] (token level); [0] without a critic
    values: torch.Tensor  # [b] or [b, R]: critic values at rollout time (0 without a critic)
    advantages: torch.Tensor  # [b] or [b, R]
    returns: torch.Tensor  # [b] or [b, R] (0 without a critic)


@dataclass
class TargetInputs:
    """What an algorithm's ``targets`` reads besides the rollout."""

    train: Any  # marft.run.config.TrainConfig (not imported: the config's validation imports this module)
    agents: list[str]  # the team's names in acting order
    models: "TeamModel"  # for the critic's features (the base model, adapters disabled, or the critic's adapter)
    heads: dict[str, ValueHead]  # the algorithm's value heads (see Algorithm.make_heads)
    work: "PassWork"  # the critic's forward passes add their work here (MFU)
    critic_adapter: str | None = None  # a learning critic's adapter (train.critic: lora); None: the frozen base

    def feature_kw(self) -> dict:
        """The feature functions' keywords: the learning critic's adapter, where there is one."""
        return {} if self.critic_adapter is None else {"adapter": self.critic_adapter}

    def micro_index(self, turn: "Turn") -> int:
        """Micro-step k = t * N + i of a turn."""
        return turn.step * len(self.agents) + self.agents.index(turn.agent)


@dataclass(frozen=True)
class Algorithm:
    """One ``train.algorithm``; see the module docstring for the fields."""

    name: str
    critic: str | None  # "team", "agent" or None
    token_level: bool
    grouped: bool
    whiten: str  # "batch", "agent" or "episode"
    targets: Callable[[TargetInputs, "Rollout"], list[TurnTargets]]

    def make_heads(self, agents: list[str], hidden: int | dict[str, int]) -> dict[str, ValueHead]:
        """The value heads, keyed ``"team"`` (centralised) or by agent; none for a critic-free one.
        ``hidden``: the width of the features, or per agent the width of its base model (an agent's
        head reads its own base; the team's head reads the first agent's, :func:`action_gae`)."""
        width = hidden if isinstance(hidden, dict) else dict.fromkeys(agents, hidden)
        if self.critic == "agent":
            return {a: ValueHead(width[a]) for a in agents}
        if self.critic == "team":
            return {"team": ValueHead(width[agents[0]])}
        return {}

    def critic_features(self, models, turn: "Turn", rows: list[int], adapter: str | None = None, grad: bool = False,
                        work=None) -> torch.Tensor:
        """The critic's features of rows ``rows`` of ``turn``, as :attr:`targets` computes them (the
        global state; at token level with the reply; for IPPO the agent's own prompt), through the
        critic's ``adapter`` (None: the frozen base) and with gradients when ``grad`` (a learning
        critic's update recomputes them for every minibatch)."""
        kw = {"work": work, "grad": grad, **({} if adapter is None else {"adapter": adapter})}
        if self.critic == "agent":
            return prompt_features(models, turn.agent, turn.prompt_ids[rows], turn.prompt_mask[rows], **kw)
        states = [turn.states[r] for r in rows]
        if self.token_level:
            return token_features(models, turn.agent, states, turn.response_ids[rows], turn.response_mask[rows], **kw)
        return state_features(models, turn.agent, states, **kw)

    def row_advantages(self, advantages: list[torch.Tensor], turns: list["Turn"], rows: list[tuple[int, int]],
                       R: int) -> torch.Tensor:
        """The advantages of ``rows`` (turn, row) as the loss reads them: [n] at action level; at
        token level [n, R], each row's reply tokens padded to ``R`` (``advantages`` per turn: [b], or
        [b * R_turn] / [b, R_turn] at token level)."""
        if self.token_level:
            return torch.stack([torch.nn.functional.pad(advantages[i].view(len(turns[i].episodes), -1)[r],
                                                        (0, R - turns[i].response_ids.shape[1])) for i, r in rows])
        return torch.stack([advantages[i][r] for i, r in rows])

    def policy_loss(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, train: Any, texts: list[str] | None = None,
                    behaviour_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """This algorithm's clipped PPO surrogate (:func:`marft.maths.losses.ppo_policy_loss`) on one
        micro-batch: ``logprobs``, ``old_logprobs`` [n, R] per reply token, ``advantages`` from
        :meth:`row_advantages`. Token level: a ratio per token, the mean over reply tokens; action
        level: a ratio per reply, its log-probability summed, averaged or per word
        (``train.logprob``; ``texts`` give the words), the mean over replies. With
        ``behaviour_logprobs`` [n, R] (stale data: the policy that sampled the replies, an older
        adapter version; ``old_logprobs`` is then the proximal policy's), the decoupled objective
        (:func:`marft.maths.losses.decoupled_ppo_policy_loss`) at the same level. (loss, statistics)."""
        if self.token_level:
            if behaviour_logprobs is None:
                return losses.ppo_policy_loss(logprobs, old_logprobs, advantages, response_mask, train.clip)
            return losses.decoupled_ppo_policy_loss(logprobs, old_logprobs, behaviour_logprobs, advantages,
                                                    response_mask, train.clip, train.max_importance_weight)
        words = torch.tensor([len(x.split()) for x in texts]) if train.logprob == "word" else None
        new = losses.action_logprobs(logprobs, response_mask, train.logprob, words)
        old = losses.action_logprobs(old_logprobs, response_mask, train.logprob, words)
        if behaviour_logprobs is None:
            return losses.ppo_policy_loss(new, old, advantages, None, train.clip)
        behaviour = losses.action_logprobs(behaviour_logprobs, response_mask, train.logprob, words)
        return losses.decoupled_ppo_policy_loss(new, old, behaviour, advantages, None, train.clip, train.max_importance_weight)

    def normalise(self, out: "Rollout", advs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each turn's advantages whitened (``train.normalize_advantages``) over the whole batch or,
        with ``whiten="agent"``, over each agent's own turns, or with ``whiten="episode"`` with the
        mean and std of each episode's first turn per agent; in a mixture of tasks, over each task's
        episodes apart (never across tasks). [b] at action level; at token level flattened [b * R]
        over the reply tokens (the learner reshapes them)."""
        if self.token_level:
            flat = torch.cat([a.flatten() for a in advs])
            mask = torch.cat([t.response_mask.flatten() for t in out.turns])
            sizes = [a.numel() for a in advs]
        else:
            flat = torch.cat(advs)
            mask = torch.ones_like(flat, dtype=torch.bool)
            sizes = [len(a) for a in advs]
        stats = _first_turns(out.turns) if self.whiten == "episode" else mask
        tasks = list(dict.fromkeys(getattr(out, "tasks", None) or [""]))
        if self.whiten in ("batch", "episode") and len(tasks) == 1:
            return list(adv_fns.normalize(flat, mask, stats).split(sizes))
        owner = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])  # entry -> turn
        agents = list(dict.fromkeys(t.agent for t in out.turns)) if self.whiten == "agent" else [None]
        if len(tasks) > 1:  # entry -> its episode's task
            episode = torch.cat([t.episodes[:, None].expand(a.shape).flatten() if self.token_level else t.episodes
                                 for t, a in zip(out.turns, advs)])
        normed = torch.zeros_like(flat)
        for task in tasks:
            in_task = (torch.tensor([x == task for x in out.tasks], dtype=torch.bool)[episode] if len(tasks) > 1
                       else torch.ones_like(mask))
            for agent in agents:
                mine = in_task if agent is None else in_task & torch.tensor([t.agent == agent for t in out.turns])[owner]
                normed = normed + adv_fns.normalize(flat, mask & mine, stats & mine)  # 0 outside its own entries
        return list(normed.split(sizes))


def _first_turns(turns: list["Turn"]) -> torch.Tensor:
    """[rows of all turns] bool: the row of each episode's first turn of each agent (turns are in
    execution order), so that an episode counts once per agent in the statistics, however many
    turns it took (action level)."""
    seen: set = set()
    first = []
    for t in turns:
        for e in t.episodes.tolist():
            first.append((e, t.agent) not in seen)
            seen.add((e, t.agent))
    return torch.tensor(first, dtype=torch.bool)


# ---------------------------------------------------------------- targets (steps 2-4)

def _critic_free(out: "Rollout", per_turn: Callable[["Turn"], torch.Tensor]) -> list[TurnTargets]:
    """Targets without a critic: advantages from ``per_turn``, values and returns 0."""
    zero = torch.zeros(0)
    return [TurnTargets(zero, torch.zeros(len(t.episodes)), per_turn(t), torch.zeros(len(t.episodes))) for t in out.turns]


def _groups(inp: TargetInputs, out: "Rollout") -> torch.Tensor:
    """[E] long: the problem group of each episode (episodes come ``train.group_size`` per problem)."""
    return torch.arange(out.rewards.shape[0]) // inp.train.group_size


def _acted(inp: TargetInputs, out: "Rollout") -> torch.Tensor:
    """[E, H, N] bool: agent i acted at step t of episode e (it has a turn there)."""
    E, H = out.rewards.shape
    acted = torch.zeros(E, H, len(inp.agents), dtype=torch.bool)
    for t in out.turns:
        acted[t.episodes, t.step, inp.agents.index(t.agent)] = True
    return acted


def _micro(inp: TargetInputs, out: "Rollout"):
    """E episodes, K = H * N micro-steps, and the action-level layout of the rollout's rewards
    ``(rewards, discounts, dones, mask)``, each [E, K] (:func:`marft.maths.advantages.micro_layout`), the
    micro-steps where an agent did not act (an agent program's) folded away."""
    tr = inp.train
    E, H = out.rewards.shape
    return E, H * len(inp.agents), adv_fns.micro_layout(out.rewards, out.dones, len(inp.agents), tr.gamma,
                                                          tr.agent_gamma, tr.credit, _acted(inp, out))


def action_gae(inp: TargetInputs, out: "Rollout") -> list[TurnTargets]:
    """marft: the centralised critic's value of every micro-step's global state, GAE over micro-steps.
    The states are read through the first agent's base model (one feature space for the one head,
    where agents are on several base models)."""
    tr, head = inp.train, inp.heads["team"]
    E, K, (rewards, discounts, dones, mask) = _micro(inp, out)
    feats = [state_features(inp.models, inp.agents[0], t.states, work=inp.work, **inp.feature_kw()) for t in out.turns]
    values = torch.zeros(E, K)
    for t, f in zip(out.turns, feats):
        with torch.no_grad():
            values[t.episodes, inp.micro_index(t)] = head(f)
    a, ret = adv_fns.gae(rewards, values, discounts, dones, mask, tr.lam)
    return [TurnTargets(f, values[t.episodes, inp.micro_index(t)], a[t.episodes, inp.micro_index(t)],
                        ret[t.episodes, inp.micro_index(t)]) for t, f in zip(out.turns, feats)]


def token_gae(inp: TargetInputs, out: "Rollout") -> list[TurnTargets]:
    """marft-token: the centralised critic's value before every generated token, GAE over tokens."""
    tr, head = inp.train, inp.heads["team"]
    E, K, (rewards, discounts, dones, mask) = _micro(inp, out)
    T = max(t.response_ids.shape[1] for t in out.turns)
    lengths = torch.zeros(E, K, dtype=torch.long)
    tok_values = torch.zeros(E, K, T)
    feats = []
    for t in out.turns:
        f = token_features(inp.models, t.agent, t.states, t.response_ids, t.response_mask, work=inp.work, **inp.feature_kw())
        feats.append(f)
        k = inp.micro_index(t)
        lengths[t.episodes, k] = t.response_mask.sum(1)
        with torch.no_grad():
            v = head(f) * t.response_mask
        tok_values[t.episodes, k, : v.shape[1]] = v
    t_rew, t_disc, t_done, t_mask, first = adv_fns.token_layout(lengths, rewards * mask, discounts, dones & mask, tr.gamma_token)
    L = t_rew.shape[1]
    v_layout = adv_fns.to_token_layout(tok_values, lengths, first, L)
    a, ret = adv_fns.gae(t_rew, v_layout, t_disc, t_done, t_mask, tr.lam)
    a_tok = adv_fns.from_token_layout(a, lengths, first, T)
    r_tok = adv_fns.from_token_layout(ret, lengths, first, T)
    targets = []
    for t, f in zip(out.turns, feats):
        k, R = inp.micro_index(t), t.response_ids.shape[1]
        targets.append(TurnTargets(f, tok_values[t.episodes, k, :R], a_tok[t.episodes, k, :R], r_tok[t.episodes, k, :R]))
    return targets


def ippo_targets(inp: TargetInputs, out: "Rollout") -> list[TurnTargets]:
    """ippo: each agent's own critic on its own prompt, GAE per agent over its own steps."""
    tr = inp.train
    E, H = out.rewards.shape
    i = inp.agents.index
    feats = [prompt_features(inp.models, t.agent, t.prompt_ids, t.prompt_mask, work=inp.work, **inp.feature_kw())
             for t in out.turns]
    values = torch.zeros(E, H, len(inp.agents))
    for t, f in zip(out.turns, feats):
        with torch.no_grad():
            values[t.episodes, t.step, i(t.agent)] = inp.heads[t.agent](f)
    a, ret = adv_fns.ippo_gae(out.rewards, values, adv_fns.valid_steps(out.dones), tr.gamma, tr.lam,
                              _acted(inp, out))
    return [TurnTargets(f, values[t.episodes, t.step, i(t.agent)], a[t.episodes, t.step, i(t.agent)],
                        ret[t.episodes, t.step, i(t.agent)]) for t, f in zip(out.turns, feats)]


def grpo_targets(inp: TargetInputs, out: "Rollout") -> list[TurnTargets]:
    """grpo: the team's episode return against its group's (``train.group_baseline``), for every turn.
    ``train.normalize_advantages`` then whitens them with the mean and std over the batch's
    episodes, each counted once per agent however many turns it took (``whiten="episode"``): a
    rescaling (they average 0 in each group), so ``rloo`` is leave-one-out up to a scale. Taken over
    turns instead, an episode that ended early would weigh less, and the mean would shift every
    advantage (a failed episode in a group of equal rewards would be reinforced)."""
    a = adv_fns.group_advantages(out.rewards.sum(1), _groups(inp, out), inp.train.group_baseline)
    return _critic_free(out, lambda t: a[t.episodes])


def dr_mas_targets(inp: TargetInputs, out: "Rollout") -> list[TurnTargets]:
    """dr-mas: each agent's own episode return sum_t r^i_t, normalised by the mean and std of that
    agent's turns in the group (:func:`marft.maths.advantages.agent_group_advantages`)."""
    a = adv_fns.agent_group_advantages(out.agent_rewards.sum(1), _acted(inp, out), _groups(inp, out))
    return _critic_free(out, lambda t: a[t.episodes, inp.agents.index(t.agent)])


def at_grpo_targets(inp: TargetInputs, out: "Rollout") -> list[TurnTargets]:
    """at-grpo: each turn's own reward r^i_t against the same agent's turns at the same step of the
    same problem (:func:`marft.maths.advantages.turn_group_advantages`); then whitened over the batch
    (``train.normalize_advantages``), as ``grpo``'s."""
    a = adv_fns.turn_group_advantages(out.agent_rewards, _acted(inp, out), _groups(inp, out))
    return _critic_free(out, lambda t: a[t.episodes, t.step, inp.agents.index(t.agent)])


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("marft", critic="team", token_level=False, grouped=False, whiten="batch", targets=action_gae),
    Algorithm("marft-token", critic="team", token_level=True, grouped=False, whiten="batch", targets=token_gae),
    Algorithm("ippo", critic="agent", token_level=False, grouped=False, whiten="batch", targets=ippo_targets),
    Algorithm("grpo", critic=None, token_level=False, grouped=True, whiten="episode", targets=grpo_targets),
    Algorithm("dr-mas", critic=None, token_level=False, grouped=True, whiten="agent", targets=dr_mas_targets),
    Algorithm("at-grpo", critic=None, token_level=False, grouped=True, whiten="batch", targets=at_grpo_targets),
)}
