"""Losses: PPO's clipped surrogate (and its decoupled form for stale data), the clipped value loss,
entropy and the k3 KL penalty.

Pure tensor functions, no model and no I/O. Each works at the token level ([B, T] with a
``response_mask``) and at the action level ([B], one log-probability per action, see
:func:`action_logprobs`). Every mean is a masked mean over the valid entries of the batch.
"""
from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is True (all when None); 0 if there are none.

    ``dim`` None: a scalar; otherwise reduce that dimension. Masked entries may hold inf or nan."""
    if mask is None:
        return x.mean() if dim is None else x.mean(dim)
    mask = mask.bool()
    xv = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if dim is None:
        return xv.sum() / mask.sum().clamp(min=1)
    return xv.sum(dim) / mask.sum(dim).clamp(min=1)


def action_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, mode: str = "sum",
                    num_words: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probability [B] of each action from its tokens' log-probabilities [B, T] (``mask`` [B, T]).

    ``"sum"``: sum_j lp_j (the log-probability of the whole reply); ``"mean"``: sum / tokens;
    ``"word"``: sum / max(num_words, 1), with ``num_words`` [B] the words of each reply.
    """
    total = torch.where(mask.bool(), token_logprobs, 0.0).sum(-1)
    if mode == "sum":
        return total
    if mode == "mean":
        return total / mask.sum(-1).clamp(min=1)
    if mode == "word":
        if num_words is None:
            raise ValueError("action_logprobs: mode 'word' needs num_words")
        return total / num_words.to(total).clamp(min=1)
    raise ValueError(f"action_logprobs mode must be 'sum', 'mean' or 'word', got {mode!r}")


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor | None = None, clip: float = 0.2
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate, to minimise.

    Token level: all of ``logprobs``, ``old_logprobs`` (rollout policy), ``advantages``, ``mask`` [B, T];
    action level: all [B] (``mask`` [B] or None for all valid). With ratio = exp(lp - old_lp)::

        loss = masked_mean( max(-A * ratio, -A * clamp(ratio, 1 - clip, 1 + clip)) )

    Returns ``(loss, stats)``; stats are detached floats: ``clip_fraction`` (share of valid entries
    where the clipped term is the one taken, so their gradient is 0), ``approx_kl`` (k3 estimate of
    KL(old || new): mean of (ratio - 1) - log ratio) and ``ratio_mean``.
    """
    log_ratio = logprobs - old_logprobs
    if mask is not None:  # padding may hold anything; keep exp() finite there
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask).item(),
            "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, stats


def decoupled_ppo_policy_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                               advantages: torch.Tensor, mask: torch.Tensor | None = None, clip: float = 0.2,
                               max_weight: float = 5.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled PPO objective for stale data (AReaL, Fu et al. 2025), to minimise: replies
    sampled by a behaviour policy mu (an older adapter version) train the current policy pi against
    the proximal policy pi_prox (the weights at the start of this update, whose log-probabilities the
    learner recomputes). With ratio = pi / pi_prox and the importance weight
    w = min(pi_prox / mu, ``max_weight``), taken as a constant::

        loss = masked_mean( w * max(-A * ratio, -A * clamp(ratio, 1 - clip, 1 + clip)) )

    The clip keeps pi near pi_prox (a trust region around the policy being updated, not around the
    stale one); w corrects for sampling from mu, capped so that one unlikely reply cannot dominate
    (truncated importance sampling; AReaL leaves such tokens out instead). With mu = pi_prox (fresh
    data), w = 1 and this is :func:`ppo_policy_loss` exactly. Shapes as there: token level [B, T]
    with ``mask``, action level [B].

    Returns ``(loss, stats)``: those of :func:`ppo_policy_loss` (against pi_prox), and
    ``importance_weight_mean`` (w before the cap) and ``capped_fraction`` (share of entries where the
    cap applied), over the valid entries.
    """
    surrogate_log_ratio = logprobs - proximal_logprobs
    stale_log_ratio = (proximal_logprobs - behaviour_logprobs).detach()
    if mask is not None:  # padding may hold anything; keep exp() finite there
        surrogate_log_ratio = torch.where(mask.bool(), surrogate_log_ratio, 0.0)
        stale_log_ratio = torch.where(mask.bool(), stale_log_ratio, 0.0)
    ratio = torch.exp(surrogate_log_ratio)
    raw = torch.exp(stale_log_ratio)
    weight = torch.clamp(raw, max=max_weight)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    loss = masked_mean(weight * torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask).item(),
            "approx_kl": masked_mean((ratio - 1) - surrogate_log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "importance_weight_mean": masked_mean(raw, mask).item(),
            "capped_fraction": masked_mean((raw > max_weight).float(), mask).item(),
        }
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor | None = None, clip: float | None = None) -> torch.Tensor:
    """Clipped value loss, all inputs the same shape ([B] or [B, T])::

        V_clipped = old + clamp(V - old, -clip, clip)
        loss      = 0.5 * masked_mean( max((V - R)^2, (V_clipped - R)^2) )

    With ``clip`` None: 0.5 * masked_mean((V - R)^2).
    """
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (v_clipped - returns) ** 2)
    return 0.5 * masked_mean(err, mask)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Masked mean entropy (scalar) of the categorical distributions given by ``logits`` [B, T, V].

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, in float32 over the valid positions only
    (``mask`` [B, T]), so padding never costs a [.., V] float32 copy. Logits must be finite.
    """
    z = logits[mask.bool()] if mask is not None else logits.reshape(-1, logits.shape[-1])
    if z.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    z = z.float()
    lse = torch.logsumexp(z, dim=-1)
    p = torch.exp(z - lse.unsqueeze(-1))
    return (lse - (p * z).sum(-1)).mean()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
               ) -> torch.Tensor:
    """k3 estimate (scalar) of KL(policy || reference) from sampled tokens' log-probabilities::

        d = ref_lp - lp,   kl = masked_mean(exp(d) - d - 1)   (>= 0, 0 when equal)

    ``logprobs``, ``ref_logprobs``, ``mask`` [B, T] (or [B])."""
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(mask.bool(), d, 0.0)
    return masked_mean(torch.exp(d) - d - 1, mask)
