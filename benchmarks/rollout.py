"""Rollout generation speed and MFU: marft's sampling loop (new and old path) against transformers'
``generate`` on the same prompts.

    .venv/bin/python benchmarks/rollout.py                 # default duo, 64 episodes, 2 threads
    .venv/bin/python benchmarks/rollout.py --episodes 16   # a quicker smoke run
    python3 benchmarks/rollout.py --episodes 128 --threads 8 model.name=DIR model.device=cuda rollout.max_new_tokens=256

Rows (each after a warm-up of its own path; on a GPU the new path is the static decode loop with
a CUDA graph, beside it without the graph, and the old path is left out):
- marft rollout, new path: ``generate``'s defaults (shared prompt prefix prefilled once, finished
  rows leave the batch, KV cache with room reserved);
- marft rollout, old path: ``compact=False, share_prefix=False, preallocate=False``;
- transformers ``model.generate`` on the prompts of the new path's rollout, agent by agent, with
  that agent's LoRA adapter active (as in rollout), same sampling and limits, stopping at the same
  end-of-turn tokens.

Seconds are generation time only (rollout's ``gen_seconds``; for transformers, its ``generate``
calls). MFU = needed FLOPs / seconds / the machine's matrix-multiply rate in the model's dtype
(``marft.engines.flops``); needed FLOPs count prompt and reply tokens only (no padding, no finished rows,
the prompt prefix all rows of a batch share once), from each run's own replies. The task,
temperature and reply limits are pinned to those BENCHMARKS.md was measured with
(``benchmarks/common.py``: chain_sum, 0.7, 64 tokens) so that the figures do not move when the main
job's config does. Sampling differs between runs (bf16 rounding), so token counts differ a little.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marft.engines.hf as hf_engine  # noqa: E402
import marft.run.rollout as rollout_module  # noqa: E402
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.engines.flops import machine_rate, model_shape, rate_label  # noqa: E402
from marft.engines.generation import Sampling, encode_chats, generate, needed_work  # noqa: E402
from marft.engines.models import stop_token_ids  # noqa: E402

from common import CONFIG, PINNED, cpu_name  # noqa: E402

PATHS = [("marft rollout, new path", {}),
         ("marft rollout, old path", {"compact": False, "share_prefix": False, "preallocate": False, "static": False})]
# on a GPU the new path is the static decode loop with its step replayed as a CUDA graph, beside it
# without the graph (benchmarks/decode.py has the other variants, at fewer tokens)
GPU_PATHS = [("marft rollout, new path (static loop + CUDA graph)", {}),
             ("marft rollout, static loop without a CUDA graph", {"graphs": False})]


def play(setup, resets, flags: dict, seed: int):
    """One rollout through ``generate(**flags)``; returns it and each call's (chats, Generated)."""
    team, models, make_env, sampling, horizon = setup
    calls = []

    def recording(model, tok, chats, sampling, stop_ids, generator=None, **kw):
        out = generate(model, tok, chats, sampling, stop_ids, generator, **{**kw, **flags})
        calls.append((chats, out))
        return out

    real, hf_engine.generate = hf_engine.generate, recording
    try:
        g = torch.Generator().manual_seed(seed)
        out = rollout_module.rollout(team, models, make_env, resets, sampling, horizon, g)
    finally:
        hf_engine.generate = real
    return out, calls


def hf_generate(models, agent: str, chats, sampling: Sampling, **extra):
    """transformers' ``generate`` on one agent's prompts (``extra``: more of its options); returns
    (seconds, prompt ids, prompt mask, reply mask)."""
    with models.acting(agent) as (model, tok):
        stops = stop_token_ids(model, tok)
        ids, mask = encode_chats(tok, chats, next(model.parameters()).device)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=sampling.temperature > 0,
                             temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                             max_new_tokens=sampling.max_new_tokens, eos_token_id=stops, pad_token_id=tok.pad_token_id, **extra)
        if out.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    reply = out[:, ids.shape[1]:]
    hit = torch.isin(reply, torch.tensor(stops, device=reply.device)).long()
    reply_mask = (hit.cumsum(1) - hit) == 0  # up to and including the first end-of-turn token
    return seconds, ids, mask, reply_mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--hf-static", action="store_true",
                   help="marft's default path, transformers generate, and transformers generate with its static cache (compiled on a GPU)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, [*PINNED, f"threads={args.threads}", *args.overrides])
    team, models, make_env = prepare(cfg)
    r = cfg.rollout
    sampling = Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens, tuple(r.stop))
    setup = (team, models, make_env, sampling, cfg.task.horizon)
    base = next(iter(models.bases.values()))
    dtype, shape = next(base.parameters()).dtype, model_shape(base)
    device = next(base.parameters()).device
    rate, label = machine_rate(base), rate_label(base)
    resets = [(i, {"split": "train"}) for i in range(args.episodes)]

    rows, runs = [], []  # rows: (name, tokens, seconds, needed FLOPs, computed FLOPs or None)
    paths = GPU_PATHS if device.type == "cuda" else PATHS
    for name, flags in paths[:1] if args.hf_static else paths:  # --hf-static: marft's default path only
        play(setup, resets[:4], flags, 0)  # warm-up
        out, calls = play(setup, resets, flags, 1)
        runs.append((out, calls))
        rows.append((name, out.generated_tokens, out.gen_seconds, sum(g.work.flops(shape) for _, g in calls),
                     sum(g.spent.flops(shape) for _, g in calls)))
        print(f"# {name}: {out.generated_tokens} tokens in {out.gen_seconds:.1f} s", flush=True)
    new_out, new_calls = runs[0]
    prompts = [(t.agent, chats) for t, (chats, _) in zip(new_out.turns, new_calls)]
    hf_generate(models, prompts[0][0], prompts[0][1][:4], sampling)  # warm-up
    tokens = seconds = needed = 0.0
    for agent, chats in prompts:
        s, ids, mask, reply_mask = hf_generate(models, agent, chats, sampling)
        tokens, seconds = tokens + int(reply_mask.sum()), seconds + s
        needed += needed_work(ids, mask, reply_mask).flops(shape)
    rows.append(("transformers generate (agent's adapter active)", int(tokens), seconds, needed, None))
    print(f"# transformers generate: {int(tokens)} tokens in {seconds:.1f} s", flush=True)
    if args.hf_static:  # transformers' static cache, which its generate compiles with torch.compile on a GPU
        t0 = time.perf_counter()
        hf_generate(models, prompts[0][0], prompts[0][1], sampling, cache_implementation="static")  # warm-up: compiles
        print(f"# transformers generate with a static cache: first call (compilation) {time.perf_counter() - t0:.1f} s")
        tokens = seconds = needed = 0.0
        for agent, chats in prompts:
            s, ids, mask, reply_mask = hf_generate(models, agent, chats, sampling, cache_implementation="static")
            tokens, seconds = tokens + int(reply_mask.sum()), seconds + s
            needed += needed_work(ids, mask, reply_mask).flops(shape)
        rows.append(("transformers generate, static cache (torch.compile on a GPU)", int(tokens), seconds, needed, None))

    print(f"# rollout generation: team {' -> '.join(team.names)}, {args.episodes} episodes, "
          f"<= {r.max_new_tokens} new tokens, T={r.temperature}, {dtype}, {torch.get_num_threads()} threads")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_name()}"
    print(f"# {where}; MFU against {label}")
    hf = next(x for x in rows if x[0].startswith("transformers generate ("))
    hf_rate = hf[1] / hf[2]
    print("| path | generated tokens | seconds | tokens/s | MFU | computed / needed FLOPs | vs transformers generate |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for i, (name, n, s, need, comp) in enumerate(rows):
        waste = f"{comp / need:.2f}" if comp else "n/a"
        print(f"| {name} | {n} | {s:.1f} | {n / s:.0f} | {need / s / rate:.2%} | {waste} | {n / s / hf_rate:.2f}x |")
        table.append({"path": name, "tokens": n, "seconds": s, "tokens_per_s": n / s, "mfu": need / s / rate,
                      "computed_per_needed": comp / need if comp else None, "vs_hf": n / s / hf_rate, "default": i == 0})
    print(f"(new path: whole rollout {new_out.seconds:.1f} s, environments and prompt building included)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "rate": label, "dtype": str(dtype), "episodes": args.episodes,
                                               "max_new_tokens": r.max_new_tokens, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
