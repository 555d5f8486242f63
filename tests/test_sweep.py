"""``marft sweep``: grids expand to one run each (grids unioned), every run's config is checked
before anything runs, complete runs are skipped, checkpointed ones resumed, failed ones recorded
and retried; and a real two-run sweep on the tiny model, killed while a run holds a checkpoint and run
again, resumes that run from its checkpoint and ends as an uninterrupted sweep does."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from marft.run.checkpoints import latest_checkpoint
from marft.cli import main
from marft.experiments.sweep import load_sweep, run_sweep
from conftest import timeless_lines

ROOT = Path(__file__).resolve().parents[1]


def write(path, text):
    path.write_text(text)
    return path


SWEEP = """
output_dir: {out}
base: {base}
overrides: {{train.iterations: 2}}
grids:
  - team: {{"2": {{team.preset: duo}}, "3": {{team.preset: trio}}}}
    algorithm:
      marft: {{train.algorithm: marft}}
      marft-ps: {{train.algorithm: marft, team.share_adapter: true}}
    seed: [0, 1]
  - team: {{"2-anon": {{team.preset: duo-anon}}}}
    algorithm: {{marft: {{train.algorithm: marft}}}}
    seed: [0, 1]
"""


def test_grids_expand_and_union(tmp_path):
    path = write(tmp_path / "s.yaml", SWEEP.format(out=tmp_path / "out", base=ROOT / "configs/duo_arithmetic.yaml"))
    sweep = load_sweep(path)
    assert len(sweep.runs) == 2 * 2 * 2 + 2
    first = sweep.runs[0]
    assert first.name == "team-2__algorithm-marft__seed-0"
    assert first.labels == {"team": "2", "algorithm": "marft", "seed": "0"}
    assert first.overrides == ["team.preset=duo", "train.algorithm=marft", "seed=0"]
    ps = next(r for r in sweep.runs if r.labels["algorithm"] == "marft-ps")
    assert "team.share_adapter=true" in ps.overrides
    assert sweep.runs[-1].name == "team-2-anon__algorithm-marft__seed-1"
    assert sweep.common == ["train.iterations=2"]


def test_a_value_may_name_the_runs_labels(tmp_path):
    """``${axis}`` in overrides and grid values is the run's label on that axis: each run can start
    from an earlier sweep's run of the same labels."""
    text = """
output_dir: {out}
base: {base}
overrides:
  model.init_adapters:
    planner: duo/algorithm-${{algorithm}}__seed-${{seed}}/adapters/planner
  train.iterations: 2
grid:
  algorithm:
    marft: {{train.algorithm: marft}}
    ps: {{team.share_adapter: true, model.init_adapters: {{team: "duo/algorithm-${{algorithm}}__seed-${{seed}}/team"}}}}
  seed: [0, 3]
"""
    sweep = load_sweep(write(tmp_path / "s.yaml", text.format(out=tmp_path / "out", base=ROOT / "configs/duo_arithmetic.yaml")),
                       missing_ok=True)  # the adapter folders are not there: recorded, not refused
    assert sweep.common == ["train.iterations=2"]
    assert sweep.runs[0].missing == [("model.init_adapters.planner", "duo/algorithm-marft__seed-0/adapters/planner")]
    first, *_, last = sweep.runs
    assert first.overrides == ["model.init_adapters={planner: duo/algorithm-marft__seed-0/adapters/planner}",
                               "train.algorithm=marft", "seed=0"]
    assert last.overrides[-2:] == ["model.init_adapters={team: duo/algorithm-ps__seed-3/team}", "seed=3"]
    from marft.experiments.sweep import _fill
    import yaml
    filled = _fill(["model.init_adapters={a: 'x/${seed}/a'}", "output_note=${seed}"], {"seed": "it's"}, "g")
    assert yaml.safe_load(filled[0].partition("=")[2]) == {"a": "x/it's/a"} and filled[1] == "output_note=it's"
    from marft.run.config import load_config  # the grid's value comes later: it is the one in force
    assert load_config(sweep.base, [*sweep.common, *last.overrides]).model.init_adapters == {"team": "duo/algorithm-ps__seed-3/team"}


@pytest.mark.parametrize("text,message", [
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\ngrid: {seed: [0]}\noverrides: {train.lr: '${sed}'}\n",
     "grids.0: ${sed} names no axis of this grid (its axes: seed)"),
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\ngrid: {rollout.temprature: [1]}\n",
     "sweep run rollout.temprature-1: config: unknown key 'rollout.temprature'"),
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\ngrid: {seed: []}\n", "grids.0.seed is an empty list"),
    ("output_dir: o\nbase: configs/nope.yaml\ngrid: {seed: [0]}\n", "base config configs/nope.yaml not found"),
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\ngird: {seed: [0]}\n", "unknown key(s) gird"),
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\n", "needs grids:"),
])
def test_bad_sweep_files_fail_before_running(tmp_path, monkeypatch, capsys, text, message):
    monkeypatch.chdir(ROOT)
    path = write(tmp_path / "bad.yaml", text)
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not Path(ROOT / "o").exists()


@pytest.mark.parametrize("text,message", [
    ("output_dir:\nbase: configs/duo_arithmetic.yaml\ngrid: {seed: [0]}\n", "output_dir must be a path (a string), got nothing"),
    ("output_dir: [a, b]\nbase: configs/duo_arithmetic.yaml\ngrid: {seed: [0]}\n",
     "output_dir must be a path (a string), got list ['a', 'b']"),
    ("output_dir: o\nbase: [configs/duo_arithmetic.yaml]\ngrid: {seed: [0]}\n",
     "base must be a path (a string), got list ['configs/duo_arithmetic.yaml']"),
    ("output_dir: configs/duo_arithmetic.yaml\nbase: configs/duo_arithmetic.yaml\ngrid: {seed: [0]}\n",
     "output_dir configs/duo_arithmetic.yaml is a file, not a folder; choose another output_dir"),
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\ngrid: {team.agents.0.prompt: ['Say hi!', 'Say hi?']}\n",
     "the values 'Say hi!' and 'Say hi?' of team.agents.0.prompt make the same folder name team.agents.0.prompt-Say_hi_; "
     "name them with distinct labels"),
    ("output_dir: o\nbase: configs/duo_arithmetic.yaml\ngrids: [{seed: {a: {seed: 1}}}, {seed: {a: {seed: 2}}}]\n",
     "run seed-a is defined twice with different overrides (seed=1 and seed=2); give one of them another label"),
])
def test_bad_sweep_paths_and_clashing_names_are_one_line(tmp_path, monkeypatch, capsys, text, message):
    monkeypatch.chdir(ROOT)
    path = write(tmp_path / "bad.yaml", text)
    before = (ROOT / "configs/duo_arithmetic.yaml").read_bytes()
    for args in (["sweep", str(path), "--dry-run"], ["sweep", str(path)]):
        assert main(args) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("marft: error: sweep") and message in lines[0], lines
    assert not Path(ROOT / "o").exists() and (ROOT / "configs/duo_arithmetic.yaml").read_bytes() == before


def test_long_labels_make_short_folder_names_that_the_dry_run_shows(tmp_path, capsys):
    """A 300-character label would exceed the file system's 255-byte name limit: it is shortened
    to its start and a hash of the whole label, the same every time, and --dry-run lists that name."""
    long_a, long_b = "Say hi! " * 40, "Say hi! " * 39 + "Say ho! "
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{team.agents.0.prompt: ['{}', '{}'], seed: [0]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml", long_a, long_b))
    sweep = load_sweep(path)
    names = [r.name for r in sweep.runs]
    assert len(set(names)) == 2 and all(len(n) < 100 for n in names)
    assert names[0].startswith("team.agents.0.prompt-Say_hi__Say_hi__") and names[0].endswith("__seed-0")
    assert [r.name for r in load_sweep(path).runs] == names  # deterministic
    assert sweep.runs[0].overrides[0] == f"team.agents.0.prompt={long_a}"  # the value itself is whole
    assert main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert all(f"{n}  [new]" in out for n in names)
    calls = []
    assert run_sweep(sweep, log=lambda m: None, execute=fake_executor(calls)) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == sorted(names)


def test_a_failed_attempt_without_checkpoint_is_kept_aside_when_the_run_starts_again(tmp_path):
    """A run that failed before its first checkpoint starts afresh on the next sweep (marft train
    refuses a folder holding an earlier run's files): its files go to earlier_attempt_1/, not lost."""
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    folder = tmp_path / "out" / "seed-0"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / "metrics.jsonl").write_text('{"iteration": 1}\n')
    (folder / "log.txt").write_text("the first attempt's log\n")
    logs, calls = [], []
    assert run_sweep(load_sweep(path), log=logs.append, execute=fake_executor(calls)) == 0
    assert calls == [("seed-0", False)]
    aside = folder / "earlier_attempt_1"
    assert (aside / "metrics.jsonl").read_text() == '{"iteration": 1}\n' and (aside / "config.yaml").read_text() == "seed: 0\n"
    assert not (folder / "metrics.jsonl").exists() and "the first attempt's log" in (folder / "log.txt").read_text()
    assert any(f"its files are kept in {aside}" in m for m in logs)


def fake_executor(calls, fail=(), delay=0.0):
    """Stands in for ``marft train``: a new run gets a checkpoint then eval_final.json; runs named
    in ``fail`` exit 1 after writing their checkpoint. Each takes ``delay`` seconds."""
    def execute(cmd, log_path):
        time.sleep(delay)
        folder = Path(cmd[cmd.index("--resume") + 1]) if "--resume" in cmd else \
            Path(next(a for a in cmd if a.startswith("output_dir=")).split("=", 1)[1])
        calls.append((folder.name, "--resume" in cmd))
        (folder / "checkpoints" / "iter_000001").mkdir(parents=True, exist_ok=True)
        (folder / "checkpoints" / "latest").write_text("iter_000001")
        if folder.name in fail:
            return 1
        (folder / "eval_final.json").write_text("{}")
        return 0
    return execute


def test_complete_runs_are_skipped_checkpointed_ones_resumed_failed_ones_retried(tmp_path):
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0, 1, 2]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    sweep = load_sweep(path)
    calls = []
    assert run_sweep(sweep, log=lambda m: None, execute=fake_executor(calls, fail={"seed-1"}, delay=0.2)) == 1
    assert calls == [("seed-0", False), ("seed-1", False), ("seed-2", False)]
    plan = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["status"] for r in plan["runs"]] == ["complete", "failed (exit 1)", "complete"]
    assert json.loads((tmp_path / "out" / "seed-1" / "sweep_run.json").read_text())["labels"] == {"seed": "1"}
    first = [r["seconds"] for r in plan["runs"]]
    # run again: only the failed run goes, and it resumes from its checkpoint
    calls.clear()
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor(calls, delay=0.2)) == 0
    assert calls == [("seed-1", True)]
    plan = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["status"] for r in plan["runs"]] == ["complete"] * 3
    # each run's wall time is kept across sweeps and summed over its attempts (two for seed-1)
    seconds = [r["seconds"] for r in plan["runs"]]
    assert min(first) >= 0.2 and seconds[0] == first[0] and seconds[2] == first[2]
    assert seconds[1] >= first[1] + 0.2
    assert json.loads((tmp_path / "out" / "seed-1" / "sweep_run.json").read_text())["seconds"] == seconds[1]
    calls.clear()
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor(calls)) == 0
    assert calls == []


def test_a_run_stopped_after_its_final_evaluation_is_not_complete(tmp_path):
    """eval_final.json comes before the ablations' evaluations: a run that wrote it and then failed
    (or was killed) is resumed by the next sweep, not counted complete."""
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0, 1]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    calls = []
    plain = fake_executor(calls)

    def ablation_fails(cmd, log_path):
        plain(cmd, log_path)
        return 1 if any(a.endswith("seed-1") for a in cmd) else 0
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=ablation_fails) == 1
    assert (tmp_path / "out" / "seed-1" / "eval_final.json").is_file()
    calls.clear()
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor(calls)) == 0
    assert calls == [("seed-1", True)]


def test_runs_made_with_other_overrides_are_named(tmp_path):
    """A sweep file whose overrides changed after some runs were made: those runs are kept as made,
    and the sweep says which, and what changed, instead of pooling them without a word."""
    text = "output_dir: {}\nbase: {}\noverrides: {{train.iterations: {}}}\ngrid: {{seed: [0, 1]}}\n"
    path = write(tmp_path / "s.yaml", text.format(tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml", 2))
    calls, logs = [], []
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor(calls)) == 0
    write(path, text.format(tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml", 3))
    calls.clear()
    assert run_sweep(load_sweep(path), log=logs.append, execute=fake_executor(calls)) == 0
    assert calls == []
    warning = next(m for m in logs if m.startswith("warning:"))
    assert "2 run(s) were made with other overrides" in warning
    assert "seed-0 (train.iterations=2 -> train.iterations=3)" in warning and "seed-1" in warning


def test_a_second_sweep_into_the_same_output_dir_is_one_line(tmp_path):
    """While one sweep runs in an output_dir (it holds the folder's lock), another is refused before
    it writes anything; once the first has ended, the folder is free."""
    import fcntl
    from marft.errors import UserError

    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    (tmp_path / "out").mkdir()
    with open(tmp_path / "out" / ".sweep.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first sweep, running
        with pytest.raises(UserError, match="another marft sweep is running in .*out; let it finish, or stop it"):
            run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor([]))
        assert not (tmp_path / "out" / "sweep.json").exists()
    calls = []
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor(calls)) == 0
    assert calls == [("seed-0", False)]


def test_a_run_still_being_trained_is_left_alone(tmp_path):
    """A sweep killed with SIGKILL leaves its runs training; the next sweep finds such a run's folder
    locked by its process: it neither starts it again nor moves its files aside, says so, and runs
    the others. Once that process has ended, the run is the sweep's again."""
    from marft.run.folder import RunFolder

    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0, 1]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    orphan = RunFolder(tmp_path / "out" / "seed-0")
    orphan.hold()
    (orphan.path / "config.yaml").write_text("seed: 0\n")  # its first files, no checkpoint yet
    calls, logs = [], []
    try:
        assert run_sweep(load_sweep(path), log=logs.append, execute=fake_executor(calls)) == 1
    finally:
        orphan.release()
    assert calls == [("seed-1", False)]
    assert (orphan.path / "config.yaml").read_text() == "seed: 0\n" and not (orphan.path / "earlier_attempt_1").exists()
    assert any(m.startswith(f"seed-0 is still being trained by process {os.getpid()}") and "left alone" in m for m in logs)
    assert "failed: seed-0" in logs[-1]
    plan = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["status"] for r in plan["runs"]] == ["failed (still training)", "complete"]
    calls = []
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor(calls)) == 0
    assert calls == [("seed-0", False)] and (orphan.path / "earlier_attempt_1" / "config.yaml").is_file()


def test_stop_file_lets_runs_in_progress_finish_and_starts_no_new_one(tmp_path):
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\nparallel: 2\ngrid: {{seed: [0, 1, 2, 3, 4]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "STOP").write_text("")  # left from an earlier sweep: removed, does not stop this one
    calls, logs = [], []
    base, both_running = fake_executor(calls, delay=0.3), threading.Barrier(2, timeout=10)

    def execute(cmd, log_path):
        if "seed-0" in str(log_path) or "seed-1" in str(log_path):
            both_running.wait()
        if "seed-0" in str(log_path):  # the user asks to stop while seeds 0 and 1 are running
            (tmp_path / "out" / "STOP").write_text("")
        return base(cmd, log_path)

    assert run_sweep(load_sweep(path), log=logs.append, execute=execute) == 1
    assert sorted(calls) == [("seed-0", False), ("seed-1", False)]  # both finished, nothing new started
    plan = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [r["status"] for r in plan["runs"]] == ["complete", "complete", "pending", "pending", "pending"]
    assert "3 not started: run the sweep again to continue" in logs[-1] and "stopped by" in logs[-1]
    assert not (tmp_path / "out" / "seed-2").exists()
    # run again: the STOP is cleared and the rest runs
    calls.clear()
    assert run_sweep(load_sweep(path), log=logs.append, execute=fake_executor(calls)) == 0
    assert sorted(calls) == [("seed-2", False), ("seed-3", False), ("seed-4", False)]
    assert not (tmp_path / "out" / "STOP").exists() and logs[-1].startswith("sweep finished: 5 of 5")


def test_parallel_runs_each_get_their_share_of_threads(tmp_path):
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\nparallel: 2\nthreads: 0\ngrid: {{seed: [0, 1, 2, 3]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    seen = []

    def execute(cmd, log_path):
        seen.append(next(a for a in cmd if a.startswith("threads=")))
        return fake_executor([])(cmd, log_path)

    assert run_sweep(load_sweep(path), log=lambda m: None, execute=execute) == 0
    assert seen == [f"threads={max(1, (os.cpu_count() or 1) // 2)}"] * 4


REAL_SWEEP = """
output_dir: {out}
base: {base}
parallel: {parallel}
threads: 1
overrides:
  model.name: {model}
  model.dtype: float32
  model.device: cpu
  task.kind: custom
  task.env: {env}:Vowel
  task.options: {{}}
  rollout.max_new_tokens: 3
  rollout.episodes: 8
  eval.problems: 2
  train.minibatch_size: 4
  train.iterations: 3
  train.save_every: 1
grid:
  algorithm: {{marft: {{train.algorithm: marft}}, grpo: {{train.algorithm: grpo}}}}
"""


comparable = timeless_lines  # a run's metrics.jsonl without its times, speeds and memory


@pytest.mark.slow  # over 15 s on 2 cores; kept out of the default suite (15 minutes), run with -m slow
def test_real_sweep_killed_while_a_run_holds_a_checkpoint_resumes_that_run(tiny_model_dir, vowel_env_path, tmp_path):
    """A real two-run sweep, SIGKILLed (the sweep and its run) while its first run holds a checkpoint
    of iteration 1 of 3, and run again: that run continues from its checkpoint (the log says so, and
    its metrics.jsonl keeps the iteration done before the kill, wall times and all), the other starts,
    and the finished sweep equals an uninterrupted one (two runs at a time: each is its own process
    with one thread), metrics, weights and evaluation. A third time, nothing runs."""
    write_sweep = lambda name, parallel: write(tmp_path / f"{name}.yaml", REAL_SWEEP.format(  # noqa: E731
        out=tmp_path / name, base=ROOT / "configs/duo_arithmetic.yaml", parallel=parallel, model=tiny_model_dir, env=vowel_env_path))
    envvars = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    sweep = lambda path: subprocess.run([sys.executable, "-m", "marft.cli", "sweep", str(path)], cwd=ROOT, env=envvars,  # noqa: E731
                                        capture_output=True, text=True, timeout=600)
    r = sweep(write_sweep("straight", 2))
    assert r.returncode == 0, r.stderr[-2000:]

    path, out = write_sweep("out", 1), tmp_path / "out"
    first = out / "algorithm-marft"
    proc = subprocess.Popen([sys.executable, "-m", "marft.cli", "sweep", str(path)], cwd=ROOT, env=envvars,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while latest_checkpoint(first) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the sweep ended before its first run wrote a checkpoint"
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the run it had started
    assert proc.wait() == -signal.SIGKILL
    assert latest_checkpoint(first).name == "iter_000001" and not (first / "eval_final.json").exists()
    before = (first / "metrics.jsonl").read_text().splitlines()
    assert len(before) == 1  # iteration 1 of 3 done, with its wall times
    assert not (out / "algorithm-grpo" / "checkpoints").exists()

    r = sweep(path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 runs, 0 complete, 2 to run" in r.stderr
    assert "resuming algorithm-marft" in r.stderr and "starting algorithm-grpo" in r.stderr
    assert f"resumed {first} at iteration 1 from iter_000001" in (first / "log.txt").read_text()
    assert (first / "metrics.jsonl").read_text().splitlines()[0] == before[0]  # kept, not run again
    for run in ("algorithm-marft", "algorithm-grpo"):
        a, b = tmp_path / "straight" / run, out / run
        assert comparable(a / "metrics.jsonl") == comparable(b / "metrics.jsonl"), run
        ca, cb = latest_checkpoint(a), latest_checkpoint(b)
        assert ca.name == cb.name == "iter_000003"
        weights = sorted(ca.rglob("*.safetensors"))
        assert weights and all(f.read_bytes() == (cb / f.relative_to(ca)).read_bytes() for f in weights), run
        ev = lambda d: json.loads((d / "eval_final.json").read_text())["per_problem_success"]  # noqa: E731
        assert ev(a) == ev(b), run

    done = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "sweep.json"}
    r = sweep(path)
    assert r.returncode == 0 and "2 runs, 2 complete, 0 to run" in r.stderr, r.stderr[-2000:]
    assert done == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != "sweep.json"}
    assert main(["report", str(out)]) == 0
    report = json.loads((out / "report" / "report.json").read_text())
    assert sorted(g["labels"]["algorithm"] for g in report["groups"]) == ["grpo", "marft"]
    assert all(g["runs_complete"] == 1 for g in report["groups"])


def test_missing_sweep_file_and_dry_run(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "nope.yaml")]) == 2
    assert "sweep file" in capsys.readouterr().err
    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0, 1]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    assert main(["sweep", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "seed-0  [new]  seed=0" in out and "2 runs in" in out
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_command_line_overrides_parallel_and_threads(tmp_path, monkeypatch):
    import marft.experiments.sweep as sweep_module

    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\nparallel: 4\ngrid: {{seed: [0]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    got = {}
    monkeypatch.setattr(sweep_module, "run_sweep", lambda sweep, log: got.update(p=sweep.parallel, t=sweep.threads) or 0)
    assert main(["sweep", str(path), "--parallel", "1", "--threads", "1"]) == 0
    assert got == {"p": 1, "t": 1}


def test_a_sigterm_to_the_sweep_reaches_its_runs(tmp_path):
    """The sweep's SIGTERM handler passes the signal on to the runs going (each stops with a
    checkpoint, exit 130, as marft train does) and lets no new run start."""
    import sys
    import threading
    import time

    from marft.experiments import sweep as sw

    script = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(130)); print('up', flush=True); time.sleep(60)"
    got = {}
    t = threading.Thread(target=lambda: got.update(rc=sw._execute([sys.executable, "-c", script], tmp_path / "log.txt")))
    t.start()
    for _ in range(600):  # the run's handler is set (a loaded machine can take seconds to start Python)
        if sw._RUNNING and "up" in (tmp_path / "log.txt").read_text():
            break
        time.sleep(0.1)
    try:
        sw.stop_runs()
        t.join(20)
        assert got.get("rc") == 130 and not sw._RUNNING
        assert sw._STOPPING.is_set()
    finally:
        sw._STOPPING.clear()


def test_a_runs_log_names_the_interpreter_relative_to_the_working_folder(tmp_path, monkeypatch):
    """A committed log.txt must not name the folder of the machine it ran on: an interpreter inside
    the working folder (the project's venv) is written relative to it, one outside it in full."""
    import sys
    from pathlib import Path

    from marft.experiments import sweep as sw

    here = Path(sys.executable).parent.parent.parent  # the folder holding the venv
    monkeypatch.chdir(here)
    assert sw._execute([sys.executable, "-c", "print('ran')"], tmp_path / "log.txt") == 0
    text = (tmp_path / "log.txt").read_text()
    assert f"$ {Path(sys.executable).relative_to(here)} -c print('ran')\n" in text and "ran\n" in text
    assert str(here) + "/" not in text
    monkeypatch.chdir(tmp_path)  # the interpreter now lies outside: named in full
    assert sw._execute([sys.executable, "-c", "pass"], tmp_path / "log2.txt") == 0
    assert f"$ {sys.executable} -c pass" in (tmp_path / "log2.txt").read_text()


def test_a_sweep_that_cannot_write_its_records_is_one_line(tmp_path):
    """The disk full (here raised where the run's attempt writes) ends the sweep with one line saying
    what to do, not a traceback."""
    from marft.errors import UserError

    path = write(tmp_path / "s.yaml", "output_dir: {}\nbase: {}\ngrid: {{seed: [0]}}\n".format(
        tmp_path / "out", ROOT / "configs/duo_arithmetic.yaml"))
    sweep = load_sweep(path)

    def disk_full(cmd, log_path):
        raise OSError(28, "No space left on device")
    with pytest.raises(UserError, match=r"sweep: cannot write in .*out \(No space left on device\); make room"):
        run_sweep(sweep, log=lambda m: None, execute=disk_full)


def test_output_dir_on_the_command_line_sends_the_runs_there(tmp_path, monkeypatch, capsys):
    """--output-dir DIR (relative to the current folder) replaces the file's output_dir: a sweep whose
    file's folder holds complete runs (a shipped sweep's committed results) runs them afresh in DIR,
    its lock, STOP, sweep.json and run folders there, the file's folder untouched; --dry-run lists the
    states in DIR."""
    import fcntl

    import marft.experiments.sweep as sweep_module

    monkeypatch.chdir(tmp_path)
    text = "output_dir: {}\nbase: {}\ngrid: {{seed: [0, 1]}}\n".format(tmp_path / "results", ROOT / "configs/duo_arithmetic.yaml")
    path = write(tmp_path / "s.yaml", text)
    assert run_sweep(load_sweep(path), log=lambda m: None, execute=fake_executor([])) == 0  # the committed results
    calls = []
    monkeypatch.setattr(sweep_module, "_execute", fake_executor(calls))
    assert main(["sweep", str(path)]) == 0 and calls == []  # all complete: nothing runs
    capsys.readouterr()
    committed = {p: p.stat().st_mtime_ns for p in (tmp_path / "results").rglob("*")}

    assert main(["sweep", str(path), "--output-dir", "runs/again", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "seed-0  [new]" in out and "seed-1  [new]" in out and "2 runs in runs/again;" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing

    (tmp_path / "runs" / "again").mkdir(parents=True)
    (tmp_path / "runs" / "again" / "STOP").write_text("")  # left from an earlier sweep there: removed
    assert main(["sweep", str(path), "--output-dir", "runs/again"]) == 0
    assert calls == [("seed-0", False), ("seed-1", False)]
    again = tmp_path / "runs" / "again"
    assert all((again / f"seed-{s}" / "eval_final.json").is_file() for s in (0, 1))
    assert (again / ".sweep.lock").exists() and not (again / "STOP").exists()
    plan = json.loads((again / "sweep.json").read_text())
    assert [r["folder"] for r in plan["runs"]] == ["seed-0", "seed-1"] and {r["status"] for r in plan["runs"]} == {"complete"}
    err = capsys.readouterr().err
    assert "removed runs/again/STOP" in err and "in runs/again" in err and "Report: marft report runs/again" in err
    assert committed == {p: p.stat().st_mtime_ns for p in (tmp_path / "results").rglob("*")}

    assert main(["sweep", str(path), "--output-dir", "runs/again", "--dry-run"]) == 0
    assert "seed-0  [complete]" in capsys.readouterr().out

    # the STOP file and the lock are those of DIR, not of the file's output_dir
    calls.clear()
    stop = lambda cmd, log_path: (again.parent / "third" / "STOP").write_text("") or fake_executor(calls)(cmd, log_path)  # noqa: E731
    monkeypatch.setattr(sweep_module, "_execute", stop)
    assert main(["sweep", str(path), "--output-dir", str(again.parent / "third")]) == 1
    assert calls == [("seed-0", False)] and f"stopped by {again.parent / 'third' / 'STOP'}" in capsys.readouterr().err
    with open(again / ".sweep.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["sweep", str(path), "--output-dir", "runs/again"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "another marft sweep is running in runs/again;" in lines[0]
        assert main(["sweep", str(path)]) == 0  # the file's output_dir is another folder: not locked


@pytest.mark.parametrize("args,message", [
    (["--output-dir", "s.yaml"], "sweep: --output-dir s.yaml is a file, not a folder; choose another --output-dir"),
    (["--output-dir", ""], "sweep: --output-dir must be a folder, got nothing"),
    (["--output-dir"], "argument --output-dir: expected one argument"),
])
def test_a_bad_output_dir_is_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "s.yaml", "output_dir: out\nbase: {}\ngrid: {{seed: [0]}}\n".format(ROOT / "configs/duo_arithmetic.yaml"))
    for dry in ([], ["--dry-run"]):
        assert main(["sweep", str(path), *args, *dry]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


def test_a_run_whose_init_adapters_are_not_there_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A run to be started afresh from an earlier sweep's adapters that are not there (run
    checkpoints are not committed) is one line naming the run and the folder, before any run starts;
    complete runs, and runs with a checkpoint to resume (they read none), are not checked. --dry-run
    marks every such run on its line, then says the same line."""
    import marft.experiments.sweep as sweep_module

    monkeypatch.chdir(tmp_path)
    text = ("output_dir: out\nbase: {}\noverrides:\n  model.init_adapters: {{planner: 'duo/seed-${{seed}}/planner'}}\n"
            "grid: {{seed: [0, 1, 2, 3]}}\n").format(ROOT / "configs/duo_arithmetic.yaml")
    path = write(tmp_path / "s.yaml", text)
    (tmp_path / "duo" / "seed-0" / "planner").mkdir(parents=True)  # seeds 1-3: not made
    (tmp_path / "out" / "seed-2").mkdir(parents=True)
    (tmp_path / "out" / "seed-2" / "eval_final.json").write_text("{}")  # complete: needs nothing
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    calls = []
    monkeypatch.setattr(sweep_module, "_execute", fake_executor(calls))
    message = ("sweep run seed-1: model.init_adapters.planner names duo/seed-1/planner, a folder that does not exist; "
               "make it first (run the sweep or the training that saves it) or point model.init_adapters.planner at a "
               "folder that exists; 1 other run(s) lack theirs too")
    assert main(["sweep", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"marft: error: {message}"]
    assert calls == [] and before == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    assert main(["sweep", str(path), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "seed-0  [new]" in out and "seed-2  [complete]" in out and "4 runs in out;" in out
    assert "seed-1  [new; model.init_adapters.planner duo/seed-1/planner does not exist]" in out
    assert "seed-3  [new; model.init_adapters.planner duo/seed-3/planner does not exist]" in out
    assert err.strip().splitlines() == [f"marft: error: {message}"]
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}

    # in another --output-dir every run is new: seed-2 is checked there too
    assert main(["sweep", str(path), "--output-dir", "fresh", "--dry-run"]) == 2
    assert "seed-2  [new; model.init_adapters.planner duo/seed-2/planner" in capsys.readouterr().out

    # seeds 1 and 3 with a checkpoint resume from it (init_adapters unread): the sweep goes
    for seed in (1, 3):
        (tmp_path / "out" / f"seed-{seed}" / "checkpoints" / "iter_000001").mkdir(parents=True)
        (tmp_path / "out" / f"seed-{seed}" / "checkpoints" / "latest").write_text("iter_000001")
    assert main(["sweep", str(path)]) == 0
    assert calls == [("seed-0", False), ("seed-1", True), ("seed-3", True)]

    # model.init_critic alike: a run started afresh from a critic not there is refused up front
    capsys.readouterr()
    path = write(tmp_path / "c.yaml", text.replace("model.init_adapters: {planner: 'duo/seed-${seed}/planner'}",
                                                   "model.init_critic: 'duo/seed-${seed}'"))
    assert main(["sweep", str(path), "--output-dir", "critic"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "marft: error: sweep run seed-1: model.init_critic names duo/seed-1, a folder that does not exist; make it first "
        "(run the sweep or the training that saves it) or point model.init_critic at a folder that exists; 2 other run(s) "
        "lack theirs too"]
