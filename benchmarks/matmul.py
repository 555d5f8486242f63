"""The ceiling MFU can reach with this model's own matrix shapes: each weight matrix's product at
the row counts the rollout and the learner use, as a fraction of the 2048^3 product that MFU
divides by (``marft.engines.flops.matmul_rate``).

    .venv/bin/python benchmarks/matmul.py                       # embedded model, its dtype, 2 threads
    .venv/bin/python benchmarks/matmul.py --dtype float32

MFU's denominator is the rate of one large square product. A small model's products are not
square: SmolLM2-135M multiplies [rows x 576] by 576 x 576 (attention), 576 x 192 (keys, values),
576 x 1536 and 1536 x 576 (MLP) and 576 x 49,152 (vocabulary). Decoding feeds as many rows as
there are live replies (8-64), the learner a micro-batch of up to 2,048 tokens. The ceiling
is the layer's products together (q, k, v, o, gate, up, down: the 2N FLOPs per token of
``marft/engines/flops.py``) at that row count, timed back to back: the MFU a forward pass would have if
nothing but its matrix products took time (the last column). No rollout or learner can beat it without changing
the shapes (more rows per product, or fused projections).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.engines.flops import matmul_rate  # noqa: E402

from common import cpu_name  # noqa: E402

ROWS = (1, 8, 32, 64, 256, 2048)


def seconds(fn, repeat: int) -> float:
    """Median of ``repeat`` timed calls after three warm-up ones."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="auto (the model's on this machine), bfloat16 or float32")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from marft.engines.models import pick_device, pick_dtype, resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(args.model, ""))
    dtype = pick_dtype(args.dtype, pick_device("cpu"))
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    mats = {"q": (H, q), "k": (H, kv), "v": (H, kv), "o": (q, H), "gate": (H, I), "up": (H, I), "down": (I, H)}
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(n, m, generator=g).to(dtype) for k, (m, n) in mats.items()}
    head = torch.randn(V, H, generator=g).to(dtype)
    rate = matmul_rate(dtype, "cpu", threads=args.threads)
    print(f"# {args.model}, {dtype}, {args.threads} threads, CPU: {cpu_name()}")
    print(f"# 2048^3 matrix rate (MFU's denominator): {rate / 1e9:.0f} GFLOP/s")
    print("| rows | " + " | ".join(f"{k} {m}x{n}" for k, (m, n) in mats.items()) + f" | vocabulary {H}x{V} | ceiling (one layer's products) |")
    print("|---" * (len(mats) + 3) + "|")
    for M in ROWS:
        x = {d: torch.randn(M, d, generator=g).to(dtype) for d in {H, q, I}}
        cells, layer_flops = [], 0
        for k, (m, n) in mats.items():
            s = seconds(lambda: torch.nn.functional.linear(x[m], weights[k]), 30)
            cells.append(f"{2 * M * m * n / s / rate:.0%}")
            layer_flops += 2 * M * m * n
        s = seconds(lambda: torch.nn.functional.linear(x[H], head), 10 if M >= 256 else 30)
        cells.append(f"{2 * M * H * V / s / rate:.0%}")

        def layer():
            for k, (m, _) in mats.items():
                torch.nn.functional.linear(x[m], weights[k])

        s = seconds(layer, 30)
        print(f"| {M} | " + " | ".join(cells) + f" | **{layer_flops / s / rate:.0%}** ({layer_flops / s / 1e9:.0f} GFLOP/s) |")


if __name__ == "__main__":
    main()
