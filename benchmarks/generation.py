"""Batched generation: marft's sampling loop against transformers' ``generate``, and two ablations.

    .venv/bin/python benchmarks/generation.py

Same 32 prompts (a solver asked to add two numbers), 64 new tokens at most, temperature 0.7, the
embedded SmolLM2-135M-Instruct, 2 threads. Rows:
- marft ``generate`` with the agent's LoRA adapter active (what rollout does);
- the same on the old path (``compact=False, share_prefix=False, preallocate=False``: every
  prompt prefilled whole, finished rows kept in the batch, the KV cache grown by concatenation);
- the same with adapters disabled;
- transformers ``model.generate`` with adapters disabled (the usual baseline);
- marft with ``torch.multinomial`` sampling instead of inverse-CDF sampling (ablation);
- marft without the contiguous-input hook on the vocabulary projection (ablation).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marft.engines.generation as gen  # noqa: E402
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines.models import stop_token_ids  # noqa: E402

CHATS = [[{"role": "system", "content": "You are the solver of a team."},
          {"role": "user", "content": f"Calculate {i} + {2 * i + 3}. Give the final answer in \\boxed{{}}."}]
         for i in range(32)]
SAMPLING = gen.Sampling(temperature=0.7, max_new_tokens=64)


def count_until_stop(ids: torch.Tensor, stops: list[int]) -> int:
    hit = torch.isin(ids, torch.tensor(stops))
    first = torch.where(hit.any(1), hit.float().argmax(1) + 1, torch.full((ids.shape[0],), ids.shape[1]))
    return int(first.sum())


def timed(fn) -> tuple[int, float]:
    fn()  # warm-up
    t0 = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t0


def main() -> None:
    cfg = load_config(None, ["threads=2"])
    _, models, _ = prepare(cfg)
    rows = []
    with models.acting("solver") as (model, tok):
        stops = stop_token_ids(model, tok)

        def ours(**flags):
            return int(gen.generate(model, tok, CHATS, SAMPLING, stops, torch.Generator().manual_seed(0), **flags).response_mask.sum())

        rows.append(("marft generate, LoRA active", *timed(ours)))
        rows.append(("marft generate, old path, LoRA active",
                     *timed(lambda: ours(compact=False, share_prefix=False, preallocate=False))))
        with model.disable_adapter():
            rows.append(("marft generate, adapters disabled", *timed(ours)))
            ids, mask = gen.encode_chats(tok, CHATS, "cpu")

            def hf():
                torch.manual_seed(0)
                out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=0.7,
                                     top_k=0, max_new_tokens=64, pad_token_id=tok.pad_token_id)
                return count_until_stop(out[:, ids.shape[1]:], stops)

            rows.append(("transformers generate, adapters disabled", *timed(hf)))
        real_sample = gen._sample
        gen._sample = lambda logits, g, u=None: torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(-1)
        rows.append(("ablation: torch.multinomial sampling, LoRA active", *timed(ours)))
        gen._sample = real_sample
        head = model.get_output_embeddings()
        hooks = dict(head._forward_pre_hooks)
        head._forward_pre_hooks.clear()
        rows.append(("ablation: no contiguous-input hook, LoRA active", *timed(ours)))
        head._forward_pre_hooks.update(hooks)
    base = rows[3][1] / rows[3][2]
    print("| generation (32 prompts, <=64 new tokens, T=0.7) | tokens | seconds | tokens/s | vs transformers generate |")
    print("|---|---|---|---|---|")
    for name, n, s in rows:
        print(f"| {name} | {n} | {s:.1f} | {n / s:.0f} | {n / s / base:.2f}x |")


if __name__ == "__main__":
    main()
