"""``marft sweep SWEEP.yaml``: a grid of training runs, each in its own folder, resumable.

A sweep file names a base config, overrides common to every run, and one or more grids. A grid
maps an axis name to its values: a list of values of the config key the axis is named after
(``seed: [0, 1]``), or a mapping ``label: {key: value, ...}`` when one choice sets several keys::

    output_dir: runs/my_sweep
    base: duo_arithmetic.yaml          # relative to this file
    parallel: 1                         # runs at once, each its own process
    overrides: {train.iterations: 10}
    grids:
      - task: {chain_sum: {task.name: chain_sum}}
        algorithm:
          marft: {train.algorithm: marft}
          ippo: {train.algorithm: ippo}
        seed: [0, 1]

Every combination of a grid is one run, in ``<output_dir>/<axis>-<label>__...``; grids are
unioned (a later grid may add, for example, an ablation for one team only). In folder names,
characters other than letters, digits and ``_.+-`` become ``_``, and an axis name or label longer
than 40 characters (a name longer than 150) is cut to its start and a hash of the whole: the same
every time, and what ``--dry-run`` lists. Two runs whose names would be the same folder (values
``'Say hi!'`` and ``'Say hi?'``) are an error: give them labels (a mapping ``label: value``).
Before anything runs, every run's config is loaded and checked, so a wrong key fails the sweep at once;
so does a run to be started afresh whose ``model.init_adapters`` or ``model.init_critic`` names a
folder that does not exist (an earlier sweep's run not made yet: complete runs, and runs resumed from a checkpoint, read none).
A value may name the run's labels: ``${seed}``, ``${algorithm}`` (any axis of its grid) become the
run's label on that axis, in ``overrides`` as in a grid's values, e.g. ``model.init_adapters:
{solver: results/duo/algorithm-${algorithm}__seed-${seed}/checkpoints/iter_000050/adapters/solver}``
to start each run from an earlier sweep's run of the same labels.

Runs go one after another, or ``parallel`` at a time with ``threads`` torch threads each (0: the
machine's cores divided among them). A run whose last attempt under a sweep ended well (its
``sweep_run.json`` says so, and ``eval_final.json`` is there) is complete and skipped; one still being
trained by another process (a run of a sweep that was killed) is left alone; one with a checkpoint is resumed with ``marft train --resume``; any other starts afresh
(``marft train`` overwrites no earlier run, so the files of an attempt that left no checkpoint, a
run killed or failed early, are first moved into ``earlier_attempt_N/`` in its folder).
So an interrupted sweep, run again, continues where it stopped. ``<output_dir>/sweep.json`` lists
every planned run, its labels and its status; ``marft report <output_dir>`` reads it (runs not
finished are reported as such). A run that fails is recorded and the sweep goes on; the sweep then
exits with status 1. Each run's output goes to ``log.txt`` in its folder; its ``sweep_run.json``
holds its labels, overrides and ``seconds``, the wall time of its attempts summed across sweeps (an
attempt killed with the sweep process is not counted).

To end a sweep without losing work in progress, create the file ``<output_dir>/STOP`` (``touch``):
the runs already going finish, no new run starts, and the sweep exits with status 1 (not all runs
complete); run it again to continue. The sweep removes a ``STOP`` it finds when it starts, so the
file only ever stops the sweep that is running. Ctrl-C in its terminal (SIGINT to the whole
process group) instead stops the runs in progress at the end of their iteration, each with a
checkpoint to resume from; so does SIGTERM to the sweep (it passes the signal on to its runs).

``marft sweep FILE --output-dir DIR`` runs the sweep in ``DIR`` (relative to the current folder, as
the file's ``output_dir:`` is) instead: its runs, ``sweep.json``, ``STOP`` and lock all go there, and
``--dry-run`` lists the runs' states there (the shipped sweep files' output_dirs hold the committed
results, whose complete runs a sweep skips).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import UserError

KNOWN = {"output_dir", "base", "parallel", "threads", "overrides", "grid", "grids"}


@dataclass
class Run:
    name: str
    folder: Path
    labels: dict[str, str]  # axis -> label
    overrides: list[str]  # key=value, after the sweep's common overrides
    status: str = "pending"  # pending | complete | failed (exit N) | running
    seconds: float = 0.0
    missing: list[tuple[str, str]] = field(default_factory=list)  # (setting, folder) of model.init_* folders not there


@dataclass
class Sweep:
    path: Path
    output_dir: Path
    base: Path
    parallel: int
    threads: int
    common: list[str]
    runs: list[Run] = field(default_factory=list)
    output_dir_given: bool = False  # --output-dir, not the file's output_dir:

    def elsewhere(self) -> str:
        """How to send the runs to another folder, for an error's last words."""
        return "choose another --output-dir" if self.output_dir_given else f"choose another output_dir in {self.path} (or give --output-dir)"


def _as_overrides(value, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{k}={_yaml_value(v)}" for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(x, str) and "=" in x for x in value):
        return list(value)
    raise UserError(f"sweep: {where} must be a mapping {{key: value}} or a list of key=value strings, got {value!r}")


def _yaml_value(v) -> str:
    if isinstance(v, str):
        return v
    return yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", label)


MAX_LABEL = 40  # characters of one axis name or label in a run's folder name
MAX_NAME = 150  # characters of a run's folder name (file systems allow 255 bytes)


def _short(text: str, limit: int, raw: str | None = None) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and a hash of ``raw`` (the
    text before it was made safe for a file name): the same every time, distinct for distinct texts."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256((raw if raw is not None else text).encode("utf-8")).hexdigest()[:8]
    return f"{text[:limit - 9]}-{digest}"


def run_name(labels: dict[str, str]) -> str:
    """The folder name of the run with these axis labels: ``axis-label__axis-label...``, with
    characters other than letters, digits and ``_.+-`` replaced by ``_`` and long names shortened
    (:func:`_short`)."""
    name = "__".join(f"{_short(_safe(a), MAX_LABEL, a)}-{_short(_safe(lab), MAX_LABEL, lab)}" for a, lab in labels.items())
    return _short(name, MAX_NAME)


def _path(value, key: str, p: Path) -> str:
    """A sweep file's ``output_dir:`` or ``base:``: a non-empty path."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        what = "nothing" if value is None or value == "" else f"{type(value).__name__} {value!r}"
        raise UserError(f"sweep file {p}: {key} must be a path (a string), got {what}")
    return str(value)


def _axis(name: str, values, where: str) -> list[tuple[str, list[str]]]:
    """(label, overrides) for each value of one axis."""
    if isinstance(values, list):
        if not values:
            raise UserError(f"sweep: {where}.{name} is an empty list; give at least one value")
        return [(str(v), [f"{name}={_yaml_value(v)}"]) for v in values]
    if isinstance(values, dict):
        if not values:
            raise UserError(f"sweep: {where}.{name} is empty; give at least one label")
        out = []
        for label, v in values.items():
            if isinstance(v, dict) or isinstance(v, list):
                out.append((str(label), _as_overrides(v, f"{where}.{name}.{label}")))
            else:
                out.append((str(label), [f"{name}={_yaml_value(v)}"]))
        return out
    raise UserError(f"sweep: {where}.{name} must be a list of values or a mapping label -> overrides, got {values!r}")


def load_sweep(path: str | Path, output_dir: str | Path | None = None, missing_ok: bool = False) -> Sweep:
    """Read and check a sweep file: every run's config is loaded (and so validated) here, and a run
    to start afresh whose ``model.init_adapters`` (or ``model.init_critic``) folders are not all there is refused
    (:func:`check_inputs`; with ``missing_ok`` only recorded in its ``missing``, for ``--dry-run``).
    ``output_dir``: where the runs go instead of the file's ``output_dir:`` (``--output-dir``)."""
    from ..run.config import load_config, read_yaml

    p = Path(path)
    data = read_yaml(p, "sweep file", "configs/sweep_paper_small.yaml", "output_dir:, base:, grids:, ...")
    unknown = sorted(set(data) - KNOWN)
    if unknown:
        raise UserError(f"sweep file {p}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(KNOWN))}")
    if "base" not in data or "output_dir" not in data:
        raise UserError(f"sweep file {p} needs base: (a config file) and output_dir: (where the runs go)")
    base = Path(_path(data["base"], "base", p))
    from_file = Path(_path(data["output_dir"], "output_dir", p))
    if output_dir is not None and not str(output_dir).strip():
        raise UserError("sweep: --output-dir must be a folder, got nothing; give one, e.g. --output-dir runs/my_sweep")
    given = output_dir is not None
    output_dir = Path(output_dir) if given else from_file
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"sweep: --output-dir {output_dir} is a file, not a folder; choose another --output-dir" if given else
                        f"sweep file {p}: output_dir {output_dir} is a file, not a folder; choose another output_dir")
    if not base.is_absolute():
        base = (p.parent / base) if (p.parent / base).is_file() else base
    if not base.is_file():
        raise UserError(f"sweep file {p}: base config {data['base']} not found (looked next to the sweep file and in the current folder)")
    grids = data.get("grids", [data["grid"]] if "grid" in data else None)
    if not grids or not isinstance(grids, list) or not all(isinstance(g, dict) and g for g in grids):
        raise UserError(f"sweep file {p} needs grids: a list of mappings axis -> values (or one grid:)")
    parallel, threads = data.get("parallel", 1), data.get("threads", 0)
    if not isinstance(parallel, int) or parallel < 1 or not isinstance(threads, int) or threads < 0:
        raise UserError(f"sweep file {p}: parallel must be a positive integer and threads 0 or more")
    common = _as_overrides(data.get("overrides"), "overrides")
    templated = [o for o in common if "${" in o]  # filled per run (their labels), before the grid's own
    sweep = Sweep(p, output_dir, base, parallel, threads, [o for o in common if "${" not in o], output_dir_given=given)
    seen: dict[str, Run] = {}
    for gi, grid in enumerate(grids):
        axes = [(str(name), _axis(str(name), values, f"grids.{gi}")) for name, values in grid.items()]
        for combo in itertools.product(*[values for _, values in axes]):
            labels = {name: label for (name, _), (label, _) in zip(axes, combo)}
            name = run_name(labels)
            overrides = _fill([*templated, *(o for _, ov in combo for o in ov)], labels, f"grids.{gi}")
            if name in seen:  # the same run again (grids are unioned), or two runs that would share a folder
                _same_run(seen[name], labels, overrides)
                continue
            seen[name] = Run(name, sweep.output_dir / name, labels, overrides)
    sweep.runs = list(seen.values())
    for run in sweep.runs:
        if run.folder.exists() and not run.folder.is_dir():
            raise UserError(f"sweep run {run.name}: its folder {run.folder} is a file; move it away or {sweep.elsewhere()}")
    for run in sweep.runs:
        try:
            cfg = load_config(sweep.base, [*sweep.common, *run.overrides, f"output_dir={run.folder}"])
        except UserError as e:
            raise UserError(f"sweep run {run.name}: {e}") from None
        run.missing = _missing_inputs(cfg, run.folder)
    if not missing_ok:
        check_inputs(sweep)
    return sweep


def _missing_inputs(cfg, folder: Path) -> list[tuple[str, str]]:
    """(setting, folder) of each ``model.init_adapters`` folder, and the ``model.init_critic`` one, that
    is not there, for a run that would start afresh (``marft train`` reads them then only: a complete
    run needs nothing, a run with a checkpoint resumes from it), the setting as
    ``model.init_adapters.<adapter>`` or ``model.init_critic``. A relative folder is relative to the
    current folder, as the runs'."""
    wanted = [(f"model.init_adapters.{a}", f) for a, f in cfg.model.init_adapters.items()]
    wanted += [("model.init_critic", cfg.model.init_critic)] if cfg.model.init_critic else []
    if not wanted or run_state(folder) != "new":
        return []
    return [(key, str(f)) for key, f in wanted if not Path(f).is_dir()]


def check_inputs(sweep: Sweep) -> None:
    """One line for the first run that cannot start (a ``model.init_adapters`` or ``model.init_critic``
    folder not there),
    before anything runs: otherwise it would fail minutes in, each such run in turn."""
    lacking = [r for r in sweep.runs if r.missing]
    if not lacking:
        return
    run, (setting, folder) = lacking[0], lacking[0].missing[0]
    others = f"; {len(lacking) - 1} other run(s) lack theirs too" if len(lacking) > 1 else ""
    raise UserError(f"sweep run {run.name}: {setting} names {folder}, a folder that does not exist; make it first "
                    f"(run the sweep or the training that saves it) or point {setting} at a folder that exists{others}")


def _fill(overrides: list[str], labels: dict[str, str], where: str) -> list[str]:
    """``${axis}`` in a run's overrides is the run's label on that axis (``${seed}``, ``${algorithm}``),
    so that one grid can point each run at files of its own (an earlier sweep's run of the same labels)."""
    def label(m: re.Match) -> str:
        if m.group(1) not in labels:
            raise UserError(f"sweep: {where}: {m.group(0)} names no axis of this grid (its axes: {', '.join(labels)})")
        return labels[m.group(1)]

    def fill(v):  # in the value's strings, then written again: a label is quoted as YAML needs
        if isinstance(v, str):
            return re.sub(r"\$\{([^{}]*)\}", label, v)
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return [fill(x) for x in v] if isinstance(v, list) else v

    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        if "${" in value:
            try:
                value = _yaml_value(fill(yaml.safe_load(value)))
            except yaml.YAMLError:
                value = fill(value)
        out.append(f"{key}={value}")
    return out


def _same_run(first: Run, labels: dict[str, str], overrides: list[str]) -> None:
    """A run whose folder name ``first`` already has: fine if it is the same run (same labels and
    overrides: grids are unioned), else a one-line error naming both."""
    if first.labels == labels and first.overrides == overrides:
        return
    if first.labels == labels:
        raise UserError(f"sweep: run {first.name} is defined twice with different overrides ({' '.join(first.overrides)} and "
                        f"{' '.join(overrides)}); give one of them another label")
    axis = next((a for a in labels if first.labels.get(a) != labels[a]), None)
    if axis is not None and axis in first.labels:
        raise UserError(f"sweep: the values {first.labels[axis]!r} and {labels[axis]!r} of {axis} make the same folder name "
                        f"{first.name}; name them with distinct labels of letters, digits and _.+- (a mapping label: value)")
    raise UserError(f"sweep: runs {first.labels} and {labels} make the same folder name {first.name}; "
                    "give them distinct labels of letters, digits and _.+-")


def run_state(folder: Path) -> str:
    """complete (eval_final.json, and its last attempt under a sweep ended well: a run stopped while
    its ablations were evaluated is not), resumable (a checkpoint) or new."""
    from ..run.checkpoints import latest_checkpoint

    if (folder / "eval_final.json").is_file() and _recorded(folder).get("complete", True):
        return "complete"
    return "resumable" if latest_checkpoint(folder) is not None else "new"


def _recorded(folder: Path) -> dict:
    """The run's sweep_run.json, or {} (none, or unreadable)."""
    try:
        return json.loads((folder / "sweep_run.json").read_text())
    except (OSError, ValueError):
        return {}


def _changed_runs(sweep: Sweep) -> list[str]:
    """Runs made (complete, or with a checkpoint to resume) with other overrides than the sweep file
    now gives them: the sweep would keep them as they are and report them with the new ones."""
    changed = []
    for run in sweep.runs:
        before = _recorded(run.folder).get("overrides")
        now = [*sweep.common, *run.overrides]
        if before is not None and before != now and run_state(run.folder) != "new":
            gone, new = [o for o in before if o not in now], [o for o in now if o not in before]
            changed.append(f"{run.name} ({', '.join(gone) or 'nothing'} -> {', '.join(new) or 'nothing'})")
    return changed


def _command(sweep: Sweep, run: Run, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "marft.cli", "train"]
    if run_state(run.folder) == "resumable":
        return [*cmd, "--resume", str(run.folder), f"threads={threads}"]
    return [*cmd, str(sweep.base), *sweep.common, *run.overrides, f"output_dir={run.folder}", f"threads={threads}"]


_PLAN_LOCK = threading.Lock()  # runs in parallel threads report their status through one file


def _write_plan(sweep: Sweep) -> None:
    with _PLAN_LOCK:
        sweep.output_dir.mkdir(parents=True, exist_ok=True)
        plan = {"sweep": str(sweep.path), "base": str(sweep.base), "common": sweep.common,
                "runs": [{"name": r.name, "folder": r.name, "labels": r.labels, "overrides": r.overrides,
                          "status": r.status, "seconds": round(r.seconds, 1)} for r in sweep.runs]}
        tmp = sweep.output_dir / "sweep.json.tmp"
        tmp.write_text(json.dumps(plan, indent=2))
        tmp.replace(sweep.output_dir / "sweep.json")


def run_sweep(sweep: Sweep, log=print, execute=None) -> int:
    """Run every run not yet complete; 0 if all are complete at the end, else 1. ``execute(cmd,
    log_path) -> exit status`` runs one command (a subprocess by default). One sweep at a time in an
    output_dir: a second one, while the first runs, is one line (a lock the first holds)."""
    import fcntl

    try:
        sweep.output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(sweep.output_dir / ".sweep.lock", "a")
    except OSError as e:
        raise UserError(f"cannot write to the sweep's output_dir {sweep.output_dir} ({e.strerror}); "
                        f"{sweep.elsewhere()}") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"sweep: another marft sweep is running in {sweep.output_dir}; let it finish, or stop it "
                            f"(touch {sweep.output_dir / 'STOP'}: its runs finish, none starts) and run this again") from None
        try:
            return _run(sweep, log, execute or _execute)
        except OSError as e:  # the disk full, the folder gone: each run keeps its checkpoints
            raise UserError(f"sweep: cannot write in {sweep.output_dir} ({e.strerror or e}); make room and run the "
                            "sweep again: runs resume from their checkpoints") from None


def _run(sweep: Sweep, log, execute) -> int:
    from ..run.folder import set_aside, training_process

    threads = sweep.threads or max(1, (os.cpu_count() or 1) // sweep.parallel)
    changed = _changed_runs(sweep)  # said, not refused: a run whose change cannot matter (0 iterations) is common
    for run in sweep.runs:
        run.status = "complete" if run_state(run.folder) == "complete" else "pending"
        run.seconds = _recorded_seconds(run.folder)  # wall time of earlier attempts
    try:
        _write_plan(sweep)
    except OSError as e:
        raise UserError(f"cannot write the sweep's plan to {sweep.output_dir / 'sweep.json'} ({e.strerror}); "
                        f"{sweep.elsewhere()}") from None
    stop_file = sweep.output_dir / "STOP"
    if stop_file.exists():
        stop_file.unlink()
        log(f"removed {stop_file}, left from an earlier sweep")
    todo = [r for r in sweep.runs if r.status != "complete"]
    log(f"sweep {sweep.path}: {len(sweep.runs)} runs, {len(sweep.runs) - len(todo)} complete, {len(todo)} to run "
        f"({sweep.parallel} at a time, {threads} threads each), in {sweep.output_dir}")
    if changed:
        log(f"warning: {len(changed)} run(s) were made with other overrides than the sweep file now gives them and are "
            f"kept as made (a report pools them with runs made with the new ones): {'; '.join(changed[:3])}"
            f"{' ...' if len(changed) > 3 else ''}. To remake one, move its folder aside")

    def one(run: Run) -> None:
        if stop_file.exists() or _STOPPING.is_set():  # drain: runs in progress finish, no new one starts
            return
        pid = training_process(run.folder)
        if pid is not None:  # a run of a sweep that was killed goes on: its folder is left alone
            run.status = "failed (still training)"
            log(f"{run.name} is still being trained by {f'process {pid}' if pid else 'another process'} (a run of a "
                "sweep that was killed?); left alone: let it end, or stop it with kill -TERM, then run the sweep again")
            _write_plan(sweep)
            return
        run.folder.mkdir(parents=True, exist_ok=True)

        machines = _recorded_machines(run.folder)
        if machine() not in machines:
            machines.append(machine())

        def record(complete: bool = False):  # seconds: wall time of every attempt, summed; machines: where they ran
            (run.folder / "sweep_run.json").write_text(json.dumps(
                {"name": run.name, "labels": run.labels, "overrides": [*sweep.common, *run.overrides],
                 "seconds": round(run.seconds, 1), "machines": machines, "complete": complete}, indent=2))

        record()
        cmd = _command(sweep, run, threads)
        how = "resuming" if "--resume" in cmd else "starting"
        if how == "starting":  # an earlier attempt that left no checkpoint: its files go aside, kept
            aside = set_aside(run.folder)
            if aside is not None:
                log(f"{run.name}: its earlier attempt left no checkpoint to resume from; its files are kept in {aside}")
        log(f"{how} {run.name}")
        t0, before = time.perf_counter(), run.seconds
        rc = execute(cmd, run.folder / "log.txt")
        run.seconds = before + time.perf_counter() - t0
        record(complete=rc == 0 and (run.folder / "eval_final.json").is_file())
        if rc in (130, -2):  # Ctrl-C reached the run too: it saved a checkpoint; stop the sweep
            run.status = "interrupted"
            _write_plan(sweep)
            raise KeyboardInterrupt
        if rc == 0 and run_state(run.folder) == "complete":
            run.status = "complete"
            log(f"done {run.name} ({(run.seconds - before) / 60:.1f} min)")
        else:
            run.status = f"failed (exit {rc})"
            log(f"FAILED {run.name} (exit {rc}); see {run.folder / 'log.txt'}")
        _write_plan(sweep)

    if sweep.parallel == 1:
        for run in todo:
            one(run)
    else:
        with ThreadPoolExecutor(sweep.parallel) as pool:
            list(pool.map(one, todo))
    failed = [r for r in sweep.runs if r.status.startswith("failed")]
    waiting = [r for r in sweep.runs if r.status == "pending"]
    complete = len(sweep.runs) - len(failed) - len(waiting)
    stopped_by = str(stop_file) if stop_file.exists() else "a signal"
    log(f"sweep {'stopped by ' + stopped_by if waiting else 'finished'}: {complete} of {len(sweep.runs)} runs"
        f" complete ({sum(r.seconds for r in sweep.runs) / 60:.0f} min of run wall time in all attempts)"
        + (f"; failed: {', '.join(r.name for r in failed)}" if failed else "")
        + (f"; {len(waiting)} not started: run the sweep again to continue" if waiting else "")
        + f". Report: marft report {sweep.output_dir}")
    return 1 if failed or waiting else 0


def _recorded_seconds(folder: Path) -> float:
    try:
        return float(json.loads((folder / "sweep_run.json").read_text()).get("seconds", 0.0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def _recorded_machines(folder: Path) -> list[str]:
    try:
        found = json.loads((folder / "sweep_run.json").read_text()).get("machines", [])
        return [str(m) for m in found] if isinstance(found, list) else []
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def machine() -> str:
    """The CPU a run ran on (:func:`marft.engines.machine.cpu_line`)."""
    from ..engines.machine import cpu_line

    return cpu_line()


_RUNNING: set = set()  # the runs' processes now going (for stop_runs)
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set by stop_runs: no new run starts


def _shown(path: str) -> str:
    """``path`` relative to the working folder where it lies inside it (the project's own venv), so
    that a committed log names no folder of the machine it ran on."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _execute(cmd: list[str], log_path: Path) -> int:
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join([_shown(cmd[0]), *cmd[1:]])}\n")
        out.flush()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        with _RUNNING_LOCK:
            _RUNNING.add(p)
        try:
            return p.wait()
        except KeyboardInterrupt:  # the run got Ctrl-C too: let it write its checkpoint
            p.wait()
            raise
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(p)


def stop_runs(signum=None, frame=None) -> None:
    """The sweep's SIGTERM handler: no new run starts, and every run going gets SIGTERM too (it
    finishes its iteration, writes a checkpoint and exits), so the sweep ends as after Ctrl-C."""
    _STOPPING.set()
    with _RUNNING_LOCK:
        for p in _RUNNING:
            p.send_signal(signal.SIGTERM)


def cmd_sweep(args) -> int:
    sweep = load_sweep(args.sweep, args.output_dir, missing_ok=args.dry_run)
    if args.parallel is not None:
        if args.parallel < 1:
            raise UserError(f"--parallel must be at least 1, got {args.parallel}")
        sweep.parallel = args.parallel
    if args.threads is not None:
        if args.threads < 0:
            raise UserError(f"--threads must be 0 (the cores divided among the runs) or more, got {args.threads}")
        sweep.threads = args.threads
    if args.dry_run:
        for run in sweep.runs:  # a run that cannot start says so on its line: all of them, not the first only
            missing = (f"; {run.missing[0][0]} {run.missing[0][1]} does not exist"
                       + (f" (and {len(run.missing) - 1} more)" if len(run.missing) > 1 else "")) if run.missing else ""
            print(f"{run.name}  [{run_state(run.folder)}{missing}]  {' '.join(run.overrides)}")
        print(f"{len(sweep.runs)} runs in {sweep.output_dir}; base {sweep.base} with {' '.join(sweep.common)}")
        check_inputs(sweep)  # then the sweep's own one-line error, and status 2, as the sweep would
        return 0
    previous = signal.signal(signal.SIGTERM, stop_runs)
    try:
        return run_sweep(sweep, log=lambda m: print(f"marft sweep: {m}", file=sys.stderr, flush=True))
    finally:
        signal.signal(signal.SIGTERM, previous)
        _STOPPING.clear()
