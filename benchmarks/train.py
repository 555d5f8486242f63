"""Training speed against the machine's own limit: one MARFT iteration, today's path beside the old.

    .venv/bin/python benchmarks/train.py                    # default duo config, embedded model
    .venv/bin/python benchmarks/train.py train.algorithm=marft-token
    .venv/bin/python benchmarks/train.py --no-ablations     # skip the learner ablation rows
    .venv/bin/python benchmarks/train.py --compile          # new path against new path + torch.compile

Prints the CPU, the dtype and the matrix-multiply rate of this machine (marft.engines.flops), then runs one
warm-up iteration and, from the same state and seed (so on nearly the same batch), one iteration
with the old path (``train.fast=false``: padded passes, every prompt prefix recomputed, float32
log-softmax over the vocabulary, a separate behaviour-log-prob pass) and
one with the new, each part's seconds, share and MFU side by side. Then, on the new iteration's
batch, the policy update alone with each of the fast path's changes switched off in turn (what
each one buys). Last the process's peak resident memory.

``--compile``: instead of the old path, the new path beside the new path compiled
(``rollout.compile`` and ``train.compile``), the compiled one after a warm-up iteration of its own
that compiles (its seconds less the measured iteration's: the compile time), from the same state.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.engines import flops, packing  # noqa: E402
from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.assemble import build_trainer  # noqa: E402
from marft.run.trainer import Trainer  # noqa: E402

from common import CONFIG, PINNED, cpu_name  # noqa: E402

PARTS = [("rollout (generation)", "generation_s", "mfu/rollout"),
         ("critic features", "critic_features_s", "mfu/critic_features"),
         ("critic update", "critic_update_s", None),
         ("behaviour log-probs", "behaviour_logprobs_s", "mfu/behaviour_logprobs"),
         ("learner forward + backward", "learner_s", "mfu/learner")]


def state(tr: Trainer) -> dict:
    return copy.deepcopy({"adapters": {a: tr.models.adapter_state(a) for a in tr.team.adapters},
                          "heads": {k: h.state_dict() for k, h in tr.heads.items()},
                          "popt": {k: lr.optimizer.state_dict() for k, lr in tr.policy.learners.items()},
                          "copt": {k: o.state_dict() for k, o in tr.critic.optimizers.items()},
                          "iteration": tr.iteration})


def restore(tr: Trainer, s: dict) -> None:
    for a, w in s["adapters"].items():
        tr.models.load_adapter_state(a, copy.deepcopy(w))
    for k, h in tr.heads.items():
        h.load_state_dict(s["heads"][k])
        tr.critic.optimizers[k].load_state_dict(copy.deepcopy(s["copt"][k]))
    for k, lr in tr.policy.learners.items():
        lr.optimizer.load_state_dict(copy.deepcopy(s["popt"][k]))
    tr.iteration = s["iteration"]


def policy_update_seconds(tr: Trainer, out, targets, s: dict) -> float:
    restore(tr, s)
    t0 = time.perf_counter()
    tr.update_policy(out, targets, list(tr.team.names))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--new-only", action="store_true", help="only the new path, two iterations: its own peak memory")
    p.add_argument("--json", help="--new-only: also write the measured iteration's figures to this JSON file")
    p.add_argument("--compile", action="store_true", help="the new path against the new path with rollout.compile and "
                                                           "train.compile (no ablations)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, [*PINNED, "threads=2", "output_dir=/tmp/marft-bench-train", *args.overrides])
    team, models, make_env = prepare(cfg)
    tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    base = tr._base()
    dtype = next(base.parameters()).dtype
    rate = flops.machine_rate(base)
    device = next(base.parameters()).device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# {where}, {torch.get_num_threads()} threads, model dtype {str(dtype).replace('torch.', '')}; "
          f"MFU against {flops.rate_label(base)}")
    tr.iteration_step()  # warm-up
    if args.new_only:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        m = tr.iteration_step()
        gpu = f"; peak GPU memory allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
        print(f"new path: {m['seconds']:.1f} s per iteration, MFU {100 * m['mfu/iteration']:.1f}%, "
              f"{m['tokens_per_s']:.1f} generated tokens/s, {m['throughput/processed_tokens_per_s']:.0f} prompt + reply "
              f"tokens/s; peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB{gpu}")
        print("| part | seconds | share | MFU |")
        print("|---|---|---|---|")
        for name, key, mkey in PARTS:
            print(f"| {name} | {m[key]:.2f} | {100 * m[key] / m['seconds']:.0f}% | {f'{100 * m[mkey]:.1f}%' if mkey else '-'} |")
        if args.json:
            keep = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if device.type == "cuda":
                keep["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            Path(args.json).write_text(json.dumps({"device": where, "rate": flops.rate_label(base), **keep}, indent=1))
        return
    s = state(tr)
    if args.compile:
        labels = ("uncompiled", "compiled")
        restore(tr, s)
        old = tr.iteration_step()
        tr.engine.flags["compile"] = tr.cfg.rollout.compile = tr.cfg.train.compile = True
        restore(tr, s)
        warm = tr.iteration_step()  # compiles
        restore(tr, s)
        new = tr.iteration_step()
        print(f"# compiling: the compiled path's first iteration took {warm['seconds']:.1f} s, "
              f"{warm['seconds'] - new['seconds']:.1f} s more than its next")
    else:
        labels = ("old", "new")
        runs = {}
        for fast in (False, True):
            restore(tr, s)
            tr.cfg.train.fast = fast
            runs[fast] = tr.iteration_step()
        old, new = runs[False], runs[True]
    a, b = labels
    print(f"# one iteration: {cfg.train.algorithm}, team {' -> '.join(team.names)}, {cfg.rollout.episodes} episodes, "
          f"<= {cfg.rollout.max_new_tokens} new tokens; {a} path {old['tokens']} generated tokens, {b} {new['tokens']}")
    print(f"| part | {a} s | {a} share | {a} MFU | {b} s | {b} share | {b} MFU | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for name, key, mkey in PARTS:
        o, n = old[key], new[key]
        mo = f"{100 * old[mkey]:.1f}%" if mkey else "-"
        mn = f"{100 * new[mkey]:.1f}%" if mkey else "-"
        print(f"| {name} | {o:.1f} | {100 * o / old['seconds']:.0f}% | {mo} | {n:.1f} | {100 * n / new['seconds']:.0f}% | {mn} | "
              f"{o / max(n, 1e-9):.1f}x |")
    print(f"| **whole iteration** | **{old['seconds']:.1f}** | | {100 * old['mfu/iteration']:.1f}% | **{new['seconds']:.1f}** | | "
          f"{100 * new['mfu/iteration']:.1f}% | **{old['seconds'] / new['seconds']:.1f}x** |")
    print(f"end to end: {a} {old['tokens_per_s']:.1f}, {b} {new['tokens_per_s']:.1f} generated tokens/s")

    if not args.no_ablations and not args.compile:
        out = tr.play(s["iteration"])
        targets = tr.targets(out)
        rows = sum(len(t.episodes) for t in out.turns)
        tok = int(sum(t.prompt_mask.sum() + t.response_mask.sum() for t in out.turns))
        print()
        print(f"# policy update alone on one batch ({rows} replies, {tok} prompt + reply tokens), one change off at a time")
        print("| learner | seconds | vs plain |")
        print("|---|---|---|")
        tr.cfg.train.fast = False
        plain = policy_update_seconds(tr, out, targets, s)
        print(f"| plain (train.fast=false) | {plain:.1f} | 1.0x |")
        tr.cfg.train.fast = True
        ablations = [("fast (all changes)", {}),
                     ("fast without the shared prefix", {"SHARE_PREFIX": False}),
                     ("fast without the fused log-prob/entropy pass", {"FUSED": False}),
                     ("fast without the first minibatch's behaviour log-probs", {"REUSE_FIRST": False}),
                     ("fast with transformers' eager attention instead of marft_cpu", {"CPU_ATTENTION": "eager"}),
                     ("fast with the model's attention (PyTorch's flash kernel)", {"CPU_ATTENTION": None})]
        for label, flags in ablations:
            saved = {k: getattr(packing, k) for k in flags}
            for k, v in flags.items():
                setattr(packing, k, v)
            sec = policy_update_seconds(tr, out, targets, s)
            for k, v in saved.items():
                setattr(packing, k, v)
            print(f"| {label} | {sec:.1f} | {plain / sec:.1f}x |")
    print()
    print(f"peak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
