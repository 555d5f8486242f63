"""The default duo's rollout on each engine: HF (barrier), vLLM (barrier) and vLLM (asynchronous),
at 64 and 256 episodes, in one process, against the HF engine as the baseline.

    .venv-vllm/bin/python benchmarks/engines.py [--episodes 64 256] [--dtype auto] [key=value ...]

Needs the vLLM venv (``bash scripts/setup.sh --vllm``). Every engine plays the same training
episodes (same seeds, the main job's config: planner replies of at most 32 tokens, solver 48,
temperature 0.7) with untrained adapters (LoRA B = 0, so the LoRA path runs but changes nothing).
Prints generated tokens/s over the whole rollout, its MFU (FLOPs the replies need / rollout time / the machine's
2048^3 matrix rate in the run's dtype), and each engine's speed as a ratio of the HF engine's at
the same episode count. The vLLM engine's start-up (model load, KV cache) is timed separately and
not counted in a rollout.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import torch

    from common import CONFIG, cpu_name
    from marft.engines import flops
    from marft.api import prepare
    from marft.run.config import load_config
    from marft.engines.hf import HFEngine
    from marft.engines.vllm import VLLMEngine
    from marft.engines.generation import Sampling
    from marft.run.rollout import rollout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(CONFIG, [f"model.dtype={args.dtype}", *args.overrides])
    if args.threads:
        torch.set_num_threads(args.threads)
    team, models, make_env = prepare(cfg)
    r = cfg.rollout
    sampling = Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens, tuple(r.stop))
    base = next(iter(models.bases.values()))
    rate = flops.machine_rate(base)
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    t0 = time.perf_counter()
    vllm = VLLMEngine(models, cfg.model, r.vllm, seed=cfg.seed)
    start_s = time.perf_counter() - t0
    hf = HFEngine(models)
    print(f"# duo, {cpu_name()}, {dtype}, {torch.get_num_threads()} torch threads; 2048^3 rate {rate / 1e9:.0f} GFLOP/s; "
          f"vLLM engine start-up {start_s:.0f} s")
    print("| episodes | engine | schedule | generated tokens | seconds | tokens/s | MFU (rollout) | vs HF |")
    print("|---|---|---|---|---|---|---|---|")
    rng = random.Random(0)
    gaps: dict[str, list[float]] = {}
    for n in args.episodes:
        resets = [(rng.randrange(2**62), {"split": "train"}) for _ in range(n)]
        baseline = None
        for name, engine, schedule in [("hf", hf, "barrier"), ("vllm", vllm, "barrier"), ("vllm", vllm, "async")]:
            g = torch.Generator().manual_seed(1)
            out = rollout(team, engine, make_env, resets, sampling, cfg.task.horizon, g, schedule=schedule)
            tps = out.generated_tokens / out.seconds
            baseline = baseline or tps
            print(f"| {n} | {name} | {schedule} | {out.generated_tokens} | {out.seconds:.1f} | {tps:.1f} | "
                  f"{100 * flops.mfu(out.gen_flops, out.seconds, rate):.1f}% | {tps / baseline:.2f}x |", flush=True)
            gaps.setdefault(name, []).extend(logprob_gaps(models, out, sampling.temperature))
    for name, g in gaps.items():
        g = torch.tensor(g)
        print(f"# {name}: |rollout - learner| log-probability per reply token: mean {g.mean():.2e}, "
              f"median {g.median():.2e}, max {g.max():.2e} ({len(g)} tokens)")
    vllm.close()


def logprob_gaps(models, out, temperature: float) -> list[float]:
    """Per reply token, |engine - learner| log-probability, the learner's teacher-forced pass
    (``marft.engines.generation.sequence_logprobs``, the tokens' own adapter) recomputing the engine's."""
    import torch

    from marft.engines.generation import sequence_logprobs

    gaps: list[float] = []
    for t in out.turns[:2]:  # the first step's planner and solver turns
        with torch.no_grad(), models.acting(t.agent) as (model, _):
            for lo in range(0, len(t.texts), 16):
                sl = slice(lo, lo + 16)
                lp = sequence_logprobs(model, t.prompt_ids[sl], t.prompt_mask[sl], t.response_ids[sl],
                                       t.response_mask[sl], temperature)
                m = t.response_mask[sl]
                gaps += (lp - t.logprobs[sl])[m].abs().tolist()
    return gaps


if __name__ == "__main__":  # vLLM starts its workers with spawn
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
