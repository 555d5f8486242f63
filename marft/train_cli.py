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
import time
from pathlib import Path

from .errors import UserError


def cmd_train(args) -> int:
    from rich.console import Console

    from .cli import env_factory, make_dir, prepare
    from .config import load_config, save_config
    from .evaluate import evaluate, write_json
    from .trainer import Trainer, append_metrics, latest_checkpoint, truncate_metrics

    console = Console(stderr=True, soft_wrap=True)  # log lines are not wrapped at 80 columns when piped
    if args.resume:
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise UserError(f"run folder {run_dir} not found; --resume takes the output_dir of an earlier marft train run")
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise UserError(f"{run_dir} has no complete checkpoint to resume from (expected {run_dir}/checkpoints/latest)")
        overrides = [*([args.config] if args.config and "=" in args.config else []), *args.overrides]
        # the run folder is where it is now, whatever output_dir said (a relative path, another cwd)
        cfg = load_config(ckpt / "config.yaml", [*overrides, f"output_dir={run_dir}"])
        _check_same_run(load_config(ckpt / "config.yaml", [f"output_dir={run_dir}"]), cfg, ckpt)
    else:
        if not args.config:
            raise UserError("marft train needs a config file (e.g. configs/duo_arithmetic.yaml) or --resume RUN_DIR")
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.output_dir)
        if latest_checkpoint(run_dir) is not None:
            raise UserError(f"run folder {run_dir} already has checkpoints; continue it with --resume {run_dir} "
                            "or choose another output_dir=...")
        make_dir(run_dir, "output_dir")
    team, models, make_env = prepare(cfg)
    make = Trainer
    if cfg.cluster.rollout_workers:  # Ray: rollout workers and learners as actors (docs/scaling.md)
        from .distributed import DistributedTrainer as make
    trainer = make(cfg, team, models, make_env, log=lambda m: console.print(f"[yellow]{m}[/]"))
    atexit.register(trainer.close)  # a vllm engine's worker processes, Ray's actors
    try:
        if args.resume:
            trainer.load(ckpt)  # every check passes before anything in the run folder changes
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        metrics_path = run_dir / "metrics.jsonl"
        probe = make_env()
        num = probe.num_problems("test") if hasattr(probe, "num_problems") else None

        def run_eval(tag: str, without: tuple = ()) -> dict:
            t0 = time.perf_counter()
            part = team.without(without) if without else team
            res = evaluate(cfg, part, trainer.engine, env_factory(cfg, part) if without else make_env, num)
            res["iteration"] = trainer.iteration
            res["without"] = list(without)
            write_json(res, run_dir / f"eval_{tag}.json")
            lo, hi = res["ci95"]
            console.print(f"eval {tag}: accuracy {100 * res['accuracy']:.1f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}), "
                          f"{res['problems']}x{res['samples']} problems, {time.perf_counter() - t0:.0f} s")
            return res

        if args.resume:
            truncate_metrics(metrics_path, trainer.iteration)
            console.print(f"resumed {run_dir} at iteration {trainer.iteration} from {ckpt.name}")
        else:
            metrics_path.unlink(missing_ok=True)
            console.print(f"[bold]marft train[/] {args.config}: {cfg.train.algorithm}, team {' -> '.join(team.names)}"
                          f"{' (shared adapter)' if cfg.team.share_adapter else ''}, {cfg.train.iterations} iterations "
                          f"x {cfg.rollout.episodes} episodes, run folder {run_dir}")
            if cfg.eval.before or cfg.train.iterations == 0:
                run_eval("untrained")
        writer = _tensorboard(run_dir, trainer.iteration + 1 if args.resume else None)
        stop = {"now": False}

        def on_stop(signum, frame):
            if stop["now"]:
                raise KeyboardInterrupt
            stop["now"] = True
            what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
            console.print(f"[yellow]{what}: stopping after this iteration (the same signal again aborts without a checkpoint)[/]")

        # SIGTERM (what SLURM, Kubernetes and `timeout` send before they kill) is treated like Ctrl-C
        previous = {s: signal.signal(s, on_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        start, done_here = time.perf_counter(), 0
        try:
            while trainer.iteration < cfg.train.iterations and not stop["now"]:
                m = trainer.iteration_step()
                done_here += 1
                append_metrics(metrics_path, m)
                if writer:
                    for k, v in m.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool):
                            writer.add_scalar(k, v, m["iteration"])
                    writer.flush()
                left = (time.perf_counter() - start) / done_here * (cfg.train.iterations - trainer.iteration)
                console.print(_line(m, cfg.train.iterations, left))
                last = trainer.iteration == cfg.train.iterations
                if trainer.iteration % cfg.train.save_every == 0 or last or stop["now"]:
                    trainer.save()
                if cfg.train.eval_every and trainer.iteration % cfg.train.eval_every == 0 and not last:
                    res = run_eval(f"iter_{trainer.iteration:06d}")
                    if writer:
                        writer.add_scalar("eval/accuracy", res["accuracy"], trainer.iteration)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if stop["now"]:
            console.print(f"stopped at iteration {trainer.iteration}; continue with: marft train --resume {run_dir}")
            return 130
        if trainer.iteration == 0 and (run_dir / "eval_untrained.json").is_file():  # train.iterations=0: a baseline run
            final = json.loads((run_dir / "eval_untrained.json").read_text())
            write_json(final, run_dir / "eval_final.json")
        else:
            final = run_eval("final")
        if cfg.eval.ablate:
            for agent in [a.name for a in team.agents if any(a.name in b.sees for b in team.agents)]:
                run_eval(f"final_without_{agent}", (agent,))
        if writer:
            writer.add_scalar("eval/accuracy", final["accuracy"], trainer.iteration)
            writer.close()
        _print_comparison(run_dir, final)
        return 0

    finally:  # the engine's processes and Ray's actors go now, not at exit
        trainer.close()
        atexit.unregister(trainer.close)

def _check_same_run(saved, cfg, ckpt: Path) -> None:
    """What a resumed run may not change: its team, adapters, algorithm and LoRA shape (the
    checkpoint holds the weights and optimiser states of exactly those)."""
    from .team import build_team

    old, new = build_team(saved.team), build_team(cfg.team)
    lo_a, lo_b = saved.model.lora, cfg.model.lora
    for what, a, b in [("team.preset", saved.team.preset, cfg.team.preset), ("the team's agents", old.names, new.names),
                       ("team.share_adapter", saved.team.share_adapter, cfg.team.share_adapter),
                       ("the adapters", old.adapters, new.adapters), ("train.algorithm", saved.train.algorithm, cfg.train.algorithm),
                       ("model.lora", (lo_a.r, lo_a.alpha, lo_a.target_modules), (lo_b.r, lo_b.alpha, lo_b.target_modules))]:
        if a != b:
            raise UserError(f"--resume cannot change {what} ({a} -> {b}): {ckpt} holds the weights of the run as it was; "
                            "drop that override, or start a new run with another output_dir=...")


def _line(m: dict, total: int, left_s: float) -> str:
    ent = m.get("entropy", next((v for k, v in m.items() if k.endswith("/entropy")), float("nan")))
    kl = m.get("approx_kl", next((v for k, v in m.items() if k.endswith("/approx_kl")), float("nan")))
    return (f"it {m['iteration']:>4}/{total}  reward {m['reward']:.3f}  acc {100 * m['accuracy']:5.1f}%  "
            f"kl {kl:.4f}  entropy {ent:.3f}  {m['tokens_per_s']:.0f} tok/s  "
            f"MFU {100 * m.get('mfu/iteration', 0.0):.0f}%  {m['seconds']:.0f} s/it  left {left_s / 60:.1f} min")


def _tensorboard(run_dir: Path, purge_step: int | None):
    """The TensorBoard writer; on resume, events from iterations after the checkpoint (written by
    the run that was stopped) are purged, as they are from metrics.jsonl."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)


def _print_comparison(run_dir: Path, final: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out evaluation ({run_dir})")
    for col in ("team", "accuracy", "95% CI", "answer extracted"):
        table.add_column(col, justify="right" if col != "team" else "left")
    untrained = run_dir / "eval_untrained.json"
    rows = [("untrained", json.loads(untrained.read_text()))] if untrained.is_file() else []
    for name, r in rows + [("trained", final)]:
        lo, hi = r["ci95"]
        table.add_row(name, f"{100 * r['accuracy']:.1f}%", f"{100 * lo:.1f}-{100 * hi:.1f}", f"{100 * r['extraction_rate']:.1f}%")
    Console().print(table)
    print(f"trained adapters: {run_dir}/checkpoints/latest -> adapters/ (marft eval CONFIG --adapters DIR)", file=sys.stderr)
