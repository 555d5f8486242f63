"""The frozen critic against the learning one (issue 44; configs/sweep_critic.yaml), from
sweep folders: per cell (task, team, algorithm, critic) over its seeds, the held-out accuracy, the
mean training accuracy (the area under the learning curve), the optimiser steps per agent to 50%
training accuracy and the critic's explained variance of the returns (its mean over the run and
over the last 10 iterations; per agent for IPPO, averaged); then, paired by seed, learning - frozen
for each algorithm and MARFT - IPPO for each critic, each a 95% t interval over the paired seeds
(the seeds as units), with the number of comparisons made. A run without a ``critic`` label (the
frozen runs of ``results/coop``, made before the learning critic) counts as ``head``; where a
folder repeats another's labels and seed the later one given is used, and whether the two
runs' training accuracies agree is printed (a frozen run made again must repeat its first).

    .venv/bin/python benchmarks/critic_runs.py results/coop results/coop_critic --out docs/results_critic
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.async_runs import fmt, t_interval  # noqa: E402
from marft.experiments.report.build import learning_speed  # noqa: E402
from marft.experiments.report.read import find_runs  # noqa: E402

AXES = ("task", "team", "algorithm", "critic")


def explained_variance(metrics: list[dict], last: int | None = None) -> float | None:
    """The run's mean explained variance (the team critic's, or the mean of the agents' critics),
    over the iterations whose rewards were not all the same: in a batch where every episode failed
    (or every one succeeded) the returns differ only by rounding in the bootstrapped values, and
    runs made before marft left such batches out of the metric (2026-12-06) report values like -1.9e15
    there (``degenerate/same_reward`` 1: the whole batch is one group for MARFT and IPPO)."""
    rows = metrics[-last:] if last else metrics
    per_it = []
    for m in rows:
        if m.get("degenerate/same_reward") == 1.0:
            continue
        ev = [v for k, v in m.items() if k == "critic/explained_variance" or k.startswith("critic/explained_variance/")]
        if ev:
            per_it.append(statistics.fmean(ev))
    return statistics.fmean(per_it) if per_it else None


def cells(paths: list[str]) -> tuple[dict[tuple, dict[str, dict]], list[str]]:
    """{(task, team, algorithm, critic): {seed: run figures}} of the finished runs, and notes on repeats."""
    out: dict[tuple, dict[str, dict]] = {}
    notes = []
    for run in find_runs(paths):
        if run.status != "complete" or run.labels.get("algorithm") in (None, "untrained"):
            continue
        labels = {"critic": "head", **run.labels}
        if set(labels) != set(AXES) or labels["algorithm"] not in ("marft", "ippo") or labels["team"] not in ("2", "3-small"):
            continue  # another experiment's cell (marft-ps, GRPO, anonymous roles ...)
        key = tuple(labels[a] for a in AXES)
        speed = learning_speed(run.metrics, run.steps_per_iteration)
        fig = {"folder": run.folder, "final": run.final["accuracy"], "area": speed["area"] if speed else None,
               "steps": speed["steps_to"] if speed else None, "ev": explained_variance(run.metrics),
               "ev_last": explained_variance(run.metrics, 10), "acc": [m.get("accuracy") for m in run.metrics],
               "machines": list(run.machines)}
        before = out.setdefault(key, {}).get(run.seed)
        if before is not None:
            same = before["acc"] == fig["acc"] and before["final"] == fig["final"]
            where = ("" if before["machines"] == fig["machines"] else
                     f" (on {' + '.join(fig['machines']) or 'an unrecorded machine'}; the first on "
                     f"{' + '.join(before['machines']) or 'an unrecorded machine'})")
            notes.append(f"{'/'.join(key)} seed {run.seed}: {run.folder} repeats {before['folder']}{where}: "
                         f"{'the same training accuracies and held-out accuracy' if same else 'NOT the same run'}")
        out[key][run.seed] = fig
    return out, notes


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--out", type=Path, default=None, help="folder for summary.md")
    args = ap.parse_args(argv)
    data, notes = cells(args.folders)
    lines = [f"From {', '.join(f'`{f}`' for f in args.folders)}: finished runs only. Accuracies in %; 95% t intervals "
             "over seeds (the seeds as units); explained variance = 1 - Var(R - V) / Var(R) of the returns, the mean over "
             "the run's iterations (and over its last 10).", "",
             "| task | team | algorithm | critic | seeds | held-out accuracy | per seed | mean training accuracy "
             "| steps to 50%, per seed | explained variance (run) | explained variance (last 10) | machine, per seed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    legend: dict[str, str] = {}  # machine -> its letter, in order of appearance

    def letters(machines: list[str]) -> str:
        return "+".join(legend.setdefault(m, chr(ord("A") + len(legend))) for m in machines) or "?"
    for key in sorted(data):
        runs = data[key]
        seeds = sorted(runs)
        evs = [runs[s]["ev"] for s in seeds if runs[s]["ev"] is not None]
        evl = [runs[s]["ev_last"] for s in seeds if runs[s]["ev_last"] is not None]
        lines.append(f"| {' | '.join(key)} | {len(seeds)} | {fmt(t_interval([runs[s]['final'] for s in seeds], 0, 1), pct=True)} "
                     f"| {' / '.join(_pct(runs[s]['final']) for s in seeds)} "
                     f"| {fmt(t_interval([runs[s]['area'] for s in seeds], 0, 1), pct=True)} "
                     f"| {' / '.join(str(runs[s]['steps'] or '–') for s in seeds)} "
                     f"| {f'{statistics.fmean(evs):.2f}' if evs else '–'} | {f'{statistics.fmean(evl):.2f}' if evl else '–'} "
                     f"| {' / '.join(letters(runs[s]['machines']) for s in seeds)} |")
    lines += ["", "Machines: " + "; ".join(f"{c}: {m}" for m, c in legend.items())
              + " (?: not recorded; A+B: resumed on another machine). Each run's record says where it ran (machine.json,"
              " sweep_run.json); the same seed repeats a run exactly only on the same kind of machine."]
    pairs = []
    for key in sorted(data):
        task, team, algorithm, critic = key
        if critic == "lora" and (task, team, algorithm, "head") in data:
            pairs.append(("learning - frozen", f"{task}, team {team}, {algorithm}", data[key], data[(task, team, algorithm, "head")]))
        if algorithm == "marft" and (task, team, "ippo", critic) in data:
            pairs.append(("MARFT - IPPO", f"{task}, team {team}, critic {critic}", data[key], data[(task, team, "ippo", critic)]))
    made = sum(len(set(a) & set(b)) >= 2 for _, _, a, b in pairs)  # a pair at one seed has no interval yet
    lines += ["", f"Paired by seed ({made} comparisons, each of held-out and of mean training accuracy; not corrected for "
              "their number: about one in twenty 95% intervals excludes 0 by chance alone; a pair at one seed so far is "
              "listed, not counted). Differences in points.", "",
              "| comparison | cell | seeds paired | held-out accuracy | mean training accuracy | excludes 0 |", "|---|---|---|---|---|---|"]
    for name, cell, a, b in pairs:
        seeds = sorted(set(a) & set(b))
        held = t_interval([a[s]["final"] - b[s]["final"] for s in seeds], -1, 1)
        area = t_interval([a[s]["area"] - b[s]["area"] for s in seeds], -1, 1)
        parted = [n for n, iv in (("held-out", held), ("training", area)) if iv and (iv[1] > 0 or iv[2] < 0)]
        verdict = ", ".join(parted) or ("no" if len(seeds) >= 2 else "n/a (one seed)")
        lines.append(f"| {name} | {cell} | {len(seeds)} | {fmt(held, pct=True)} | {fmt(area, pct=True)} | {verdict} |")
    if notes:
        lines += ["", "Runs made twice:", ""] + [f"- {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
