"""marft.run.trackers: TensorBoard, W&B (offline mode, read back from its .wandb file) and MLflow (a
sqlite and a file: store in tmp_path, read back with MlflowClient). No network, no model."""
from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from marft.run.config import load_config
from marft.errors import UserError
from marft.run.trackers import Trackers, eval_scalars, flatten_config, mlflow_key

ERRORS_MD = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
RESULT = {
    "problems": 4, "samples": 1, "accuracy": 0.5, "ci95": [0.25, 0.75], "extraction_rate": 0.75,
    "pass_at_k": {"1": 0.5}, "mean_reward": 0.5,
    "agents": {"planner": {"mean_tokens": 12.0, "truncated": 0.0}, "solver": {"mean_tokens": 20.0, "truncated": 0.25}},
    "transcripts": [{"problem": 0, "observation": "What is 1+1?", "correct": True, "answer": "2",
                     "turns": [{"step": 1, "agent": "planner", "reply": "Add them.", "truncated": False},
                               {"step": 1, "agent": "solver", "reply": "The answer is 2.", "truncated": False}]}],
    "iteration": 2, "without": [],
}


def _cfg(*overrides: str):
    return load_config(None, ["log.tensorboard=false", *overrides])


def _metrics(i: int) -> dict:
    return {"iteration": i, "reward": round(0.1 * i, 6), "planner/entropy": round(2.0 - 0.1 * i, 6), "mfu/iteration": 0.01,
            "stopped": False, "note": "text is not a scalar"}


# ------------------------------------------------------------------------------------------------ config

def test_log_config_defaults_and_validation():
    lg = load_config(None).log
    assert (lg.tensorboard, lg.wandb, lg.mlflow, lg.wandb_mode, lg.run_name) == (True, False, False, "", "")
    for mode in ("online", "offline", "disabled", ""):
        assert load_config(None, [f"log.wandb_mode={mode}"]).log.wandb_mode == mode
    with pytest.raises(UserError, match=r"^config: log.wandb_mode must be online, offline, disabled or empty .*got 'ofline'$") as e:
        load_config(None, ["log.wandb_mode=ofline"])
    assert f"`marft: error: {e.value}`" in ERRORS_MD.read_text()
    with pytest.raises(UserError, match="log.wandb_project is empty") as e:
        load_config(None, ["log.wandb=true", "log.wandb_project="])
    assert f"`marft: error: {e.value}`" in ERRORS_MD.read_text()
    with pytest.raises(UserError, match="log.mlflow_experiment is empty"):
        load_config(None, ["log.mlflow=true", "log.mlflow_experiment="])
    with pytest.raises(UserError, match="did you mean 'log.wandb'"):
        load_config(None, ["log.wandbb=true"])


def test_helpers():
    assert mlflow_key("planner/entropy") == "planner/entropy"
    assert mlflow_key("eval/final_without_planner/ci95_low") == "eval/final_without_planner/ci95_low"
    assert mlflow_key("a:b*c") == "a_b_c"
    assert mlflow_key("/x//y/") == "x/y"
    assert mlflow_key("a/../b") == "a/_/b"
    assert mlflow_key("é") == "_" and mlflow_key("") == "_" and len(mlflow_key("k" * 400)) == 250
    flat = flatten_config({"train": {"lr": 5e-5}, "team": {"agents": [{"name": "p"}], "graph": "chain", "max_new_tokens": {}},
                           "model": {"lora": {"target_modules": ["q_proj", "v_proj"]}}})
    assert flat == {"train.lr": "5e-05", "team.agents.0.name": "p", "team.graph": "chain", "team.max_new_tokens": "{}",
                    "model.lora.target_modules": "['q_proj', 'v_proj']"}
    s = eval_scalars("final", RESULT)
    assert s == {"eval/final/accuracy": 0.5, "eval/final/ci95_low": 0.25, "eval/final/ci95_high": 0.75,
                 "eval/final/extraction_rate": 0.75, "eval/accuracy": 0.5}
    ablation = eval_scalars("final_without_planner", {**RESULT, "without": ["planner"]})
    assert "eval/accuracy" not in ablation and "eval/final_without_planner/accuracy" in ablation


# ------------------------------------------------------------------------------------------------ TensorBoard

def _tb_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_tags_and_resume_purge(tmp_path):
    cfg = load_config(None)
    t = Trackers(cfg, tmp_path, None)
    assert t.active == ["log.tensorboard"]
    for i in (1, 2, 3):
        t.log_metrics(_metrics(i), i)
    t.log_eval("final", RESULT, 3)
    t.close()
    t.close()
    got = _tb_scalars(tmp_path / "tensorboard")
    assert {"iteration", "reward", "planner/entropy", "mfu/iteration", "eval/accuracy", "eval/final/accuracy"} <= set(got)
    assert "stopped" not in got and "note" not in got  # bools and text are not scalars
    assert got["reward"] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert got["eval/accuracy"] == [(3, 0.5)]
    # a resumed run is a new process at a later second; in one process within one second the two event
    # files' names differ only in a per-process counter that TensorBoard sorts as text ("...9" after
    # "...10"), which read them in the wrong order once enough writers had been made before this test
    time.sleep(1.01 - time.time() % 1)
    t = Trackers(cfg, tmp_path, 3)  # resumed from the checkpoint of iteration 2: iteration 3 is redone
    t.log_metrics({**_metrics(3), "reward": 0.9}, 3)
    t.close()
    assert _tb_scalars(tmp_path / "tensorboard")["reward"] == [(1, 0.1), (2, 0.2), (3, 0.9)]


# ------------------------------------------------------------------------------------------------ W&B

def _wandb_records(path: Path) -> list:
    """The records of a .wandb file (LevelDB log format: 32 KiB blocks of CRC32, length, type chunks,
    after a 7-byte ':W&B' header), parsed as wandb's Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:  # padding up to the end of the block
            pos += (block - pos % block) % block
            continue
        buf += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _finished_records(path: Path, timeout_s: float = 30.0) -> list:
    """The records of a finished run's .wandb file. wandb-core writes the file in its own process
    and may still be writing it when run.finish() returns: wait for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = _wandb_records(path)
        except Exception:  # a record half written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _wandb_run(run_dir: Path, run_id: str) -> tuple[list, dict, dict[str, dict[int, object]]]:
    """(run records, config, {key: {step: value}}) of every offline W&B folder of ``run_id``."""
    runs, config, history = [], {}, {}
    for f in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")):
        for rec in _finished_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                runs.append(rec.run)
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)
                    history.setdefault(key, {})[rec.history.step.num] = json.loads(item.value_json)
    return runs, config, history


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for var, sub in [("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_CACHE_DIR", "wandb_cache"),
                     ("WANDB_DATA_DIR", "wandb_data")]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    for var in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY"):
        monkeypatch.delenv(var, raising=False)
    pytest.importorskip("wandb")


def test_wandb_offline_scalars_config_tables_and_resume(tmp_path, wandb_env):
    run_dir = tmp_path / "runs" / "duo"
    cfg = _cfg("log.wandb=true", "log.wandb_mode=offline", "train.lr=3e-4")
    t = Trackers(cfg, run_dir, None)
    assert t.active == ["log.wandb"]
    for i in (1, 2):
        t.log_metrics(_metrics(i), i)
    t.log_eval("final", RESULT, 2)
    t.close()
    t.close()
    run_id = (run_dir / "wandb_id").read_text().strip()
    assert len(run_id) == 8
    runs, config, history = _wandb_run(run_dir, run_id)
    assert [(r.run_id, r.display_name, r.project) for r in runs] == [(run_id, "duo", "marft")]
    assert config["train"]["lr"] == 3e-4 and config["team"]["agents"][0]["name"] == "planner"
    assert history["reward"] == {1: 0.1, 2: 0.2}
    assert history["planner/entropy"] == {1: 1.9, 2: 1.8} and history["mfu/iteration"] == {1: 0.01, 2: 0.01}
    assert "stopped" not in history and "note" not in history
    assert history["eval/accuracy"] == {2: 0.5} and history["eval/final/ci95_high"] == {2: 0.75}
    assert history["eval/final/extraction_rate"] == {2: 0.75}
    assert history["eval/final/transcripts/_type"] == {2: "table-file"}
    (table_file,) = run_dir.glob("wandb/offline-run-*/files/media/table/eval/final/transcripts_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["problem", "observation", "answer", "correct", "replies"]
    assert table["data"] == [[0, "What is 1+1?", "2", True, "[1] planner: Add them.\n\n[1] solver: The answer is 2."]]
    (agents_file,) = run_dir.glob("wandb/offline-run-*/files/media/table/eval/final/agents_*.table.json")
    assert json.loads(agents_file.read_text())["data"] == [["planner", 12.0, 0.0], ["solver", 20.0, 0.25]]

    t = Trackers(cfg, run_dir, 3)  # resumed: the same W&B run
    t.log_metrics(_metrics(3), 3)
    t.close()
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    runs, _, history = _wandb_run(run_dir, run_id)
    assert [r.run_id for r in runs] == [run_id, run_id]
    assert history["reward"] == {1: 0.1, 2: 0.2, 3: 0.3}

    t = Trackers(_cfg("log.wandb=true", "log.wandb_mode=offline", "log.run_name=again"), run_dir, None)  # a new run
    t.close()
    assert (run_dir / "wandb_id").read_text().strip() != run_id


# ------------------------------------------------------------------------------------------------ MLflow

def test_mlflow_sqlite_metrics_params_artifacts_and_resume(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # the default artifact root, ./mlruns, lands here
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    over = ["log.mlflow=true", f"log.mlflow_tracking_uri={uri}", "log.mlflow_experiment=exp1", "log.run_name=first"]
    run_dir = tmp_path / "run"
    t = Trackers(_cfg(*over, "train.lr=3e-4"), run_dir, None)
    for i in (1, 2):
        t.log_metrics({**_metrics(i), "odd:key*": 7.0}, i)
    t.log_eval("final", RESULT, 2)
    t.close()
    t.close()
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp1"

    def history(key):
        return [(m.step, round(m.value, 6)) for m in client.get_metric_history(run_id, key)]

    assert history("reward") == [(1, 0.1), (2, 0.2)]
    assert history("planner/entropy") == [(1, 1.9), (2, 1.8)]
    assert history("odd_key_") == [(1, 7.0), (2, 7.0)]
    assert history("eval/accuracy") == [(2, 0.5)] and history("eval/final/ci95_low") == [(2, 0.25)]
    assert history("stopped") == [] and history("note") == []
    params = run.data.params
    assert params["train.lr"] == "0.0003" and params["team.agents.0.name"] == "planner"
    assert params["log.mlflow_tracking_uri"] == uri and params["train.iterations"] == "40"
    assert all(len(v) <= 500 for v in params.values())
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", "eval_final.json"}
    saved = json.loads(Path(client.download_artifacts(run_id, "eval_final.json", str(tmp_path / "dl"))).read_text())
    assert saved == RESULT

    t = Trackers(_cfg(*over, "train.lr=3e-4", "train.iterations=80"), run_dir, 3)  # resumed, one override changed
    t.log_metrics(_metrics(3), 3)
    t.close()
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert history("reward") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert client.get_run(run_id).data.params["train.iterations"] == "40"  # MLflow params cannot change
    import yaml
    resumed = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "dl2"))).read_text())
    assert resumed["train"]["iterations"] == 80

    t = Trackers(_cfg(*over), run_dir, None)  # a new run in the same folder: a new MLflow run
    t.close()
    assert (run_dir / "mlflow_run_id").read_text().strip() != run_id


def test_mlflow_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 refuses file: stores without it
    uri = (tmp_path / "mlruns").as_uri()
    t = Trackers(_cfg("log.mlflow=true", f"log.mlflow_tracking_uri={uri}"), tmp_path / "run", None)
    t.log_metrics(_metrics(1), 1)
    t.close()
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    client = MlflowClient(uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward")] == [(1, 0.1)]
    assert client.get_run(run_id).info.run_name == "run"


# ------------------------------------------------------------------------------------------------ failures

@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_missing_package_is_one_line(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # import wandb / import mlflow raises ImportError
    with pytest.raises(UserError) as e:
        Trackers(load_config(None, [f"log.{package}=true"]), tmp_path, None)
    assert str(e.value) == f'log.{package}: true needs the {package} package; pip install "marft[{package}]"'
    if package == "wandb":  # docs/errors.md shows this row (and says mlflow's is alike)
        assert f"`marft: error: {e.value}`" in ERRORS_MD.read_text()


class _Flaky:
    name = "log.flaky"

    def __init__(self):
        self.calls, self.closed = 0, 0

    def metrics(self, scalars, step):
        self.calls += 1
        raise ConnectionError("network down\nsecond line")

    def evaluation(self, tag, result, scalars, step):
        raise AssertionError("a disabled tracker is not called again")

    def close(self):
        self.closed += 1
        raise RuntimeError("already dead")


def test_failing_tracker_warns_once_and_is_disabled(tmp_path, capsys):
    t = Trackers(load_config(None), tmp_path, None)
    flaky = _Flaky()
    t._sinks.append(flaky)
    capsys.readouterr()
    for i in (1, 2, 3):
        t.log_metrics(_metrics(i), i)
    t.log_eval("final", RESULT, 3)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("marft: warning: log.flaky failed (ConnectionError: network down second line)")
    assert "training goes on" in err
    assert flaky.calls == 1 and t.active == ["log.tensorboard"]
    t.close()  # closes the dead one too, swallowing its error
    t.close()
    assert flaky.closed == 1
    assert _tb_scalars(tmp_path / "tensorboard")["reward"] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def test_real_tracker_failing_mid_run(tmp_path, wandb_env, capsys):
    t = Trackers(_cfg("log.wandb=true", "log.wandb_mode=offline"), tmp_path, None)
    sink = t._sinks[0]

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    sink.run.log = broken
    t.log_metrics(_metrics(1), 1)
    t.log_eval("final", RESULT, 1)
    assert t.active == [] and capsys.readouterr().err.count("marft: warning: log.wandb failed (OSError") == 1
    t.close()
