"""Experiment trackers of ``marft train``: TensorBoard, Weights & Biases and MLflow (``log:`` in the
config), written beside ``metrics.jsonl``, which is always there and always complete.

    trackers = Trackers(cfg, run_dir, resume_step)   # None for a new run
    trackers.log_metrics(metrics, step)              # one iteration's metrics dict
    trackers.log_eval("final", result, step)         # a marft.run.evaluation.evaluate() result
    trackers.close()

Each tracker gets the same scalars: every int or float (not bool) value of an iteration's metrics
under its own key (``reward``, ``planner/entropy``, ``mfu/iteration``), and of each evaluation
``eval/<tag>/accuracy``, ``eval/<tag>/ci95_low``, ``eval/<tag>/ci95_high``,
``eval/<tag>/extraction_rate`` and ``eval/accuracy`` (the accuracy curve across evaluations; not for
ablations, which evaluate a team without some agent); for a mixture of tasks the same per task,
``eval/<tag>/<task>/accuracy``, beside the macro mean. W&B also gets the config (``wandb.config``)
and each evaluation's transcripts and per-agent numbers as tables; MLflow the config as params
(dotted keys: ``train.lr``) and as the artifact ``config.yaml``, and each evaluation result as the
artifact ``eval_<tag>.json``.

Resuming: TensorBoard purges events after the checkpoint's iteration (``purge_step``); W&B and
MLflow continue the run whose id the first run left in ``<run>/wandb_id`` / ``<run>/mlflow_run_id``.
(W&B drops points at steps it has already seen, so iterations redone after a crash between two
checkpoints keep their first values there; MLflow keeps both.)

A tracker that fails while logging (network down, disk full) prints one warning line and is off for
the rest of the run; training goes on. A tracker that cannot start (package missing, bad tracking
URI, no W&B login) stops the command with a one-line :class:`~marft.errors.UserError` before
training begins. Only this module imports ``wandb`` and ``mlflow``, and only when they are turned on.
"""
from __future__ import annotations

import importlib.util
import os
import re
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoints import write_atomic
from ..errors import UserError

_MLFLOW_PARAM_VALUE_LIMIT = 500  # MLflow 1.x-2.2 stores at most 500 characters (later: 6000)
_MLFLOW_KEY_LIMIT = 250
_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores
_MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit); metrics: 1000


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _scalars(metrics: dict) -> dict[str, float]:
    return {str(k): v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def eval_scalars(tag: str, result: dict) -> dict[str, float]:
    """The scalars of one evaluation result (see the module docstring)."""
    out: dict[str, float] = {}
    acc = result.get("accuracy")
    if isinstance(acc, (int, float)) and not isinstance(acc, bool):
        out[f"eval/{tag}/accuracy"] = float(acc)
    ci = result.get("ci95")
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        out[f"eval/{tag}/ci95_low"], out[f"eval/{tag}/ci95_high"] = float(ci[0]), float(ci[1])
    if isinstance(result.get("extraction_rate"), (int, float)):
        out[f"eval/{tag}/extraction_rate"] = float(result["extraction_rate"])
    if f"eval/{tag}/accuracy" in out and not result.get("without"):
        out["eval/accuracy"] = out[f"eval/{tag}/accuracy"]
    for task, r in (result.get("tasks") or {}).items():  # a mixture: each task's own (the top is their macro mean)
        out.update({k.replace(f"eval/{tag}/", f"eval/{tag}/{task}/", 1): v
                    for k, v in eval_scalars(tag, {**r, "without": True}).items()})
    return out


def mlflow_key(name: str) -> str:
    """A metric or param name MLflow accepts, the same for the same name every time: each character
    other than ASCII letters, digits, ``_ - . /`` and space becomes ``_`` (``:`` too, which MLflow
    refuses on Windows); empty ``/``-segments are dropped and ``.``/``..`` segments become ``_`` (MLflow
    refuses names that a path normalisation would change); at most 250 characters. Keys marft
    writes itself (``planner/entropy``, ``eval/final/accuracy``, ``train.lr``) come through unchanged."""
    clean = re.sub(r"[^A-Za-z0-9_\-. /]", "_", str(name))
    parts = ["_" if p in (".", "..") else p for p in clean.split("/") if p]
    return ("/".join(parts) or "_")[:_MLFLOW_KEY_LIMIT]


def flatten_config(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config data as ``{"train.lr": "5e-05", "team.agents.0.name": "planner", ...}``: mappings
    and lists of mappings are walked, other values stringified (lists as ``[a, b]``)."""
    out: dict[str, str] = {}
    if isinstance(data, dict) and data:
        for k, v in data.items():
            out.update(flatten_config(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and data and all(isinstance(v, dict) for v in data):
        for i, v in enumerate(data):
            out.update(flatten_config(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix] = str(data)
    return out


def _transcript_rows(result: dict) -> tuple[list[str], list[list]]:
    """The transcripts of an evaluation result as table rows: problem index, the observation the
    team saw, the extracted answer, whether it was correct, and every reply (``[step] agent: text``)."""
    columns = ["problem", "observation", "answer", "correct", "replies"]
    rows = []
    for t in result.get("transcripts") or []:
        replies = "\n\n".join(f"[{turn.get('step')}] {turn.get('agent')}: {turn.get('reply')}" for turn in t.get("turns", []))
        answer = t.get("answer")
        rows.append([t.get("problem"), str(t.get("observation", "")), "" if answer is None else str(answer),
                     bool(t.get("correct", False)), replies])
    return columns, rows


# ------------------------------------------------------------------------------------------------
# the trackers

class _TensorBoard:
    name = "log.tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step)

    def metrics(self, scalars: dict, step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def evaluation(self, tag: str, result: dict, scalars: dict, step: int) -> None:
        self.metrics(scalars, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    name = "log.wandb"

    def __init__(self, cfg, run_dir: Path, resume_step: int | None, name: str):
        try:
            import wandb
        except ImportError:
            raise UserError('log.wandb: true needs the wandb package; pip install "marft[wandb]"') from None
        from .config import to_dict

        self.wandb = wandb
        lg = cfg.log
        id_path = run_dir / "wandb_id"
        run_id = id_path.read_text().strip() if resume_step is not None and id_path.is_file() else ""
        run_id = run_id or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        try:
            self.run = wandb.init(project=lg.wandb_project, entity=lg.wandb_entity or None, name=name, dir=str(run_dir),
                                  config=to_dict(cfg), mode=lg.wandb_mode or None, id=run_id, resume="allow")
        except Exception as e:
            raise UserError(f"log.wandb: wandb.init failed ({type(e).__name__}: {_one_line(e)}); run wandb login, "
                            "check log.wandb_project and log.wandb_entity, or set log.wandb_mode=offline") from None
        write_atomic(id_path, run_id + "\n")

    def metrics(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def evaluation(self, tag: str, result: dict, scalars: dict, step: int) -> None:
        data: dict[str, Any] = dict(scalars)
        columns, rows = _transcript_rows(result)
        if rows:
            data[f"eval/{tag}/transcripts"] = self.wandb.Table(columns=columns, data=rows)
        agents = result.get("agents") or {}
        if agents:
            data[f"eval/{tag}/agents"] = self.wandb.Table(
                columns=["agent", "mean_tokens", "truncated"],
                data=[[a, v.get("mean_tokens"), v.get("truncated")] for a, v in agents.items()])
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    name = "log.mlflow"

    def __init__(self, cfg, run_dir: Path, resume_step: int | None, name: str):
        try:
            import mlflow
            from mlflow.entities import Param, RunStatus
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise UserError('log.mlflow: true needs the mlflow package; pip install "marft[mlflow]"') from None
        import yaml

        from .config import to_dict

        lg = cfg.log
        uri = lg.mlflow_tracking_uri
        if uri and (uri.startswith("file:") or "://" not in uri):
            # MLflow 3 refuses its file store unless asked for it; a file: URI given here is asking for it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.RunStatus = RunStatus
        id_path = run_dir / "mlflow_run_id"
        where = uri or "MLflow's default tracking store"
        resolved = uri or mlflow.get_tracking_uri()
        if resolved.split(":", 1)[0].split("+")[0] in _DB_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
            raise UserError(f'log.mlflow: the tracking store {resolved} needs SQLAlchemy; pip install "marft[mlflow]"')
        try:
            self.client = client = MlflowClient(tracking_uri=uri or None)
            where = client.tracking_uri
            exp = client.get_experiment_by_name(lg.mlflow_experiment)
            if exp is not None and exp.lifecycle_stage == "deleted":
                raise UserError(f"log.mlflow_experiment {lg.mlflow_experiment!r} is deleted in {where}; restore it "
                                "(mlflow experiments restore) or choose another log.mlflow_experiment=...")
            exp_id = exp.experiment_id if exp is not None else client.create_experiment(lg.mlflow_experiment)
            run = None
            if resume_step is not None and id_path.is_file():
                old = id_path.read_text().strip()
                try:
                    run = client.get_run(old)
                except MlflowException:
                    print(f"marft: warning: log.mlflow: run {old} of {id_path} is not in {where}; starting a new MLflow run",
                          file=sys.stderr, flush=True)
                if run is not None:
                    client.update_run(run.info.run_id, status="RUNNING")
            if run is None:
                run = client.create_run(exp_id, run_name=name, tags=_mlflow_tags(run_dir))
            self.run_id = run.info.run_id
            have = run.data.params  # a resumed run: MLflow refuses to change a param, so changed ones
            params = {}             # stay as they were (config.yaml is rewritten with the new values)
            for k, v in flatten_config(to_dict(cfg)).items():
                key = mlflow_key(k)
                if key not in have:
                    params[key] = v[:_MLFLOW_PARAM_VALUE_LIMIT]
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), _MLFLOW_BATCH):
                client.log_batch(self.run_id, params=items[i:i + _MLFLOW_BATCH])
            client.log_text(self.run_id, yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True), "config.yaml")
        except UserError:
            raise
        except ImportError as e:
            raise UserError(f"log.mlflow: the tracking store {where} needs the {e.name or 'missing'} package; "
                            'pip install "marft[mlflow]" (or give another log.mlflow_tracking_uri=...)') from None
        except Exception as e:
            raise UserError(f"log.mlflow: cannot start a run in {where} ({type(e).__name__}: {_one_line(e, 600)}); "
                            "check log.mlflow_tracking_uri") from None
        write_atomic(id_path, self.run_id + "\n")

    def metrics(self, scalars: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in scalars.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def evaluation(self, tag: str, result: dict, scalars: dict, step: int) -> None:
        self.metrics(scalars, step)
        self.client.log_dict(self.run_id, result, f"eval_{tag}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, self.RunStatus.to_string(self.RunStatus.FINISHED))


def _mlflow_tags(run_dir: Path) -> dict[str, str]:
    tags = {"marft.run_dir": str(run_dir.resolve())}
    try:  # the tags mlflow.start_run would set (user, source, git commit)
        from mlflow.tracking.context.registry import resolve_tags

        tags = resolve_tags(tags)
    except Exception:
        pass
    return tags


class Trackers:
    """The trackers ``cfg.log`` turns on, for the run folder ``run_dir``; ``resume_step`` is the first
    iteration a resumed run will log (None for a new run)."""

    def __init__(self, cfg, run_dir: Path, resume_step: int | None):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        lg = cfg.log
        name = lg.run_name or run_dir.resolve().name
        self._sinks: list = []
        self._dead: list = []  # trackers that failed: still closed (flushed, finished) at the end
        self._closed = False
        try:
            if lg.tensorboard:
                try:
                    self._sinks.append(_TensorBoard(run_dir, resume_step))
                except ImportError as e:  # tensorboard is a dependency; a broken install only loses the curves
                    self._warn("log.tensorboard", e, "is off for this run")
            if lg.wandb:
                self._sinks.append(_WandB(cfg, run_dir, resume_step, name))
            if lg.mlflow:
                self._sinks.append(_MLflow(cfg, run_dir, resume_step, name))
        except BaseException:
            self.close()
            raise

    @property
    def active(self) -> list[str]:
        """The names of the trackers still logging (``log.tensorboard``, ``log.wandb``, ``log.mlflow``)."""
        return [s.name for s in self._sinks]

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Every int/float (not bool) value of one iteration's metrics at ``step``."""
        scalars = _scalars(metrics)
        for sink in list(self._sinks):
            self._call(sink, "metrics", scalars, step)

    def log_eval(self, tag: str, result: dict, step: int) -> None:
        """One evaluation result (``eval_<tag>.json``) at ``step``: its scalars everywhere, its tables
        in W&B, the whole result as an MLflow artifact."""
        scalars = eval_scalars(tag, result)
        for sink in list(self._sinks):
            self._call(sink, "evaluation", tag, result, scalars, step)

    def close(self) -> None:
        """Flush and finish every tracker; safe to call twice, never raises for a dead tracker."""
        if self._closed:
            return
        self._closed = True
        sinks, self._sinks, self._dead = self._sinks + self._dead, [], []
        for sink in sinks:
            try:
                sink.close()
            except Exception:
                pass

    # ---------------------------------------------------------------- internals
    def _call(self, sink, method: str, *args) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception as e:
            self._sinks.remove(sink)
            self._dead.append(sink)
            self._warn(sink.name, e, "is off for the rest of this run; training goes on (metrics.jsonl has every value)")

    @staticmethod
    def _warn(name: str, e: BaseException, what: str) -> None:
        print(f"marft: warning: {name} failed ({type(e).__name__}: {_one_line(e, 200)}) and {what}", file=sys.stderr, flush=True)
