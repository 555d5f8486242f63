"""Model FLOPs utilisation (MFU): the FLOPs a piece of work needs, divided by the time it took and
by the machine's own matrix-multiply rate in the run's dtype, measured in the same process.

FLOPs of a decoder-only transformer, per token, counting a multiply-add as 2 FLOPs:

    forward   = 2 * N  +  4 * L * d_attn * ctx  (+ 2 * H * V where that token's logits are computed)

where N is the number of non-embedding parameters (every weight matrix a token passes through:
attention projections and MLP of every layer), L the layers, d_attn = heads * head_dim the width
of the attention (the QK^T and the attention-times-V products), ctx the number of positions the
token attends to (itself and every earlier one), H the hidden size and V the vocabulary (the output
projection, computed only where log-probabilities or samples are needed). The backward pass of a
LoRA learner through a frozen base computes activation gradients only (no weight gradients for the
base): one matrix product per weight, as in the forward, and two per attention product, so

    forward + backward = 2 * (2 * N + 2 * H * V [logits positions]) + 3 * (4 * L * d_attn * ctx)

(LoRA's own products, 2 * r * (d_in + d_out) per adapted matrix, are below 1% at r = 8 and left out.)

"Needed" is the work itself, not what a given implementation spends on it: padding is not counted,
and a prefix that every row of a batch shares (the system prompt and chat template) is counted once
per batch, so an implementation that recomputes it or computes padding shows as a lower MFU.

The machine's rate is that of one square matrix product in the run's dtype on the run's device and
thread count, best of a few repetitions after warm-ups, measured once per process and cached: n = 2048
on a CPU (about a second there), n = 8192 on a GPU. A GPU runs a 2048^3 product far below its peak
(an H200 in bf16: 545-640 TFLOP/s, against 790 for 8192^3), and MFU divided by it would read about
2.9x too high; 8192^3 is the size at which the rate stops growing. ``MARFT_PEAK_TFLOPS`` replaces
the measurement by a figure of the user's (a datasheet peak, say); :func:`rate_label` names whichever
was used, for logs and benchmark tables.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from .models import text_config


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs to know about a model."""

    non_embedding_params: int  # N: weights every token passes through (no embedding, no output projection)
    layers: int  # L
    attn_dim: int  # heads * head_dim
    hidden: int  # H
    vocab: int  # V

    def forward(self, tokens: float, context: float, logits: float) -> float:
        """FLOPs of a forward pass over ``tokens`` tokens whose attention contexts sum to ``context``
        positions, with the output projection at ``logits`` of them."""
        return 2 * self.non_embedding_params * tokens + 4 * self.layers * self.attn_dim * context + 2 * self.hidden * self.vocab * logits

    def forward_backward(self, tokens: float, context: float, logits: float) -> float:
        """FLOPs of forward + backward through a frozen base with LoRA (activation gradients only)."""
        return 2 * (2 * self.non_embedding_params * tokens + 2 * self.hidden * self.vocab * logits) + 3 * 4 * self.layers * self.attn_dim * context


def model_shape(model) -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face causal LM (or a PEFT model around one)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = text_config(model)
    embed = base.get_input_embeddings()
    skip = {id(embed.weight)}
    head = base.get_output_embeddings()
    if head is not None:
        skip.add(id(head.weight))
    n = sum(p.numel() for name, p in base.named_parameters() if id(p) not in skip and p.dim() >= 2 and "lora_" not in name)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelShape(n, cfg.num_hidden_layers, heads * head_dim, cfg.hidden_size, embed.weight.shape[0])


def causal_context(lengths: torch.Tensor, offset: torch.Tensor | int = 0) -> float:
    """Sum over the tokens of rows of ``lengths`` [b] tokens, appended after ``offset`` earlier
    positions, of the positions each attends to: sum_b (offset_b * n_b + n_b (n_b + 1) / 2)."""
    n = lengths.double()
    return float((torch.as_tensor(offset, dtype=torch.float64) * n + n * (n + 1) / 2).sum())


@lru_cache(maxsize=None)
def matmul_rate(dtype: torch.dtype = torch.float32, device: str = "cpu", n: int = 2048, threads: int = 0) -> float:
    """FLOP/s of an ``n`` x ``n`` x ``n`` matrix product in ``dtype`` on ``device``: the best of
    five timed repetitions after two warm-up ones. ``threads`` only keys the cache (the rate is
    measured with the current ``torch.get_num_threads()``)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=dev).to(dtype)
    b = torch.randn(n, n, generator=g, device=dev).to(dtype)
    warm, timed = (2, 5) if dev.type == "cpu" else (5, 10)  # a GPU's clocks settle over a few products
    best = float("inf")
    for i in range(warm + timed):
        _sync(dev)
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        if i >= warm:
            best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rate_size(device) -> int:
    """The side n of the n^3 product that measures a device's rate: 2048 on a CPU, 8192 elsewhere."""
    return 2048 if torch.device(device).type == "cpu" else 8192


def peak_override() -> float:
    """``MARFT_PEAK_TFLOPS`` in FLOP/s (0 when unset): a rate the user gives instead of the measured one."""
    value = os.environ.get("MARFT_PEAK_TFLOPS", "").strip()
    try:
        peak = float(value) if value else 0.0
    except ValueError:
        peak = -1.0
    if peak < 0 or peak != peak:
        from ..errors import UserError

        raise UserError(f"MARFT_PEAK_TFLOPS={value!r} is not a rate; give the device's peak in TFLOP/s (e.g. 989) or unset it")
    return peak * 1e12


def machine_rate(model) -> float:
    """The matrix rate (FLOP/s) MFU divides by for ``model``'s dtype and device at the current
    thread count: ``MARFT_PEAK_TFLOPS`` if set, else measured (:func:`matmul_rate` at :func:`rate_size`)."""
    override = peak_override()
    if override:
        return override
    p = next(model.parameters())
    threads = torch.get_num_threads() if p.device.type == "cpu" else 0  # a GPU's rate does not depend on them
    return matmul_rate(p.dtype, str(p.device), rate_size(p.device), threads=threads)


def rate_label(model) -> str:
    """What :func:`machine_rate` is, in words: "790 TFLOP/s (8192^3 bf16 product measured on cuda:0)"."""
    p = next(model.parameters())
    rate = machine_rate(model)
    if peak_override():
        return f"{rate / 1e12:.0f} TFLOP/s (MARFT_PEAK_TFLOPS)"
    n = rate_size(p.device)
    dtype = str(p.dtype).replace("torch.", "").replace("bfloat16", "bf16")
    tflops = rate / 1e12  # a slow or busy CPU measures under 0.05: two significant digits, never "0.0"
    shown = f"{tflops:.0f}" if tflops >= 100 else f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}"
    return f"{shown} TFLOP/s ({n}^3 {dtype} product measured on {p.device})"


def mfu(flops: float, seconds: float, rate: float) -> float:
    """FLOPs / (seconds * rate); 0 when nothing was timed."""
    return flops / (seconds * rate) if seconds > 0 and rate > 0 else 0.0

