"""Building ``marft report``'s figures from the runs read (:mod:`.read`): groups over seeds with
their intervals (:mod:`marft.maths.stats`), the differences between recipes, learning speed, each
run's figures and the machines; all plain data (``report.json``)."""
from __future__ import annotations

import statistics

import torch

from ...maths.stats import accuracy_interval, macro_interval, seed_interval, spearman, welch_interval
from .read import RunInfo


def _group_key(labels: dict[str, str]) -> tuple:
    return tuple(labels.items())


def comparisons(rows: list[dict], key: str = "final") -> list[dict]:
    """Every pair of trained groups whose labels differ in exactly one (an algorithm against
    another on the same team, a team size against another with the same algorithm, ...), with the
    difference of their seed means of ``key`` (``final``: held-out accuracy; ``speed``: the learning
    speed's area) and its Welch 95% interval over seeds."""
    out = []
    trained = [r for r in rows if r[key] and r["labels"].get("algorithm") != "untrained"]
    for i, a in enumerate(trained):
        for b in trained[i + 1:]:
            if a["labels"].keys() != b["labels"].keys():
                continue
            differ = [k for k in a["labels"] if a["labels"][k] != b["labels"][k]]
            if len(differ) != 1:
                continue
            accs_a, accs_b = a[key]["per_seed"], b[key]["per_seed"]
            out.append({"axis": differ[0], "same": {k: v for k, v in a["labels"].items() if k != differ[0]},
                        "a": a["labels"][differ[0]], "b": b["labels"][differ[0]],
                        "diff": statistics.fmean(accs_a) - statistics.fmean(accs_b),
                        "ci95": welch_interval(accs_a, accs_b), "seeds": [len(accs_a), len(accs_b)]})
    out.sort(key=lambda c: c["axis"] != "algorithm")  # algorithms first, then the other axes
    return out


SPEED_THRESHOLD = 0.5  # the training accuracy "reached" means, for learning speed
SPEED_WINDOW = 5  # iterations in the trailing mean that must reach it


def learning_speed(metrics: list[dict], steps_per_iteration: int | None) -> dict | None:
    """How fast a run learned, from its training accuracy per iteration (fresh training problems
    at the rollout temperature, every iteration): ``area``, the mean training accuracy over all
    iterations (the area under the curve: higher is faster), and ``steps_to``, the optimiser steps
    per agent after which the trailing mean over :data:`SPEED_WINDOW` iterations first reaches
    :data:`SPEED_THRESHOLD` (None: never)."""
    acc = [m["accuracy"] for m in metrics if m.get("accuracy") is not None]
    if not acc:
        return None
    reached = next((i + 1 for i in range(SPEED_WINDOW - 1, len(acc))
                    if statistics.fmean(acc[i + 1 - SPEED_WINDOW:i + 1]) >= SPEED_THRESHOLD), None)
    steps = reached * steps_per_iteration if reached is not None and steps_per_iteration else None
    return {"area": statistics.fmean(acc), "iterations": len(acc), "reached_at_iteration": reached, "steps_to": steps}


def summary(results: list[dict]) -> dict | None:
    """Mean, std over seeds, the pooled (problems) and the over-seeds 95% intervals of a list of
    evaluation results."""
    if not results:
        return None
    accs = [r["accuracy"] for r in results]
    out = {"mean": statistics.fmean(accs), "std": statistics.stdev(accs) if len(accs) > 1 else None,
           "seeds": len(accs), "per_seed": accs, "ci95_seeds": seed_interval(accs)}
    per = [r.get("per_problem_success") for r in results]
    out["problems"] = len(per[0]) if per[0] else None
    tasks = [r.get("tasks") for r in results]
    if len(results) > 1 and all(tasks) and len({tuple(t) for t in tasks}) == 1:  # mixtures: the macro mean's interval
        per_task = [summary([t[name] for t in tasks]) for name in tasks[0]]
        out["ci95"] = macro_interval([{"accuracy": x["mean"], "ci95": x["ci95"]} for x in per_task]) \
            if all(x["ci95"] for x in per_task) else None
    elif len(results) == 1:
        out["ci95"] = results[0].get("ci95")  # marft eval's own interval
    elif all(per) and len({len(x) for x in per}) == 1:
        table = torch.tensor(per, dtype=torch.float).T  # [problems, seeds]: problems are the units
        out["ci95"] = list(accuracy_interval(table)[1:])
    else:
        out["ci95"] = None  # the seeds were evaluated on different problem sets
    return out


def _per_task(done: list[RunInfo], label: str) -> dict | None:
    """A group's accuracy per task, where any of its runs trained on a mixture (its evaluations hold
    ``tasks``): task -> {untrained, final} summaries over seeds; None for single-task groups."""
    if not any(r.final.get("tasks") for r in done):
        return None
    of = lambda res: (res or {}).get("tasks") or ({label: res} if res else {})  # noqa: E731
    names = list(dict.fromkeys(t for r in done for t in of(r.final)))
    return {t: {"final": summary([of(r.final)[t] for r in done if t in of(r.final)]),
                "untrained": summary([of(r.untrained)[t] for r in done if t in of(r.untrained)])} for t in names}


def build_report(runs: list[RunInfo]) -> dict:
    groups: dict[tuple, list[RunInfo]] = {}
    for r in runs:
        groups.setdefault(_group_key(r.labels), []).append(r)
    rows = []
    for key, members in groups.items():
        done = [r for r in members if r.final is not None]
        final = summary([r.final for r in done])
        untrained = summary([r.untrained for r in done if r.untrained is not None])
        without = {}
        agents = sorted({a for r in done for a in r.without})
        for a in agents:
            both = [r for r in done if a in r.without]
            without[a] = {"with": statistics.fmean(r.final["accuracy"] for r in both),
                          "without": statistics.fmean(r.without[a]["accuracy"] for r in both), "seeds": len(both)}
        minutes = [sum((m.get("seconds") or 0.0) for m in r.metrics) / 60 for r in done if r.metrics]
        speeds = [s for s in (learning_speed(r.metrics, r.steps_per_iteration) for r in done) if s]
        areas = [s["area"] for s in speeds]
        speed = {"mean": statistics.fmean(areas), "std": statistics.stdev(areas) if len(areas) > 1 else None,
                 "per_seed": areas, "ci95_seeds": seed_interval(areas), "seeds": len(areas),
                 "steps_to": [s["steps_to"] for s in speeds]} if areas else None
        rows.append({
            "labels": dict(key), "runs_complete": len(done), "runs_planned": len(members),
            "tasks": _per_task(done, dict(key).get("task", "")),
            "final": final, "untrained": untrained,
            "delta": (final["mean"] - untrained["mean"]) if final and untrained and dict(key).get("algorithm") != "untrained" else None,
            "train_minutes": statistics.fmean(minutes) if minutes else None,
            "speed": speed,
            "without": without,
            "incomplete": [{"folder": str(r.folder), "seed": r.seed, "status": r.status} for r in members if r.final is None],
            "machines": sorted({m for r in done for m in (r.machines or ["not recorded"])}),
        })
    # rows of the same task/team together, the untrained team first
    firsts: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        firsts.setdefault(tuple((k, v) for k, v in r["labels"].items() if k != "algorithm"), i)
    rows.sort(key=lambda r: (firsts[tuple((k, v) for k, v in r["labels"].items() if k != "algorithm")],
                             r["labels"].get("algorithm") != "untrained"))
    # runs without their own untrained evaluation (eval.before=false) compare with the group whose
    # algorithm label is "untrained" (a train.iterations=0 run) and whose other labels are the same
    def others(r):  # the labels but the algorithm
        return tuple((k, v) for k, v in r["labels"].items() if k != "algorithm")

    untrained = [r for r in rows if r["labels"].get("algorithm") == "untrained"]
    baseline = {others(r): r["final"] for r in untrained}
    per_task_baseline = {others(r): r["tasks"] for r in untrained if r.get("tasks")}
    for r in rows:
        key = others(r)
        if r["untrained"] is None and r["labels"].get("algorithm") not in (None, "untrained"):
            r["untrained"] = baseline.get(key)
            if r["final"] and r["untrained"]:
                r["delta"] = r["final"]["mean"] - r["untrained"]["mean"]
        for task, v in (r.get("tasks") or {}).items():  # a mixture's tasks, likewise
            base = (per_task_baseline.get(key) or {}).get(task)
            if v["untrained"] is None and base and r["labels"].get("algorithm") != "untrained":
                v["untrained"] = base["final"]
    train_s = sum((m.get("seconds") or 0.0) for r in runs for m in r.metrics)
    # a train.iterations=0 run's final evaluation is a copy of its untrained one: count it once
    eval_s = sum(((e or {}).get("seconds") or 0.0) for r in runs
                 for e in (r.final, None if r.untrained == r.final else r.untrained, *r.without.values()))
    each = [{"labels": r.labels, "seed": r.seed, "accuracy": r.final["accuracy"],
             "extraction_rate": r.final.get("extraction_rate"), "graded": r.graded,
             "agents": {a: {"mean_tokens": v.get("mean_tokens"), "truncated": v.get("truncated")}
                        for a, v in (r.final.get("agents") or {}).items()}}
            for r in runs if r.final is not None]
    pairs = [(e["agents"][e["graded"]]["truncated"], e["accuracy"]) for e in each
             if e["labels"].get("algorithm") != "untrained" and e["graded"] in e["agents"]
             and e["agents"][e["graded"]].get("truncated") is not None]
    cut = {"runs": len(pairs), "spearman": spearman(*map(list, zip(*pairs))) if pairs else None}
    return {"groups": rows, "comparisons": comparisons(rows), "speed_comparisons": comparisons(rows, "speed"),
            "speed_threshold": SPEED_THRESHOLD, "speed_window": SPEED_WINDOW, "each_run": each, "graded_cut_vs_accuracy": cut,
            "runs": len(runs), "complete": sum(r.final is not None for r in runs),
            "train_minutes": train_s / 60, "eval_minutes": eval_s / 60,
            "machines": _machine_counts(runs)}


def _machine_counts(runs: list[RunInfo]) -> dict[str, int]:
    """How many runs (with any result) ran on each machine; "not recorded" for those that say nothing."""
    counts: dict[str, int] = {}
    for r in runs:
        if r.final is None and not r.metrics:
            continue
        for m in r.machines or ["not recorded"]:
            counts[m] = counts.get(m, 0) + 1
    return counts
