"""Asynchronous training (``train.max_staleness``, :mod:`marft.run.asynchronous`): the decoupled
objective on stale rows against hand-computed values, the staleness bound under random delays, a
hung episode that delays only itself, a pipelined run that is the same run twice and after a
resume, a run killed at k = 1 that resumes to the uninterrupted result, and the configuration's
errors. Staleness 0 is the synchronous run bit for bit: tests/test_unchanged.py."""
from __future__ import annotations

import json
import math
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import marft
from marft.errors import UserError
from marft.maths.algorithms import ALGORITHMS
from marft.run.config import load_config
from marft.run.learner import PolicyBatch
from marft.turns import Turn

sys.path.insert(0, str(Path(__file__).parent))
import test_unchanged as U  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

@pytest.fixture(scope="module")
def slow_env() -> Path:
    """The vowel task whose grading takes time (tests/data/slow_task.py)."""
    return Path(__file__).parent / "data" / "slow_task.py"


def _cfg(run_dir: Path, *extra: str, env: Path | None = None):
    task = U.ENV if env is None else ["task.kind=custom", "task.options={}", f"task.env={env}:Slow", "task.horizon=2"]
    return marft.load_config(str(ROOT / U.DUO), [*U.BASE, *task, "train.algorithm=marft", *extra, f"output_dir={run_dir}"])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- the objective on stale rows
def _turn(versions) -> Turn:
    b, R = len(versions), 2
    return Turn(0, "solver", torch.arange(b), torch.ones(b, 1, dtype=torch.long), torch.ones(b, 1, dtype=torch.bool),
                torch.ones(b, R, dtype=torch.long), torch.ones(b, R, dtype=torch.bool), torch.zeros(b, R),
                torch.zeros(b, dtype=torch.bool), ["a b"] * b, [""] * b, versions=torch.tensor(versions))


def test_stale_rows_are_those_of_an_older_version():
    batch = PolicyBatch([_turn([3, 2, 3])], [torch.zeros(3)], [(0, 0), (0, 1), (0, 2)], [[(0, 0), (0, 1), (0, 2)]], version=3)
    assert batch.stale([(0, 0), (0, 1), (0, 2)]).tolist() == [False, True, False]
    assert batch.stale([(0, 0), (0, 2)]) is None  # no stale row: the plain PPO loss
    assert PolicyBatch([_turn([0])], [torch.zeros(1)], [(0, 0)], [[(0, 0)]]).stale([(0, 0)]) is None  # a synchronous batch


def test_the_decoupled_objective_at_action_level_by_hand():
    """Two replies of two tokens, the learner at the proximal policy (ratio 1): the first reply
    fresh (behaviour = proximal, weight 1), the second sampled by an older version whose tokens
    were 0.5 less likely each: action-level weight exp(2 * 0.5) = e; the third 1.5 less likely each,
    weight exp(3) = 20.1, capped at 5. Loss = -mean(A * w) = -(1 * 1 + 2 * e + 1 * 5) / 3."""
    algo, train = ALGORITHMS["marft"], load_config(str(ROOT / U.DUO), []).train
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-1.0, -1.0]], requires_grad=True)
    prox = lp.detach().clone()
    behaviour = prox - torch.tensor([[0.0], [0.5], [1.5]])
    adv = torch.tensor([1.0, 2.0, 1.0])
    mask = torch.ones(3, 2, dtype=torch.bool)
    loss, st = algo.policy_loss(lp, prox, adv, mask, train, ["a b"] * 3, behaviour)
    assert loss.item() == pytest.approx(-(1 + 2 * math.e + 5) / 3, rel=1e-6)
    assert st["capped_fraction"] == pytest.approx(1 / 3)
    assert st["importance_weight_mean"] == pytest.approx((1 + math.e + math.exp(3)) / 3, rel=1e-6)
    loss.backward()  # d loss / d lp[i, j] = -A_i * w_i / 3 for every token (ratio 1, unclipped)
    want = torch.tensor([[-1 / 3] * 2, [-2 * math.e / 3] * 2, [-5 / 3] * 2])
    assert torch.allclose(lp.grad, want, rtol=1e-6)
    fresh, _ = algo.policy_loss(lp, prox, adv, mask, train, ["a b"] * 3)  # without stale rows: PPO
    same, _ = algo.policy_loss(lp, prox, adv, mask, train, ["a b"] * 3, prox.clone())
    assert fresh.item() == same.item() == pytest.approx(-(1 + 2 + 1) / 3)


# ---------------------------------------------------------------------------- runs
def test_no_trained_reply_is_older_than_the_bound_under_random_delays(tiny_model_dir, slow_env, tmp_path, monkeypatch):
    """Streaming, chunks of one episode, k = 1, grading taking random times: every row an update
    trains on is at most one version old (and never newer than the learner), and the metrics say so."""
    import marft.run.trainer as T

    seen = []
    update = T.Trainer.update_policy

    def recording(self, out, targets, trained):
        seen.append([(self.iteration, int(v)) for t in out.turns for v in t.versions])
        return update(self, out, targets, trained)

    monkeypatch.setattr(T.Trainer, "update_policy", recording)
    sys.modules.pop("slow_task", None)  # the environment as this test's variables make it
    cfg = _cfg(tmp_path / "run", "train.iterations=5", "train.max_staleness=1", "train.async_mode=streaming",
               "train.async_chunk=1", "threads=2", "train.save_every=10", env=slow_env)
    with marft.MarftTrainer(cfg, log=None) as t:
        t.train()
    assert len(seen) == 5 and all(seen)
    assert all(0 <= it - v <= 1 for rows in seen for it, v in rows)
    m = _metrics(tmp_path / "run")
    assert all(x["async/staleness_max"] <= 1 for x in m)
    assert any(x["async/staleness_max"] == 1 for x in m)  # generation did run ahead of the learner


def test_a_hung_episode_delays_only_itself(tiny_model_dir, slow_env, tmp_path, monkeypatch):
    """One episode's grading hangs 30 s (its time limit): streaming with chunks of one episode
    fills every batch from the others, so no iteration waits for it (a synchronous run waits the
    30 s); the hung episode comes back failed or too stale and is left out."""
    monkeypatch.setenv("MARFT_TEST_HANG_S", "30")
    sys.modules.pop("slow_task", None)
    cfg = _cfg(tmp_path / "run", "train.iterations=3", "train.max_staleness=1", "train.async_mode=streaming",
               "train.async_chunk=1", "threads=2", "rollout.env_timeout_s=30", "train.save_every=10", "eval.before=false",
               env=slow_env)
    with marft.MarftTrainer(cfg, log=None) as t:
        t0 = time.monotonic()
        t.train()
        took = time.monotonic() - t0
    assert took < 20, f"training took {took:.0f} s: the hung episode held a batch back"
    assert all(x["async/learner_wait_s"] < 15 for x in _metrics(tmp_path / "run"))


def test_chunks_dropped_as_too_stale_are_replaced(tiny_model_dir, slow_env, tmp_path, monkeypatch):
    """Every fifth grading takes 3 s while an iteration takes a fraction of one: those chunks come
    back more than one version old and are dropped, new chunks take their places, and the run ends
    (a bound that did not replace them would starve the learner)."""
    monkeypatch.setenv("MARFT_TEST_SLOW_EVERY", "5")
    monkeypatch.setenv("MARFT_TEST_SLOW_S", "3")
    sys.modules.pop("slow_task", None)
    cfg = _cfg(tmp_path / "run", "train.iterations=8", "train.max_staleness=1", "train.async_mode=streaming",
               "train.async_chunk=1", "threads=2", "train.save_every=10", "eval.before=false", env=slow_env)
    with marft.MarftTrainer(cfg, log=None) as t:
        t.train()
    m = _metrics(tmp_path / "run")
    assert len(m) == 8 and all(x["async/staleness_max"] <= 1 for x in m)
    assert sum(x["async/dropped"] for x in m) > 0


def test_a_synchronous_checkpoint_resumes_asynchronously(tiny_model_dir, tmp_path):
    """A run checkpointed synchronously and resumed with train.max_staleness=1 has no adapters of the
    version before its checkpoint: its first batch plays with the checkpoint's own, and says so."""
    logs = []
    with marft.MarftTrainer(_cfg(tmp_path / "run", "train.iterations=2"), log=None) as t:
        t.train()
    with marft.MarftTrainer.resume(tmp_path / "run", ["train.iterations=3", "train.max_staleness=1"], log=logs.append) as t:
        t.train()
    assert any("holds no adapters of version 1" in line for line in logs), logs
    assert [x.get("async/staleness_max") for x in _metrics(tmp_path / "run")] == [None, None, 0]


def _comparable(summary: dict) -> dict:
    """A summary without what depends on timing (episodes ahead, discarded at a resume)."""
    keep = lambda m: {k: v for k, v in m.items() if k not in ("async/ahead", "async/discarded")}  # noqa: E731
    return {**summary, "metrics": [keep(m) for m in summary["metrics"]]}


def test_pipelined_is_the_same_run_twice_and_after_a_resume(tiny_model_dir, tmp_path):
    """Pipelined, k = 1: iteration t plays with exactly version t - 1, so the same seed gives the
    same metrics, evaluations, adapters and optimisers; a run resumed at iteration 2 (its checkpoint
    keeps version 1, which batch 2 plays with) ends as the uninterrupted one."""
    over = ("train.iterations=4", "train.max_staleness=1", "train.async_mode=pipelined")
    runs = {}
    for name in ("a", "b"):
        with marft.MarftTrainer(_cfg(tmp_path / name, *over), log=None) as t:
            t.train()
        runs[name] = _comparable(U.summarise(tmp_path / name))
    assert runs["a"] == runs["b"]
    assert [m["async/staleness_max"] for m in runs["a"]["metrics"]] == [0, 1, 1, 1]
    # stale rows (every batch after the first) are trained with the decoupled objective, fresh ones with PPO
    weights = [[k for k in m if k.endswith("/importance_weight")] for m in runs["a"]["metrics"]]
    assert weights[0] == [] and all(w == ["planner/importance_weight", "solver/importance_weight"] for w in weights[1:])
    with marft.MarftTrainer(_cfg(tmp_path / "c", *over[1:], "train.iterations=2"), log=None) as t:
        t.train()
    with marft.MarftTrainer.resume(tmp_path / "c", ["train.iterations=4"], log=None) as t:
        t.train()
    resumed = _comparable(U.summarise(tmp_path / "c"))
    assert resumed["metrics"] == runs["a"]["metrics"]
    assert resumed["checkpoints"]["iter_000004"] == runs["a"]["checkpoints"]["iter_000004"]
    assert resumed["evaluations"]["eval_final"] == runs["a"]["evaluations"]["eval_final"]


def test_killed_asynchronous_run_resumes_to_the_same_result(tiny_model_dir, vowel_env_path, tmp_path):
    """``marft train`` at k = 1 (pipelined) killed with SIGKILL in the middle of iteration 2's policy
    update, while generation plays batch 3 beside it: the resumed run discards that batch (and
    says so), plays it again with the checkpoint's version 1, and ends with the uninterrupted run's
    metrics, adapters and evaluation."""
    from test_kill import DRIVER, comparable, marft as run_marft

    (tmp_path / "driver.py").write_text(DRIVER)
    over = [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "threads=2",
            "task.kind=custom", f"task.env={vowel_env_path}:Vowel", "task.options={}", "rollout.max_new_tokens=3",
            "rollout.episodes=8", "eval.problems=2", "rollout.temperature=1.0", "train.lr=1e-2", "train.minibatch_size=4",
            "train.micro_batch_size=2", "train.save_every=1", "train.iterations=3", "train.max_staleness=1"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = run_marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={straight}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_marft("train", "configs/duo_arithmetic.yaml", *over, f"output_dir={killed}", driver=tmp_path / "driver.py",
                  kill=["update", "2"])
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    r = run_marft("train", "--resume", str(killed))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {killed} at iteration 1" in r.stderr
    # batch 1 played or playing, and batch 2 too once version 1 was out: one or two batches lost
    assert re.search(r"\b(8|16) episodes in flight when the checkpoint was written are discarded", r.stderr), r.stderr[-2000:]
    timeless = lambda run: [{k: v for k, v in m.items() if k not in ("async/ahead", "async/discarded")}  # noqa: E731
                            for m in comparable(run / "metrics.jsonl")]
    assert timeless(straight) == timeless(killed)
    for f in sorted((straight / "checkpoints" / "iter_000003").rglob("*.safetensors")):
        assert f.read_bytes() == (killed / "checkpoints" / "iter_000003" / f.relative_to(straight / "checkpoints" / "iter_000003")).read_bytes()
    ev = lambda run: json.loads((run / "eval_final.json").read_text())["per_problem_success"]  # noqa: E731
    assert ev(straight) == ev(killed)


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("extra,says", [
    (["train.max_staleness=-1"], "train.max_staleness must be 0"),
    (["train.max_staleness=1", "train.async_mode=eager"], "train.async_mode must be pipelined or streaming"),
    (["train.max_staleness=1", "rollout.engine=vllm"], "runs on the hf engine for now"),
    (["train.max_staleness=1", "cluster.rollout_workers=2", "train.async_mode=streaming"], "streaming runs in one process for now"),
    (["train.max_staleness=1", "train.async_mode=streaming", "train.async_chunk=3"], "must divide rollout.episodes (4)"),
    (["train.max_staleness=1", "train.async_mode=streaming", "train.algorithm=grpo", "train.group_size=2",
      "train.async_chunk=1"], "multiple of train.group_size (2)"),
    (["train.max_staleness=1", "train.max_importance_weight=0.5"], "train.max_importance_weight must be at least 1"),
])
def test_asynchronous_settings_that_cannot_work_say_why(extra, says):
    with pytest.raises(UserError, match=None) as e:
        load_config(str(ROOT / U.DUO), ["rollout.episodes=4", *extra])
    assert says in str(e.value)
    assert "\n" not in str(e.value)


def test_a_streaming_resume_plays_each_chunk_once():
    """Streaming chunks are (iteration, q), 2 an iteration. At a checkpoint after iteration 3 the
    batches had taken every chunk up to (3, 0), and (4, 0) early, while (3, 1) was still being
    played: the resumed run starts at (3, 1) and passes over (4, 0) (it restarted at (4, 0) before,
    training (4, 0) twice and never (3, 1))."""
    from marft.run.asynchronous import next_chunk

    taken = {(t, q) for t in range(3) for q in range(2)} | {(3, 0), (4, 0)}
    first = next_chunk(None, (0, 0), 2, taken)
    assert first == (3, 1)
    later = {k for k in taken if k > first}
    assert later == {(4, 0)}
    order, k = [first], first
    for _ in range(3):
        k = next_chunk(k, None, 2, later)
        order.append(k)
    assert order == [(3, 1), (4, 1), (5, 0), (5, 1)]


def test_a_streaming_run_stopped_and_resumed_takes_no_chunk_twice(tiny_model_dir, slow_env, tmp_path, monkeypatch):
    """Streaming, chunks of one episode, grading taking random times (so batches take chunks out of
    order and early), stopped after iteration 2 with its checkpoint and resumed to 5: over both
    attempts no chunk is taken by two batches, and every batch is whole."""
    import marft.run.asynchronous as A

    taken: list = []
    play = A.AsyncEpisodes.play

    def recording(self, iteration, resets):
        before = set(self.taken)
        out = play(self, iteration, resets)
        taken.extend(sorted(set(self.taken) - before))
        return out

    monkeypatch.setattr(A.AsyncEpisodes, "play", recording)
    sys.modules.pop("slow_task", None)

    class StopAt2:
        def on_iteration(self, trainer, metrics):
            if metrics["iteration"] == 2:
                trainer.stop()

    cfg = _cfg(tmp_path / "run", "train.iterations=5", "train.max_staleness=1", "train.async_mode=streaming",
               "train.async_chunk=1", "threads=2", "train.save_every=10", "eval.before=false", env=slow_env)
    with marft.MarftTrainer(cfg, log=None, callbacks=[StopAt2()]) as t:
        assert t.train().stopped
    with marft.MarftTrainer.resume(tmp_path / "run", log=None) as t:
        t.train()
    assert len(taken) == len(set(taken)) and len(taken) >= 5 * cfg.rollout.episodes
    assert [m["iteration"] for m in _metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]
