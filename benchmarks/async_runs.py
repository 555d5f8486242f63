"""Asynchronous training against synchronous, from a sweep's run folders (BENCHMARKS.md and RESULTS.md,
"Asynchronous training"): per setting of the ``staleness`` axis, over its seeds, the training wall
time (the iterations' seconds, without start-up and evaluations), episodes per minute, the held-out
accuracy of the trained team and the mean training accuracy; and against staleness 0, paired by
seed, the speed-up (the ratio of wall times) and the accuracy difference, each with its 95% t
interval over seeds (the seeds as units). A figure shows each run's training accuracy (a running
mean over 3 iterations) against its wall-clock time.

    .venv/bin/python benchmarks/async_runs.py results/async_tools --out docs/results_async_tools
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from marft.maths.stats import t_quantile_975


def t_interval(xs: list[float], lo: float = -math.inf, hi: float = math.inf) -> tuple[float, float, float] | None:
    """(mean, low, high): mean +- t(0.975, n - 1) s / sqrt(n), clipped to [lo, hi] (what the
    quantity can be: an accuracy in [0, 1], a difference of two in [-1, 1]); None below two values."""
    if len(xs) < 2:
        return None
    mean = statistics.fmean(xs)
    half = t_quantile_975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return mean, max(lo, mean - half), min(hi, mean + half)


def read_run(folder: Path) -> dict | None:
    """One finished run: its labels, wall time, episodes, accuracies and curve."""
    final = folder / "eval_final.json"
    if not final.is_file():
        return None
    labels = dict(part.split("-", 1) for part in folder.name.split("__"))
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    from marft.run.config import load_config

    batch = load_config(str(folder / "config.yaml")).rollout.episodes
    iterations = len(metrics)
    times, t = [], 0.0
    for m in metrics:
        t += m["seconds"]
        times.append(t)
    acc = [m["accuracy"] for m in metrics]
    smooth = [statistics.fmean(acc[max(0, i - 2):i + 1]) for i in range(len(acc))]
    return {"labels": labels, "seconds": t, "episodes": iterations * batch, "per_min": iterations * batch / t * 60,
            "final": json.loads(final.read_text())["accuracy"], "train_acc": statistics.fmean(acc),
            "curve": (times, smooth), "dropped": sum(m.get("async/dropped", 0) for m in metrics),
            "staleness": statistics.fmean(m.get("async/staleness_mean", 0.0) for m in metrics),
            "phases": phases(metrics[1:] or metrics)}


# Where an iteration's time goes, from the trainer's per-iteration timings: the rollout (in a
# synchronous run the learner waits for all of it; pipelined, rollout_s is 0 and the learner's wait
# for the batch is async/learner_wait_s), generation within it, the rest of the rollout (prompts,
# scoring, the sandbox or the tools the episodes wait for), and the learner side: behaviour
# log-probabilities, the update, the critic's features and update.
PHASES = [("iteration", lambda m: m["seconds"]),
          ("generation", lambda m: m.get("generation_s", 0.0)),
          ("rollout besides generation", lambda m: max(m.get("rollout_s", 0.0) - m.get("generation_s", 0.0), 0.0)),
          ("behaviour log-probs", lambda m: m.get("behaviour_logprobs_s", 0.0)),
          ("update", lambda m: m.get("learner_s", 0.0)),
          ("critic", lambda m: m.get("critic_features_s", 0.0) + m.get("critic_update_s", 0.0)),
          ("learner side", lambda m: m.get("policy_update_s", 0.0) + m.get("critic_features_s", 0.0) + m.get("critic_update_s", 0.0)),
          ("learner waits for data", lambda m: m.get("async/learner_wait_s", 0.0)),
          ("generation waits for weights", lambda m: m.get("async/generation_wait_s", 0.0))]


def phases(metrics: list[dict]) -> list[list[float]]:
    """Each phase's seconds per iteration (the first iteration left out where there are more: it
    includes warming up, and an asynchronous run's first plays ahead)."""
    return [[get(m) for m in metrics] for _, get in PHASES]


def fmt(iv, pct=False, digits=1) -> str:
    if iv is None:
        return "n/a (one seed)"
    k = 100 if pct else 1
    return f"{k * iv[0]:.{digits}f} ({k * iv[1]:.{digits}f} to {k * iv[2]:.{digits}f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="folder for summary.md and accuracy_vs_time.png")
    args = ap.parse_args(argv)
    runs = [r for f in sorted(args.sweep.iterdir()) if f.is_dir() and (r := read_run(f))]
    settings = list(dict.fromkeys(r["labels"]["staleness"] for r in runs))
    by = {s: {r["labels"]["seed"]: r for r in runs if r["labels"]["staleness"] == s} for s in settings}
    base = by.get("0", {})
    lines = [(f"From `{args.sweep}` ({len(runs)} finished runs). 95% t intervals over seeds; each setting against "
             f"staleness 0 paired by seed ({max(len(settings) - 1, 0)} comparisons)."), "",
             ("| staleness | seeds | training wall time (s) | episodes / min | held-out accuracy (%) | mean training accuracy (%) "
             "| mean staleness | dropped | speed-up vs 0 (paired) | held-out accuracy - staleness 0 (points, paired) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in settings:
        rs = list(by[s].values())
        seeds = sorted(by[s])
        paired = [x for x in seeds if x in base]
        speed = t_interval([base[x]["seconds"] / by[s][x]["seconds"] for x in paired]) if s != "0" else None
        diff = t_interval([by[s][x]["final"] - base[x]["final"] for x in paired], -1, 1) if s != "0" else None
        lines.append(f"| {s} | {len(rs)} | {fmt(t_interval([r['seconds'] for r in rs]), digits=0)} "
                     f"| {fmt(t_interval([r['per_min'] for r in rs]))} | {fmt(t_interval([r['final'] for r in rs], 0, 1), pct=True)} "
                     f"| {fmt(t_interval([r['train_acc'] for r in rs], 0, 1), pct=True)} | {statistics.fmean(r['staleness'] for r in rs):.2f} "
                     f"| {sum(r['dropped'] for r in rs)} | {'' if s == '0' else fmt(speed, digits=2) + ('x' if speed else '')} "
                     f"| {'' if s == '0' else fmt(diff, pct=True)} |")
    lines += ["", "Per run (seconds, episodes / min, held-out accuracy %):", ""]
    for s in settings:
        lines.append(f"- staleness {s}: " + "; ".join(f"seed {x}: {r['seconds']:.0f} s, {r['per_min']:.1f}/min, {100 * r['final']:.1f}%"
                                                      for x, r in sorted(by[s].items())))
    lines += ["", ("Where an iteration's time goes (seconds; means over iterations 2 onwards of every seed's run; "
                   "a pipelined run generates on one core while the learner side runs on the other):"), "",
              "| staleness | " + " | ".join(name for name, _ in PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for s in settings:
        cols = [statistics.fmean(x for r in by[s].values() for x in r["phases"][i]) for i in range(len(PHASES))]
        lines.append(f"| {s} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.md").write_text(text)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        colours = dict(zip(settings, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
        for s in settings:
            for k, r in enumerate(by[s].values()):
                times, acc = r["curve"]
                ax.plot(times, [100 * a for a in acc], color=colours[s], alpha=0.8, label=f"staleness {s}" if k == 0 else None)
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("training accuracy (%), mean of 3 iterations")
        ax.legend()
        ax.set_title(f"{args.sweep.name}: each seed's run")
        fig.tight_layout()
        fig.savefig(args.out / "accuracy_vs_time.png", dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
