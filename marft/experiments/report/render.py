"""Rendering ``marft report``: the Markdown of the figures built (:mod:`.build`), the PNGs of the
training curves per group and of the learning curve per run."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from .read import RunInfo, evaluations

CURVES = [("reward", "reward (train)"), ("accuracy", "team accuracy (train)"),
          ("approx_kl", "approx. KL per agent"), ("entropy", "entropy per agent"), ("value_loss", "value loss"),
          ("critic/explained_variance", "critic's explained variance"), ("abs_advantage", "mean |advantage| per agent")]


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _interval(ci) -> str:
    return f"{100 * ci[0]:.1f}–{100 * ci[1]:.1f}" if ci else "–"


def _cell(s: dict | None) -> tuple[str, str]:
    if s is None:
        return "–", "–"
    mean = f"{100 * s['mean']:.1f}" + (f" ± {100 * s['std']:.1f}" if s["std"] is not None else "")
    return mean, _interval(s.get("ci95"))


def to_markdown(report: dict, plots: list[str]) -> str:
    rows = report["groups"]
    axes = list(dict.fromkeys(k for r in rows for k in r["labels"]))
    lines = ["# marft report", "",
             f"{report['complete']} of {report['runs']} runs complete. Accuracy on held-out problems in %: mean ± "
             "standard deviation over seeds; each seed's accuracy; the 95% interval pooled over seeds with the problems "
             "as the units (how well these teams are measured); and the 95% interval over seeds, Student's t with the "
             "runs as the units (where another run of the recipe may land: compare recipes by this one).",
             f"Time in the runs: {report['train_minutes'] + report['eval_minutes']:.0f} min "
             f"(training {report['train_minutes']:.0f}, evaluation {report['eval_minutes']:.0f}; the runs' own timings, "
             "summed; model loading not included).",
             "Machines (every run with a result, finished or not): " + ("; ".join(f"{m}: {n} run{'s' if n != 1 else ''}" for m, n in report.get("machines", {}).items())
                             or "none recorded") + ".", ""]
    head = [*axes, "runs", "untrained", "untrained 95% CI", "final", "per seed", "final 95% CI (problems)",
            "final 95% CI (seeds)", "change", "train min/run"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        u, uci = _cell(r["untrained"])
        f, fci = _cell(r["final"])
        runs = f"{r['runs_complete']}/{r['runs_planned']}" + ("" if r["runs_complete"] == r["runs_planned"] else " ⚠")
        change = "–" if r["delta"] is None else f"{100 * r['delta']:+.1f}"
        mins = "–" if r["train_minutes"] is None else f"{r['train_minutes']:.1f}"
        per_seed = " / ".join(_pct(a) for a in r["final"]["per_seed"]) if r["final"] else "–"
        sci = _interval(r["final"]["ci95_seeds"]) if r["final"] else "–"
        lines.append("| " + " | ".join([*(r["labels"].get(a, "") for a in axes), runs, u, uci, f, per_seed, fci, sci,
                                        change, mins]) + " |")
    mixed = [r for r in rows if len(r.get("machines", [])) > 1]
    if mixed:
        lines += ["", "Groups whose complete runs ran on more than one kind of machine (a seed repeats a run exactly "
                  "only on the same kind; their intervals mix machines):", ""]
        lines += [f"- {', '.join(f'{k} {v}' for k, v in r['labels'].items())}: {'; '.join(r['machines'])}" for r in mixed]
    incomplete = [(r, x) for r in rows for x in r["incomplete"]]
    if incomplete:
        lines += ["", "Runs not in the table (not complete):", ""]
        lines += [f"- {x['folder']} (seed {x['seed']}): {x['status']}" for _, x in incomplete]
    pairs = [c for c in report.get("comparisons", []) if c["ci95"]]
    if pairs:
        lines += ["", "## Differences between recipes", "",
                  "Each pair of groups whose labels differ in one: the difference of their mean held-out accuracy "
                  "(points) and its 95% interval over seeds (Welch's t; the runs as the units). \"parted\": the "
                  f"interval excludes 0, the difference is more than run-to-run noise. {len(pairs)} comparisons, not "
                  "corrected for their number: about one in twenty intervals excludes 0 by chance alone.", "",
                  "| axis | same | A | B | A − B | 95% CI | parted |", "|---|---|---|---|---|---|---|"]
        for c in pairs:
            same = ", ".join(f"{k} {v}" for k, v in c["same"].items())
            parted = "yes" if c["ci95"][0] > 0 or c["ci95"][1] < 0 else "no"
            lines.append(f"| {c['axis']} | {same} | {c['a']} | {c['b']} | {100 * c['diff']:+.1f} | "
                         f"{100 * c['ci95'][0]:+.1f} to {100 * c['ci95'][1]:+.1f} | {parted} |")
    speed = [r for r in rows if r.get("speed") and r["labels"].get("algorithm") != "untrained"]
    if speed:
        thr, win = 100 * report["speed_threshold"], report["speed_window"]
        lines += ["", "## Learning speed", "",
                  "From the training accuracy of every iteration (fresh training problems at the rollout temperature): "
                  "its mean over the run (the area under the learning curve, %: higher learned sooner; mean ± standard "
                  f"deviation over seeds and the 95% interval over seeds), and per seed the optimiser steps per agent "
                  f"after which the mean of the last {win} iterations first reached {thr:.0f}% (\"–\": not within the run).",
                  "", "| " + " | ".join([*axes, "mean training accuracy", "95% CI (seeds)", f"steps to {thr:.0f}%, per seed"]) + " |",
                  "|" + "---|" * (len(axes) + 3)]
        for r in speed:
            s = r["speed"]
            mean = f"{100 * s['mean']:.1f}" + (f" ± {100 * s['std']:.1f}" if s["std"] is not None else "")
            steps = " / ".join("–" if x is None else str(x) for x in s["steps_to"])
            lines.append("| " + " | ".join([*(r["labels"].get(a, "") for a in axes), mean, _interval(s["ci95_seeds"]),
                                            steps]) + " |")
        pairs = [c for c in report.get("speed_comparisons", []) if c["ci95"]]
        if pairs:
            lines += ["", f"Differences in mean training accuracy (points) between groups whose labels differ in one, "
                      f"Welch 95% interval over seeds ({len(pairs)} comparisons; about one in twenty intervals excludes 0 "
                      "by chance alone):", "", "| axis | same | A | B | A − B | 95% CI | parted |", "|---|---|---|---|---|---|---|"]
            for c in pairs:
                same = ", ".join(f"{k} {v}" for k, v in c["same"].items())
                parted = "yes" if c["ci95"][0] > 0 or c["ci95"][1] < 0 else "no"
                lines.append(f"| {c['axis']} | {same} | {c['a']} | {c['b']} | {100 * c['diff']:+.1f} | "
                             f"{100 * c['ci95'][0]:+.1f} to {100 * c['ci95'][1]:+.1f} | {parted} |")
    if any(r.get("tasks") for r in rows):
        lines += ["", "## Per task", "",
                  "Held-out accuracy (%) on each task's own problems: for a run trained on a mixture of tasks, each of its "
                  "tasks (the tables above hold their macro mean); for a run trained on one task, that task. Mean ± "
                  "standard deviation over seeds, the 95% interval over seeds:", "",
                  "| " + " | ".join([*axes, "evaluated on", "untrained", "final", "final 95% CI (seeds)", "change"]) + " |",
                  "|" + "---|" * (len(axes) + 5)]
        for r in rows:
            tasks = r.get("tasks") or ({r["labels"].get("task", ""): {"final": r["final"], "untrained": r["untrained"]}}
                                       if r["final"] else {})
            for task, v in tasks.items():
                f, u = v["final"], v["untrained"]
                change = "–" if not (f and u) or r["labels"].get("algorithm") == "untrained" else f"{100 * (f['mean'] - u['mean']):+.1f}"
                lines.append("| " + " | ".join([*(r["labels"].get(a, "") for a in axes), task, _cell(u)[0], _cell(f)[0],
                                                _interval(f["ci95_seeds"]) if f else "–", change]) + " |")
    ablations = [(r, a, v) for r in rows for a, v in r["without"].items()]
    if ablations:
        lines += ["", "## What each agent adds", "",
                  "Held-out accuracy (%) of the trained team, and of the same team with one agent left out (it does "
                  "not act; nobody sees its message), mean over the seeds evaluated so:", "",
                  "| " + " | ".join([*axes, "agent left out", "seeds", "whole team", "without it", "its contribution"]) + " |",
                  "|" + "---|" * (len(axes) + 5)]
        for r, a, v in ablations:
            lines.append("| " + " | ".join([*(r["labels"].get(x, "") for x in axes), a, str(v.get("seeds", "?")), _pct(v["with"]),
                                            _pct(v["without"]), f"{100 * (v['with'] - v['without']):+.1f}"]) + " |")
    each = report.get("each_run", [])
    if each:
        lines += ["", "## Each run's final evaluation", "",
                  "Accuracy, the share of episodes whose answer could be extracted (a gain that is only format shows "
                  "here), and per agent its mean reply length in tokens / the share of its replies cut at their "
                  "limit, in %:", "",
                  "| " + " | ".join([*axes, "seed", "accuracy", "answer extracted", "replies: tokens / cut"]) + " |",
                  "|" + "---|" * (len(axes) + 4)]
        for e in each:
            agents = ", ".join(f"{a} {v['mean_tokens']:.0f} / {100 * v['truncated']:.0f}%" for a, v in e["agents"].items()
                               if v["mean_tokens"] is not None and v["truncated"] is not None)
            lines.append("| " + " | ".join([*(e["labels"].get(x, "") for x in axes), str(e["seed"]), _pct(e["accuracy"]),
                                            _pct(e["extraction_rate"]), agents or "–"]) + " |")
        cut = report.get("graded_cut_vs_accuracy") or {}
        if cut.get("spearman") is not None:
            lines += ["", f"Over the {cut['runs']} trained runs, Spearman's rank correlation between the graded agent's "
                      f"share of replies cut at its limit and the team's accuracy: {cut['spearman']:+.2f}."]
    if plots:
        lines += ["", "## Training curves", ""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_curves(runs: list[RunInfo], out: Path) -> list[str]:
    """One PNG per group without the algorithm axis: lines per remaining label set (seed mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figures: dict[tuple, dict[tuple, list[RunInfo]]] = {}
    for r in runs:
        if not r.metrics:
            continue
        fig_key = tuple((k, v) for k, v in r.labels.items() if k != "algorithm")
        line_key = tuple((k, v) for k, v in r.labels.items() if k == "algorithm") or (("run", r.folder.name),)
        figures.setdefault(fig_key, {}).setdefault(line_key, []).append(r)
    files = []
    styles = ["-", "--", ":", "-."]
    for fig_key, lines in figures.items():
        # 2 x 4 panels, the last holds the legend: colour = algorithm (or run), line style = agent (or task)
        fig, axs = plt.subplots(2, 4, figsize=(16, 6.6), dpi=80)
        axs = axs.ravel()
        series_style: dict[str, str] = {}
        for ax, (metric, title) in zip(axs, CURVES):
            for color, (line_key, members) in zip(plt.cm.tab10.colors, lines.items()):
                keys = sorted({k for r in members for m in r.metrics for k in m if k == metric
                               or k.endswith("/" + metric) or k.startswith(metric + "/")} - {"skipped/" + metric})
                for k in keys:
                    xs, ys = _seed_mean(members, k)
                    if xs:
                        series = series_label(k, metric)  # "agent: planner", "task: arith", or "" (the team's)
                        style = series_style.setdefault(series, styles[len(series_style) % len(styles)]) if series else "-"
                        ax.plot(xs, ys, style, color=color, marker="o", markersize=3)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("iteration")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if not ax.lines:
                ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        legend_ax = axs[len(CURVES)]
        legend_ax.axis("off")
        handles = [plt.Line2D([], [], color=c, label=", ".join(v for _, v in key)) for c, key in zip(plt.cm.tab10.colors, lines)]
        handles += [plt.Line2D([], [], color="gray", linestyle=st, label=a) for a, st in series_style.items()]
        legend_ax.legend(handles=handles, loc="center", fontsize=9, frameon=False,
                         title="seed mean per iteration", title_fontsize=9)
        fig.suptitle(", ".join(f"{k} {v}" for k, v in fig_key) or "training curves", fontsize=11)
        fig.tight_layout()
        name = "curves_" + ("_".join(f"{k}-{v}" for k, v in fig_key) or "all") + ".png"
        name = "".join(c if c.isalnum() or c in "._-+" else "_" for c in name)
        fig.savefig(out / name)
        plt.close(fig)
        files.append(name)
    return files


def series_label(key: str, metric: str) -> str:
    """The legend label of the curve of metrics.jsonl's ``key`` in ``metric``'s panel: a mixture's
    task for ``tasks/<task>/<metric>`` (``task: arith``; a task's label may hold a "/"), an agent
    for ``planner/approx_kl``, ``value_loss/planner`` or ``critic/explained_variance/planner``
    (``agent: planner``), "" for the team's."""
    if key.startswith("tasks/") and key.endswith("/" + metric):
        return "task: " + key[len("tasks/"):-len(metric) - 1]
    agent = (key[len(metric) + 1:] if key.startswith(metric + "/") else
             key[:-len(metric) - 1] if key.endswith("/" + metric) else "")
    return f"agent: {agent}" if agent else ""


def plot_learning(runs: list[RunInfo], out: Path) -> list[str]:
    """Per run with held-out evaluations at three or more points (untrained, at least one
    ``train.eval_every`` one, final; a sweep's runs, evaluated twice, get none): training reward
    (each iteration and a running mean over 5) and held-out accuracy with its 95% interval, against
    training minutes (the iterations' own seconds summed; evaluation time not counted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for r in runs:
        evals = evaluations(r.folder)
        if len(evals) < 3 or not r.metrics:
            continue
        minutes, total = {0: 0.0}, 0.0
        for m in r.metrics:
            total += float(m.get("seconds") or 0.0) / 60
            minutes[int(m["iteration"])] = total
        rewarded = [m for m in r.metrics if m.get("reward") is not None]
        if not rewarded:
            continue
        xs = [minutes[int(m["iteration"])] for m in rewarded]
        reward = [float(m["reward"]) for m in rewarded]
        smooth = [statistics.fmean(reward[max(0, i - 4):i + 1]) for i in range(len(reward))]
        fig, ax = plt.subplots(figsize=(7, 4), dpi=90)
        ax.plot(xs, reward, color="tab:blue", alpha=0.3, linewidth=1)
        ax.plot(xs, smooth, color="tab:blue", label="training reward (running mean of 5 iterations)")
        ev = [(minutes.get(int(e["iteration"]), total), e) for e in evals]
        ax.errorbar([x for x, _ in ev], [e["accuracy"] for _, e in ev],
                    yerr=[[e["accuracy"] - e["ci95"][0] for _, e in ev], [e["ci95"][1] - e["accuracy"] for _, e in ev]],
                    color="tab:red", marker="o", capsize=3, label=f"held-out accuracy, {evals[0].get('problems', '?')} problems (95% CI)")
        ax.set_xlabel("training minutes")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_title(", ".join(f"{k} {v}" for k, v in r.labels.items()) + f", seed {r.seed}", fontsize=10)
        fig.tight_layout()
        name = "".join(c if c.isalnum() or c in "._-+" else "_" for c in f"learning_{r.folder.name}.png")
        fig.savefig(out / name)
        plt.close(fig)
        files.append(name)
    return files


def _seed_mean(members: list[RunInfo], key: str) -> tuple[list[int], list[float]]:
    by_it: dict[int, list[float]] = {}
    for r in members:
        for m in r.metrics:
            v = m.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                by_it.setdefault(int(m["iteration"]), []).append(float(v))
    xs = sorted(by_it)
    return xs, [statistics.fmean(by_it[x]) for x in xs]
