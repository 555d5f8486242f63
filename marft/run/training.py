"""One run's training loop (:meth:`Training.train`): evaluate the untrained team, iterate the trainer
(:mod:`marft.run.trainer`) with checkpoints and evaluations on the run folder's schedule
(:class:`marft.run.folder.RunFolder`), evaluate the trained team and, with ``eval.ablate``, the team
without each agent another reads; metrics to ``metrics.jsonl`` and the trackers, progress lines to
``log``, and the callbacks called. :class:`marft.MarftTrainer` (the Python API) builds one from its
pieces and hands it the calls; the pieces are built by :func:`marft.run.assemble.prepare` and
:func:`marft.assemble.build_trainer`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .assemble import describe, env_factory, num_problems
from .config import RunConfig, is_workflow
from .folder import RunFolder
from .trainer import Trainer


@dataclass
class TrainResult:
    """What :meth:`MarftTrainer.train` gives back."""

    run_dir: Path
    """The run folder: config.yaml, metrics.jsonl, checkpoints/, eval_*.json, tensorboard/."""
    metrics: list[dict]
    """One dict per iteration (the lines of metrics.jsonl, also those before a resume)."""
    untrained: dict | None
    """The untrained team's evaluation (None when ``eval.before`` is off or on resume)."""
    final: dict | None
    """The trained team's evaluation (None when the run was stopped early)."""
    adapters: Path | None
    """The trained adapters, one PEFT folder per adapter (``load_team`` or ``marft eval --adapters``)."""
    stopped: bool = False
    """:meth:`MarftTrainer.stop` (Ctrl-C or SIGTERM on the command line) ended the run early;
    resume it with ``MarftTrainer.resume(run_dir)``."""
    ablations: dict[str, dict] = field(default_factory=dict)
    """``eval.ablate``: the trained team's evaluation without each agent whose message another reads."""


class Training:
    """The run of ``cfg`` in ``run`` with ``trainer`` (the team ``team`` on ``models``, its tasks
    ``make_env``); ``owner`` is what the callbacks are handed (the :class:`marft.MarftTrainer`)."""

    def __init__(self, cfg: RunConfig, run: RunFolder, team, models, make_env, trainer: Trainer,
                 log: Callable[[str], None], callbacks: Iterable[Any] = (), owner: Any = None):
        self.config, self.run, self.team, self.models, self.make_env = cfg, run, team, models, make_env
        self.trainer, self._log, self.callbacks = trainer, log, list(callbacks)
        self.owner = owner if owner is not None else self
        self.stopping = False  # stop() was called: train() returns after the current iteration
        self._num = None

    def evaluate(self, tag: str | None = None, without: Iterable[str] = ()) -> dict:
        """The team as it is now on the held-out problems; with a ``tag`` the result is also
        written to ``<run>/eval_<tag>.json``."""
        from .evaluation import evaluate as run_evaluation

        if self._num is None:
            self._num = num_problems(self.make_env) or 0
        without = tuple(without)
        part = self.team.without(without) if without else self.team
        make_env = env_factory(self.config, part) if without else self.make_env
        res = run_evaluation(self.config, part, self.trainer.engine, make_env, self._num or None)
        res["iteration"] = self.trainer.iteration
        res["without"] = list(without)
        res["machine"] = describe(self.models)
        if tag is not None:
            self.run.write_evaluation(tag, res)
        return res

    def train(self) -> TrainResult:
        """Evaluate the untrained team (``eval.before``), run ``train.iterations`` iterations with
        checkpoints every ``train.save_every`` and evaluations every ``train.eval_every``, then
        evaluate the trained team (and, with ``eval.ablate``, the team without each read agent).
        Writes metrics.jsonl, TensorBoard and the trackers of ``log:``; resumes where it stopped."""
        cfg, run = self.config, self.run
        # a tracker that cannot start stops the run here, before anything in the run folder changes
        trackers = run.trackers(cfg, self.trainer.iteration)
        untrained = None
        try:
            moved = run.start(cfg, describe(self.models), self.trainer.iteration)
            if run.resumed:
                self._log(f"resumed {run.path} at iteration {self.trainer.iteration} from {run.checkpoint.name}")
                for line in (moved, run.set_aside_later_evaluations(cfg, self.trainer.iteration)):
                    if line:
                        self._log(line)
            else:
                self._log(f"marft train: {cfg.train.algorithm}, team {' -> '.join(self.team.names)}"
                          f"{' (shared adapter)' if cfg.team.share_adapter else ''}, {cfg.train.iterations} iterations "
                          f"x {cfg.rollout.episodes} episodes, run folder {run.path}")
            compiled = [name for name, on in (("rollout.compile", cfg.rollout.compile), ("train.compile", cfg.train.compile)) if on]
            if compiled:  # else the first evaluation or iteration looks stuck for minutes
                self._log(f"{' and '.join(compiled)}: the first calls of each agent compile with torch.compile "
                          "(a minute or more on a CPU), later ones run compiled")
            if not run.resumed:
                if cfg.eval.before or cfg.train.iterations == 0:
                    untrained = self._run_eval("untrained", trackers)
            else:  # the checkpoint's own evaluation, where the attempt that saved it ended before it
                for tag in run.evaluations_due(cfg, self.trainer.iteration):
                    res = self._run_eval(tag, trackers)
                    untrained = res if tag == "untrained" else untrained
            start, done_here = time.perf_counter(), 0
            while self.trainer.iteration < cfg.train.iterations and not self.stopping:
                m = self.trainer.iteration_step()
                done_here += 1
                run.append_metrics(m)
                trackers.log_metrics(m, m["iteration"])
                left = (time.perf_counter() - start) / done_here * (cfg.train.iterations - self.trainer.iteration)
                self._log(progress_line(m, cfg.train.iterations, left))
                for cb in self.callbacks:
                    _call(cb, "on_iteration", self.owner, m)
                if run.saves_after(cfg, self.trainer.iteration, self.stopping):
                    self.trainer.save()
                if run.evaluates_after(cfg, self.trainer.iteration):
                    self._run_eval(f"iter_{self.trainer.iteration:06d}", trackers)
            result = TrainResult(run.path, run.metrics(), untrained, None, run.adapters(), stopped=self.stopping)
            if self.stopping:
                if run.latest() is None:  # stopped before the first iteration's end (the untrained evaluation)
                    self.trainer.save()
                    result.adapters = run.adapters()
                self._log(f"stopped at iteration {self.trainer.iteration}; continue with: marft train --resume {run.path}")
                return result
            baseline = run.read_evaluation("untrained") if self.trainer.iteration == 0 else None
            if baseline is not None:  # a baseline run: its final evaluation is the untrained one
                result.final = baseline
                run.write_evaluation("final", baseline)
            else:
                result.final = self._run_eval("final", trackers)
            if cfg.eval.ablate and is_workflow(cfg):
                self._log("eval.ablate: not for a workflow task (the program decides whom it calls)")
            elif cfg.eval.ablate:
                read = [a.name for a in self.team.agents if any(a.name in b.sees for b in self.team.agents)]
                groups = [(a,) for a in read]
                graded = self.team.answering[-1]
                others = tuple(n for n in self.team.names if n != graded)
                if len(others) > 1 and others not in groups:  # and the graded agent alone
                    groups.append(others)
                for names in groups:
                    label = "+".join(names)
                    result.ablations[label] = self._run_eval(f"final_without_{label}", trackers, names)
            return result
        finally:
            trackers.close()

    def _run_eval(self, tag: str, trackers, without: tuple = ()) -> dict:
        t0 = time.perf_counter()
        res = self.evaluate(tag, without)
        trackers.log_eval(tag, res, self.trainer.iteration)
        lo, hi = res["ci95"]
        per_task = "".join(f", {task} {100 * r['accuracy']:.1f}%" for task, r in (res.get("tasks") or {}).items())
        mean = " (macro mean over tasks)" if per_task else ""
        failed = f", {res['failed_episodes']} episodes failed (counted unsolved)" if res.get("failed_episodes") else ""
        self._log(f"eval {tag}: accuracy{mean} {100 * res['accuracy']:.1f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}){per_task}, "
                  f"{res['problems']}x{res['samples']} problems{failed}, {time.perf_counter() - t0:.0f} s")
        for cb in self.callbacks:
            _call(cb, "on_evaluate", self.owner, tag, res)
        return res

    def close(self) -> None:
        """Free the engine's processes and Ray's actors (safe to call twice)."""
        self.trainer.close()


def _call(callback, method: str, *args) -> None:
    """A callback object's ``method(trainer, ...)``, or a plain function ``f(metrics)`` for iterations."""
    fn = getattr(callback, method, None)
    if fn is not None:
        fn(*args)
    elif method == "on_iteration" and callable(callback):
        callback(args[-1])


def progress_line(m: dict, total: int, left_s: float) -> str:
    ent = m.get("entropy", next((v for k, v in m.items() if k.endswith("/entropy")), float("nan")))
    kl = m.get("approx_kl", next((v for k, v in m.items() if k.endswith("/approx_kl")), float("nan")))
    per_task = "".join(f" {k.split('/')[1]} {100 * v:.0f}%" for k, v in m.items() if k.startswith("tasks/") and k.endswith("/accuracy"))
    return (f"it {m['iteration']:>4}/{total}  reward {m['reward']:.3f}  acc {100 * m['accuracy']:5.1f}%{per_task}  "
            f"kl {kl:.4f}  entropy {ent:.3f}  {m['tokens_per_s']:.0f} tok/s  "
            f"MFU {100 * m.get('mfu/iteration', 0.0):.0f}%  {m['seconds']:.0f} s/it  left {left_s / 60:.1f} min")
