"""Credit assignment: generalised advantage estimation over MARFT micro-steps, and baselines.

Pure tensor functions, no model and no I/O. The core is :func:`gae` over a sequence of positions
per row; the helpers lay out a batch of episodes as such sequences:

* action level: one position per micro-step k = t * N + i (step t, i-th agent to act), see
  :func:`credit_rewards`, :func:`micro_discounts`, :func:`micro_layout`;
* token level: one position per generated token, the actions of an episode back to back, see
  :func:`token_layout`, :func:`to_token_layout`, :func:`from_token_layout`;
* IPPO: one sequence of steps per agent, :func:`ippo_gae`;
* critic-free group baselines (GRPO / RLOO), :func:`group_advantages`; per agent (Dr. MAS),
  :func:`agent_group_advantages`; per agent and turn (AT-GRPO), :func:`turn_group_advantages`.

Conventions: ``done_k`` means the episode ended after position k (no bootstrap from k + 1);
padding (``mask`` False) sits at the end of a row.
"""
from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, discounts: torch.Tensor, dones: torch.Tensor,
        mask: torch.Tensor, lam: float, last_values: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation along the positions of each row.

    Shapes: ``rewards``, ``values``, ``discounts`` float [B, L]; ``dones``, ``mask`` bool [B, L];
    ``last_values`` float [B] or None. Returns ``(advantages, returns)``, both [B, L].

    Position k bootstraps from position k + 1::

        delta_k = r_k + g_k * V_{k+1} * (1 - done_k) - V_k
        A_k     = delta_k + g_k * lam * (1 - done_k) * A_{k+1}
        R_k     = A_k + V_k

    with g_k = ``discounts[:, k]`` and k + 1 the next position with ``mask`` True: positions with
    ``mask`` False (padding at the end, or micro-steps that did not happen inside a row) are passed
    over, contribute nothing and get advantage and return 0, whatever their values; a hole's reward
    and discount belong on the position before it (:func:`fold_skipped` puts them there).

    Truncation: marft's rollouts mark the last valid position of every row done, an episode cut at
    the horizon included (the horizon is part of the task). A caller that leaves it open bootstraps
    from ``last_values`` (the value of the state after the cut; 0 when None):
    ``delta = r + g * last_values - V``.
    """
    B, L = rewards.shape
    mask = mask.bool()
    rewards = torch.where(mask, rewards, 0.0)
    values = torch.where(mask, values, 0.0)
    cont = (~dones.bool() & mask).to(values.dtype)  # 1 where position k bootstraps from k + 1
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device) if last_values is None \
        else last_values.to(values.dtype)
    next_adv = torch.zeros_like(next_value)
    for k in reversed(range(L)):
        # through a position with mask False the carry stays: (last_values, 0) through the end's padding,
        # the next valid position's (V, A) through a hole
        delta = rewards[:, k] + discounts[:, k] * next_value * cont[:, k] - values[:, k]
        adv = delta + discounts[:, k] * lam * cont[:, k] * next_adv
        valid = mask[:, k]
        advantages[:, k] = torch.where(valid, adv, 0.0)
        next_value = torch.where(valid, values[:, k], next_value)
        next_adv = torch.where(valid, adv, next_adv)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def fold_skipped(rewards: torch.Tensor, discounts: torch.Tensor, dones: torch.Tensor, kept: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold the positions that did not happen (``kept`` False) into the kept position before them.

    All [B, L]. A kept position k followed by skipped positions k + 1 .. j - 1 (j the next kept
    one) becomes one transition from k to j: reward r_k + g_k r_(k+1) + g_k g_(k+1) r_(k+2) + ...,
    discount g_k g_(k+1) ... g_(j-1), done if any of them is done (nothing after a done is added).
    Skipped positions get reward 0, discount 0 and not done; skipped positions before the first kept
    one are dropped. With this, :func:`gae` with ``mask = kept`` treats a row with holes (an agent
    that did not act at a step of an agent program) as the sequence of the positions that happened.
    """
    kept = kept.bool()
    dones = dones.bool()
    B, L = rewards.shape
    out_r, out_g = torch.zeros_like(rewards), torch.zeros_like(discounts)
    out_d = torch.zeros_like(dones)
    # (reward, discount, done) of the skipped run that starts after position k, folded
    run_r = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    run_g = torch.ones(B, dtype=discounts.dtype, device=discounts.device)
    run_d = torch.zeros(B, dtype=torch.bool, device=dones.device)
    for k in reversed(range(L)):
        go_on = ~dones[:, k]
        r = rewards[:, k] + torch.where(go_on, discounts[:, k] * run_r, 0.0)
        g = discounts[:, k] * run_g
        d = dones[:, k] | (go_on & run_d)
        keep = kept[:, k]
        out_r[:, k], out_g[:, k], out_d[:, k] = torch.where(keep, r, 0.0), torch.where(keep, g, 0.0), keep & d
        run_r = torch.where(keep, 0.0, r)
        run_g = torch.where(keep, 1.0, g)
        run_d = ~keep & d
    return out_r, out_g, out_d


# ---------------------------------------------------------------- action level: micro-steps (t, i)

def credit_rewards(step_rewards: torch.Tensor, num_agents: int, mode: str = "last",
                   acted: torch.Tensor | None = None) -> torch.Tensor:
    """Spread team rewards [E, H] over micro-steps [E, H * N], micro-step k = t * N + i.

    ``"last"``: r_t goes to micro-step (t, N - 1), the other agents of the step get 0.
    ``"equal"``: each of the step's N micro-steps gets r_t / N.
    With ``acted`` [E, H, N] bool (agent i acted at step t; None: every agent of every step), among
    the agents that acted only: the last of them, or each of them r_t / (how many acted).
    """
    E, H = step_rewards.shape
    if mode not in ("last", "equal"):
        raise ValueError(f"credit mode must be 'last' or 'equal', got {mode!r}")
    if acted is None:
        acted = torch.ones(E, H, num_agents, dtype=torch.bool, device=step_rewards.device)
    acted = acted.bool()
    if mode == "last":  # the last agent that acted: the only one with no acting agent after it
        after = acted.flip(-1).long().cumsum(-1).flip(-1) - acted.long()
        share = (acted & (after == 0)).to(step_rewards.dtype)
    else:
        share = acted.to(step_rewards.dtype) / acted.sum(-1, keepdim=True).clamp(min=1)
    return (step_rewards.unsqueeze(-1) * share).reshape(E, H * num_agents)


def micro_discounts(horizon: int, num_agents: int, gamma: float, agent_gamma: float) -> torch.Tensor:
    """Discount g_k [H * N] from micro-step k to k + 1.

    g_(t, i) = ``agent_gamma`` for i < N - 1 (agent i to agent i + 1 within step t), and
    g_(t, N-1) = ``gamma`` (last agent of step t to the first agent of step t + 1).
    """
    g = torch.full((horizon, num_agents), float(agent_gamma))
    g[:, -1] = gamma
    return g.reshape(-1)


def valid_steps(dones: torch.Tensor) -> torch.Tensor:
    """Steps [E, H] bool that happened: every step up to and including the first done."""
    dones = dones.bool()
    ended_before = (dones.long().cumsum(1) - dones.long()) > 0
    return ~ended_before


def micro_layout(step_rewards: torch.Tensor, dones: torch.Tensor, num_agents: int, gamma: float,
                 agent_gamma: float, credit: str = "last", acted: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Action-level inputs for :func:`gae` from a rollout's step tensors.

    ``step_rewards`` [E, H] float, ``dones`` [E, H] bool (episode ended after step t), ``acted``
    [E, H, N] bool or None (every agent acts at every step that happened). Returns
    ``(rewards, discounts, dones, mask)``, each [E, H * N] in micro-step order k = t * N + i: rewards
    from :func:`credit_rewards`; discounts from :func:`micro_discounts`; done at (t, N - 1) when step
    t was done; mask True for the micro-steps that happened (steps that happened, :func:`valid_steps`,
    and agents that acted). Micro-steps that did not happen (an agent program that skips an agent
    at a step) are folded away (:func:`fold_skipped`): a done lands on the step's last micro-step
    that happened, and the discount from a micro-step to the next one that happened is that of the
    agents that acted: ``agent_gamma`` within a step, ``gamma`` from a step's last acting agent to the
    next step's first (``gamma`` per step where whole steps lie between).
    """
    E, H = step_rewards.shape
    N = num_agents
    happened = valid_steps(dones).unsqueeze(-1).expand(E, H, N)
    if acted is not None:
        happened = happened & acted.bool()
    rewards = credit_rewards(step_rewards, N, credit, happened)
    discounts = micro_discounts(H, N, gamma, agent_gamma).to(step_rewards).expand(E, -1)
    micro_dones = torch.zeros(E, H, N, dtype=torch.bool, device=dones.device)
    micro_dones[:, :, -1] = dones.bool()
    mask = happened.reshape(E, H * N)
    if acted is None:  # nothing skipped inside a row: padding at the end only
        return rewards, discounts, micro_dones.reshape(E, H * N), mask
    rewards, _, micro_dones = fold_skipped(rewards, discounts, micro_dones.reshape(E, H * N), mask)
    # the discount to the next micro-step that happened: the skipped ones between are no transitions
    pos = torch.arange(H * N, device=mask.device).expand(E, -1)
    later = torch.where(mask, pos, H * N)
    nxt = torch.cat([later[:, 1:], later.new_full((E, 1), H * N)], 1).flip(1).cummin(1).values.flip(1)
    steps_on = (nxt // N - pos // N).clamp(min=0).float()  # 0: the same step
    folded = torch.where(steps_on == 0, float(agent_gamma), float(gamma) ** steps_on).to(discounts)  # as micro_discounts
    return rewards, torch.where(mask & (nxt < H * N), folded, torch.where(mask, discounts, 0.0)), micro_dones, mask


# ---------------------------------------------------------------- token level

def token_layout(lengths: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor,
                 dones: torch.Tensor, gamma_token: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level inputs for :func:`gae`: every generated token is a position.

    Inputs per action, K actions of each episode in execution order (k = t * N + i):
    ``lengths`` [E, K] long (tokens of the action; 0 for an action that did not happen),
    ``rewards`` [E, K], ``discounts`` [E, K] (g_k, to the next action), ``dones`` [E, K] bool.

    Returns ``(token_rewards, token_discounts, token_dones, mask, first)``: the first four [E, L]
    with L = max total tokens of an episode, the tokens of an episode contiguous from position 0,
    padding at the end; ``first`` [E, K] long, the position of each action's first token (for an
    action of length 0, where its first token would have been).

    Inside an action a token has reward 0 and discount ``gamma_token`` to the next token; the
    action's last token carries its reward r_k, discount g_k and done_k (so it bootstraps to the
    first token of the next action that happened). Actions of length 0 are skipped; they must have
    reward 0 and not be done (raises otherwise).
    """
    lengths = lengths.long()
    E, K = lengths.shape
    empty = lengths == 0
    if (empty & ((rewards != 0) | dones.bool())).any():
        raise ValueError("token_layout: an action with 0 tokens has a reward or is done")
    ends = lengths.cumsum(1)  # [E, K] one past each action's last token
    first = ends - lengths
    L = int(ends[:, -1].max()) if K > 0 else 0
    positions = torch.arange(L, device=lengths.device)
    mask = positions.unsqueeze(0) < ends[:, -1:]  # [E, L]
    token_rewards = torch.zeros(E, L, dtype=rewards.dtype, device=rewards.device)
    token_discounts = torch.where(mask, gamma_token, 0.0).to(discounts.dtype)
    token_dones = torch.zeros(E, L, dtype=torch.bool, device=lengths.device)
    e_idx, k_idx = (~empty).nonzero(as_tuple=True)
    last = ends[e_idx, k_idx] - 1
    token_rewards[e_idx, last] = rewards[e_idx, k_idx]
    token_discounts[e_idx, last] = discounts[e_idx, k_idx]
    token_dones[e_idx, last] = dones.bool()[e_idx, k_idx]
    return token_rewards, token_discounts, token_dones, mask, first


def _token_index(lengths: torch.Tensor, first: torch.Tensor, T: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Episode index, layout position and validity, each [E, K, T], of token j of action k."""
    E, K = lengths.shape
    j = torch.arange(T, device=lengths.device)
    valid = j < lengths.unsqueeze(-1)
    pos = first.unsqueeze(-1) + j
    e_idx = torch.arange(E, device=lengths.device).view(E, 1, 1).expand(E, K, T)
    return e_idx, pos, valid


def to_token_layout(x: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor, L: int) -> torch.Tensor:
    """Per-action tokens [E, K, T] (right-padded) -> episode layout [E, L]; 0 where nothing lands."""
    E, K, T = x.shape
    e_idx, pos, valid = _token_index(lengths.long(), first, T)
    out = torch.zeros(E, L, dtype=x.dtype, device=x.device)
    out[e_idx[valid], pos[valid]] = x[valid]
    return out


def from_token_layout(y: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor, T: int) -> torch.Tensor:
    """Episode layout [E, L] -> per-action tokens [E, K, T] (right-padded with 0)."""
    e_idx, pos, valid = _token_index(lengths.long(), first, T)
    if y.shape[1] == 0:
        return torch.zeros(valid.shape, dtype=y.dtype, device=y.device)
    out = y[e_idx, pos.clamp(max=y.shape[1] - 1)]
    return torch.where(valid, out, torch.zeros((), dtype=y.dtype, device=y.device))


# ---------------------------------------------------------------- IPPO

def ippo_gae(step_rewards: torch.Tensor, values: torch.Tensor, step_mask: torch.Tensor, gamma: float,
             lam: float, acted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent PPO: GAE per agent over its own steps with the shared team reward.

    ``step_rewards`` [E, H] team reward r_t, ``values`` [E, H, N] agent i's own critic at step t,
    ``step_mask`` [E, H] bool (steps that happened, padding at the end), ``acted`` [E, H, N] bool
    or None (every agent acts at every step that happened). Returns ``(advantages, returns)``, each
    [E, H, N], 0 where the agent did not act. For agent i::

        delta_t = r_t + gamma * V^i_{t+1} - V^i_t,   A_t = delta_t + gamma * lam * A_{t+1}

    An agent never bootstraps through another agent's value. The last valid step of each row is
    terminal (no bootstrap; truncated episodes are not bootstrapped here). Steps at which agent i did
    not act (an agent program that calls it at some steps only) are folded into its previous step
    (:func:`fold_skipped`): the team rewards of the skipped steps, discounted, and t + 1 above is
    its next step.
    """
    E, H, N = values.shape
    mask = step_mask.bool()
    last = mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # last valid step
    rows = lambda x: x.unsqueeze(-1).expand(E, H, N).permute(0, 2, 1).reshape(E * N, H)  # noqa: E731
    per_agent = lambda x: x.permute(0, 2, 1).reshape(E * N, H)  # noqa: E731
    rewards = rows(torch.where(mask, step_rewards, 0.0))
    discounts = torch.full((E * N, H), float(gamma), dtype=values.dtype, device=values.device)
    dones, kept = rows(last), rows(mask)
    if acted is not None:
        kept = kept & per_agent(acted.bool())
        rewards, discounts, dones = fold_skipped(rewards, discounts, dones, kept)
    adv, ret = gae(rewards, per_agent(values), discounts, dones, kept, lam)
    back = lambda x: x.reshape(E, N, H).permute(0, 2, 1)  # noqa: E731
    return back(adv), back(ret)


# ---------------------------------------------------------------- critic-free baselines

def group_advantages(returns: torch.Tensor, group_ids: torch.Tensor, mode: str = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages [B] from returns [B] and group ids [B] (long, any values).

    ``"grpo"``: (R - mean_g) / (std_g + eps), with the SAMPLE std (divide by n - 1), as TRL's
    ``GRPOTrainer`` (``Tensor.std``). ``"rloo"``: R - mean of the other n - 1 members of the group.
    Groups of size 1 get advantage 0.
    """
    if mode not in ("grpo", "rloo"):
        raise ValueError(f"group mode must be 'grpo' or 'rloo', got {mode!r}")
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    x = returns.double()
    n = torch.zeros(G, dtype=x.dtype, device=x.device).index_add_(0, inv, torch.ones_like(x))
    total = torch.zeros(G, dtype=x.dtype, device=x.device).index_add_(0, inv, x)
    n_i, total_i = n[inv], total[inv]
    single = n_i < 2
    if mode == "rloo":
        adv = x - (total_i - x) / (n_i - 1).clamp(min=1)
    else:
        mean_i = total_i / n_i
        sq = torch.zeros(G, dtype=x.dtype, device=x.device).index_add_(0, inv, (x - mean_i) ** 2)
        std_i = (sq[inv] / (n_i - 1).clamp(min=1)).sqrt()
        adv = (x - mean_i) / (std_i + eps)
    return torch.where(single, 0.0, adv).to(returns.dtype)


def _row_ids(*columns: torch.Tensor) -> torch.Tensor:
    """[B] long: one id per distinct row of the stacked ``columns`` (each [B])."""
    if columns[0].numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.unique(torch.stack([c.long() for c in columns], 1), dim=0, return_inverse=True)[1]


def agent_group_advantages(agent_returns: torch.Tensor, acted: torch.Tensor, group_ids: torch.Tensor,
                           eps: float = 1e-6) -> torch.Tensor:
    """Dr. MAS (agent-wise normalisation): group-relative advantages [E, N] with each agent's own
    statistics.

    ``agent_returns`` [E, N]: agent i's return R^i_e in episode e (the team's return where the task
    gives every agent the team reward); ``acted`` [E, H, N] bool: agent i acted at step t of episode
    e; ``group_ids`` [E]: the episode's problem group. Every turn of agent i is one sample, valued at
    its episode's R^i_e; for group g the samples Y_(g,i) = {(e, t): e in g, acted[e, t, i]} give::

        A^i_e = (R^i_e - mean_(Y_(g,i)) R^i) / (std_(Y_(g,i)) R^i + eps)

    with the SAMPLE std, as :func:`group_advantages`. So an agent is compared only with itself on
    the same problem, and an episode weighs by the number of the agent's turns in it (the paper's
    sum over an agent's active steps). A group of one sample, and an agent that did not act in an
    episode, get 0.
    """
    E, H, N = acted.shape
    e, t, i = acted.bool().nonzero(as_tuple=True)
    a = group_advantages(agent_returns[e, i], _row_ids(group_ids[e], i), "grpo", eps)
    out = torch.zeros(E, N, dtype=agent_returns.dtype, device=agent_returns.device)
    out[e, i] = a  # the same value for every turn of agent i in episode e
    return out


def turn_group_advantages(agent_rewards: torch.Tensor, acted: torch.Tensor, group_ids: torch.Tensor,
                          eps: float = 1e-6) -> torch.Tensor:
    """AT-GRPO (agent- and turn-wise grouping): advantages [E, H, N], one per turn.

    ``agent_rewards`` [E, H, N]: agent i's reward r^i_(e,t) for step t (the team reward where the
    task gives no agent its own); ``acted`` [E, H, N] bool; ``group_ids`` [E]. The group of a turn is
    (problem group, step t, agent i): agent i's action at step t is compared only with that agent's
    actions at the same step of the same problem::

        A^i_(e,t) = (r^i_(e,t) - mean_g r) / (std_g r + eps),   g = (group_ids[e], t, i)

    with the sample std. Each turn is credited with its own step's reward, not the episode's return.
    Turns that did not happen, and groups of one turn (a step only one episode of the group reached),
    get 0.
    """
    e, t, i = acted.bool().nonzero(as_tuple=True)
    a = group_advantages(agent_rewards[e, t, i], _row_ids(group_ids[e], t, i), "grpo", eps)
    out = torch.zeros(acted.shape, dtype=agent_rewards.dtype, device=agent_rewards.device)
    out[e, t, i] = a
    return out


def normalize(x: torch.Tensor, mask: torch.Tensor, stats: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening: (x - mean) / (std + eps) of the entries where ``mask`` is True, the mean
    and std taken over the entries where ``stats`` is True (default: ``mask``; a subset of it, such
    as one entry per episode where an episode's turns share one advantage).

    Any shape (``mask`` the same shape). Sample std (n - 1), as CleanRL's ``advantages.std()``;
    with fewer than 2 entries in ``stats`` only the mean is removed. Masked entries are returned as 0.
    """
    mask = mask.bool()
    stats = mask if stats is None else stats.bool() & mask
    n = stats.sum()
    xv = torch.where(stats, x, 0.0)
    mean = xv.sum() / n.clamp(min=1)
    centred = torch.where(mask, x - mean, 0.0)
    if n < 2:
        return centred
    std = ((torch.where(stats, centred, 0.0) ** 2).sum() / (n - 1)).sqrt()
    return centred / (std + eps)
