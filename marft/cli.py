"""The command line: ``marft train``, ``marft eval``, ``marft sweep``, ``marft report``, ``marft env-check``.

User errors (a bad config, a missing file) print one line and exit with status 2; ``--debug``
shows the traceback instead.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong command or flag is a :class:`UserError` (one line, status 2)."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="marft", description="Multi-agent reinforcement fine-tuning for LLM agent teams.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ev = sub.add_parser("eval", help="evaluate a team on held-out problems and print a table")
    ev.add_argument("config", help="YAML config (see configs/)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.problems=32 rollout.temperature=0.8")
    ev.add_argument("--adapters", help="folder of trained adapters (one subfolder per adapter)")
    ev.add_argument("--no-critic", action="store_true", help="do not score the checkpoint's critic on the held-out "
                                                             "episodes (scored where --adapters is a checkpoint with one)")
    ev.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    tr = sub.add_parser("train", help="train a team with MARFT (or IPPO / GRPO), evaluating before and after")
    tr.add_argument("config", nargs="?", help="YAML config (see configs/); not needed with --resume")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.iterations=20 train.algorithm=ippo")
    tr.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    tr.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    sw = sub.add_parser("sweep", help="run a grid of training runs (resumable), see marft/experiments/sweep.py")
    sw.add_argument("sweep", help="sweep YAML file (see configs/sweep_paper_small.yaml)")
    sw.add_argument("--dry-run", action="store_true", help="list the runs and their state; run nothing")
    sw.add_argument("--parallel", type=int, metavar="N", help="runs at once (overrides the file's parallel:)")
    sw.add_argument("--threads", type=int, metavar="N", help="torch threads per run (overrides the file's threads:)")
    sw.add_argument("--output-dir", metavar="DIR", help="run the sweep in DIR, relative to the current folder (overrides "
                                                        "the file's output_dir:, e.g. to run a shipped sweep afresh)")
    sw.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    rp = sub.add_parser("report", help="tables, curves and per-agent views from run folders")
    rp.add_argument("runs", nargs="+", help="run folders, folders holding runs, or sweep output folders")
    rp.add_argument("--out", help="where report.md, report.json and the plots go (default: <first folder>/report)")
    rp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    sv = sub.add_parser("serve", help="serve the team as an OpenAI-compatible endpoint (each agent a model)")
    sv.add_argument("config", help="YAML config (see configs/)")
    sv.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.temperature=0.7")
    sv.add_argument("--adapters", help="folder of trained adapters (one subfolder per adapter)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    sv.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    cf = sub.add_parser("config", help="print a config as a run would use it: every key, defaults included, as YAML")
    cf.add_argument("config", nargs="?", help="YAML config (see configs/); none: the defaults alone")
    cf.add_argument("overrides", nargs="*", help="key=value overrides, e.g. team.preset=trio")
    cf.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    ck = sub.add_parser("env-check", help="check an environment class, or play a few episodes of a workflow (agent program)",
                        description="Check that an environment follows marft's environment API, or play a few episodes "
                                    "of a workflow (task.kind: workflow) and report its calls, steps, rewards and failures.")
    ck.add_argument("env", help="module:Class or path/to/file.py:Class, or a task kind: math, dataset, code, reasoning_gym, "
                                "coop; a workflow: a config file with task.kind: workflow, or workflow (with "
                                "workflow=path/to/file.py:function), or the workflow's module:function itself")
    ck.add_argument("options", nargs="*", help="key=value constructor options of the environment; for a workflow: "
                                               "overrides of its config (model.name=tiny), or task keys (dataset=..., "
                                               "reward=...) with workflow")
    ck.add_argument("--episodes", type=int, default=4, metavar="N", help="a workflow's episodes to play (default 4)")
    ck.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` items after a flag (``--adapters DIR k=v``) are
    overrides too, anything else unknown is an error."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown:
        raise UserError(f"unrecognized arguments: {' '.join(unknown)}; see marft {args.command} --help")
    if extra and args.command in ("sweep", "report"):
        raise UserError(f"unrecognized arguments: {' '.join(extra)}; see marft {args.command} --help")
    if extra:
        if args.command == "env-check":
            args.options = [*args.options, *extra]
        else:
            args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = _parse(argv)
        debug = args.debug
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "train":
            from .train_cli import cmd_train

            return cmd_train(args)
        if args.command == "env-check":
            return cmd_env_check(args)
        if args.command == "config":
            return cmd_config(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "sweep":
            from .experiments.sweep import cmd_sweep

            return cmd_sweep(args)
        if args.command == "report":
            from .experiments.report import cmd_report

            return cmd_report(args)
    except UserError as e:
        if debug:
            raise
        print(f"marft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("marft: interrupted", file=sys.stderr)
        return 130
    return 0


def cmd_config(args) -> int:
    """``marft config [CONFIG] [key=value ...]``: the config with its overrides, checked as a run
    checks it, every key with its value (the defaults included), as YAML a run could be given."""
    import yaml

    from .run.config import load_config, to_dict
    from .run.folder import config_file

    given = args.config if args.config and "=" not in args.config else None
    overrides = [*([args.config] if args.config and not given else []), *args.overrides]
    cfg = load_config(config_file(given, "config") if given else None, overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True), end="")
    return 0


def cmd_eval(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .api import adapters_folder, evaluate
    from .run.assemble import task_label
    from .run.folder import config_file, output_file
    from .run.config import load_config
    from .run.evaluation import format_table, write_json

    cfg = load_config(config_file(args.config, "eval"), args.overrides)
    out = Path(cfg.eval.output or Path(cfg.output_dir) / "eval.json")
    output_file(out, "eval.output" if cfg.eval.output else "output_dir")  # fail now, not after the evaluation
    if args.adapters:
        adapters_folder(args.adapters)  # a file, or a run folder without a checkpoint: say so now
    console = Console(stderr=True, soft_wrap=True)  # log lines are not wrapped at 80 columns when piped
    console.print(f"[bold]marft eval[/] {args.config}: team {' -> '.join(a.name for a in cfg.team.agents)}, "
                  f"model {cfg.model.name}, task {_task_text(cfg)}")
    with Progress(TextColumn("evaluating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[speed]}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("eval", total=None, speed="")
        t0, last = time.perf_counter(), 0

        def progress(done, total, tokens):
            nonlocal last
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.update(task, completed=done, total=total, speed=f"{tokens / elapsed:.0f} tok/s")
            if done != last and not console.is_terminal:  # a log file gets one line per batch instead of a bar
                last = done
                console.print(f"evaluating: {done}/{total} episodes, {tokens / elapsed:.0f} tok/s, {elapsed / 60:.1f} min")

        result = evaluate(cfg, args.adapters, cfg.eval.without, progress=progress, critic=not args.no_critic)
    result = {**result, "config": args.config}
    write_json(result, out)
    Console().print(format_table(result, title=f"{' -> '.join(result['agents'])} on {task_label(cfg)}"
                                 + (" (trained adapters)" if args.adapters else " (untrained)")
                                 + (f", without {', '.join(cfg.eval.without)}" if cfg.eval.without else "")))
    console.print(f"results written to {out}")
    return 0


def cmd_serve(args) -> int:
    """``marft serve``: the team (untrained, or with ``--adapters``) behind an OpenAI-compatible
    endpoint until Ctrl-C; the key is ``MARFT_API_KEY`` if set, else a random one printed here."""
    import os
    import signal
    import threading

    from .api import adapters_folder, team_server
    from .run.assemble import prepare
    from .run.folder import config_file
    from .run.config import load_config

    cfg = load_config(config_file(args.config, "serve"), args.overrides)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0-65535, got {args.port}")
    team, models, _ = prepare(cfg)
    if args.adapters:
        models.load_adapters(adapters_folder(args.adapters))
    server = team_server(cfg, team, models, args.host, args.port, os.environ.get("MARFT_API_KEY") or None)
    try:
        server.start()  # a port in use or a host not of this machine: a UserError saying which
    except UserError:
        server.stop()
        raise
    except (OSError, RuntimeError, SystemExit) as e:
        server.stop()
        raise UserError(f"cannot serve on {args.host}:{args.port}: the server did not start ({e})") from None
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"marft serve: {', '.join(team.names)} at {server.url} (API key: {server.api_key}); Ctrl-C stops",
          flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        server.stop()
    print("marft serve: stopped", file=sys.stderr)
    return 0


def cmd_env_check(args) -> int:
    from .run.config import split_override
    from .envs.check import SHIPPED, load_env_class, main_check
    from .run.workflow_check import is_workflow_config, looks_like_workflow, main_check_workflow

    # a workflow: its config file, the kind "workflow" with task keys, or the workflow function itself
    if is_workflow_config(args.env) or args.env == "workflow":
        return main_check_workflow(args.env, list(args.options), args.episodes)
    if args.env not in SHIPPED:
        fn = load_env_class(args.env)
        if looks_like_workflow(fn):
            from .envs.workflow import check_workflow

            check_workflow(fn, args.env)  # workflow(problem, client): a wrong signature is one line, now
            return main_check_workflow(args.env, list(args.options), args.episodes)
    options = dict(split_override(o, "env-check option", "seed=1") for o in args.options)
    return main_check(args.env, options)



def _task_text(cfg) -> str:
    """The task of ``cfg`` in a line: ``kind:name`` (or its file), or a mixture's names."""
    from .run.assemble import task_label

    t = cfg.task
    if cfg.tasks:
        return f"mixture of {task_label(cfg)}"
    return f"{t.kind}:{t.name if t.kind in ('reasoning_gym', 'coop') else t.test_path or t.env or t.dataset}"


if __name__ == "__main__":
    sys.exit(main())
