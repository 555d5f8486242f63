"""The Python API: everything ``marft train`` and ``marft eval`` do, from a script or a notebook.
The command line (:mod:`marft.cli`, :mod:`marft.train_cli`) only parses arguments and prints.

    import marft

    config = marft.load_config("configs/duo_arithmetic.yaml", train={"iterations": 20}, seed=1)
    with marft.MarftTrainer(config) as trainer:
        result = trainer.train()          # evaluates before and after, checkpoints, logs
    print(result.untrained["accuracy"], "->", result.final["accuracy"], result.adapters)

    team = marft.load_team(result.run_dir)  # the trained adapters on the base model (a PeftModel)
    print(team.solve("Calculate 12 + 7. Give the final answer in \\\\boxed{}."))

A config comes from a YAML path, a dict or an earlier config, with ``key=value`` overrides (as on the
command line), a ``{"dotted.key": value}`` dict, or a section per keyword (``train={"lr": 1e-5}``).
"""
from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .run.config import RunConfig, is_workflow, load_config as _load_config, save_config, to_dict
from .run.assemble import (_machine, _num_problems, _quiet_libraries, _record_machine, check_new_run_dir, env_factory, make_dir,
                       output_file, prepare)
from .errors import UserError

__all__ = ["MarftConfig", "MarftTrainer", "TrainResult", "TrainedTeam", "evaluate", "load_config", "load_team"]

MarftConfig = RunConfig
"""The whole configuration of a run (model, team, task, rollout, eval, train, cluster, log):
typed dataclasses with defaults; see :mod:`marft.run.config` and docs/config.md."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# configs

def load_config(source: str | Path | dict | RunConfig | None = None, overrides: Iterable[str] | dict = (),
                **sections: Any) -> RunConfig:
    """A validated :class:`MarftConfig` from ``source``: a YAML file, a dict of the same shape, an
    earlier config, or None (every default). Then ``overrides`` (``["train.lr=1e-5"]`` as on the
    command line, or ``{"train.lr": 1e-5}``) and keyword sections (``train={"lr": 1e-5}``,
    ``seed=1``) apply, in that order. A wrong key or value is a :class:`marft.UserError`."""
    pairs: list = list(overrides.items()) if isinstance(overrides, dict) else list(overrides)  # "k=v" or (k, v)
    for key, value in sections.items():
        if isinstance(value, dict):
            pairs += _flatten(value, key)
        else:
            pairs.append((key, value))
    if isinstance(source, RunConfig):
        source = to_dict(source)
    if isinstance(source, dict):
        source = dict(source)
        if isinstance(source.get("task"), dict):
            source["task"] = _task_paths(source["task"], "task")
        if isinstance(source.get("tasks"), list):
            source["tasks"] = [_task_paths(t, f"tasks.{i}") if isinstance(t, dict) else t for i, t in enumerate(source["tasks"])]
    pairs = [_override_paths(o) if isinstance(o, tuple) else o for o in pairs]
    return _load_config(source, pairs)


def _task_paths(task: dict, where: str) -> dict:
    """A task's settings with a reward function, workflow or environment class given as the object
    itself turned into its import path."""
    task = dict(task)
    for k in ("reward", "env", "workflow"):
        if k in task:
            task[k] = _import_path(task[k], f"{where}.{k}")
    return task


def _override_paths(pair: tuple) -> tuple:
    """``(key, value)``: the same for ``task.reward`` (``tasks.N.reward``, ``.env``, ``.workflow``),
    and for ``tasks`` given whole as a list of dicts."""
    key, value = pair
    if key == "tasks" and isinstance(value, list):
        return key, [_task_paths(t, f"tasks.{i}") if isinstance(t, dict) else t for i, t in enumerate(value)]
    if re.fullmatch(r"(task|tasks\.\d+)\.(reward|env|workflow)", key):
        return key, _import_path(value, key)
    return pair


def _import_path(value: Any, key: str) -> Any:
    """A reward function or environment class given as the object itself -> the ``module:name``
    (or ``file.py:name``, for a script) the config holds and every process can import."""
    if isinstance(value, str) or not callable(value):
        return value
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not module or "<" in name or "." in name:
        raise UserError(f"{key}: {name or repr(value)} is not a top-level function or class of a module (a lambda or a function "
                        "defined inside another cannot be found by name); define it at the top of a module or script")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if module == "__main__" and main_file:  # a script: its file, which other processes can import too
        return f"{Path(main_file).resolve()}:{name}"
    return f"{module}:{name}"  # a notebook's __main__ works in this process (not on Ray workers)


def _flatten(data: dict, prefix: str) -> list[tuple[str, Any]]:
    """``{"lora": {"r": 4}}`` under ``model`` -> ``[("model.lora.r", 4)]``; an empty dict stays a
    value (``task={"options": {}}`` clears the options)."""
    out: list[tuple[str, Any]] = []
    for k, v in data.items():
        key = f"{prefix}.{k}"
        out += _flatten(v, key) if isinstance(v, dict) and v else [(key, v)]
    return out


# --------------------------------------------------------------------------------------------
# evaluation

def evaluate(config: RunConfig, adapters: str | Path | None = None, without: Iterable[str] = (),
             output: str | Path | None = None, progress: Callable[[int, int, int], None] | None = None) -> dict:
    """The team of ``config`` on its held-out problems (``eval.problems`` x ``eval.samples``):
    untrained, or with the trained ``adapters`` (a run folder, a checkpoint, or its ``adapters/``
    folder), optionally ``without`` some agents. Returns the result dict (``accuracy``, ``ci95``,
    ``extraction_rate``, ``pass_at_k``, per-agent lengths, ``transcripts``...) and writes it to
    ``output`` as JSON when given. ``progress(done, total, tokens)`` is called after every turn."""
    from .engines import make_engine
    from .run.evaluation import evaluate as run_evaluation, write_json

    cfg = config
    without = list(without or cfg.eval.without)
    if output is not None:
        output_file(Path(output), "eval.output")  # fail now, not after the evaluation
    team, models, make_env = prepare(cfg)
    if adapters:
        models.load_adapters(adapters_folder(adapters))
    if without:
        team = team.without(without)
        make_env = env_factory(cfg, team)
    num = _num_problems(make_env)
    engine = make_engine(cfg, models)  # after the adapters are loaded: the vllm engine copies them
    try:
        result = run_evaluation(cfg, team, engine, make_env, num, progress)
    finally:
        engine.close()
    result["adapters"] = str(adapters) if adapters else None
    result["without"] = without
    result["machine"] = _machine(models)
    if output is not None:
        write_json(result, output)
    return result


def adapters_folder(source: str | Path) -> Path:
    """The ``adapters/`` folder of a run folder (its latest checkpoint), of a checkpoint, or itself.
    A path through ``checkpoints/latest`` (a file naming the newest checkpoint, not a folder) goes
    to that checkpoint: ``run/checkpoints/latest/adapters`` works."""
    from .run.checkpoints import latest_checkpoint, no_checkpoint_reason

    p = Path(source)
    for i, part in enumerate(p.parts):
        head = Path(*p.parts[:i + 1])
        if part == "latest" and head.is_file() and head.parent.name == "checkpoints":
            target = latest_checkpoint(head.parent.parent)
            if target is not None:
                p = target.joinpath(*p.parts[i + 1:])
            break
    if p.exists() and not p.is_dir():  # after resolving checkpoints/latest, which is a file naming a folder
        raise UserError(f"adapters {source} is a file, not a folder; give a checkpoint's adapters/ folder, a checkpoint or a run folder")
    if (p / "checkpoints").is_dir():
        ckpt = latest_checkpoint(p)
        if ckpt is None:
            if (p / "checkpoints" / "latest").exists():  # a latest that names no checkpoint: say which
                raise UserError(f"run folder {p}: {no_checkpoint_reason(p)}")
            raise UserError(f"run folder {p} has no complete checkpoint (expected {p}/checkpoints/latest); "
                            "train it first or give a checkpoint's adapters/ folder")
        return ckpt / "adapters"
    if (p / "adapters").is_dir():
        return p / "adapters"
    return p


# --------------------------------------------------------------------------------------------
# training

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


class MarftTrainer:
    """Trains the team of ``config`` (MARFT, IPPO or GRPO; in one process or on Ray when
    ``cluster.rollout_workers`` > 0) in its run folder ``config.output_dir``.

    ``log(message)`` receives the progress lines (default: standard error). ``callbacks`` are
    functions ``f(metrics)`` called after every iteration, or objects with optional methods
    ``on_iteration(trainer, metrics)`` and ``on_evaluate(trainer, tag, result)``.
    Use it as a context manager (or call :meth:`close`) to free the engine and Ray's actors."""

    def __init__(self, config: RunConfig, *, log: Callable[[str], None] | None = _stderr,
                 callbacks: Iterable[Any] = (), _resume: Path | None = None):
        from .run.trainer import Trainer

        self.config = cfg = config
        self.run_dir = Path(cfg.output_dir)
        self._log = log or (lambda message: None)
        self.callbacks = list(callbacks)
        self._checkpoint = _resume
        if not _resume:
            check_new_run_dir(self.run_dir)  # a new run never overwrites an earlier run's files
            make_dir(self.run_dir, "output_dir")
        self.team, self.models, self.make_env = prepare(cfg)
        if not _resume:  # a new run's adapters from trained ones (a resumed run has its checkpoint's)
            self.models.init_adapters(cfg.model.init_adapters)
        make = Trainer
        if cfg.cluster.rollout_workers:  # Ray: rollout workers and learners as actors (docs/scaling.md)
            from .distributed import DistributedTrainer as make
        self.trainer = make(cfg, self.team, self.models, self.make_env, log=self._log)
        self._stop = False
        self._num = None
        if self._checkpoint is not None:
            try:
                self.trainer.load(self._checkpoint)  # every check passes before anything in the run folder changes
            except BaseException:
                self.close()
                raise

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: Iterable[str] | dict = (), **kwargs: Any) -> "MarftTrainer":
        """The run in ``run_dir`` at its last checkpoint, with its saved config and ``overrides``
        (those that do not change what the checkpoint holds: more iterations, a learning rate...)."""
        from .run.checkpoints import resume_checkpoint

        run_dir = Path(run_dir)
        ckpt = resume_checkpoint(run_dir)  # or a UserError saying what is wrong with run_dir
        sections = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("log", "callbacks")}
        # the run folder is where it is now, whatever output_dir said (a relative path, another cwd)
        saved = load_config(ckpt / "config.yaml", output_dir=str(run_dir))
        cfg = load_config(saved, overrides, **sections, output_dir=str(run_dir))
        _check_same_run(saved, cfg, ckpt)
        return cls(cfg, _resume=ckpt, **kwargs)

    # ------------------------------------------------------------------ the pieces
    @property
    def iteration(self) -> int:
        """Iterations done (those of an earlier run included after a resume)."""
        return self.trainer.iteration

    @property
    def checkpoint(self) -> Path | None:
        """The checkpoint this trainer resumed from, or None."""
        return self._checkpoint

    def stop(self) -> None:
        """Ask :meth:`train` to stop after the current iteration (it saves a checkpoint first)."""
        self._stop = True

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called: :meth:`train` returns after the current iteration."""
        return self._stop

    def step(self) -> dict:
        """One iteration (rollout, targets, critic and policy updates); returns its metrics."""
        return self.trainer.iteration_step()

    def save(self) -> Path:
        """A checkpoint of this iteration (atomic; ``checkpoints/latest`` points at it)."""
        return self.trainer.save()

    def evaluate(self, tag: str | None = None, without: Iterable[str] = ()) -> dict:
        """The team as it is now on the held-out problems; with a ``tag`` the result is also
        written to ``<run>/eval_<tag>.json``."""
        from .run.evaluation import write_json, evaluate as run_evaluation

        if self._num is None:
            self._num = _num_problems(self.make_env) or 0
        without = tuple(without)
        part = self.team.without(without) if without else self.team
        make_env = env_factory(self.config, part) if without else self.make_env
        res = run_evaluation(self.config, part, self.trainer.engine, make_env, self._num or None)
        res["iteration"] = self.trainer.iteration
        res["without"] = list(without)
        res["machine"] = _machine(self.models)
        if tag is not None:
            write_json(res, self.run_dir / f"eval_{tag}.json")
        return res

    # ------------------------------------------------------------------ the whole run
    def train(self) -> TrainResult:
        """Evaluate the untrained team (``eval.before``), run ``train.iterations`` iterations with
        checkpoints every ``train.save_every`` and evaluations every ``train.eval_every``, then
        evaluate the trained team (and, with ``eval.ablate``, the team without each read agent).
        Writes metrics.jsonl, TensorBoard and the trackers of ``log:``; resumes where it stopped."""
        from .run.evaluation import write_json
        from .run.trackers import Trackers
        from .run.checkpoints import append_metrics, latest_checkpoint, read_metrics, truncate_metrics

        cfg, run_dir, resumed = self.config, self.run_dir, self._checkpoint is not None
        run_dir.mkdir(parents=True, exist_ok=True)
        # a tracker that cannot start stops the run here, before anything in the run folder changes
        trackers = Trackers(cfg, run_dir, self.trainer.iteration + 1 if resumed else None)
        metrics_path = run_dir / "metrics.jsonl"
        untrained = None
        try:
            save_config(cfg, run_dir / "config.yaml")
            _record_machine(run_dir, self.models, self.trainer.iteration)
            if resumed:
                truncate_metrics(metrics_path, self.trainer.iteration)
                self._log(f"resumed {run_dir} at iteration {self.trainer.iteration} from {self._checkpoint.name}")
            else:
                metrics_path.unlink(missing_ok=True)
                self._log(f"marft train: {cfg.train.algorithm}, team {' -> '.join(self.team.names)}"
                          f"{' (shared adapter)' if cfg.team.share_adapter else ''}, {cfg.train.iterations} iterations "
                          f"x {cfg.rollout.episodes} episodes, run folder {run_dir}")
            compiled = [name for name, on in (("rollout.compile", cfg.rollout.compile), ("train.compile", cfg.train.compile)) if on]
            if compiled:  # else the first evaluation or iteration looks stuck for minutes
                self._log(f"{' and '.join(compiled)}: the first calls of each agent compile with torch.compile "
                          "(a minute or more on a CPU), later ones run compiled")
            if not resumed:
                if cfg.eval.before or cfg.train.iterations == 0:
                    untrained = self._run_eval("untrained", trackers)
            start, done_here = time.perf_counter(), 0
            while self.trainer.iteration < cfg.train.iterations and not self._stop:
                m = self.trainer.iteration_step()
                done_here += 1
                append_metrics(metrics_path, m)
                trackers.log_metrics(m, m["iteration"])
                left = (time.perf_counter() - start) / done_here * (cfg.train.iterations - self.trainer.iteration)
                self._log(progress_line(m, cfg.train.iterations, left))
                for cb in self.callbacks:
                    _call(cb, "on_iteration", self, m)
                last = self.trainer.iteration == cfg.train.iterations
                if self.trainer.iteration % cfg.train.save_every == 0 or last or self._stop:
                    self.trainer.save()
                if cfg.train.eval_every and self.trainer.iteration % cfg.train.eval_every == 0 and not last:
                    self._run_eval(f"iter_{self.trainer.iteration:06d}", trackers)
            result = TrainResult(run_dir, read_metrics(metrics_path), untrained, None, self._adapters(), stopped=self._stop)
            if self._stop:
                if latest_checkpoint(run_dir) is None:  # stopped before the first iteration's end (the untrained evaluation)
                    self.trainer.save()
                    result.adapters = self._adapters()
                self._log(f"stopped at iteration {self.trainer.iteration}; continue with: marft train --resume {run_dir}")
                return result
            if self.trainer.iteration == 0 and (run_dir / "eval_untrained.json").is_file():  # a baseline run
                result.final = json.loads((run_dir / "eval_untrained.json").read_text())
                write_json(result.final, run_dir / "eval_final.json")
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
            _call(cb, "on_evaluate", self, tag, res)
        return res

    def _adapters(self) -> Path | None:
        from .run.checkpoints import latest_checkpoint

        ckpt = latest_checkpoint(self.run_dir)
        return ckpt / "adapters" if ckpt is not None else None

    def close(self) -> None:
        """Free the engine's processes and Ray's actors (safe to call twice)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            trainer.close()

    def __enter__(self) -> "MarftTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def _check_same_run(saved: RunConfig, cfg: RunConfig, ckpt: Path) -> None:
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


# --------------------------------------------------------------------------------------------
# inference with trained adapters

class TrainedTeam:
    """A team's base model with its trained LoRA adapters, for inference. ``model`` is the PEFT
    ``PeftModel`` holding every adapter by name (``model.set_adapter("solver")``, then Hugging
    Face's ``generate``), ``tokenizer`` its tokenizer; :meth:`reply` and :meth:`solve` play agents."""

    def __init__(self, config: RunConfig, adapters: str | Path | None = None):
        from .engines.models import TeamModel
        from .team import build_team

        _quiet_libraries()
        self.config = config
        self.team = build_team(config.team)
        self._models = TeamModel(self.team, config.model)
        if adapters is not None:
            self._models.load_adapters(adapters_folder(adapters))
        self.model, self.tokenizer, _ = self._models.for_agent(self.team.names[0])

    def reply(self, agent: str, observation: str, replies: dict[str, str] | None = None,
              max_new_tokens: int | None = None, temperature: float = 0.0) -> str:
        """``agent``'s reply to ``observation`` given its teammates' ``replies`` (those it sees),
        greedy by default, with its own adapter active."""
        import torch

        from .engines.generation import encode_chats
        from .engines.models import stop_token_ids
        from .team import agent_messages

        if agent not in self.team.names:
            raise UserError(f"unknown agent {agent!r}; the team has {', '.join(self.team.names)}")
        a = self.team[agent]
        limit = max_new_tokens or a.max_new_tokens or self.config.rollout.max_new_tokens
        with self._models.acting(agent) as (model, tok):
            ids, mask = encode_chats(tok, [agent_messages(a, observation, replies or {})], model.device)
            sample = temperature > 0
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask.long(), max_new_tokens=limit, do_sample=sample,
                                     temperature=temperature if sample else None, top_p=None, top_k=None,
                                     eos_token_id=stop_token_ids(model, tok), pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def solve(self, problem: str, instruction: str | None = None, task: str | None = None, **kwargs: Any) -> dict[str, str]:
        """One step of the team on ``problem``, as in training: every agent once, in acting order,
        each reading the replies it sees, the answering agents told ``instruction`` (None: the
        task's own, e.g. "Give the final answer in \\boxed{}."; "": nothing; a team trained on
        several tasks: the own instruction of ``task``, one of their labels). ``{agent: reply}``."""
        if instruction is None:
            instruction = self._instruction(task)
        answering = problem + f"\n\n{instruction}" if instruction else problem
        replies: dict[str, str] = {}
        for a in self.team.agents:
            replies[a.name] = self.reply(a.name, answering if a.answers else problem, replies, **kwargs)
        return replies

    def serve(self, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        """The trained team behind the OpenAI-compatible endpoint a workflow run trains through
        (:mod:`marft.serving.serve`), started: each agent a model named as the agent, with its trained
        adapter, sampling as the config's rollout. Use it as a context manager (or ``.stop()``)::

            with marft.load_team("runs/workflow_duo").serve() as server:
                client = openai.OpenAI(base_url=server.url, api_key=server.api_key)
        """
        return team_server(self.config, self.team, self._models, host, port, api_key).start()

    def _instruction(self, task: str | None = None) -> str:
        """The answer instruction of the config's task (what its environment tells answering
        agents); of a mixture, of its task ``task``."""
        from .envs.mixture import MixtureFactory

        cache = self.__dict__.setdefault("_task_instructions", {})
        if task not in cache:
            make_env = env_factory(self.config, self.team)
            if isinstance(make_env, MixtureFactory):
                labels = make_env.labels
                if task is None and len(labels) > 1:
                    raise UserError(f"this team was trained on several tasks ({', '.join(labels)}); say which one "
                                    f"the problem is of: solve(problem, task={labels[0]!r}), or give instruction=...")
                if task is not None and task not in labels:
                    raise UserError(f"unknown task {task!r}; this team's tasks are {', '.join(labels)}")
                make_env = make_env.factories[task or labels[0]]
            env = make_env()
            cache[task] = env.answer_instruction() if hasattr(env, "answer_instruction") else ""
        return cache[task]


def team_server(config: RunConfig, team, models, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
    """A :class:`marft.serving.serve.TeamServer` (not started) for ``team`` on ``models`` with the engine
    ``rollout.engine`` names and the rollout's sampling; stopping it closes the engine."""
    from .engines import make_engine
    from .engines.generation import Sampling
    from .serving.serve import serve_team

    r = config.rollout
    return serve_team(models, team, make_engine(config, models), Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                                                                          tuple(r.stop)),
                      api_key=api_key, host=host, port=port, seed=config.seed, owns_engine=True)


def load_team(source: str | Path, config: RunConfig | str | Path | dict | None = None, **sections: Any) -> TrainedTeam:
    """The trained team of a run folder (its last checkpoint and saved config), of a checkpoint
    folder, or of an ``adapters/`` folder (then give the ``config`` it was trained with)."""
    p = Path(source)
    if not p.exists():
        raise UserError(f"{p} not found; give a run folder, a checkpoint or an adapters/ folder of a marft train run")
    folder = adapters_folder(p)
    if config is None:
        saved = next((c for c in (folder.parent / "config.yaml", p / "config.yaml") if c.is_file()), None)
        if saved is None:
            raise UserError(f"no config.yaml beside {folder}; pass the config it was trained with: load_team(path, config)")
        config = saved
    return TrainedTeam(load_config(config, **sections), folder)

