"""Killed runs: ``marft train`` killed with SIGKILL during generation, during a policy update, and at
three moments of a checkpoint write (adapters half written, before the rename, before ``latest``
moves), and at random moments, resumes from its last complete checkpoint and ends with the same
metrics, weights and evaluation as a run that was never interrupted. SIGINT stops after writing a
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

from marft.checkpoints import latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]

# Runs marft with one function wrapped so that the process SIGKILLs itself at a chosen moment of a
# chosen iteration: argv = WHERE ITERATION marft-arguments...
DRIVER = '''
import os, signal, sys
import marft.models as M, marft.engines.hf as R, marft.trainer as T, marft.checkpoints as C
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
elif where == "update":  # the second micro-batch of the policy update, after an optimiser step
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
    assert marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={straight}").returncode == 0
    return folder, over, straight


def env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def marft(*args, driver=None, kill=None):
    cmd = [sys.executable, str(driver), *kill, *args] if driver else [sys.executable, "-m", "marft.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)


def comparable(path):
    skip = {"seconds", "tokens_per_s"}  # and every time (*_s) and speed (mfu/*, machine/*)
    return [{k: v for k, v in json.loads(line).items() if k not in skip and not k.endswith("_s") and not k.startswith(("mfu/", "machine/"))}
            for line in path.read_text().splitlines()]


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
    ("generation", 1, None),  # before the first checkpoint: resume says so, a fresh start recovers
])
def test_killed_run_resumes_to_the_same_result(setup, where, at, resumes_from):
    folder, over, straight = setup
    run = folder / f"killed_{where}_{at}"
    r = marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}", driver=folder / "driver.py", kill=[where, str(at)])
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    last = latest_checkpoint(run)
    if resumes_from is None:
        assert last is None
        r = marft("train", "--resume", str(run))
        assert r.returncode == 2 and "has no complete checkpoint" in r.stderr and "Traceback" not in r.stderr
        r = marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}")
    else:
        assert last.name == f"iter_{resumes_from:06d}"
        r = marft("train", "--resume", str(run))
        assert f"resumed {run} at iteration {resumes_from}" in r.stderr
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(straight, run)


def test_killed_at_random_moments_resumes_to_the_same_result(setup):
    """Three kills at random times of one run (whatever it was doing), each followed by a resume."""
    folder, over, straight = setup
    run = folder / "killed_random"
    rng = random.Random(int(os.environ.get("MARFT_KILL_SEED", "0")))
    for _ in range(3):
        last = latest_checkpoint(run)
        args = ["train", "--resume", str(run)] if last else ["train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}"]
        proc = subprocess.Popen([sys.executable, "-m", "marft.cli", *args], cwd=ROOT, env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(3.0, 12.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    last = latest_checkpoint(run)
    args = ["train", "--resume", str(run)] if last else ["train", "configs/duo_arithmetic.yaml", *over, f"output_dir={run}"]
    r = marft(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(straight, run)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_sigint_or_sigterm_stops_after_writing_a_checkpoint(setup, sig):
    """Ctrl-C, and SIGTERM (what SLURM, Kubernetes and ``timeout`` send before a kill), alike."""
    folder, over, straight = setup
    run = folder / f"interrupted-{sig.name}"
    proc = subprocess.Popen([sys.executable, "-m", "marft.cli", "train", "configs/duo_arithmetic.yaml", *over,
                             f"output_dir={run}"], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    done = len(metrics.read_text().splitlines())
    if done < ITERATIONS:  # stopped early: the iteration in progress was finished and saved
        assert proc.returncode == 130, err[-2000:]
        assert f"continue with: marft train --resume {run}" in err and "Traceback" not in err
        assert latest_checkpoint(run).name == f"iter_{done:06d}"
        r = marft("train", "--resume", str(run))
        assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(straight, run)
