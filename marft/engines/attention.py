"""Attention for the learner's passes on a CPU: matrix products and a fused float32 softmax, like
transformers' eager attention, with a hand-written backward that keeps only the bf16 probabilities
(eager attention's autograd also keeps float32 copies of the scores and the softmax).

Why (``benchmarks/attention.py``, bf16, 2 threads, Intel Xeon with AMX): PyTorch's CPU
flash-attention kernel is slow in bf16 at these lengths (one layer's forward + backward on
[8, 9, 153, 64] queries over 201 keys: 35.7 ms, eager attention 14.3 ms, this 21.7 ms), and eager
attention keeps float32 copies of every layer's scores and softmax. Over the learner's passes on 32
solver replies of the default duo (4 micro-batches, 3 interleaved rounds) this measured 10.25 s
best, eager 11.79 s, PyTorch's kernel 14.36 s, with 0.59, 0.81 and 0.58 MB per token saved for the
backward.

With s = q k^T * scale + mask, p = softmax(s) (float32 inside, stored in q's dtype), o = p v, and
upstream gradient do, the backward is::

    dv = p^T do,   dp = do v^T,   ds = p (dp - rowsum(dp * p)) * scale,   dq = ds k,   dk = ds^T q

Grouped-query attention is handled without repeating keys and values: the query heads of a group
are stacked along the query axis. Registered with transformers as ``marft_cpu`` (attention, and
the eager implementation's additive mask, always materialised).
"""
from __future__ import annotations

import functools
import inspect

import torch

from .models import text_config

NAME = "marft_cpu"


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        # q [b, kvh, g, Lq, d]; k, v [b, kvh, Lk, d]; mask [b, 1, 1, Lq, Lk] additive (q's dtype) or None
        b, kvh, g, Lq, d = q.shape
        s = (q.reshape(b, kvh, g * Lq, d) @ k.transpose(-1, -2)).view(b, kvh, g, Lq, -1).mul_(scale)
        if mask is not None:
            s.add_(mask)
        p = torch.softmax(s, -1, dtype=torch.float32).to(q.dtype)  # one fused pass, float32 inside
        o = (p.view(b, kvh, g * Lq, -1) @ v).view(b, kvh, g, Lq, d)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, p = ctx.saved_tensors
        b, kvh, g, Lq, d = q.shape
        flat = lambda x: x.reshape(b, kvh, g * Lq, -1)  # noqa: E731
        do = do.contiguous()
        dv = flat(p).transpose(-1, -2) @ flat(do)
        dp = (flat(do) @ v.transpose(-1, -2)).view_as(p)
        # softmax's backward, p (dp - rowsum(dp * p)), fused, in float32
        ds = torch.ops.aten._softmax_backward_data(dp.float(), p.float(), -1, torch.float32).mul_(ctx.scale).to(q.dtype)
        dq = (flat(ds) @ k).view_as(q)
        dk = flat(ds).transpose(-1, -2) @ flat(q)
        return dq, dk, dv, None, None


def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [b, h, Lq, d], key/value [b, kvh, Lk, d],
    ``attention_mask`` additive [b, 1, Lq, Lk] or None; returns ([b, Lq, h, d], None)."""
    if dropout and module.training:
        raise ValueError("marft_cpu attention has no dropout; use the model's own attention")
    extra = [name for name in EXTRAS if kwargs.get(name) is not None]
    if extra:  # never computed silently without them (replaces() keeps such models on their own)
        raise NotImplementedError(f"marft's attention cannot apply {', '.join(extra)}; this model must keep its own "
                                  "attention: please report it with the model's name")
    b, h, Lq, d = query.shape
    kvh = key.shape[1]
    q = query.view(b, kvh, h // kvh, Lq, d)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]].to(query.dtype).unsqueeze(2)  # [b, 1, 1, Lq, Lk]
    o = _Attention.apply(q, key, value, mask, float(scaling))
    return o.view(b, h, Lq, d).transpose(1, 2).contiguous(), None


# what an attention layer may hand its attention function that this one does not compute: soft-capped
# scores (Gemma 2's softcap=) and sink logits (gpt-oss's s_aux=, others' sinks=)
EXTRAS = ("softcap", "s_aux", "sinks")


def replaces(model) -> bool:
    """Whether this attention computes what ``model``'s own does, so that marft may switch to it:
    not where the model's attention layer passes one of :data:`EXTRAS` (read from its code), nor
    where Gemma 2's config caps the scores."""
    if getattr(text_config(model), "attn_logit_softcapping", None) is not None:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer = next((m for m in base.modules() if type(m).__name__.endswith("Attention")), None)
    return layer is None or _plain_layer(type(layer))


@functools.lru_cache(maxsize=None)
def _plain_layer(cls) -> bool:
    try:
        code = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source to read: as before, the layer is taken as plain
        return True
    return not any(f"{name}=" in code for name in EXTRAS)


def register() -> str:
    """Register ``marft_cpu`` with transformers (attention and mask); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    return NAME
