"""``marft train``: evaluate the untrained team, train, checkpoint, evaluate the trained team.

Run folder (``output_dir``): ``config.yaml``, ``metrics.jsonl`` (one line per iteration),
``tensorboard/``, ``checkpoints/iter_NNNNNN/`` (+ ``latest``), ``eval_untrained.json``,
``eval_iter_NNNNNN.json``, ``eval_final.json``. Ctrl-C or SIGTERM finishes the current iteration,
writes a checkpoint and stops (exit status 130); ``marft train --resume RUN_DIR`` continues.
"""
from __future__ import annotations

import atexit
import json
import signal
import sys
from pathlib import Path

from .errors import UserError


def cmd_train(args) -> int:
    from rich.console import Console

    from .api import MarftTrainer
    from .run.config import load_config

    console = Console(stderr=True, soft_wrap=True)  # log lines are not wrapped at 80 columns when piped

    def log(message: str) -> None:
        console.print(message, markup=False, highlight=False)

    from .run.folder import RunFolder, config_file, killed_before_a_checkpoint

    if args.resume:
        given = args.config if args.config and "=" not in args.config else None
        overrides = [*([args.config] if args.config and not given else []), *args.overrides]
        if killed_before_a_checkpoint(args.resume):  # nothing to continue from: the run starts again
            run, cfg, aside = RunFolder.restarted(args.resume, overrides)
            log(f"{run.path} has no checkpoint (the run ended before its first): starting it again from its config.yaml; "
                f"the earlier attempt's files are in {aside}")
        else:
            run = RunFolder.existing(args.resume)
            cfg = run.config(overrides)  # the saved config and the overrides
            if given:  # marft train CONFIG --resume RUN: CONFIG must be the run's own
                run.check_given_config(load_config(config_file(given, "train"), [*overrides, ("output_dir", str(run.path))]), given, cfg)
        trainer = MarftTrainer(cfg, run=run, log=log)
    else:
        if not args.config:
            raise UserError("marft train needs a config file (e.g. configs/duo_arithmetic.yaml) or --resume RUN_DIR")
        cfg = load_config(config_file(args.config, "train"), args.overrides)
        # before the models load: nothing to overwrite, not even the config file given
        trainer = MarftTrainer(cfg, run=RunFolder.new(cfg.output_dir, args.config), log=log)
    atexit.register(trainer.close)  # a vllm engine's worker processes, Ray's actors

    signalled = []  # the signals that stopped the run

    def on_stop(signum, frame):
        signalled.append(signum)
        if trainer.stopping:
            if signum == signal.SIGINT:  # a second Ctrl-C: the user means it
                raise KeyboardInterrupt
            return  # a second SIGTERM (one to the process, one to its group): the checkpoint still comes
        trainer.stop()
        if signum == signal.SIGINT:
            console.print("[yellow]Ctrl-C: stopping after this iteration (Ctrl-C again aborts without a checkpoint)[/]")
        else:
            console.print("[yellow]SIGTERM: stopping after this iteration, with a checkpoint[/]")

    # SIGTERM (what SLURM, Kubernetes and `timeout` send before they kill) is treated like Ctrl-C
    previous = {s: signal.signal(s, on_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = trainer.train()
    finally:  # the engine's processes and Ray's actors go now, not at exit
        for s, handler in previous.items():  # a run stopped by SIGTERM ignores a late second one: it exits 130
            signal.signal(s, signal.SIG_IGN if s == signal.SIGTERM and s in signalled else handler)
        trainer.close()
        atexit.unregister(trainer.close)
    if result.stopped:
        return 130
    _print_comparison(result.run_dir, result.final, result.adapters)
    return 0


def _print_comparison(run_dir: Path, final: dict, adapters: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out evaluation ({run_dir})")
    for col in ("team", "accuracy", "95% CI", "answer extracted"):
        table.add_column(col, justify="right" if col != "team" else "left")
    untrained = run_dir / "eval_untrained.json"
    rows = [("untrained", json.loads(untrained.read_text()))] if untrained.is_file() else []
    if adapters is not None or not rows:  # train.iterations=0 trains nothing: its final evaluation is the untrained one
        rows.append(("trained", final))
    for name, r in rows:
        lo, hi = r["ci95"]
        mean = ", macro mean" if r.get("tasks") else ""
        table.add_row(name + mean, f"{100 * r['accuracy']:.1f}%", f"{100 * lo:.1f}-{100 * hi:.1f}", f"{100 * r['extraction_rate']:.1f}%")
        for task, x in (r.get("tasks") or {}).items():
            tl, th = x["ci95"]
            table.add_row(f"  {task}", f"{100 * x['accuracy']:.1f}%", f"{100 * tl:.1f}-{100 * th:.1f}", f"{100 * x['extraction_rate']:.1f}%")
    Console().print(table)
    if adapters is not None:
        print(f"trained adapters: {run_dir}/checkpoints/latest -> adapters/ (marft eval CONFIG --adapters DIR)", file=sys.stderr)
    else:
        print("no adapters were trained (train.iterations=0): the table is the untrained team's", file=sys.stderr)
