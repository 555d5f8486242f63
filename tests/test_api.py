"""The Python API (marft/api.py): the Python API guide's example runs, the API and the command line give the
same run, configs from every kind of source agree, callbacks and stop/resume, and the trained team
loaded for inference replies as the team did in its evaluation."""
import json
import shutil
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import marft
from marft.cli import main
from marft.run.checkpoints import latest_checkpoint
from conftest import timeless_lines

ROOT = Path(__file__).parents[1]
CONFIG = str(ROOT / "configs/duo_arithmetic.yaml")


@pytest.fixture
def vowel(tiny_model_dir, vowel_env_path, tmp_path):
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
            "task.kind=custom", f"task.env={vowel_env_path}:Vowel", "task.options={}",
            "rollout.max_new_tokens=4", "rollout.episodes=16", "eval.problems=4", "eval.transcripts=4",
            "rollout.temperature=1.0", "train.lr=1e-2", "train.minibatch_size=16", "train.entropy_coef=0",
            "team.max_new_tokens={}", "train.iterations=2", f"output_dir={tmp_path / 'run'}"]


def comparable(run: Path) -> list[dict]:
    """metrics.jsonl without times, speeds and memory."""
    return timeless_lines(run / "metrics.jsonl")


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return {a: load_file(latest_checkpoint(run) / "adapters" / a / "adapter_model.safetensors") for a in ("planner", "solver")}


def test_the_python_api_guides_example_runs(vowel, tmp_path, monkeypatch, capsys):
    """The first ```python block of the Python API guide (docs/guides/python-api.md), as written, with
    the tiny model and task put in under it (load_config applies them after the example's own settings)."""
    text = (ROOT / "docs" / "guides" / "python-api.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    real = marft.load_config
    tiny = [*vowel, f"output_dir={tmp_path / 'from_python'}"]
    monkeypatch.setattr(marft, "load_config", lambda *a, **kw: real(real(*a, **kw), tiny))
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(compile(code, "docs/guides/python-api.md", "exec"), scope)
    out = capsys.readouterr().out
    result, team, alone = scope["result"], scope["team"], scope["alone"]
    assert result.run_dir == tmp_path / "from_python" and result.final is not None
    assert len(result.metrics) == 2 and result.adapters == latest_checkpoint(result.run_dir) / "adapters"
    assert "untrained" in out and "-> trained" in out
    assert alone["without"] == ["planner"] and alone["problems"] == 4
    assert team.model.active_adapter == "solver"


def test_api_and_command_line_give_the_same_run(vowel, tmp_path):
    cli, api = tmp_path / "cli", tmp_path / "api"
    assert main(["train", CONFIG, *vowel, f"output_dir={cli}"]) == 0
    config = marft.load_config(CONFIG, [*vowel, f"output_dir={api}"])
    with marft.MarftTrainer(config, log=None) as trainer:
        result = trainer.train()
    assert comparable(cli) == comparable(api) and len(comparable(api)) == 2
    for name in ("eval_untrained.json", "eval_final.json"):
        a, b = (json.loads((run / name).read_text()) for run in (cli, api))
        assert a["per_problem_success"] == b["per_problem_success"] and a["transcripts"] == b["transcripts"]
    wa, wb = weights(cli), weights(api)
    assert all(torch.equal(wa[a][k], wb[a][k]) for a in wa for k in wa[a])
    assert result.final["accuracy"] == json.loads((cli / "eval_final.json").read_text())["accuracy"]


def test_configs_from_every_source_agree(tmp_path):
    from marft.envs.rewards import gsm8k

    a = marft.load_config(CONFIG, ["train.lr=1e-3", "model.lora.r=4", "seed=3"])
    b = marft.load_config(CONFIG, {"train.lr": 1e-3, "model.lora.r": 4}, seed=3)
    c = marft.load_config(CONFIG, train={"lr": 1e-3}, model={"lora": {"r": 4}}, seed=3)
    import yaml

    d = marft.load_config(yaml.safe_load(Path(CONFIG).read_text()), train={"lr": 1e-3}, model={"lora": {"r": 4}}, seed=3)
    e = marft.load_config(marft.load_config(CONFIG), train={"lr": 1e-3}, model={"lora": {"r": 4}}, seed=3)
    assert a == b == c == d == e and a.train.lr == 1e-3 and a.model.lora.r == 4 and a.seed == 3
    assert a.team.agents[0].prompt == marft.load_config(CONFIG).team.agents[0].prompt
    # a function or class as itself: its import path is what the config holds
    f = marft.load_config(None, task={"kind": "dataset", "dataset": "x.jsonl", "reward": gsm8k})
    assert f.task.reward == "marft.envs.rewards:gsm8k"
    with pytest.raises(marft.UserError, match="top-level function"):
        marft.load_config(None, task={"kind": "dataset", "dataset": "x.jsonl", "reward": lambda reply, record: 1.0})
    with pytest.raises(marft.UserError, match="unknown key 'train.bogus'"):
        marft.load_config(CONFIG, train={"bogus": 1})


def test_callbacks_stop_and_resume(vowel, tmp_path):
    seen = {"metrics": [], "evals": []}

    class Stopper:
        def on_iteration(self, trainer, metrics):
            seen["metrics"].append(metrics["iteration"])
            if metrics["iteration"] == 1:
                trainer.stop()

        def on_evaluate(self, trainer, tag, result):
            seen["evals"].append((tag, trainer.iteration))

    plain: list = []
    config = marft.load_config(CONFIG, vowel, train={"iterations": 3})
    with marft.MarftTrainer(config, log=None, callbacks=[Stopper(), plain.append]) as trainer:
        first = trainer.train()
    assert first.stopped and first.final is None and seen["metrics"] == [1]
    assert [m["iteration"] for m in plain] == [1] and latest_checkpoint(first.run_dir).name == "iter_000001"
    with pytest.raises(marft.UserError, match="already has checkpoints"):
        marft.MarftTrainer(config, log=None)
    records = json.loads((first.run_dir / "machine.json").read_text())
    (first.run_dir / "machine.json").write_text(json.dumps([{**records[0], "dtype": "bfloat16"}]))
    said: list = []  # the first attempt said it ran in bf16: the resume says the machine changed
    with marft.MarftTrainer.resume(first.run_dir, log=said.append, callbacks=[Stopper()]) as trainer:
        assert trainer.iteration == 1 and trainer.checkpoint.name == "iter_000001"
        with pytest.raises(marft.UserError, match="is held by a MarftTrainer of this process; call its close"):
            marft.MarftTrainer.resume(first.run_dir)  # one trainer trains a folder at a time
        second = trainer.train()
    assert any("another kind of machine" in s and "dtype bfloat16 -> float32" in s for s in said), said
    assert not second.stopped and [m["iteration"] for m in second.metrics] == [1, 2, 3]
    assert seen["evals"] == [("untrained", 0), ("final", 3), ("final_without_planner", 3)]  # the config has eval.ablate
    assert set(second.ablations) == {"planner"}
    machine = json.loads((first.run_dir / "machine.json").read_text())  # one record per attempt
    assert [m["from_iteration"] for m in machine] == [0, 1] and machine[1]["dtype"] == "float32"
    with pytest.raises(marft.UserError, match="cannot change train.algorithm"):
        marft.MarftTrainer.resume(first.run_dir, train={"algorithm": "grpo"})


def test_a_resume_on_another_kind_of_machine_says_so():
    from marft.run.folder import machine_change

    cpu = {"from_iteration": 0, "cpu": "AMD EPYC", "gpu": None, "device": "cpu", "dtype": "float32",
           "torch_threads": 2, "torch": "2.13.0"}
    assert machine_change(None, cpu) is None and machine_change(cpu, {**cpu, "from_iteration": 5}) is None
    assert machine_change(cpu, {**cpu, "torch": "2.14.0"}) is None  # a version alone is recorded, not said
    said = machine_change(cpu, {**cpu, "cpu": "Intel Xeon", "dtype": "bfloat16"})
    assert "cpu AMD EPYC -> Intel Xeon, dtype float32 -> bfloat16" in said and "iteration 0's" in said
    assert "torch_threads 2 -> 1" in machine_change(cpu, {**cpu, "torch_threads": 1})
    gpu = {**cpu, "gpu": "NVIDIA H100", "device": "cuda", "dtype": "bfloat16"}
    assert machine_change(gpu, {**gpu, "torch_threads": 16}) is None  # CPU threads do not move a GPU's sums


def test_trained_team_replies_as_in_its_evaluation(vowel, tmp_path):
    """Loaded for inference (a PeftModel, Hugging Face's generate), the trained team gives the
    replies its greedy evaluation transcripts hold: the adapters and the prompts are the trained ones."""
    from peft import PeftModel

    config = marft.load_config(CONFIG, vowel, eval={"temperature": 0})
    with marft.MarftTrainer(config, log=None) as trainer:
        result = trainer.train()
    team = marft.load_team(result.run_dir)
    assert isinstance(team.model, PeftModel) and set(team.model.peft_config) == {"planner", "solver"}
    saved = weights(result.run_dir)
    from peft import get_peft_model_state_dict

    for adapter in ("planner", "solver"):
        loaded = get_peft_model_state_dict(team.model, adapter_name=adapter)
        assert loaded.keys() == saved[adapter].keys()
        assert all(torch.equal(loaded[k], saved[adapter][k]) for k in loaded)
    transcripts = result.final["transcripts"]
    assert len(transcripts) == 4
    for t in transcripts:
        replies = team.solve(t["observation"].removeprefix("Problem: "))  # the state before the first turn
        assert replies == {turn["agent"]: turn["reply"] for turn in t["turns"]}
    # an adapters folder needs the config it was trained with; a wrong path is one line
    first = "Say a word."
    assert marft.load_team(result.adapters, config).solve(first) == team.solve(first)
    with pytest.raises(marft.UserError, match="not found"):
        marft.load_team(tmp_path / "nothing")
    (tmp_path / "bare" / "adapters").mkdir(parents=True)
    with pytest.raises(marft.UserError, match="pass the config it was trained with"):
        marft.load_team(tmp_path / "bare" / "adapters")
    with pytest.raises(marft.UserError, match="unknown agent"):
        team.reply("critic", "Say a word.")


def test_evaluate_with_adapters_equals_the_runs_final_evaluation(vowel, tmp_path):
    config = marft.load_config(CONFIG, vowel)
    with marft.MarftTrainer(config, log=None) as trainer:
        result = trainer.train()
    again = marft.evaluate(config, adapters=result.run_dir, output=tmp_path / "e" / "eval.json")
    assert again["per_problem_success"] == result.final["per_problem_success"]
    assert again["transcripts"] == result.final["transcripts"]
    assert json.loads((tmp_path / "e" / "eval.json").read_text())["accuracy"] == again["accuracy"]
    # the path the README gives, through the checkpoints/latest pointer file
    latest = marft.evaluate(config, adapters=result.run_dir / "checkpoints" / "latest" / "adapters")
    assert latest["per_problem_success"] == result.final["per_problem_success"]
    untrained = marft.evaluate(config)
    assert untrained["per_problem_success"] == result.untrained["per_problem_success"]


@pytest.mark.slow
def test_quickstart_example_runs_end_to_end(tmp_path):
    """examples/quickstart.py as a script with the embedded model (minutes), in a fresh folder."""
    import subprocess
    import sys

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    proc = subprocess.run([sys.executable, str(ROOT / "examples/quickstart.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    print(out)  # the example's figures, with pytest -s
    assert "untrained: accuracy" in out and "trained: accuracy" in out and "trained solver alone" in out
    assert "[planner]" in out and "[solver]" in out and "PeftModelForCausalLM ['planner', 'solver']" in out
    final = json.loads((tmp_path / "runs/quickstart/eval_final.json").read_text())
    assert final["problems"] == 64 and final["iteration"] == 12


def test_training_run_logs_to_mlflow_and_wandb(vowel, tmp_path, monkeypatch):
    """A real run (marft train's loop) with log.mlflow and log.wandb (offline) on: each tracker
    holds the reward of every iteration of metrics.jsonl and the evaluations."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tmp_path / "tracked"
    assert main(["train", CONFIG, *vowel, f"output_dir={run}", "eval.ablate=false", "log.mlflow=true",
                 f"log.mlflow_tracking_uri={uri}", "log.wandb=true", "log.wandb_mode=offline"]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    client = MlflowClient(uri)
    run_id = (run / "mlflow_run_id").read_text().strip()
    got = [(m.step, m.value) for m in client.get_metric_history(run_id, "reward")]
    assert got == [(m["iteration"], pytest.approx(m["reward"])) for m in lines] and len(got) == 2
    final = json.loads((run / "eval_final.json").read_text())
    acc = [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")]
    assert acc[-1] == (2, pytest.approx(final["accuracy"])) and acc[0][0] == 0  # untrained, then final
    assert client.get_run(run_id).data.params["train.lr"] == "0.01"
    assert len(list(run.glob("wandb/offline-run-*/run-*.wandb"))) == 1


def test_stopped_during_the_untrained_evaluation_resumes(vowel, tmp_path):
    # Ctrl-C while the untrained team is evaluated: a checkpoint of iteration 0, so --resume goes on
    # (before: no checkpoint, and the folder's config.yaml refused a new run there)
    class StopAtOnce:
        def on_evaluate(self, trainer, tag, result):
            if tag == "untrained":
                trainer.stop()

    config = marft.load_config(CONFIG, vowel, train={"iterations": 1}, eval={"ablate": False})
    with marft.MarftTrainer(config, log=None, callbacks=[StopAtOnce()]) as trainer:
        first = trainer.train()
    assert first.stopped and latest_checkpoint(first.run_dir).name == "iter_000000" and first.adapters is not None
    with marft.MarftTrainer.resume(first.run_dir, log=None) as trainer:
        second = trainer.train()
    assert not second.stopped and [m["iteration"] for m in second.metrics] == [1] and second.final is not None


def test_a_trackers_files_alone_do_not_block_a_new_run(vowel, tmp_path):
    # a tracker that failed to start (wandb not logged in) left tensorboard/ behind, nothing else
    from marft.run.folder import check_new_run_dir
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"x")
    (run / "wandb_id").write_text("abc")
    check_new_run_dir(run)  # no error
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(marft.UserError, match="already holds config.yaml of an earlier run"):
        check_new_run_dir(run)


def test_one_process_trains_a_run_folder_at_a_time(tmp_path):
    """The lock a training process holds on its run folder: another RunFolder of the folder (another
    process, or this one) cannot take it, and neither a new run nor a resume starts there; released,
    the folder is free again."""
    from marft.run.folder import RunFolder, check_not_training, training_process
    run = tmp_path / "run"
    assert training_process(run) is None  # no folder yet
    first = RunFolder.new(run)
    first.hold()
    first.hold()  # holding twice is holding once
    assert training_process(run) == os.getpid()
    assert (run / ".marft.lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(marft.UserError, match="run folder .*run is held by a MarftTrainer of this process; call its close"):
        RunFolder(run).hold()
    with pytest.raises(marft.UserError, match="held by a MarftTrainer of this process"):
        RunFolder.new(run)
    with pytest.raises(marft.UserError, match="held by a MarftTrainer of this process"):
        RunFolder.existing(run)  # before its missing checkpoint is reported
    other = subprocess.run([sys.executable, "-c", "import sys; from marft.run.folder import check_not_training as c; "
                            "from marft.errors import UserError\ntry: c(sys.argv[1])\nexcept UserError as e: print(e)", str(run)],
                           capture_output=True, text=True, check=True)  # another process
    assert other.stdout.strip() == (f"run folder {run} is being trained by process {os.getpid()} now; wait for it to end, "
                                    f"or stop it with kill -TERM {os.getpid()} (it saves a checkpoint first), then run this again")
    first.release()
    first.release()
    assert training_process(run) is None
    check_not_training(run)
    second = RunFolder.new(run)  # the lock file alone is no earlier run's file
    second.hold()
    second.release()


def test_adapters_through_checkpoints_latest(vowel, tmp_path):
    from marft.api import adapters_folder
    run = tmp_path / "r"
    ckpt = run / "checkpoints" / "iter_000002"
    (ckpt / "adapters" / "solver").mkdir(parents=True)
    (ckpt / "trainer.pt").write_bytes(b"")
    (ckpt / "config.yaml").write_text("seed: 0\n")
    (run / "checkpoints" / "latest").write_text("iter_000002")
    assert adapters_folder(run / "checkpoints" / "latest") == ckpt / "adapters"
    assert adapters_folder(run / "checkpoints" / "latest" / "adapters") == ckpt / "adapters"
    with pytest.raises(marft.UserError, match="is a file, not a folder"):
        adapters_folder(ckpt / "trainer.pt")
    # model.init_critic reads the critic of the checkpoint the same paths name (one resolver)
    from marft.run.checkpoints import critic_checkpoint
    for source in (run, ckpt, ckpt / "adapters", run / "checkpoints" / "latest", run / "checkpoints" / "latest" / "adapters"):
        assert critic_checkpoint(source) == ckpt, source
    assert critic_checkpoint(tmp_path) is None  # a folder that names no checkpoint's adapters
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(marft.UserError, match="has no complete checkpoint"):
        critic_checkpoint(tmp_path / "empty")


def test_a_resume_makes_the_evaluation_its_checkpoint_was_owed_and_sets_later_ones_aside(vowel, tmp_path):
    """A kill after a checkpoint but before its evaluation (eval_iter_000001 missing), and a later
    evaluation of the killed attempt (eval_iter_000002, of weights no checkpoint holds): the resume
    makes the first and moves the second into earlier_attempt_1/, saying so. Saving the iteration
    latest names again writes nothing (its state is that checkpoint)."""
    class StopAfterOne:
        def on_iteration(self, trainer, metrics):
            trainer.stop()

    config = marft.load_config(CONFIG, vowel, train={"iterations": 3, "eval_every": 1}, eval={"ablate": False})
    with marft.MarftTrainer(config, log=None, callbacks=[StopAfterOne()]) as trainer:
        first = trainer.train()
        saved = trainer.save()  # iteration 1 again: latest names it already
    run = first.run_dir
    assert saved == latest_checkpoint(run) and saved.name == "iter_000001"
    assert not list((run / "checkpoints").glob(".iter_*"))
    (run / "eval_iter_000001.json").unlink()  # killed while evaluating
    (run / "eval_iter_000002.json").write_text('{"accuracy": 0.5}')  # written by an attempt killed later
    said: list = []
    with marft.MarftTrainer.resume(run, log=said.append, callbacks=[StopAfterOne()]) as trainer:
        trainer.train()
    assert json.loads((run / "eval_iter_000001.json").read_text())["iteration"] == 1
    assert json.loads((run / "earlier_attempt_1" / "eval_iter_000002.json").read_text()) == {"accuracy": 0.5}
    assert json.loads((run / "eval_iter_000002.json").read_text())["iteration"] == 2  # its own, made again
    assert any("eval_iter_000002.json: evaluations of weights after the checkpoint (iteration 1), moved into" in s
               for s in said), said
    assert any(s.startswith("eval iter_000001:") for s in said)


def test_an_adapter_named_default_is_refused():
    with pytest.raises(marft.UserError, match="would train an adapter named 'default', the name PEFT keeps"):
        marft.load_config(CONFIG, ["team.agents=[{name: default}, {name: solver}]"])
    marft.load_config(CONFIG, ["team.agents=[{name: default, adapter: first}, {name: solver}]"])  # renamed: fine


def test_a_file_system_without_locks_trains_with_a_warning(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    import marft.errors
    from marft.run.folder import RunFolder

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(marft.errors, "WARNED", set())
    run = RunFolder.new(tmp_path / "run")
    run.hold()  # no error
    assert "its file system has no file locks (Function not implemented)" in capsys.readouterr().err
    run.release()


def test_a_run_killed_before_its_first_checkpoint_resumes_by_starting_again(vowel, tmp_path, capsys):
    """Killed during iteration 1 (config.yaml, machine.json and a metrics line, no checkpoint): a new
    run into the folder says to resume it; --resume starts it again from its own config.yaml, the
    attempt's files kept in earlier_attempt_1/; a finished run kept without weights is not restarted."""
    from marft.cli import main as cli
    from marft.run.config import save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(marft.load_config(CONFIG, vowel, train={"iterations": 1}, eval={"ablate": False, "before": False}),
                run / "config.yaml")
    (run / "machine.json").write_text('[{"from_iteration": 0, "device": "cpu"}]')
    (run / "metrics.jsonl").write_text('{"iteration": 1, "reward": 0.5}\n{"iter')  # cut by the kill
    assert cli(["train", CONFIG, *vowel]) == 2
    assert f"holds a run that ended before its first checkpoint; start it again with marft train --resume {run}" in \
        capsys.readouterr().err
    assert cli(["train", "--resume", str(run)]) == 0
    assert "has no checkpoint (the run ended before its first): starting it again from its config.yaml" in capsys.readouterr().err
    assert (run / "earlier_attempt_1" / "metrics.jsonl").read_text().endswith('{"iter')
    assert latest_checkpoint(run).name == "iter_000001" and (run / "eval_final.json").is_file()
    shutil.rmtree(run / "checkpoints")  # finished, its weights not kept (as results/ holds runs)
    assert cli(["train", "--resume", str(run)]) == 2 and "has no complete checkpoint" in capsys.readouterr().err
