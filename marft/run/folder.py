"""The run object: one training run's folder, built once by the front doors and used by the trainer.

A :class:`RunFolder` owns what ``marft train`` writes into ``output_dir``: ``config.yaml``,
``metrics.jsonl`` (one fsynced line per iteration; cut back to the checkpoint on resume), the
checkpoints (:mod:`marft.run.checkpoints`: atomic, ``checkpoints/latest`` names the newest), the
evaluations ``eval_<tag>.json``, ``machine.json`` (where each attempt ran) and the trackers
(:mod:`marft.run.trackers`); and the schedule of the training loop: when to save and when to evaluate.
Its checks run once, where it is made: a new run overwrites nothing (:meth:`RunFolder.new`); a
resumed run has a checkpoint, and keeps its team, adapters, algorithm and LoRA shape
(:meth:`RunFolder.existing`, :meth:`RunFolder.config`); one process trains a folder at a time
(:meth:`RunFolder.hold`, a lock in ``.marft.lock``).

The module also holds the checks on other paths a command writes (``make_dir``, ``output_file``,
``config_file``) and what a sweep moves aside of a failed attempt (:data:`RUN_FILES`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from ..errors import UserError
from . import checkpoints
from .config import RunConfig, load_config, save_config, to_dict


class RunFolder:
    """One run's folder (``path``); ``checkpoint``: the checkpoint a resumed run continues from
    (None for a new run). Make one with :meth:`new` or :meth:`existing`."""

    def __init__(self, path: str | Path, checkpoint: Path | None = None):
        self.path = Path(path)
        self.checkpoint = checkpoint
        self.metrics_path = self.path / "metrics.jsonl"
        self._saved: RunConfig | None = None
        self._lock = None  # the open lock file while this process trains the run (hold)
        self.created = False  # made by this process (new): a start that fails leaves no empty folder (abandon)

    @classmethod
    def new(cls, path: str | Path, config_file: str | Path | None = None) -> "RunFolder":
        """The folder of a new run, created; a :class:`UserError` if it holds an earlier run's files
        or ``config_file``, the config the run was started from (:func:`check_new_run_dir`)."""
        path = Path(path)
        check_not_training(path)
        check_new_run_dir(path, config_file)  # before the models load: nothing to overwrite
        existed = path.exists()
        make_dir(path, "output_dir")
        run = cls(path)
        run.created = not existed
        return run

    @classmethod
    def restarted(cls, path: str | Path, overrides: Iterable = ()) -> tuple["RunFolder", RunConfig, Path]:
        """A run killed before its first checkpoint (:func:`killed_before_a_checkpoint`), to start
        again from its own ``config.yaml`` with ``overrides``: the folder, the config, and
        ``earlier_attempt_K/``, where the attempt's files now are (the config is checked first:
        a bad override moves nothing)."""
        path = Path(path)
        check_not_training(path)
        cfg = load_config(path / "config.yaml", [*overrides, ("output_dir", str(path))])
        return cls(path), cfg, set_aside(path)

    @classmethod
    def existing(cls, path: str | Path) -> "RunFolder":
        """The folder of a run to resume, at its last checkpoint (or a :class:`UserError` saying
        what is wrong with it)."""
        check_not_training(path)
        return cls(path, checkpoints.resume_checkpoint(path))

    @property
    def resumed(self) -> bool:
        return self.checkpoint is not None

    def saved_config(self) -> RunConfig:
        """The config the checkpoint was written with, its ``output_dir`` this folder (wherever it
        is now: a relative path, another working directory)."""
        if self._saved is None:  # read once: resuming and checking a given config both compare with it
            self._saved = load_config(self.checkpoint / "config.yaml", [("output_dir", str(self.path))])
        return self._saved

    def config(self, overrides: Iterable = ()) -> RunConfig:
        """The resumed run's config: the saved one with ``overrides`` (``"key=value"`` or
        ``(key, value)``) that do not change what the checkpoint holds (:meth:`check_same_run`);
        its ``output_dir`` is this folder, wherever it is now (a relative path, another working directory)."""
        saved = self.saved_config()
        cfg = load_config(to_dict(saved), [*overrides, ("output_dir", str(self.path))])
        self.check_same_run(saved, cfg)
        return cfg

    def check_same_run(self, saved: RunConfig, cfg: RunConfig) -> None:
        """What a resumed run may not change: its team, adapters, algorithm, critic and LoRA shape (the
        checkpoint holds the weights and optimiser states of exactly those)."""
        from ..team import build_team

        old, new = build_team(saved.team), build_team(cfg.team)
        lo_a, lo_b = saved.model.lora, cfg.model.lora
        for what, a, b in [("team.preset", saved.team.preset, cfg.team.preset), ("the team's agents", old.names, new.names),
                           ("team.share_adapter", saved.team.share_adapter, cfg.team.share_adapter),
                           ("the adapters", old.adapters, new.adapters), ("train.algorithm", saved.train.algorithm, cfg.train.algorithm),
                           ("train.critic", saved.train.critic, cfg.train.critic),
                           ("model.lora", (lo_a.r, lo_a.alpha, lo_a.target_modules), (lo_b.r, lo_b.alpha, lo_b.target_modules))]:
            if a != b:
                raise UserError(f"--resume cannot change {what} ({a} -> {b}): {self.checkpoint} holds the weights of the run as it "
                                "was; drop that override, or start a new run with another output_dir=...")

    def check_given_config(self, given: RunConfig, given_file: str, run_cfg: RunConfig) -> None:
        """``marft train CONFIG --resume RUN``: the run continues with its own config (``run_cfg``,
        the saved one with the overrides), so ``given`` (CONFIG with the same overrides) must be that
        config; a one-line error names the first keys where it is not, and how to make the change instead."""
        self.check_same_run(self.saved_config(), given)  # the team, adapters, algorithm and LoRA shape: their own message
        a, b = flat_config(run_cfg), flat_config(given)
        differ = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
        if differ:
            shown = "; ".join(f"{k}: {a.get(k)!r} in the run, {b.get(k)!r} in {given_file}" for k in differ[:3])
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise UserError(f"{given_file} is not the config of run {self.path} ({self.checkpoint / 'config.yaml'}): {shown}{more}; "
                            f"--resume continues the run with its own config: give a change as an override "
                            f"({differ[0]}={yaml_value(b.get(differ[0]))}), or leave {given_file} out")

    def hold(self) -> None:
        """Take the run's lock (``.marft.lock`` in its folder, with this process's id) for as long as
        this process trains it: another ``marft train`` of the folder (a second terminal, a run still
        going after the sweep that started it was killed) stops with one line before it loads
        anything. :meth:`release`, or the process's end, frees it."""
        import fcntl
        import os

        if self._lock is not None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        lock = open(self.path / LOCK_FILE, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            check_not_training(self.path)
            raise UserError(f"run folder {self.path} is being trained by another process; wait for it to end, then run "
                            "this again") from None
        except OSError as e:  # a file system without locks (Lustre without -o flock, some NFS): go on without
            lock.close()
            from ..errors import warn_once

            warn_once(f"warning: run folder {self.path}: its file system has no file locks ({e.strerror or e}), so "
                      "nothing stops a second process from training the same folder at once", key="no_flock")
            return
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def release(self) -> None:
        """Free the lock :meth:`hold` took (safe to call twice)."""
        if self._lock is not None:
            self._lock.close()  # closing the file frees its flock
            self._lock = None

    def abandon(self) -> None:
        """A new run that did not start (a check failed while it was being built): free the lock and,
        if nothing but the lock is in the folder, remove the lock file, and the folder :meth:`new`
        made, so that a failed start leaves nothing behind. A resumed run's folder is left as it was."""
        self.release()
        if self.checkpoint is None and [p.name for p in self.path.iterdir()] == [LOCK_FILE]:
            (self.path / LOCK_FILE).unlink()
            if self.created:
                self.path.rmdir()

    # ------------------------------------------------------------------ what the run writes
    def start(self, cfg: RunConfig, machine: dict, iteration: int) -> str | None:
        """The run (re)starts at ``iteration``: its config saved, where it runs recorded
        (``machine.json``), and the metrics of a killed attempt after its checkpoint cut (a new
        run's metrics file starts empty). Returns a one-line notice when a resume runs on another
        kind of machine than the attempt before it, else None."""
        save_config(cfg, self.path / "config.yaml")
        before = self.record_machine(machine, iteration)
        if self.resumed:
            checkpoints.truncate_metrics(self.metrics_path, iteration)
        else:
            self.metrics_path.unlink(missing_ok=True)
        return machine_change(before, machine) if self.resumed else None

    def set_aside_later_evaluations(self, cfg: RunConfig, iteration: int) -> str | None:
        """A resumed run's evaluations of weights no checkpoint holds (``eval_iter_N`` after
        ``iteration``, written by the attempt that was killed; ``eval_final*`` while iterations
        remain: a finished run extended) moved into ``earlier_attempt_K/`` (kept, not read as the
        run's); a one-line notice naming them, or None."""
        later = [p for p in sorted(self.path.glob("eval_iter_*.json")) if _iteration_of(p) > iteration]
        if iteration < cfg.train.iterations:
            later += sorted(self.path.glob("eval_final*.json"))
        if not later:
            return None
        aside = _move_aside(self.path, later)
        return (f"{', '.join(f.name for f in later)}: evaluations of weights after the checkpoint (iteration {iteration}), "
                f"moved into {aside}; the run makes its own again")

    def evaluations_due(self, cfg: RunConfig, iteration: int) -> list[str]:
        """The evaluations a run resumed at ``iteration`` owes the checkpoint it resumes from: the
        untrained team's at 0, or ``iter_N`` at an evaluation's iteration, where the attempt that
        saved it was stopped or killed before writing it."""
        if iteration == 0:
            due = ["untrained"] if cfg.eval.before or cfg.train.iterations == 0 else []
        else:
            due = [f"iter_{iteration:06d}"] if self.evaluates_after(cfg, iteration) else []
        return [tag for tag in due if self.read_evaluation(tag) is None]

    def record_machine(self, machine: dict, iteration: int) -> dict | None:
        """Append where this attempt of the run ran (CPU, GPU, device, dtype, versions) to
        ``machine.json``: one record per start or resume, with the iteration it started from.
        Returns the record of the attempt before this one (None for the first)."""
        from .evaluation import write_json

        path = self.path / "machine.json"
        try:
            records = json.loads(path.read_text()) if path.is_file() else []
        except ValueError:
            records = []
        records = [r for r in records if r.get("from_iteration", 0) < iteration]  # a resume replaces later ones
        write_json([*records, {"from_iteration": iteration, **machine}], path)
        return records[-1] if records and isinstance(records[-1], dict) else None

    def trackers(self, cfg: RunConfig, iteration: int):
        """The run's trackers (:class:`marft.run.trackers.Trackers`), continuing after ``iteration``
        on resume; one that cannot start stops the run before anything in the folder changes."""
        from .trackers import Trackers

        self.path.mkdir(parents=True, exist_ok=True)
        return Trackers(cfg, self.path, iteration + 1 if self.resumed else None)

    def append_metrics(self, metrics: dict) -> None:
        checkpoints.append_metrics(self.metrics_path, metrics)

    def metrics(self) -> list[dict]:
        """Every iteration's metrics (those before a resume included)."""
        return checkpoints.read_metrics(self.metrics_path)

    def write_evaluation(self, tag: str, result: dict) -> Path:
        from .evaluation import write_json

        path = self.path / f"eval_{tag}.json"
        write_json(result, path)
        return path

    def read_evaluation(self, tag: str) -> dict | None:
        path = self.path / f"eval_{tag}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return checkpoints.latest_checkpoint(self.path)

    def adapters(self) -> Path | None:
        """The trained adapters: the newest checkpoint's ``adapters/`` folder, or None."""
        ckpt = self.latest()
        return ckpt / "adapters" if ckpt is not None else None

    # ------------------------------------------------------------------ the schedule
    @staticmethod
    def saves_after(cfg: RunConfig, iteration: int, stopping: bool = False) -> bool:
        """A checkpoint after ``iteration`` (1-based, done): every ``train.save_every``, at the last
        iteration, and when the run is stopping."""
        return iteration % cfg.train.save_every == 0 or iteration == cfg.train.iterations or stopping

    @staticmethod
    def evaluates_after(cfg: RunConfig, iteration: int) -> bool:
        """An evaluation after ``iteration`` (``eval_iter_NNNNNN``): every ``train.eval_every``, except
        at the last iteration (the final evaluation follows)."""
        return bool(cfg.train.eval_every) and iteration % cfg.train.eval_every == 0 and iteration != cfg.train.iterations


def killed_before_a_checkpoint(run_dir: str | Path) -> bool:
    """``run_dir`` holds a run's ``config.yaml`` and ``machine.json``, no checkpoint at all and no final evaluation: a run
    killed (or failed) before its first checkpoint, which ``--resume`` starts again
    (:meth:`RunFolder.restarted`). A finished run kept without its weights (``results/``) is not one."""
    run_dir = Path(run_dir)
    return ((run_dir / "config.yaml").is_file() and (run_dir / "machine.json").is_file()  # as a run's start writes
            and not (run_dir / "trainer.pt").exists() and not (run_dir / "eval_final.json").exists()
            and not (run_dir / "checkpoints" / "latest").exists()
            and not checkpoints.saved_checkpoints(run_dir / "checkpoints"))


def set_aside(folder: Path) -> Path | None:
    """Move the files of an earlier ``marft train`` attempt in ``folder`` (one that left no
    checkpoint: a run killed or failed early) into ``folder/earlier_attempt_K/``, so that the run
    can start afresh there without overwriting them; None if there were none."""
    found = earlier_run_files(folder, trackers=True)
    return _move_aside(folder, found) if found else None


def _move_aside(folder: Path, files: list[Path]) -> Path:
    """``files`` of ``folder`` moved into its next free ``earlier_attempt_K/``, which is returned."""
    import os

    k = 1
    while (folder / f"earlier_attempt_{k}").exists():
        k += 1
    aside = folder / f"earlier_attempt_{k}"
    aside.mkdir()
    for f in files:
        os.replace(f, aside / f.name)
    return aside


def _iteration_of(path: Path) -> int:
    """N of ``eval_iter_N.json`` (-1 for a name that is not one)."""
    digits = path.stem.removeprefix("eval_iter_")
    return int(digits) if digits.isdigit() else -1


def flat_config(cfg: RunConfig) -> dict[str, Any]:
    """``{"model.lora.r": 8, ...}``: every key of the config, dotted (an empty dict stays a value)."""
    def flat(data: dict, prefix: str) -> list:
        out = []
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else k
            out += flat(v, key) if isinstance(v, dict) and v else [(key, v)]
        return out

    return dict(flat(to_dict(cfg), ""))


def yaml_value(v) -> str:
    """``v`` as it is written on the command line (YAML, flow style)."""
    import yaml

    return v if isinstance(v, str) else yaml.safe_dump(v, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def make_dir(path: Path, key: str) -> Path:
    """Create the folder ``path`` named by config key ``key``, or say why not (a UserError)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the folder {path} for {key} ({e.strerror}); choose another {key}=...") from None
    return path


def config_file(path: str, command: str) -> str:
    """``path``, the config file of ``marft COMMAND``; a folder is a one-line error saying what to
    give instead (a run folder's own config, or ``--resume``)."""
    p = Path(path)
    if not p.is_dir():
        return path  # a missing file or a bad one: load_config says so
    hint = ""
    if (p / "config.yaml").is_file():
        hint = (f" (a run folder: continue it with marft train --resume {p})" if command == "train" else
                f" (a run folder: its config is {p / 'config.yaml'})" if command == "config" else
                f" (a run folder: marft {command} {p / 'config.yaml'} --adapters {p} uses its config and trained adapters)")
    raise UserError(f"config file {p} is a folder; give the path of a YAML file such as configs/duo_arithmetic.yaml{hint}")


def output_file(path: Path, key: str) -> Path:
    """Check, before any work, that a result can be written to the file ``path`` (config key
    ``key``): its folder is created, and ``path`` is not itself a folder."""
    make_dir(path.parent, key)
    if path.is_dir():
        if key == "output_dir":  # the default file in output_dir
            raise UserError(f"{path}, the result file in output_dir, is a folder; choose another output_dir=... "
                            "or give a file: eval.output=path/to/result.json")
        raise UserError(f"{key} {path} is a folder; give the path of a file to write, e.g. {key}={path / 'eval.json'}")
    return path


# what marft train writes into its run folder, most valuable first: a new run refuses a folder that
# holds any of RUN_FILES (a tracker's files alone, left by a tracker that failed to start before the
# run wrote anything, do not count); a sweep moves all of them of a failed attempt aside
RUN_FILES = ("eval_final.json", "metrics.jsonl", "eval_untrained.json", "eval_iter_*.json", "eval_final_without_*.json",
             "checkpoints", "config.yaml", "machine.json")
TRACKER_FILES = ("tensorboard", "wandb_id", "mlflow_run_id")


def earlier_run_files(run_dir: Path, trackers: bool = False) -> list[Path]:
    """The files and folders of an earlier ``marft train`` run in ``run_dir`` (:data:`RUN_FILES`,
    and with ``trackers`` :data:`TRACKER_FILES`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found: list[Path] = []
    for pattern in RUN_FILES + (TRACKER_FILES if trackers else ()):
        for p in sorted(run_dir.glob(pattern)):
            if p.is_dir() and not any(p.iterdir()):
                continue  # an empty folder holds nothing to lose
            if p not in found:
                found.append(p)
    return found


LOCK_FILE = ".marft.lock"  # held by the process training the run (RunFolder.hold)


def training_process(run_dir: Path) -> int | None:
    """The id of the process training the run in ``run_dir`` now (it holds :data:`LOCK_FILE`), 0 if
    one does but its id cannot be read, None if none does."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    try:
        lock = open(path)
    except OSError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = lock.read().strip()
            return int(text) if text.isdigit() else 0
        except OSError:
            return None
        return None


def check_not_training(run_dir: Path) -> None:
    """A :class:`UserError` when another process is training the run in ``run_dir``."""
    import os

    pid = training_process(run_dir)
    if pid == os.getpid():
        raise UserError(f"run folder {run_dir} is held by a MarftTrainer of this process; call its close() (or use it in "
                        "a with block) before another trains the folder")
    if pid is not None:
        who = f"process {pid}" if pid else "another process"
        stop = f"stop it with kill -TERM {pid} (it saves a checkpoint first)" if pid else "stop it"
        raise UserError(f"run folder {run_dir} is being trained by {who} now; wait for it to end, or {stop}, then run this again")


def check_new_run_dir(run_dir: Path, config_file: str | Path | None = None) -> None:
    """A new (not resumed) run in ``run_dir`` must not overwrite anything: not an earlier run's
    checkpoints, results or config, nor ``config_file``, the config it was started from. A
    :class:`UserError` naming the file otherwise."""
    run_dir = Path(run_dir)
    if checkpoints.latest_checkpoint(run_dir) is not None:
        raise UserError(f"run folder {run_dir} already has checkpoints; continue it with --resume {run_dir} "
                        f"(in Python: MarftTrainer.resume({str(run_dir)!r})) or choose another output_dir=...")
    if config_file is not None and (run_dir / "config.yaml").exists():
        try:
            same = Path(config_file).resolve() == (run_dir / "config.yaml").resolve()
        except OSError:
            same = False
        if same:
            raise UserError(f"output_dir {run_dir} holds {config_file}, the config file you gave, which marft train would "
                            "overwrite with its own config.yaml; choose another output_dir=...")
    found = earlier_run_files(run_dir)
    if found:
        what = found[0].name + ("/" if found[0].is_dir() else "")
        if killed_before_a_checkpoint(run_dir):
            raise UserError(f"output_dir {run_dir} holds a run that ended before its first checkpoint; start it again with "
                            f"marft train --resume {run_dir} (its files are kept in {run_dir}/earlier_attempt_N/), or choose "
                            "another output_dir=...")
        raise UserError(f"output_dir {run_dir} already holds {what} of an earlier run, which a new run would overwrite, and no "
                        f"checkpoint to resume from; choose another output_dir=..., or move that run's files away first")


# what makes the same seed give other numbers: another processor, device or precision, and on a CPU
# the thread count (it splits the sums)
_KIND = ("cpu", "gpu", "device", "dtype")


def machine_change(before: dict | None, now: dict) -> str | None:
    """A one-line notice when ``now`` (this attempt's machine record) differs from ``before`` (the
    attempt it resumes) in what decides the numbers; None when it does not, or nothing is known."""
    if not before:
        return None
    kind = _KIND + (("torch_threads",) if now.get("device") == "cpu" else ())
    changed = [f"{k} {before.get(k)} -> {now.get(k)}" for k in kind if k in before and before.get(k) != now.get(k)]
    if not changed:
        return None
    return (f"resumed on another kind of machine than iteration {before.get('from_iteration', 0)}'s attempt "
            f"({', '.join(changed)}): the run goes on, but will not repeat one made without a break; "
            "machine.json records both")
