"""Rollout speed and memory: batched team rollout against a naive one-episode-at-a-time loop.

    .venv/bin/python benchmarks/rollout.py                  # default duo, embedded model, CPU
    .venv/bin/python benchmarks/rollout.py --quick          # fewer episodes, for a smoke run

Part 1 runs both in this process on the same config, seeds and problems, and prints generated
tokens/s of each and their ratio. Part 2 starts one fresh process per team size (1, 2, 4 agents)
and prints its peak resident memory after loading the team and playing a batch of episodes: the
team holds one base model whatever its size, so memory barely grows with agents.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.cli import prepare  # noqa: E402
from marft.config import load_config  # noqa: E402
from marft.generation import Sampling  # noqa: E402
from marft.rollout import rollout  # noqa: E402


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def play(team, models, make_env, resets, sampling, horizon, seed):
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    out = rollout(team, models, make_env, resets, sampling, horizon, g)
    return out.generated_tokens, time.perf_counter() - t0


def speed(args) -> dict:
    cfg = load_config(args.config, args.overrides + [f"threads={args.threads}"])
    team, models, make_env = prepare(cfg)
    r = cfg.rollout
    sampling = Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens, tuple(r.stop))
    resets = [(i, {"split": "train"}) for i in range(args.episodes)]
    play(team, models, make_env, resets[:4], sampling, cfg.task.horizon, 0)  # warm-up
    batched_tokens, batched_s = play(team, models, make_env, resets, sampling, cfg.task.horizon, 1)
    naive_tokens, naive_s = 0, 0.0
    for i in range(args.naive_episodes):
        n, s = play(team, models, make_env, [resets[i]], sampling, cfg.task.horizon, 100 + i)
        naive_tokens, naive_s = naive_tokens + n, naive_s + s
    res = {
        "team": team.names, "episodes": args.episodes, "naive_episodes": args.naive_episodes,
        "max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "threads": torch.get_num_threads(),
        "dtype": str(next(iter(models.bases.values())).dtype),
        "batched_tokens": batched_tokens, "batched_s": batched_s, "batched_tok_s": batched_tokens / batched_s,
        "naive_tokens": naive_tokens, "naive_s": naive_s, "naive_tok_s": naive_tokens / naive_s,
        "peak_rss_gb": peak_rss_gb(),
    }
    res["speedup"] = res["batched_tok_s"] / res["naive_tok_s"]
    return res


def memory_child(args) -> dict:
    """In a fresh process: load the team, play one batch, report peak memory."""
    cfg = load_config(args.config, args.overrides + [f"team.preset={args.preset}", f"threads={args.threads}"])
    team, models, make_env = prepare(cfg)
    load_gb = peak_rss_gb()
    r = cfg.rollout
    sampling = Sampling(r.temperature, r.top_p, r.top_k, args.memory_tokens, tuple(r.stop))
    tokens, _ = play(team, models, make_env, [(i, {"split": "train"}) for i in range(args.episodes)],
                     sampling, cfg.task.horizon, 0)
    base_params = sum(p.numel() * p.element_size() for m in models.bases.values()
                      for n, p in m.named_parameters() if "lora_" not in n)
    lora_params = sum(p.numel() * p.element_size() for m in models.bases.values()
                      for n, p in m.named_parameters() if "lora_" in n)
    return {"preset": args.preset, "agents": len(team.agents), "base_copies": len(models.bases),
            "base_weights_gb": base_params / 2**30, "adapter_weights_mb": lora_params / 2**20,
            "peak_rss_after_load_gb": load_gb, "peak_rss_gb": peak_rss_gb(), "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs/duo_arithmetic.yaml"))
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--naive-episodes", type=int, default=8, help="episodes of the one-at-a-time loop (it is slow)")
    p.add_argument("--memory-tokens", type=int, default=32, help="max new tokens in the memory runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 episodes, 2 naive, 32 new tokens")
    p.add_argument("--child", help=argparse.SUPPRESS)  # preset, for the memory subprocess
    p.add_argument("--preset", default="duo", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    # pinned, so that the figures do not move when the example config changes
    args.overrides = ["rollout.temperature=1.0", "rollout.max_new_tokens=96", *args.overrides]
    if args.quick:
        args.episodes, args.naive_episodes = 8, 2
        args.overrides.append("rollout.max_new_tokens=32")
    if args.child:
        print(json.dumps(memory_child(args)))
        return

    s = speed(args)
    print(f"# rollout: team {' -> '.join(s['team'])}, {s['max_new_tokens']} new tokens max, T={s['temperature']}, "
          f"{s['dtype']}, {s['threads']} threads")
    print(f"batched ({s['episodes']} episodes at once): {s['batched_tokens']} tokens in {s['batched_s']:.1f} s = {s['batched_tok_s']:.1f} tok/s")
    print(f"naive   (1 episode at a time, {s['naive_episodes']} episodes): {s['naive_tokens']} tokens in {s['naive_s']:.1f} s = {s['naive_tok_s']:.1f} tok/s")
    print(f"speed-up batched / naive: {s['speedup']:.1f}x    peak RSS of this process: {s['peak_rss_gb']:.2f} GiB")
    print()
    print(f"# memory by team size (fresh process each, {args.episodes} episodes, {args.memory_tokens} new tokens)")
    print("| agents | preset | base model copies | base weights GiB | adapter weights MiB | peak RSS after load GiB | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for preset in ("solo", "duo", "quartet"):
        cmd = [sys.executable, __file__, "--child", "1", "--preset", preset, "--config", args.config,
               "--episodes", str(args.episodes), "--memory-tokens", str(args.memory_tokens),
               "--threads", str(args.threads), *args.overrides]
        m = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(f"| {m['agents']} | {m['preset']} | {m['base_copies']} | {m['base_weights_gb']:.3f} | "
              f"{m['adapter_weights_mb']:.2f} | {m['peak_rss_after_load_gb']:.2f} | {m['peak_rss_gb']:.2f} |")


if __name__ == "__main__":
    main()
