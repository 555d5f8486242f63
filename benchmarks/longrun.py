"""Long runs: does a training process hold steady over hundreds of iterations?

    .venv/bin/python benchmarks/longrun.py                     # 200 iterations on a tiny model
    .venv/bin/python benchmarks/longrun.py --iterations 500 --every 25 rollout.episodes=16

Builds a tiny random chat model from a config (as the tests do, ``tests/conftest.py``), then runs
the training loop of ``marft train`` (iteration, metrics line, TensorBoard scalars, a checkpoint
every ``train.save_every`` iterations, a held-out evaluation every ``--eval-every``) on the default
task (reasoning-gym ``chain_sum``, a fresh environment per episode) and samples, every ``--every``
iterations: resident memory (VmRSS from ``/proc/self/status``), open file descriptors
(``/proc/self/fd``) and live child processes. It prints a table and a verdict: RSS growth from the
end of warm-up (``--warmup``) to the end, in MiB and as a ratio, and fds and children at start and
end. Linux only (``/proc``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import build_tiny_model  # noqa: E402

from marft.api import prepare  # noqa: E402
from marft.run.config import load_config  # noqa: E402
from marft.run.evaluation import evaluate  # noqa: E402
from marft.run.checkpoints import append_metrics  # noqa: E402
from marft.assemble import build_trainer  # noqa: E402


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def children() -> int:
    """Live descendants of this process (children, grandchildren ...), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    mine, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - mine
        mine |= frontier
    return len(mine)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="sample every n iterations")
    p.add_argument("--warmup", type=int, default=20, help="iterations before the RSS baseline")
    p.add_argument("--eval-every", type=int, default=50, help="held-out evaluation every n iterations (0 = never)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. rollout.episodes=16")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="marft-longrun-"))
    model = build_tiny_model(work / "model")
    cfg = load_config(ROOT / "configs/duo_arithmetic.yaml", [
        f"model.name={model}", "model.dtype=float32", "model.device=cpu", "threads=1",
        "rollout.episodes=8", "rollout.max_new_tokens=8", "eval.problems=8", "train.minibatch_size=8",
        "train.save_every=10", f"train.iterations={args.iterations}", f"output_dir={work / 'run'}", *args.overrides])
    team, models, make_env = prepare(cfg)
    trainer = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run / "tensorboard"))
    rows = [(0, rss_mib(), open_fds(), children(), 0.0)]
    print(f"# {args.iterations} iterations: {cfg.train.algorithm}, team {' -> '.join(team.names)}, "
          f"{cfg.rollout.episodes} episodes x <= {cfg.rollout.max_new_tokens} tokens, task {cfg.task.name}, "
          f"checkpoint every {cfg.train.save_every}, eval every {args.eval_every}; run folder {run}")
    print("| iteration | RSS MiB | open fds | children | s/iteration |")
    print("|---|---|---|---|---|")
    print(f"| 0 | {rows[0][1]:.1f} | {rows[0][2]} | {rows[0][3]} | |")
    start = time.perf_counter()
    last_t, last_i = start, 0
    while trainer.iteration < args.iterations:
        m = trainer.iteration_step()
        append_metrics(run / "metrics.jsonl", m)
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                writer.add_scalar(k, v, m["iteration"])
        writer.flush()
        it = trainer.iteration
        if it % cfg.train.save_every == 0:
            trainer.save()
        if args.eval_every and it % args.eval_every == 0:
            evaluate(cfg, team, models, make_env, None)
        if it % args.every == 0 or it == args.iterations:
            now = time.perf_counter()
            rows.append((it, rss_mib(), open_fds(), children(), (now - last_t) / (it - last_i)))
            last_t, last_i = now, it
            print(f"| {it} | {rows[-1][1]:.1f} | {rows[-1][2]} | {rows[-1][3]} | {rows[-1][4]:.2f} |", flush=True)
    writer.close()
    base = min((r for r in rows if r[0] >= args.warmup), key=lambda r: r[0])
    end = rows[-1]
    growth = end[1] - base[1]
    print()
    print(f"RSS after warm-up (iteration {base[0]}): {base[1]:.1f} MiB; at iteration {end[0]}: {end[1]:.1f} MiB; "
          f"growth {growth:+.1f} MiB ({end[1] / base[1]:.3f}x), {growth / max(end[0] - base[0], 1) * 1024:+.1f} KiB/iteration")
    print(f"open fds: {rows[0][2]} at start, {base[2]} after warm-up, {end[2]} at the end; "
          f"children: {rows[0][3]} at start, {end[3]} at the end; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
