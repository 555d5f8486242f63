"""Rollout faults on the tiny model: an environment or reward that raises or hangs for one episode
fails that episode (error recorded, left out of training, counted) and not the run; a batch where
every episode fails stops with one line and leaves the last checkpoint as it was."""
import hashlib
import threading
import time

import pytest
import torch

from marft.api import prepare
from marft.cli import main
from marft.run.config import load_config
from marft.engines.generation import Sampling
from marft.run.rollout import Rollout, Turn, rollout
from marft.run.checkpoints import latest_checkpoint
from marft.assemble import build_trainer

ENVS = '''
import time
from marft.envs.base import TurnBasedEnv, Problem, Grade

class Faulty(TurnBasedEnv):
    """Problem i; grading problem 1 raises, problem 2 loops forever, problem 3 sleeps (or what
    the options say); the others are graded normally (reward 1 for a reply starting with a vowel)."""
    def __init__(self, agents, answering, horizon=1, raise_on=(1,), loop_on=(2,), sleep_on=(), reset_raise_on=(),
                 all_raise=False, log=""):
        super().__init__(agents, answering, horizon)
        self.raise_on, self.loop_on, self.sleep_on = set(raise_on), set(loop_on), set(sleep_on)
        self.reset_raise_on, self.all_raise, self.log = set(reset_raise_on), all_raise, log
    def new_problem(self, rng, split, index):
        i = index if index is not None else rng.randrange(8)
        if i in self.reset_raise_on:
            raise KeyError(f"record {i} has no answer")
        return Problem(f"Say a word ({i}).", i)
    def grade(self, problem, reply):
        i = problem.answer
        if self.log:  # when each grading began: "problem monotonic-time", one line each
            with open(self.log, "a") as f:
                f.write(f"{i} {time.monotonic()}\\n")
        if self.all_raise or i in self.raise_on:
            raise ValueError(f"reward function broke on problem {i}")
        if i in self.loop_on:
            while True:
                pass
        if i in self.sleep_on:
            time.sleep(60)
        return Grade(reply.strip()[:1].lower() in tuple("aeiou"), True)

class ConcurrentFaulty(Faulty):
    concurrent_steps = True
'''


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "faulty_envs.py"
    path.write_text(ENVS)
    return path


def overrides(tiny_model_dir, env_file, tmp_path, cls="Faulty", options="{}", extra=()):
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
            "task.kind=custom", f"task.env={env_file}:{cls}", f"task.options={options}",
            "rollout.max_new_tokens=3", "rollout.episodes=8", "eval.problems=8", "train.minibatch_size=4",
            "train.lr=1e-2", "rollout.env_timeout_s=1.5", f"output_dir={tmp_path / 'run'}", *extra]


def setup(over):
    cfg = load_config("configs/duo_arithmetic.yaml", over)
    return cfg, *prepare(cfg)


def play(cfg, team, models, make_env, n=8):
    resets = [(i, {"split": "test", "index": i}) for i in range(n)]
    return rollout(team, models, make_env, resets, Sampling(max_new_tokens=3), cfg.task.horizon,
                   torch.Generator().manual_seed(0), env_timeout_s=cfg.rollout.env_timeout_s)


@pytest.mark.parametrize("cls", ["Faulty", "ConcurrentFaulty"])
def test_raising_and_hanging_episodes_fail_alone(tiny_model_dir, env_file, tmp_path, cls):
    log = tmp_path / "graded.txt"
    opts = f"{{raise_on: [1], loop_on: [2], sleep_on: [3], log: '{log}'}}"
    cfg, team, models, make_env = setup(overrides(tiny_model_dir, env_file, tmp_path, cls, opts))
    threads_before = threading.active_count()
    t0 = time.monotonic()
    out = play(cfg, team, models, make_env)
    took = time.monotonic() - t0
    assert out.failed.tolist() == [False, True, True, True, False, False, False, False]
    assert "ValueError: reward function broke on problem 1" in out.infos[1]["error"]
    assert "timed out after 1.5 s" in out.infos[2]["error"] and "timed out" in out.infos[3]["error"]
    assert not out.success[1:4].any() and (out.rewards[1:4] == 0).all()
    # the healthy episodes are graded as usual: reward 1 exactly when the solver's reply starts with a vowel
    solver = [t for t in out.turns if t.agent == "solver"][0]
    for row, e in enumerate(solver.episodes.tolist()):
        if e not in (1, 2, 3):
            assert out.rewards[e, 0] == float(solver.texts[row].strip()[:1].lower() in tuple("aeiou"))
    # The timeouts, measured where they happen: when each episode's grading began. One at a time, the
    # loop (problem 2) holds the next episode back for its whole timeout, and so does the 60 s sleep
    # (problem 3): two timeouts in turn. Concurrent, every grading begins before the first timeout
    # ends: one timeout in all. (Whatever the machine's speed: only the timeout itself separates them.)
    began = dict(map(float, line.split()) for line in log.read_text().splitlines())
    assert sorted(began) == [0, 1, 2, 3, 4, 5, 6, 7]  # each episode graded once
    gaps = [began[i + 1] - began[i] for i in range(7)]
    if cls == "Faulty":
        assert gaps[2] > 0.9 * 1.5 and gaps[3] > 0.9 * 1.5, gaps  # 3 began after 2 timed out, 4 after 3 did
    else:
        assert max(began.values()) - min(began.values()) < 1.5 / 2, gaps  # all eight at once
    assert took < 2 * 1.5 + 20  # and bounded
    # the looping thread was stopped (the sleeping one stops when its sleep ends)
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads_before + 1


def test_reset_that_raises_fails_its_episode(tiny_model_dir, env_file, tmp_path):
    cfg, team, models, make_env = setup(overrides(tiny_model_dir, env_file, tmp_path, options="{raise_on: [], loop_on: [], reset_raise_on: [5]}"))
    out = play(cfg, team, models, make_env)
    assert out.failed.tolist() == [i == 5 for i in range(8)]
    assert "KeyError" in out.infos[5]["error"] and "record 5 has no answer" in out.infos[5]["error"]
    assert all(5 not in t.episodes.tolist() for t in out.turns)  # it never acted


def test_select_keeps_and_renumbers_episodes():
    def turn(step, agent, episodes):
        b = len(episodes)
        return Turn(step, agent, torch.tensor(episodes), torch.arange(b).view(b, 1), torch.ones(b, 1, dtype=torch.bool),
                    torch.arange(b).view(b, 1) + 10, torch.ones(b, 1, dtype=torch.bool), torch.zeros(b, 1),
                    torch.zeros(b, dtype=torch.bool), [f"{agent}{e}" for e in episodes], [f"s{e}" for e in episodes])

    E = 4
    out = Rollout([turn(0, "a", [0, 1, 2, 3]), turn(0, "b", [0, 2, 3]), turn(1, "a", [1])],
                  torch.arange(E * 2, dtype=torch.float).view(E, 2), torch.zeros(E, 2, 2), torch.zeros(E, 2, dtype=torch.bool),
                  torch.tensor([1, 2, 1, 1]), torch.tensor([True, False, False, True]), torch.ones(E, dtype=torch.bool),
                  infos=[{"i": i} for i in range(E)], failed=torch.tensor([False, True, False, False]))
    kept = out.select(~out.failed)
    assert [t.agent for t in kept.turns] == ["a", "b"]  # the step-1 turn held only episode 1
    assert kept.turns[0].episodes.tolist() == [0, 1, 2] and kept.turns[0].texts == ["a0", "a2", "a3"]
    assert kept.turns[0].response_ids.flatten().tolist() == [10, 12, 13]
    assert kept.turns[1].episodes.tolist() == [0, 1, 2] and kept.turns[1].states == ["s0", "s2", "s3"]
    assert kept.rewards.tolist() == [[0, 1], [4, 5], [6, 7]]
    assert kept.steps.tolist() == [1, 1, 1] and kept.success.tolist() == [True, False, True]
    assert [i["i"] for i in kept.infos] == [0, 2, 3] and not kept.failed.any()


@pytest.mark.parametrize("algorithm,left", [("marft", 6), ("grpo", 4)])
def test_training_leaves_failed_episodes_out(tiny_model_dir, env_file, tmp_path, algorithm, left):
    over = overrides(tiny_model_dir, env_file, tmp_path, options="{raise_on: [], loop_on: []}",
                     extra=[f"train.algorithm={algorithm}", "train.group_size=4"])
    cfg, team, models, make_env = setup(over)
    messages = []
    trainer = build_trainer(cfg, team, models, make_env, log=messages.append)
    # training problems are drawn at random: mark two episodes as failed, as the rollout would
    original = trainer.play

    def rigged(it):
        out = original(it)
        for e in (1, 2):
            out.failed[e] = True
            out.infos[e] = {"success": False, "extracted": False, "error": "ValueError: broke"}
        return out

    trainer.play = rigged
    kept = {}
    original_targets = trainer.targets

    def spy(out):
        kept["episodes"] = len(out.steps)
        return original_targets(out)

    trainer.targets = spy
    m = trainer.iteration_step()
    assert m["episodes/failed"] == 2
    assert kept["episodes"] == left  # grpo drops the whole group of 4 that held them
    assert any("2 of 8 episodes failed in the environment" in x and "ValueError: broke" in x for x in messages)


def test_every_episode_failing_stops_the_run_and_keeps_the_checkpoint(tiny_model_dir, env_file, tmp_path, capsys):
    run = tmp_path / "run"
    good = overrides(tiny_model_dir, env_file, tmp_path, options="{raise_on: [], loop_on: []}", extra=["eval.problems=2"])
    assert main(["train", "configs/duo_arithmetic.yaml", *good, "train.iterations=1"]) == 0
    ckpt = latest_checkpoint(run)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.iterations=3", "task.options={all_raise: true}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("marft: error: every episode of iteration 2 failed in the environment")
    assert "reward function broke" in err[-1] and "Traceback" not in "\n".join(err)
    assert err[-1].endswith("check it with marft env-check), then marft train --resume")
    assert latest_checkpoint(run) == ckpt
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in ckpt.rglob("*") if p.is_file()}


def test_eval_counts_failed_episodes_as_unsolved(tiny_model_dir, env_file, tmp_path, capsys):
    out_json = tmp_path / "eval.json"
    over = overrides(tiny_model_dir, env_file, tmp_path, options="{raise_on: [0, 4], loop_on: [6]}",
                     extra=[f"eval.output={out_json}"])
    assert main(["eval", "configs/duo_arithmetic.yaml", *over]) == 0
    import json

    res = json.loads(out_json.read_text())
    assert res["failed_episodes"] == 3
    assert [res["per_problem_success"][i] for i in (0, 4, 6)] == [0.0, 0.0, 0.0]
    assert any("reward function broke on problem 0" in e for e in res["first_errors"])
    assert any("timed out" in e for e in res["first_errors"])
    assert "episodes failed in the environment" in capsys.readouterr().out


def test_env_timeout_is_validated(tiny_model_dir, env_file, tmp_path, capsys):
    over = overrides(tiny_model_dir, env_file, tmp_path, extra=["rollout.env_timeout_s=0"])
    assert main(["eval", "configs/duo_arithmetic.yaml", *over]) == 2
    assert "rollout.env_timeout_s must be positive" in capsys.readouterr().err


def test_every_episode_failing_before_a_checkpoint_says_to_start_again(tiny_model_dir, env_file, tmp_path, capsys):
    # at iteration 1 there is nothing to resume: the message says to start again elsewhere, not --resume
    bad = overrides(tiny_model_dir, env_file, tmp_path, options="{all_raise: true}", extra=["eval.problems=2", "eval.before=false"])
    assert main(["train", "configs/duo_arithmetic.yaml", *bad, "train.iterations=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("marft: error: every episode of iteration 1 failed in the environment")
    assert err[-1].endswith("then start the run again with another output_dir= (no checkpoint to resume from yet)")
