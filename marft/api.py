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

import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from .run.config import RunConfig, load_config as _load_config, to_dict
from .run.assemble import describe, env_factory, num_problems, prepare, quiet_libraries
from .run.checkpoints import adapters_folder  # noqa: F401 - part of the API
from .run.folder import RunFolder, killed_before_a_checkpoint, output_file
from .run.training import TrainResult, progress_line  # noqa: F401 - progress_line: part of the API
from .errors import UserError

__all__ = ["MarftConfig", "MarftTrainer", "TrainResult", "TrainedTeam", "evaluate", "load_config", "load_team"]

MarftConfig = RunConfig
"""The whole configuration of a run (model, team, task, rollout, eval, train, cluster, log):
typed dataclasses with defaults; see :mod:`marft.run.config` and docs/reference/config.md."""


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
    pairs = _pairs(overrides, sections)
    if isinstance(source, RunConfig):
        source = to_dict(source)
    if isinstance(source, dict):
        source = dict(source)
        if isinstance(source.get("task"), dict):
            source["task"] = _task_paths(source["task"], "task")
        if isinstance(source.get("tasks"), list):
            source["tasks"] = [_task_paths(t, f"tasks.{i}") if isinstance(t, dict) else t for i, t in enumerate(source["tasks"])]
    return _load_config(source, pairs)


def _pairs(overrides: Iterable[str] | dict, sections: dict) -> list:
    """The overrides and keyword sections of :func:`load_config` as one list of ``"key=value"``
    strings and ``(key, value)`` pairs, in that order, objects given for a reward, environment
    or workflow turned into their import paths."""
    pairs: list = list(overrides.items()) if isinstance(overrides, dict) else list(overrides)  # "k=v" or (k, v)
    for key, value in sections.items():
        if isinstance(value, dict):
            pairs += _flatten(value, key)
        else:
            pairs.append((key, value))
    return [_override_paths(o) if isinstance(o, tuple) else o for o in pairs]


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
             output: str | Path | None = None, progress: Callable[[int, int, int], None] | None = None,
             critic: bool = True) -> dict:
    """The team of ``config`` on its held-out problems (``eval.problems`` x ``eval.samples``):
    untrained, or with the trained ``adapters`` (a run folder, a checkpoint, or its ``adapters/``
    folder), optionally ``without`` some agents. Returns the result dict (``accuracy``, ``ci95``,
    ``extraction_rate``, ``pass_at_k``, per-agent lengths, ``transcripts``...) and writes it to
    ``output`` as JSON when given. ``progress(done, total, tokens)`` is called after every turn.
    With ``critic`` and a checkpoint that holds a critic (its ``critic/`` folder, beside
    ``adapters/``), the whole team's evaluation also scores the critic on the held-out episodes:
    ``result["critic"]`` (:class:`marft.run.evaluation.CriticCheck`)."""
    from .engines import make_engine
    from .run.evaluation import critic_check, evaluate as run_evaluation, write_json

    cfg = config
    without = list(without or cfg.eval.without)
    if output is not None:
        output_file(Path(output), "eval.output")  # fail now, not after the evaluation
    team, models, make_env = prepare(cfg)
    check = None
    if adapters:
        folder = adapters_folder(adapters)
        models.load_adapters(folder)
        if critic and not without:
            check = critic_check(cfg, team, models, folder.parent)
    if without:
        team = team.without(without)
        make_env = env_factory(cfg, team)
    num = num_problems(make_env)
    engine = make_engine(cfg, models)  # after the adapters are loaded: the vllm engine copies them
    try:
        result = run_evaluation(cfg, team, engine, make_env, num, progress, check)
    finally:
        engine.close()
    result["adapters"] = str(adapters) if adapters else None
    result["without"] = without
    result["machine"] = describe(models)
    if output is not None:
        write_json(result, output)
    return result


# --------------------------------------------------------------------------------------------
# training

class MarftTrainer:
    """Trains the team of ``config`` with its ``train.algorithm`` (marft, marft-token, ippo, grpo,
    dr-mas or at-grpo; :data:`marft.maths.algorithms.ALGORITHMS`), in one process or on Ray when
    ``cluster.rollout_workers`` > 0, in its run folder ``config.output_dir``.

    ``log(message)`` receives the progress lines (default: standard error). ``callbacks`` are
    functions ``f(metrics)`` called after every iteration, or objects with optional methods
    ``on_iteration(trainer, metrics)`` and ``on_evaluate(trainer, tag, result)``.
    Use it as a context manager (or call :meth:`close`) to free the engine and Ray's actors."""

    def __init__(self, config: RunConfig, *, log: Callable[[str], None] | None = _stderr,
                 callbacks: Iterable[Any] = (), run: RunFolder | None = None):
        """``run``: the run's folder when the caller made it already (:meth:`resume`, the command
        line); None: ``config.output_dir`` as a new run's, which must not hold an earlier run's files."""
        from .assemble import build_training

        self.config = config
        self.run = run if run is not None else RunFolder.new(config.output_dir)
        self.run_dir = self.run.path
        self.run.hold()  # one process trains a folder at a time
        try:
            self.training = build_training(config, self.run, log or (lambda message: None), callbacks, owner=self)
        except BaseException:
            self.run.abandon()
            raise
        self.team, self.models, self.make_env = self.training.team, self.training.models, self.training.make_env
        self.trainer, self.callbacks = self.training.trainer, self.training.callbacks

    @classmethod
    def resume(cls, run_dir: str | Path | RunFolder, overrides: Iterable[str] | dict = (), **kwargs: Any) -> "MarftTrainer":
        """The run in ``run_dir`` at its last checkpoint, with its saved config and ``overrides``
        (those that do not change what the checkpoint holds: more iterations, a learning rate...).
        A run that ended before its first checkpoint starts again from its ``config.yaml``, its
        files moved into ``earlier_attempt_K/``."""
        pairs = _pairs(overrides, {k: kwargs.pop(k) for k in list(kwargs) if k not in ("log", "callbacks")})
        if not isinstance(run_dir, RunFolder) and killed_before_a_checkpoint(run_dir):  # no checkpoint: start it again
            run, config, _ = RunFolder.restarted(run_dir, pairs)  # its earlier files into earlier_attempt_K/
            return cls(config, run=run, **kwargs)
        run = run_dir if isinstance(run_dir, RunFolder) else RunFolder.existing(run_dir)  # or a UserError saying what is wrong
        return cls(run.config(pairs), run=run, **kwargs)

    # ------------------------------------------------------------------ the pieces
    @property
    def iteration(self) -> int:
        """Iterations done (those of an earlier run included after a resume)."""
        return self.trainer.iteration

    @property
    def checkpoint(self) -> Path | None:
        """The checkpoint this trainer resumed from, or None."""
        return self.run.checkpoint

    def stop(self) -> None:
        """Ask :meth:`train` to stop after the current iteration (it saves a checkpoint first)."""
        self.training.stopping = True

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called: :meth:`train` returns after the current iteration."""
        return self.training.stopping

    def step(self) -> dict:
        """One iteration (rollout, targets, critic and policy updates); returns its metrics."""
        return self.trainer.iteration_step()

    def save(self) -> Path:
        """A checkpoint of this iteration (atomic; ``checkpoints/latest`` points at it)."""
        return self.trainer.save()

    def evaluate(self, tag: str | None = None, without: Iterable[str] = ()) -> dict:
        """The team as it is now on the held-out problems; with a ``tag`` the result is also
        written to ``<run>/eval_<tag>.json``."""
        return self.training.evaluate(tag, without)

    # ------------------------------------------------------------------ the whole run
    def train(self) -> TrainResult:
        """Evaluate the untrained team (``eval.before``), run ``train.iterations`` iterations with
        checkpoints every ``train.save_every`` and evaluations every ``train.eval_every``, then
        evaluate the trained team (and, with ``eval.ablate``, the team without each read agent).
        Writes metrics.jsonl, TensorBoard and the trackers of ``log:``; resumes where it stopped."""
        return self.training.train()

    def close(self) -> None:
        """Free the engine's processes and Ray's actors (safe to call twice)."""
        training = getattr(self, "training", None)
        if training is not None:
            training.close()
        if getattr(self, "run", None) is not None:
            self.run.release()

    def __enter__(self) -> "MarftTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# inference with trained adapters

class TrainedTeam:
    """A team's base model with its trained LoRA adapters, for inference. ``model`` is the PEFT
    ``PeftModel`` holding every adapter by name (``model.set_adapter("solver")``, then Hugging
    Face's ``generate``), ``tokenizer`` its tokenizer; :meth:`reply` and :meth:`solve` play agents."""

    def __init__(self, config: RunConfig, adapters: str | Path | None = None):
        from .engines.models import TeamModel
        from .team import build_team

        quiet_libraries()
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

