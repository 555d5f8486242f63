"""Token log-probabilities and entropies straight from final hidden states, chunked.

The plain path (``logits = h @ W.T``, then ``log_softmax(logits.float() / T)``) holds several
[n, V] float32 tensors at once (logits, log-softmax, softmax, their gradients). Here the rows go
``chunk`` at a time: each chunk's logits are computed in the model's dtype (a bf16 GEMM on a bf16
model), reduced in float32 to what is needed, and dropped; the backward pass recomputes them. Only
[n]-sized float32 statistics are kept between the passes, so the extra memory is O(chunk * V).

Notation, for one row (one position) with target t::

    z_j   = (h @ W.T)_j / T                          logits at temperature T
    lse   = logsumexp_j z_j,   log p_j = z_j - lse,   p_j = exp(log p_j)
    lp    = log p_t                                   (the target's log-probability)
    H     = -sum_j p_j log p_j  = lse - sum_j p_j z_j (entropy of p)

and the gradients the backward pass uses (upstream gradients g_lp, g_H per row)::

    d lp / d z_j = [j = t] - p_j
    d H  / d z_j = -p_j (log p_j + H)                 (= -p_j (z_j - sum_k p_k z_k))
    g_z_j        = g_lp ([j = t] - p_j) - g_H p_j (log p_j + H)
    g_h          = (g_z / T) @ W                      ([n, V] @ [V, H]); W gets no gradient
"""
from __future__ import annotations

import torch


def _dtypes(hidden, weight):
    """(GEMM dtype, reduction dtype): bf16 and float32 on a bf16 model; float64 for gradcheck."""
    dt = torch.promote_types(hidden.dtype, weight.dtype)
    return dt, torch.promote_types(dt, torch.float32)


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward and backward of :func:`token_logprobs_and_entropy` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        dt, acc = _dtypes(hidden, weight)
        w = weight.to(dt)
        lse = hidden.new_empty(n, dtype=acc)
        lp = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (hidden[s:e].to(dt) @ w.T).to(acc)  # [c, V]
            if temperature != 1.0:
                z.div_(temperature)
            lse[s:e] = torch.logsumexp(z, -1)
            logp = z.sub_(lse[s:e, None])  # in place: z is not needed again
            lp[s:e] = logp.gather(1, targets[s:e, None]).squeeze(1)
            if with_entropy:  # -sum p log p as a batched dot product, no [c, V] product tensor
                ent[s:e] = -torch.linalg.vecdot(logp.exp(), logp)
        # [n]-sized only: lse to rebuild p, and H (needed by dH/dz; saving it spares a reduction)
        ctx.save_for_backward(hidden, weight, targets, lse, *(() if ent is None else (ent,)))
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        ent = rest[0] if rest else None
        if ent is None:
            g_ent = None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None
        T, chunk, n = ctx.temperature, ctx.chunk, hidden.shape[0]
        dt, acc = _dtypes(hidden, weight)
        w = weight.to(dt)
        # fold 1/T into the per-row upstream gradients: g_h = (g_z / T) @ W
        a = None if g_lp is None else g_lp.to(acc) / T
        b = None if g_ent is None else g_ent.to(acc) / T
        grad = torch.empty_like(hidden)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (hidden[s:e].to(dt) @ w.T).to(acc)
            if T != 1.0:
                z.div_(T)
            logp = z.sub_(lse[s:e, None])
            p = logp.exp()
            # two [c, V] float32 buffers (logp, p), reused in place for the terms of g_z / T
            ent_term = None
            if b is not None:  # b p (log p + H), computed before p is overwritten
                ent_term = logp.add_(ent[s:e, None]).mul_(p).mul_(b[s:e, None])
            if a is not None:  # a ([j = t] - p)
                gz = p.mul_(-a[s:e, None]).scatter_add_(1, targets[s:e, None], a[s:e, None])
                if ent_term is not None:
                    gz.sub_(ent_term)
            else:
                gz = ent_term.neg_()
            grad[s:e] = (gz.to(dt) @ w).to(hidden.dtype)
        return grad, None, None, None, None, None


def token_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities [n] and entropies [n] (float32; float64 for float64 inputs) of ``softmax(hidden @ weight.T / T)``.

    ``hidden`` [n, H]: the model's final (normed) hidden states at the n positions that predict a
    token, any dtype, may require grad. ``weight`` [V, H]: the output projection (or tied
    embedding), frozen. ``targets`` [n] long. Returns ``(lp, H)`` with lp = log p[target] and H the
    entropy of the same temperature-scaled distribution (None when ``with_entropy`` is False, which
    also skips its work). Same values as the plain ``F.log_softmax((hidden @ weight.T).float() / T)``
    path, up to float32 rounding; the GEMMs run in the promoted dtype of hidden and weight.

    Gradients flow to ``hidden`` only (formulas in the module docstring); ``weight`` must not
    require grad (pass ``weight.detach()`` if it is a trainable tensor you mean to hold fixed).
    Memory beyond the inputs: a few [chunk, V] float32 buffers, instead of several [n, V].
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [n] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("token_logprobs_and_entropy gives weight no gradient; pass weight.detach()")
    return _ChunkedLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk),
                                  bool(with_entropy))
