"""Training speed: the time split of one MARFT iteration and the learner's tokens/s.

    .venv/bin/python benchmarks/train.py                    # default duo config, embedded model
    .venv/bin/python benchmarks/train.py train.algorithm=marft-token

Runs one warm-up iteration and then one measured iteration of the config, and prints where its
time goes (generation, prompts and scoring, critic features, critic update, policy update). Then,
on that iteration's batch, it times the learner: teacher-forced forward passes without gradients
(what computing the behaviour log-probabilities costs) against forward + backward through the
policy with LoRA (what an update costs), in tokens (prompt + reply) per second, and their ratio.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marft.cli import prepare  # noqa: E402
from marft.config import load_config  # noqa: E402
from marft.trainer import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs/duo_arithmetic.yaml"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, ["threads=2", "output_dir=/tmp/marft-bench-train", *args.overrides])
    team, models, make_env = prepare(cfg)
    trainer = Trainer(cfg, team, models, make_env, log=lambda m: None)
    trainer.iteration_step()  # warm-up
    m = trainer.iteration_step()
    total = m["seconds"]
    parts = [("generation", m["generation_s"]), ("prompts and scoring", m["rollout_s"] - m["generation_s"]),
             ("critic features", m["critic_features_s"]), ("critic update", m["critic_update_s"]),
             ("policy update (recompute log-probs + forward/backward)", m["policy_update_s"])]
    print(f"# one iteration: {cfg.train.algorithm}, team {' -> '.join(team.names)}, {cfg.rollout.episodes} episodes, "
          f"<= {cfg.rollout.max_new_tokens} new tokens, {m['tokens']} generated tokens, {torch.get_num_threads()} threads")
    print("| part | seconds | share |")
    print("|---|---|---|")
    for name, s in parts:
        print(f"| {name} | {s:.1f} | {100 * s / total:.0f}% |")
    print(f"| **total** | **{total:.1f}** | end to end {m['tokens_per_s']:.1f} generated tokens/s |")

    out = trainer._rollout(99)
    rows = [(i, r) for i, t in enumerate(out.turns) for r in range(len(t.episodes))]
    tokens = int(sum(t.prompt_mask.sum() + t.response_mask.sum() for t in out.turns))
    t0 = time.perf_counter()
    old = trainer._old_logprobs(out, rows)
    fwd_s = time.perf_counter() - t0
    targets = trainer._targets(out)
    adv = trainer._normalised_advantages(out, targets)
    t0 = time.perf_counter()
    mb = cfg.train.minibatch_size
    for lo in range(0, len(rows), mb):
        trainer._accumulate(out, rows[lo:lo + mb], old, adv, len(rows[lo:lo + mb]))
    fwd_bwd_s = time.perf_counter() - t0
    print()
    print(f"# learner on {len(rows)} replies, {tokens} tokens (prompt + reply), micro-batch {cfg.train.micro_batch_size}")
    print("| learner pass | seconds | tokens/s |")
    print("|---|---|---|")
    print(f"| forward only, no gradients (behaviour log-probs) | {fwd_s:.1f} | {tokens / fwd_s:.0f} |")
    print(f"| forward + backward with LoRA, entropy{' + KL' if cfg.train.kl_coef else ''} | {fwd_bwd_s:.1f} | {tokens / fwd_bwd_s:.0f} |")
    print(f"| ratio forward+backward / forward | {fwd_bwd_s / fwd_s:.2f}x | |")
    print()
    print(f"peak resident memory of this process (model, two adapters, critic, optimisers, learner): "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
