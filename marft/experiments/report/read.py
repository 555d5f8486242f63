"""Reading run folders for ``marft report``: a sweep's plan (``sweep.json``, ``sweep_run.json``), each
run's config, metrics (``metrics.jsonl``), evaluations (``eval_*.json``) and machines
(``machine.json``) into a :class:`RunInfo`; a malformed file is left out with one warning line."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...engines.machine import bf16_label
from ...errors import UserError


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
    from ...run.config import horizon, load_config, task_label
    from ...team import build_team

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
    """Where a run ran, one line per machine: from ``machine.json`` (CPU, fast bf16, cores and on a
    CPU the torch threads, GPU, device, dtype), else from the sweep's ``sweep_run.json`` (CPU only; older runs)."""
    records = _read_json(folder / "machine.json")
    records = [m for m in records if isinstance(m, dict)] if isinstance(records, list) else None
    if records:
        out = []
        for m in records:
            bf16 = bf16_label(m.get("cpu_bf16") or [])
            threads = m.get("torch_threads")  # on a CPU they split the sums: another count, other numbers
            threads = f", {threads} thread{'s' if threads != 1 else ''}" if threads and m.get("device") == "cpu" else ""
            where = m.get("gpu") or f"{m.get('cpu', '?')} ({bf16}, {m.get('cpu_cores', '?')} cores{threads})"
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
    """Every run under ``paths`` (see the module docstring), each once however many paths reach it;
    a path holding none is an error. A malformed file of a run is left out with a warning naming
    it; the run is still listed."""
    _WARNED.clear()
    runs = _runs_under(paths)
    seen, unique = set(), []
    for run in runs:
        key = run.folder.resolve()
        if key in seen:
            _warn(f"{run.folder} was given twice (two sweeps, or a sweep and one of its runs); it counts once")
            continue
        seen.add(key)
        unique.append(run)
    return unique


def _runs_under(paths: list[str]) -> list[RunInfo]:
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
        found = [f for f in found if not f.name.startswith("earlier_attempt_")]  # a run's set-aside attempt: not a run
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


def evaluations(folder: Path) -> list[dict]:
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
