"""What a learning critic costs (BENCHMARKS.md, "The critic: frozen head against its own adapter"):
the same short run of the cooperative sum duo with ``train.critic=head`` and ``train.critic=lora``,
one after the other in fresh processes: per iteration (the mean over iterations 2..N, the first
being warm-up) the critic's two phases (its features and values for the batch; its update) and
the whole iteration, and the process's peak memory (maximum resident set, from /usr/bin/time).

    .venv/bin/python benchmarks/critic.py --iterations 4 [--algorithm marft] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(kind: str, args, extra: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "marft.cli", "train", "configs/coop_duo_sum.yaml",
               f"train.algorithm={args.algorithm}", f"train.critic={kind}", f"train.iterations={args.iterations}",
               "eval.before=false", "eval.problems=4", "eval.ablate=false", "train.save_every=1000", f"threads={args.threads}",
               f"output_dir={tmp}/run", *extra]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if p.returncode != 0:
            raise SystemExit(p.stderr[-3000:])
        peak_kib = int(p.stderr.strip().splitlines()[-1])
        m = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()][1:]
    mean = lambda k: statistics.fmean(x[k] for x in m)  # noqa: E731
    return {"critic_features_s": mean("critic_features_s"), "critic_update_s": mean("critic_update_s"),
            "iteration_s": mean("seconds"), "peak_mib": peak_kib / 1024,
            "explained_variance": statistics.fmean(x.get("critic/explained_variance", float("nan")) for x in m)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--algorithm", default="marft")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    rows = {"head": run("head", args), "lora": run("lora", args),
            "lora, critic_epochs 1": run("lora", args, ("train.critic_epochs=1",))}
    print(f"{args.algorithm}, configs/coop_duo_sum.yaml, {args.iterations} iterations (means of iterations 2..{args.iterations}), "
          f"{args.threads} threads")
    print("| critic | features + values (s) | update (s) | iteration (s) | peak memory (MiB) |")
    print("|---|---|---|---|---|")
    for kind, r in rows.items():
        print(f"| {kind} | {r['critic_features_s']:.2f} | {r['critic_update_s']:.2f} | {r['iteration_s']:.2f} | {r['peak_mib']:.0f} |")
    h = rows["head"]
    for kind, r in rows.items():
        if kind != "head":
            print(f"{kind} / head: iteration {r['iteration_s'] / h['iteration_s']:.2f}x, critic update "
                  f"{r['critic_update_s'] / max(h['critic_update_s'], 1e-9):.1f}x, peak memory {r['peak_mib'] / h['peak_mib']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
