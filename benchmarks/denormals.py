"""Generation with subnormal floats flushed to zero (marft's default) against not flushed.

    .venv/bin/python benchmarks/denormals.py [--tokens 192] [--batch 16]

The coder's prompts of the first MBPP test problems (about 270 tokens; a synthetic prompt of the
same length if ../shared/data is absent), the embedded SmolLM2-135M-Instruct in bf16, 2 threads,
temperature 0.7, the same seed in both runs. ``TeamModel`` turns flushing on
(``torch.set_flush_denormal(True)``); the baseline turns it off again for its run. Prints tokens/s
of each, their ratio, and how far the two runs' replies agree.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marft.generation as gen  # noqa: E402
from marft.cli import prepare  # noqa: E402
from marft.config import load_config  # noqa: E402
from marft.models import stop_token_ids  # noqa: E402

MBPP = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp" / "mbpp.jsonl"


def prompts(n: int) -> list[str]:
    if MBPP.exists():
        from marft.envs.code import load_mbpp

        ps = [p for p in load_mbpp(str(MBPP)).values() if 11 <= p.task_id <= 510][:n]
        return [p.prompt for p in ps]
    text = "Write a function to find the shared elements from the given two lists. " * 12
    return [text] * n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    cfg = load_config(None, ["threads=2", "team.preset=code-solo"])
    _, models, _ = prepare(cfg)
    chats = [[{"role": "system", "content": "You are the coder of a team."},
              {"role": "user", "content": p + "\n\nWrite the complete Python function in one ```python code block."}]
             for p in prompts(a.batch)]
    sampling = gen.Sampling(temperature=0.7, max_new_tokens=a.tokens)
    rows, outs = [], []
    with models.acting("coder") as (model, tok):
        stops = stop_token_ids(model, tok)
        gen.generate(model, tok, chats[:2], gen.Sampling(temperature=0.7, max_new_tokens=4), stops)  # warm-up
        for flush in (True, False):
            torch.set_flush_denormal(flush)
            t = time.perf_counter()
            out = gen.generate(model, tok, chats, sampling, stops, torch.Generator().manual_seed(0))
            dt = time.perf_counter() - t
            n = int(out.response_mask.sum())
            rows.append((flush, n, dt, n / dt))
            outs.append(out)
        torch.set_flush_denormal(True)
    print(f"# {len(chats)} prompts of {outs[0].prompt_ids.shape[1]} tokens (padded), <= {a.tokens} new tokens\n")
    print("| subnormals | tokens | seconds | tokens/s | vs not flushed |")
    print("|---|---|---|---|---|")
    for flush, n, dt, tps in rows:
        print(f"| {'flushed to zero (marft)' if flush else 'kept (PyTorch default)'} | {n} | {dt:.1f} | {tps:.1f} | "
              f"{tps / rows[1][3]:.2f}x |")
    same = sum(x == y for x, y in zip(outs[0].texts, outs[1].texts))
    print(f"\nidentical replies in both runs: {same} of {len(chats)}")


if __name__ == "__main__":
    main()
