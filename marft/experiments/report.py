"""``marft report RUN_DIR...``: the table of held-out scores, training curves and per-agent views.

Inputs: run folders of ``marft train`` (``config.yaml``, ``metrics.jsonl``, ``eval_untrained.json``,
``eval_final.json``, ``eval_final_without_<agent>.json``), folders that hold such runs, and sweep
folders (``sweep.json`` lists the planned runs, so a run that never started is reported too).

Runs are grouped by their labels without the seed: a sweep's axis labels (``sweep_run.json``), or
for other runs task, team, algorithm (``-ps`` with a shared adapter). Per group:

- **final**: mean and sample standard deviation over seeds of the held-out accuracy, and two 95%
  intervals that answer different questions. *Problems*: pools every seed's problems, with the
  problems as the independent units (the same estimator as ``marft eval`` with several samples,
  ``evaluate.accuracy_interval``, on the problems x seeds table; with one seed, that run's own
  interval from ``marft eval``): how well these trained teams are measured. *Seeds*: Student's t
  over the seeds' accuracies, the runs as the units (mean +- t(0.975, S-1) s / sqrt(S), clipped to
  [0, 1]; needs two seeds): where another run of the same recipe may land. Algorithms compared on
  the same problems differ by more than noise only where their seed intervals part; the problem
  interval alone hides a recipe that succeeds with one seed and fails with the next;
- **each run**: its final accuracy, answer-extraction rate, and per agent the mean reply length
  and the share of replies cut at the limit (``eval_final.json``'s ``agents``); over the trained
  runs (not ``algorithm: untrained``), Spearman's rank correlation between the graded agent's
  (the last answering one, whose answer decides success) share of cut replies and accuracy;
- **differences between recipes**: for each pair of groups whose labels differ in one (an
  algorithm against another on one team, one team size against another under one algorithm), the
  difference of the seed means with its Welch 95% interval over seeds;
- **learning speed** (:func:`learning_speed`): per group, the mean training accuracy over the
  run (the area under the learning curve) with its interval over seeds, the optimiser steps per
  agent until the trailing mean of 5 iterations reaches 50% per seed, and the same pairwise
  differences as for the final accuracy;
- **untrained**: the same for ``eval_untrained.json`` (the team before training, same problems),
  or, for runs that skipped it (``eval.before=false``), the final score of the group labelled
  ``algorithm: untrained`` (a ``train.iterations=0`` run) with the same other labels;
- **runs**: complete / planned; a group with runs missing, failed or stopped early says so, and
  those runs are listed under the table: nothing is silently dropped. A malformed file (an
  ``eval_*.json`` that is not an evaluation result, a ``metrics.jsonl`` line that is not a metrics
  record or not UTF-8, a ``sweep.json`` or ``sweep_run.json`` of the wrong shape) is left out with
  one ``marft report: warning: ...`` line naming it, and its run is still listed.

Writes ``report.md`` and ``report.json`` and, per group without the algorithm axis, a PNG of the
training curves (reward, training accuracy, then KL, entropy and value loss per agent), the
seeds' mean per iteration; and per run evaluated at three or more points (untrained, every
``train.eval_every`` iterations, final), a learning curve: training reward and held-out accuracy
with its interval against training minutes (``learning_<run>.png``).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..run.evaluation import accuracy_interval
from ..engines.machine import bf16_label

CURVES = [("reward", "reward (train)"), ("accuracy", "team accuracy (train)"),
          ("approx_kl", "approx. KL per agent"), ("entropy", "entropy per agent"), ("value_loss", "value loss")]


@dataclass
class RunInfo:
    folder: Path
    labels: dict[str, str]
    seed: str
    status: str  # complete | partial (i/N iterations) | failed (exit N) | not started | missing (...)
    final: dict | None = None
    untrained: dict | None = None
    without: dict[str, dict] = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)
    graded: str | None = None  # the last answering agent (its answer decides success), from config.yaml
    steps_per_iteration: int | None = None  # optimiser steps per agent per iteration, from config.yaml
    machines: list[str] = field(default_factory=list)  # where it ran (machine.json, or the sweep's record)


_WARNED: set[str] = set()  # each warning once per report (a file is read more than once)


def _warn(message: str) -> None:
    """A malformed file is left out of the report with one line saying which (the run stays listed)."""
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"marft report: warning: {message}", file=sys.stderr, flush=True)


def _read_json(path: Path):
    """The JSON in ``path``; None if there is none, with a warning if the file is there but unreadable."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        _warn(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); left out")
    except json.JSONDecodeError as e:
        _warn(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); left out")
    except OSError as e:
        _warn(f"{path} cannot be read ({e.strerror}); left out")
    return None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _result_problem(r) -> str | None:
    """What is wrong with ``r`` as a marft evaluation result (what the report reads of it), or None."""
    if not isinstance(r, dict):
        return f"holds a JSON {type(r).__name__}, not an object"
    if not _number(r.get("accuracy")):
        return "has no numeric accuracy"
    ci = r.get("ci95")
    if ci is not None and not (isinstance(ci, list) and len(ci) == 2 and all(map(_number, ci))):
        return "has a ci95 that is not two numbers"
    for key in ("extraction_rate", "seconds"):
        if r.get(key) is not None and not _number(r[key]):
            return f"has a {key} that is not a number"
    per = r.get("per_problem_success")
    if per is not None and not (isinstance(per, list) and all(map(_number, per))):
        return "has a per_problem_success that is not a list of numbers"
    if r.get("iteration") is not None and not (isinstance(r["iteration"], int) and not isinstance(r["iteration"], bool)):
        return "has an iteration that is not a whole number"
    agents = r.get("agents")
    if agents is not None:
        if not isinstance(agents, dict) or not all(isinstance(v, dict) for v in agents.values()):
            return "has agents that are not a mapping agent -> figures"
        if any(v.get(k) is not None and not _number(v[k]) for v in agents.values() for k in ("mean_tokens", "truncated")):
            return "has an agent's mean_tokens or truncated that is not a number"
    tasks = r.get("tasks")
    if tasks is not None:
        if not isinstance(tasks, dict):
            return "has tasks that are not a mapping task -> result"
        for name, t in tasks.items():
            problem = _result_problem(t)
            if problem:
                return f"has a task {name!r} that {problem}"
    return None


def _read_result(path: Path) -> dict | None:
    """The evaluation result in ``path`` (``eval_*.json``); None, with a warning, if it is not one."""
    r = _read_json(path)
    if r is None:
        return None
    problem = _result_problem(r)
    if problem:
        _warn(f"{path} is not a marft evaluation result (it {problem}); left out")
        return None
    return r


def _metrics(path: Path) -> list[dict]:
    """The lines of metrics.jsonl up to the first that is not a metrics record (a warning names
    it; a last line cut by a kill is left out silently, as a resumed run cuts it)."""
    out: list[dict] = []
    if not path.is_file():
        return out
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        _warn(f"{path} cannot be read ({e.strerror}); left out")
        return out
    while lines and not lines[-1].strip():
        lines.pop()
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            m = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            _warn(f"{path} line {i} is not UTF-8 text (byte 0x{raw[e.start]:02x}); it and the lines after it are left out")
            break
        except json.JSONDecodeError:
            if i < len(lines):
                _warn(f"{path} line {i} is not valid JSON; it and the lines after it are left out")
            break
        it = m.get("iteration") if isinstance(m, dict) else None
        if not isinstance(it, int) or isinstance(it, bool) or any(
                m.get(k) is not None and not isinstance(m[k], (int, float)) for k in ("reward", "accuracy", "seconds")):
            _warn(f"{path} line {i} is not a metrics record (a JSON object with a whole-number iteration); "
                  "it and the lines after it are left out")
            break
        out.append(m)
    return out


def _sweep_labels(folder: Path) -> dict[str, str] | None:
    """The axis labels ``sweep_run.json`` gives a run, or None (not a sweep's run, or malformed: a warning)."""
    if not (folder / "sweep_run.json").is_file():
        return None
    record = _read_json(folder / "sweep_run.json")
    if record is None:
        return None
    labels = record.get("labels") if isinstance(record, dict) else None
    if not isinstance(labels, dict):
        _warn(f"{folder / 'sweep_run.json'} has no labels mapping; the run is labelled from its config.yaml")
        return None
    return {str(k): str(v) for k, v in labels.items()}


def _labels_from_config(folder: Path) -> tuple[dict[str, str], str, int, str, int]:
    """Labels of a run outside a sweep, its seed, planned iterations, graded agent and optimiser
    steps per agent per iteration, from its config.yaml."""
    from ..run.config import horizon, load_config, task_label
    from ..team import build_team

    cfg = load_config(folder / "config.yaml", [f"output_dir={folder}"])
    t = cfg.task
    task = t.name if t.kind in ("reasoning_gym", "code", "coop") else (Path(t.test_path).stem if t.test_path else t.env or t.kind)
    if cfg.tasks:
        task = "+".join(task_label(x) for x in cfg.tasks)
    team = cfg.team.preset or "+".join(a.name for a in cfg.team.agents)
    algo = cfg.train.algorithm + ("-ps" if cfg.team.share_adapter else "")
    if cfg.train.iterations == 0:
        algo = "untrained"
    tr = cfg.train  # an agent's replies per iteration (one per episode and step), in minibatches, each epoch
    steps = tr.epochs * math.ceil(cfg.rollout.episodes * horizon(cfg) / tr.minibatch_size)
    return ({"task": task, "team": team, "algorithm": algo}, str(cfg.seed), cfg.train.iterations,
            build_team(cfg.team).answering[-1], steps)


def _machines(folder: Path) -> list[str]:
    """Where a run ran, one line per machine: from ``machine.json`` (CPU, fast bf16, GPU, device,
    dtype), else from the sweep's ``sweep_run.json`` (CPU only; older runs)."""
    records = _read_json(folder / "machine.json")
    records = [m for m in records if isinstance(m, dict)] if isinstance(records, list) else None
    if records:
        out = []
        for m in records:
            bf16 = bf16_label(m.get("cpu_bf16") or [])
            where = m.get("gpu") or f"{m.get('cpu', '?')} ({bf16}, {m.get('cpu_cores', '?')} cores)"
            line = f"{where}, {m.get('device', '?')}, {m.get('dtype', '?')}"
            if line not in out:
                out.append(line)
        return out
    swept = _read_json(folder / "sweep_run.json")
    machines = swept.get("machines") if isinstance(swept, dict) else None
    return [str(m) for m in machines] if isinstance(machines, list) else []


def _load_run(folder: Path, labels: dict | None, status: str | None) -> RunInfo:
    planned_iters = graded = steps = None
    seed = None
    if labels is not None:
        labels = dict(labels)
        seed = labels.pop("seed", None)
    if (folder / "config.yaml").is_file():
        try:
            derived, cfg_seed, planned_iters, graded, steps = _labels_from_config(folder)
        except UserError as e:
            _warn(f"{folder / 'config.yaml'} cannot be read as a marft config ({e}); the run is labelled by its folder name")
            derived, cfg_seed = {"run": folder.name}, "?"
        labels = labels if labels is not None else derived
        seed = seed if seed is not None else cfg_seed
    elif labels is None:
        labels = {"run": folder.name}
    run = RunInfo(folder, labels, seed if seed is not None else "?", "missing", graded=graded, steps_per_iteration=steps)
    if not folder.is_dir():
        run.status = "not started" if not status or status == "pending" else f"missing (the sweep recorded: {status})"
        return run
    run.machines = _machines(folder)
    run.final = _read_result(folder / "eval_final.json")
    run.untrained = _read_result(folder / "eval_untrained.json")
    run.metrics = _metrics(folder / "metrics.jsonl")
    for p in sorted(folder.glob("eval_final_without_*.json")):
        r = _read_result(p)
        if r is not None:
            run.without[p.stem.removeprefix("eval_final_without_")] = r
    if run.final is not None:
        run.status = "complete"
    elif status and status.startswith("failed"):
        run.status = status
    elif run.metrics or run.untrained is not None:
        done = run.metrics[-1]["iteration"] if run.metrics else 0
        run.status = f"partial ({done}/{planned_iters if planned_iters is not None else '?'} iterations)"
    else:
        run.status = "not started"
    return run


def find_runs(paths: list[str]) -> list[RunInfo]:
    """Every run under ``paths`` (see the module docstring); a path holding none is an error. A
    malformed file of a run is left out with a warning naming it; the run is still listed."""
    _WARNED.clear()
    runs: list[RunInfo] = []
    for p in map(Path, paths):
        if not p.exists():
            raise UserError(f"{p} not found; give run folders (output_dir of marft train) or sweep folders")
        plan = _sweep_plan(p / "sweep.json")
        if plan is not None:
            for folder, labels, status in plan:
                runs.append(_load_run(p / folder, labels, status))
            continue
        if (p / "config.yaml").is_file():
            runs.append(_load_run(p, _sweep_labels(p), None))
            continue
        found = sorted({c.parent for c in p.glob("*/config.yaml")} | {c.parent for c in p.glob("*/*/config.yaml")})
        if not found:
            raise UserError(f"{p} holds no marft runs (no config.yaml in it or in its subfolders) and no sweep.json")
        for f in found:
            runs.append(_load_run(f, _sweep_labels(f), None))
    return runs


def _sweep_plan(path: Path) -> list[tuple[str, dict | None, str | None]] | None:
    """(folder, labels, status) of each run a sweep's ``sweep.json`` plans; None if there is no
    such file, or (with a warning) it is not a sweep plan: then the folder is searched for runs."""
    plan = _read_json(path)
    if plan is None:
        return None
    entries = plan.get("runs") if isinstance(plan, dict) else None
    if not isinstance(entries, list):
        _warn(f"{path} is not a sweep plan (an object with a list of runs); the run folders under it are read instead")
        return None
    out = []
    for i, r in enumerate(entries):
        folder = r.get("folder") if isinstance(r, dict) else None
        if not isinstance(folder, str) or not folder or Path(folder).is_absolute() or ".." in Path(folder).parts:
            _warn(f"{path}: run {i} has no folder name; left out")
            continue
        labels = r.get("labels")
        labels = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else None
        status = r.get("status") if isinstance(r.get("status"), str) else None
        out.append((folder, labels, status))
    return out


def _group_key(labels: dict[str, str]) -> tuple:
    return tuple(labels.items())


def t_quantile_975(df: float) -> float:
    """The 0.975 quantile of Student's t with ``df`` (>= 1, not necessarily whole) degrees of
    freedom: bisection on the distribution function, whose density is integrated by Simpson's rule
    (within 1e-4 of the printed tables; no scipy needed)."""
    if not df >= 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df > 1e5:
        return 1.959963984540054
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, steps: int = 1000) -> float:
        h = x / steps
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((k * h) ** 2 / df)) for k in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 1.9, 13.0  # t(0.975) falls from 12.706 at df = 1 towards 1.960
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < 0.975 else (lo, mid)
    return (lo + hi) / 2


def seed_interval(accs: list[float]) -> list[float] | None:
    """95% interval of the mean over seeds, the runs as the units (None for one seed)."""
    if len(accs) < 2:
        return None
    mean, half = statistics.fmean(accs), t_quantile_975(len(accs) - 1) * statistics.stdev(accs) / math.sqrt(len(accs))
    return [max(0.0, mean - half), min(1.0, mean + half)]


def welch_interval(a: list[float], b: list[float]) -> list[float] | None:
    """95% interval of mean(a) - mean(b) for two independent sets of runs (Welch: unequal
    variances, Welch-Satterthwaite degrees of freedom), clipped to [-1, 1]; None unless both have
    two runs."""
    if len(a) < 2 or len(b) < 2:
        return None
    d = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return [d, d]
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile_975(max(df, 1.0)) * math.sqrt(va + vb)
    return [max(-1.0, d - half), min(1.0, d + half)]  # two accuracies differ by at most 1


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's r of the ranks, tied values sharing their mean rank.
    None with fewer than three pairs or where either side is constant."""
    def ranks(v):  # values below w, then the mean of the ranks the ties of w share
        return [sum(u < w for u in v) + (sum(u == w for u in v) + 1) / 2 for w in v]
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return statistics.correlation(ranks(x), ranks(y))


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


def _summary(results: list[dict]) -> dict | None:
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
        from ..envs.mixture import macro_interval

        per_task = [_summary([t[name] for t in tasks]) for name in tasks[0]]
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
    return {t: {"final": _summary([of(r.final)[t] for r in done if t in of(r.final)]),
                "untrained": _summary([of(r.untrained)[t] for r in done if t in of(r.untrained)])} for t in names}


def build_report(runs: list[RunInfo]) -> dict:
    groups: dict[tuple, list[RunInfo]] = {}
    for r in runs:
        groups.setdefault(_group_key(r.labels), []).append(r)
    rows = []
    for key, members in groups.items():
        done = [r for r in members if r.final is not None]
        final = _summary([r.final for r in done])
        untrained = _summary([r.untrained for r in done if r.untrained is not None])
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
                  "not act; nobody sees its message), mean over seeds:", "",
                  "| " + " | ".join([*axes, "agent left out", "whole team", "without it", "its contribution"]) + " |",
                  "|" + "---|" * (len(axes) + 4)]
        for r, a, v in ablations:
            lines.append("| " + " | ".join([*(r["labels"].get(x, "") for x in axes), a, _pct(v["with"]), _pct(v["without"]),
                                            f"{100 * (v['with'] - v['without']):+.1f}"]) + " |")
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
        # 2 x 3 panels, the sixth holds the legend: colour = algorithm (or run), line style = agent (or task)
        fig, axs = plt.subplots(2, 3, figsize=(12, 6.6), dpi=80)
        axs = axs.ravel()
        series_style: dict[str, str] = {}
        for ax, (metric, title) in zip(axs, CURVES):
            for color, (line_key, members) in zip(plt.cm.tab10.colors, lines.items()):
                keys = sorted({k for r in members for m in r.metrics for k in m if k == metric
                               or k.endswith("/" + metric) or k.startswith(metric + "/")} - {"skipped/" + metric})
                for k in keys:
                    xs, ys = _seed_mean(members, k)
                    if xs:
                        series = _series(k, metric)  # "agent: planner", "task: arith", or "" (the team's)
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


def _series(key: str, metric: str) -> str:
    """The legend label of the curve of metrics.jsonl's ``key`` in ``metric``'s panel: a mixture's
    task for ``tasks/<task>/<metric>`` (``task: arith``; a task's label may hold a "/"), an agent
    for ``planner/approx_kl`` or ``value_loss/planner`` (``agent: planner``), "" for the team's."""
    if key.startswith("tasks/") and key.endswith("/" + metric):
        return "task: " + key[len("tasks/"):-len(metric) - 1]
    agent = "/".join(x for x in key.split("/") if x != metric)
    return f"agent: {agent}" if agent else ""


def _evaluations(folder: Path) -> list[dict]:
    """A run's held-out evaluations of the whole team, in training order: untrained, every
    ``train.eval_every`` one, final (each with its ``iteration``)."""
    paths = [folder / "eval_untrained.json", *sorted(folder.glob("eval_iter_*.json")), folder / "eval_final.json"]
    out = []
    for i, p in enumerate(paths):
        r = _read_result(p) if p.is_file() else None
        if r is not None:
            r.setdefault("iteration", 0 if i == 0 else None)
            out.append(r)
    return [r for r in out if r["iteration"] is not None]


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
        evals = _evaluations(r.folder)
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


def cmd_report(args) -> int:
    import sys

    runs = find_runs(args.runs)
    out = Path(args.out) if args.out else Path(args.runs[0]) / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the report folder {out} ({e.strerror}); choose another --out") from None
    report = build_report(runs)
    plots = plot_curves(runs, out) + plot_learning(runs, out)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    md = to_markdown(report, plots)
    (out / "report.md").write_text(md)
    print(md)
    print(f"marft report: {report['complete']} of {report['runs']} runs complete; wrote {out / 'report.md'}, "
          f"{out / 'report.json'} and {len(plots)} plot(s)", file=sys.stderr)
    return 0
