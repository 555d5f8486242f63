"""Killed runs: ``marft train`` killed with SIGKILL during generation, during a policy update, and at
three moments of a checkpoint write (adapters half written, before the rename, before ``latest``
moves), and at random moments of its iterations (each kill timed from the run's progress and the
uninterrupted run's measured speed, and required to hit a run still going), resumes from its last
complete checkpoint and ends with the same metrics, weights and evaluation as a run that was never
interrupted. SIGINT stops after writing a
checkpoint, and so does SIGTERM. Every run here is a separate process on the tiny model with one thread, so that the
runs compared are computed the same way."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marft.run.checkpoints import latest_checkpoint
from conftest import timeless_lines

ROOT = Path(__file__).resolve().parents[1]

# Runs marft with one function wrapped so that the process SIGKILLs itself at a chosen moment of a
# chosen iteration: argv = WHERE ITERATION marft-arguments...
DRIVER = '''
import os, signal, sys
import marft.engines.models as M, marft.engines.hf as R, marft.run.trainer as T, marft.run.checkpoints as C
from marft.cli import main

where, at, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
state = {"it": 0, "calls": 0}
step = T.Trainer.iteration_step

def counted(self):
    state["it"], state["calls"] = self.iteration + 1, 0
    return step(self)

T.Trainer.iteration_step = counted

def kill_at(fn, nth=1, after=False, when=lambda *a, **k: True):
    def wrapped(*a, **k):
        if state["it"] == at and when(*a, **k):
            state["calls"] += 1
            if state["calls"] == nth and not after:
                os.kill(os.getpid(), signal.SIGKILL)
            out = fn(*a, **k)
            if state["calls"] == nth and after:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return fn(*a, **k)
    return wrapped

if where == "generation":  # the second agent's turn of the rollout
    R.generate = kill_at(R.generate, nth=2)
elif where == "update":  # the third minibatch's forward and backward of the update, after an optimiser step
    try:
        from marft.run.learner import AdapterLearner
        AdapterLearner.accumulate = kill_at(AdapterLearner.accumulate, nth=3)
    except ImportError:  # before marft/run/learner.py
        T.Trainer._accumulate = kill_at(T.Trainer._accumulate, nth=3)
elif where == "adapters":  # the checkpoint's adapters are written, trainer.pt is not
    M.TeamModel.save_adapters = kill_at(M.TeamModel.save_adapters, after=True)
elif where == "rename":  # the checkpoint is complete in its temporary folder, not yet renamed
    C._fsync_tree = kill_at(C._fsync_tree, after=True)
elif where == "pointer":  # the checkpoint is renamed, latest still names the previous one
    C.write_atomic = kill_at(C.write_atomic, when=lambda path, text: path.name == "latest")
sys.exit(main(args))
'''

ITERATIONS = 3


@pytest.fixture(scope="module")
def setup(tiny_model_dir, vowel_env_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kill")
    (folder / "driver.py").write_text(DRIVER)
    over = [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "threads=1",
            "task.kind=custom", f"task.env={vowel_env_path}:Vowel", "task.options={}",
            "rollout.max_new_tokens=3", "rollout.episodes=8", "eval.problems=2", "rollout.temperature=1.0",
            "train.lr=1e-2", "train.minibatch_size=4", "train.micro_batch_size=2", "train.save_every=1",
            f"train.iterations={ITERATIONS}"]
    straight = folder / "straight"
    # the uninterrupted run, and how long its iterations take on this machine now (when each checkpoint appeared)
    log = folder / "straight.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "marft.cli", "train", "configs/duo_arithmetic.yaml", *over,
                                 f"output_dir={straight}"], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=err)
    seen = {}
    while proc.poll() is None:
        for k in range(1, ITERATIONS + 1):
            if k not in seen and (straight / "checkpoints" / f"iter_{k:06d}").is_dir():
                seen[k] = time.monotonic()
        time.sleep(0.005)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert sorted(seen) == list(range(1, ITERATIONS + 1))
    iteration_s = min(seen[k + 1] - seen[k] for k in range(1, ITERATIONS))
    return folder, over, straight, iteration_s


def env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def marft(*args, driver=None, kill=None):
    cmd = [sys.executable, str(driver), *kill, *args] if driver else [sys.executable, "-m", "marft.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)


comparable = timeless_lines  # a run's metrics.jsonl without times, speeds and memory


def assert_same_run(a: Path, b: Path):
    assert comparable(a / "metrics.jsonl") == comparable(b / "metrics.jsonl")
    ca, cb = latest_checkpoint(a), latest_checkpoint(b)
    assert ca.name == cb.name == f"iter_{ITERATIONS:06d}"
    for f in sorted(ca.rglob("*.safetensors")):
        assert f.read_bytes() == (cb / f.relative_to(ca)).read_bytes(), f
    ev = lambda run: json.loads((run / "eval_final.json").read_text())["per_problem_success"]  # noqa: E731
    assert ev(a) == ev(b)
    assert not list((b / "checkpoints").glob(".*"))  # no temporary folders left behind


@pytest.mark.parametrize("where,at,resumes_from", [
    ("generation", 2, 1), ("update", 2, 1), ("adapters", 2, 1), ("rename", 2, 1), ("pointer", 2, 1),
    ("generation", 1, None),  # before the first checkpoint: --resume starts it again, the attempt's files set aside
])
def test_killed_run_resumes_to_the_same_result(setup, where, at, resumes_from):
    folder, over, straight, _ = setup
    run = folder / f"killed_{where}_{at}"
    r = marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}", driver=folder / "driver.py", kill=[where, str(at)])
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    last = latest_checkpoint(run)
    if resumes_from is None:
        assert last is None
        r = marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}")  # a new run overwrites nothing
        assert r.returncode == 2 and f"holds a run that ended before its first checkpoint; start it again with marft " \
            f"train --resume {run}" in r.stderr, r.stderr[-2000:]
        r = marft("train", "--resume", str(run))
        assert "has no checkpoint (the run ended before its first): starting it again" in r.stderr, r.stderr[-2000:]
        assert (run / "earlier_attempt_1" / "config.yaml").is_file()
    else:
        assert last.name == f"iter_{resumes_from:06d}"
        r = marft("train", "--resume", str(run))
        assert f"resumed {run} at iteration {resumes_from}" in r.stderr
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(straight, run)


def test_killed_at_random_moments_resumes_to_the_same_result(setup):
    """Three SIGKILLs, each at a random moment of a training iteration (generating, updating or
    writing a checkpoint, whatever it was doing then) of a run that is still going: the first
    after the first checkpoint appears, the others after the resumed run says where it continues,
    each a random fraction of the uninterrupted run's shortest iteration later. Every kill must hit
    a live process before its end (exit -9, no final evaluation yet), every resume must continue
    from the checkpoint the kill left, and the run must end as the uninterrupted one did."""
    folder, over, straight, iteration_s = setup
    run = folder / "killed_random"
    rng = random.Random(int(os.environ.get("MARFT_KILL_SEED", "0")))
    for kill in range(3):
        last = latest_checkpoint(run)
        if last is not None and last.name == f"iter_{ITERATIONS:06d}":  # only the final evaluation is left:
            assert kill >= 2  # no iteration to kill in (a machine much faster now than when it was measured)
            break
        args = ["train", "--resume", str(run)] if last else ["train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}"]
        log = folder / f"killed_random_{kill}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "marft.cli", *args], cwd=ROOT, env=env(),
                                    stdout=subprocess.DEVNULL, stderr=err)
        # the mark: a fresh run's first checkpoint; a resumed run's line saying where it continues
        # (at least one iteration and the final evaluation are still to come after either)
        resumed = f"resumed {run} at iteration {int(last.name[5:])} from {last.name}" if last else None
        reached = (lambda: resumed in log.read_text()) if last else (lambda: latest_checkpoint(run) is not None)
        deadline = time.monotonic() + 300
        while not reached() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert reached(), f"kill {kill}: the run ended (exit {proc.poll()}) before its mark: {log.read_text()[-2000:]}"
        time.sleep(rng.uniform(0.0, 0.75) * iteration_s)
        assert proc.poll() is None, f"kill {kill}: the run ended before the kill: {log.read_text()[-2000:]}"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        assert not (run / "eval_final.json").exists()  # killed in the middle, not after the end
        if last:  # it got past where it continued from before dying
            assert int(latest_checkpoint(run).name[5:]) >= int(last.name[5:])
    last = latest_checkpoint(run)
    assert last is not None and int(last.name[5:]) >= 1
    r = marft("train", "--resume", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at iteration {int(last.name[5:])} from {last.name}" in r.stderr
    assert_same_run(straight, run)


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)], ids=["sigint", "sigterm"])  # sigterm: -m slow
def test_sigint_or_sigterm_stops_after_writing_a_checkpoint(setup, sig):
    """Ctrl-C, and SIGTERM (what SLURM, Kubernetes and ``timeout`` send before a kill), alike."""
    folder, over, straight, _ = setup
    run = folder / f"interrupted-{sig.name}"
    proc = subprocess.Popen([sys.executable, "-m", "marft.cli", "train", "configs/duo_arithmetic.yaml", *over,
                             f"output_dir={run}"], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the signal"  # the signal must reach a run in progress
    proc.send_signal(sig)
    if sig == signal.SIGTERM:  # sent twice, as to a process and to its group (SLURM, systemd): still a checkpoint
        time.sleep(0.2)
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    done = len(metrics.read_text().splitlines())
    # it stopped early: the iteration in progress was finished and saved, and the rest not run
    assert 1 <= done < ITERATIONS, err[-2000:]
    assert proc.returncode == 130, err[-2000:]
    assert f"continue with: marft train --resume {run}" in err and "Traceback" not in err
    assert latest_checkpoint(run).name == f"iter_{done:06d}" and not (run / "eval_final.json").exists()
    r = marft("train", "--resume", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at iteration {done} from iter_{done:06d}" in r.stderr
    assert_same_run(straight, run)
