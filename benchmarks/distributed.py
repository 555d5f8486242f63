"""The default duo trained in one process and on a local Ray cluster with 1 and 2 rollout workers
(one learner actor per adapter), side by side in one script: episodes per second over whole
iterations, each as a ratio of the in-process run's, and the bytes each iteration moved between
the driver and the actors.

    .venv/bin/python benchmarks/distributed.py [--iterations 4] [--episodes 32] [key=value ...]

Every run trains from the same start with the same seeds for ``--iterations`` iterations; the
first is a warm-up and not counted. The in-process run uses all the machine's cores as torch
threads; on Ray each rollout worker gets cores / workers threads and each learner one (the
learners of the two adapters run at the same time). Ray is started once, with the machine's cores
as logical CPUs (actors' CPU requests are bookkeeping: on 2 cores the driver, the workers and the
learners share them). Bytes are the pickled sizes of what crosses the object store: the workers'
shards of turns, each learner's turns and advantages, its reply (statistics and new adapter
weights), and the adapter weights sent to every worker after each update.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import ray

    from common import CONFIG, PINNED, cpu_name
    from marft.engines import flops
    from marft.api import prepare
    from marft.run.config import load_config
    from marft.assemble import build_trainer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    ray.init(num_cpus=max(cores, 4), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    common = [*PINNED, f"rollout.episodes={args.episodes}", "eval.before=false", "output_dir=/tmp/marft-bench-distributed",
              *args.overrides]
    rows = []
    for workers in [0, *args.workers]:
        extra = [f"threads={cores}"] if not workers else [
            f"cluster.rollout_workers={workers}", f"cluster.worker_cpus={max(1, cores // workers)}", "cluster.learner_cpus=1",
            f"threads={cores}"]
        cfg = load_config(CONFIG, [*common, *extra])
        team, models, make_env = prepare(cfg)
        t0 = time.perf_counter()
        tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)  # Ray parts when the cluster has workers
        start_s = time.perf_counter() - t0
        ms = [tr.iteration_step() for _ in range(args.iterations)]
        tr.close()
        timed = ms[1:]
        seconds = sum(m["seconds"] for m in timed)
        eps = args.episodes * len(timed) / seconds
        moved = {k: sum(m.get(f"distributed/bytes_{k}", 0) for m in timed) / len(timed)
                 for k in ("rollout", "learner_in", "learner_out", "weights")}
        rows.append((workers, start_s, eps, seconds / len(timed), sum(m["rollout_s"] for m in timed) / len(timed),
                     sum(m["policy_update_s"] for m in timed) / len(timed), moved, timed[-1]["reward"]))
        if not workers:
            base = next(iter(models.bases.values()))
            rate = flops.machine_rate(base)
            dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    print(f"# duo ({cfg.model.name}), {cpu_name()}, {dtype}, {cores} cores; 2048^3 rate {rate / 1e9:.0f} GFLOP/s; "
          f"{args.episodes} episodes x {args.iterations - 1} timed iterations")
    print("| run | start-up s | episodes/s | vs one process | s/iteration | rollout s | policy update s | "
          "turns to driver | to learners | from learners | adapters to workers | all bytes/iteration |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    base_eps = rows[0][2]
    for workers, start_s, eps, it_s, roll_s, upd_s, moved, _ in rows:
        name = "one process" if not workers else f"Ray, {workers} rollout worker{'s' if workers > 1 else ''}"
        kb = lambda b: f"{b / 1e3:.0f} kB" if workers else "-"  # noqa: E731
        print(f"| {name} | {start_s:.1f} | {eps:.2f} | {eps / base_eps:.2f}x | {it_s:.1f} | {roll_s:.1f} | {upd_s:.1f} | "
              f"{kb(moved['rollout'])} | {kb(moved['learner_in'])} | {kb(moved['learner_out'])} | {kb(moved['weights'])} | "
              f"{kb(sum(moved.values()))} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
