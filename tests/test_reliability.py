"""Numerical trouble and degenerate batches on the tiny model: a NaN in a loss, a gradient or a
log-probability skips the update (weights unchanged, a warning logged, counted in the metrics);
``train.max_bad_updates`` skipped updates in a row stop the run with one line and leave the last
checkpoint as it was; batches where every episode got the same reward, every reply is empty or
every reply is cut at the token limit train without NaN and are counted."""
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import marft.engines.hf
from marft.maths import losses
from conftest import VOWEL_ENV
from marft.api import prepare
from marft.cli import main
from marft.run.config import load_config
from marft.run.learner import AdapterLearner
from marft.run.checkpoints import latest_checkpoint
from marft.assemble import build_trainer
from marft.run.trainer import Trainer

ENVS = VOWEL_ENV + '''
class Never(Vowel):
    def grade(self, problem, reply):
        return Grade(False, True, feedback="No.")
'''


@pytest.fixture
def overrides(tiny_model_dir, tmp_path):
    env = tmp_path / "rel_envs.py"
    env.write_text(ENVS)
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
            "task.kind=custom", f"task.env={env}:Vowel", "task.options={}", "rollout.max_new_tokens=3",
            "rollout.episodes=8", "eval.problems=2", "train.minibatch_size=4", "train.lr=1e-2",
            f"output_dir={tmp_path / 'run'}"]


def trainer_for(overrides, log=None):
    cfg = load_config("configs/duo_arithmetic.yaml", overrides)
    team, models, make_env = prepare(cfg)
    return build_trainer(cfg, team, models, make_env, log=log if log is not None else (lambda m: None))


def snapshot(trainer):
    return {a: {k: v.clone() for k, v in trainer.models.adapter_state(a).items()} for a in trainer.team.adapters}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def poison_loss(monkeypatch, when=lambda: True):
    """Make the PPO loss NaN (while ``when()``)."""
    original = losses.ppo_policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return (loss * float("nan"), stats) if when() else (loss, stats)

    monkeypatch.setattr(losses, "ppo_policy_loss", nan_loss)


def poison_gradient(monkeypatch):
    """A finite loss whose gradient is NaN (the unselected branch of ``where`` divides by 0)."""
    original = losses.ppo_policy_loss

    def nan_grad(*args, **kwargs):
        loss, stats = original(*args, **kwargs)
        return torch.where(torch.tensor(True), loss, loss / 0.0), stats

    monkeypatch.setattr(losses, "ppo_policy_loss", nan_grad)


def poison_recomputed(monkeypatch):
    original = AdapterLearner.behaviour_logprobs
    monkeypatch.setattr(AdapterLearner, "behaviour_logprobs",
                        lambda self, batch, rows: {i: lp * float("nan") for i, lp in original(self, batch, rows).items()})


def poison_rollout(monkeypatch):
    original = Trainer.play

    def nan_rollout(self, it):
        out = original(self, it)
        for t in out.turns:
            t.logprobs[0, 0] = float("-inf")  # one row of each turn
        return out

    monkeypatch.setattr(Trainer, "play", nan_rollout)


@pytest.mark.parametrize("where,warning", [
    ("loss", "non-finite loss"),
    ("gradient", "non-finite gradient"),
    ("recomputed", "non-finite recomputed log-probabilities"),
    ("recomputed-plain", "non-finite recomputed log-probabilities"),
    ("rollout", "non-finite rollout log-probabilities"),
])
def test_non_finite_update_is_skipped(overrides, monkeypatch, where, warning):
    logged = []
    fast = "train.fast=false" if where == "recomputed-plain" else "train.fast=true"
    tr = trainer_for(overrides + ["train.max_bad_updates=0", "train.micro_batch_size=4", fast], log=logged.append)
    {"loss": poison_loss, "gradient": poison_gradient, "recomputed": poison_recomputed, "recomputed-plain": poison_recomputed,
     "rollout": poison_rollout}[where](monkeypatch)
    before = snapshot(tr)
    m = tr.iteration_step()
    assert any(warning in line and "skipped" in line for line in logged), logged
    updates = 2 * 2  # two adapters, 8 replies each in minibatches of 4
    if where == "rollout":  # only the micro-batch holding row 0 is skipped: the other update goes ahead
        assert m["skipped/micro_batches"] == 2 and m["skipped/updates"] == 2
        assert not same(before["solver"], snapshot(tr)["solver"])
        return
    if where == "recomputed":  # the fast path recomputes nothing for each adapter's first minibatch (its
        # behaviour log-probs come from its own pass, before any step): only the second is skipped
        assert m["skipped/micro_batches"] == 2 and m["skipped/updates"] == 2
        assert not same(before["solver"], snapshot(tr)["solver"])
        return
    assert m["skipped/updates"] == updates and m["skipped/updates_in_a_row"] == updates
    assert m["skipped/micro_batches"] == (0 if where == "gradient" else updates)
    after = snapshot(tr)
    assert all(same(before[a], after[a]) for a in before)
    assert all(torch.isfinite(v).all() for a in after for v in after[a].values())


def test_a_good_update_resets_the_count(overrides, monkeypatch):
    calls = {"n": 0}

    def first_only():
        calls["n"] += 1
        return calls["n"] == 1

    poison_loss(monkeypatch, first_only)
    tr = trainer_for(overrides + ["train.max_bad_updates=2"])
    m = tr.iteration_step()
    assert m["skipped/updates"] == 1 and m["skipped/updates_in_a_row"] == 0 and tr.iteration == 1


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bad_updates_in_a_row_stop_the_run_and_keep_the_checkpoint(overrides, monkeypatch, tmp_path, capsys):
    """Iteration 1 trains and is saved; from then on every loss is NaN: 3 skipped updates in a row
    stop iteration 2 with one line, status 2, and iteration 1's checkpoint as it was written."""
    run = tmp_path / "run"
    state = {"poisoned": False, "saved": None}
    original_save = Trainer.save

    def save_then_poison(self):
        path = original_save(self)
        state["saved"], state["poisoned"] = tree_hash(run / "checkpoints"), True
        return path

    monkeypatch.setattr(Trainer, "save", save_then_poison)
    poison_loss(monkeypatch, lambda: state["poisoned"])
    rc = main(["train", "configs/duo_arithmetic.yaml", *overrides, "train.iterations=4", "train.save_every=1",
               "train.max_bad_updates=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("marft: error: training stopped at iteration 2: 3 policy updates in a row were skipped")
    assert "iter_000001, is kept as it was" in line and "train.lr" in line
    assert [x for x in err.splitlines() if x.startswith("marft: error:")] == [line]
    assert latest_checkpoint(run).name == "iter_000001"
    assert tree_hash(run / "checkpoints") == state["saved"]
    assert [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def test_max_bad_updates_is_validated(overrides, capsys):
    assert main(["eval", "configs/duo_arithmetic.yaml", *overrides, "train.max_bad_updates=-1"]) == 2
    assert "train.max_bad_updates must be 0 (off) or positive, got -1" in capsys.readouterr().err


# ---------------------------------------------------------------- degenerate batches

def finite_metrics(m: dict) -> bool:
    return all(torch.isfinite(torch.tensor(float(v))) for v in m.values() if isinstance(v, (int, float)))


@pytest.mark.parametrize("algorithm", ["marft", "marft-token", "ippo", "grpo"])
def test_every_episode_rewarded_the_same(overrides, algorithm):
    env = next(o for o in overrides if o.startswith("task.env=")).replace(":Vowel", ":Never")
    tr = trainer_for(overrides + [env, f"train.algorithm={algorithm}", "train.group_size=4", "task.horizon=2"])
    before = snapshot(tr)
    out = tr.play(0)
    assert (out.rewards == 0).all()
    targets = tr.targets(out)
    for a in tr.normalised_advantages(out, targets):
        assert torch.isfinite(a).all()
    m = tr.iteration_step()
    assert m["degenerate/same_reward"] == 1.0 and m["skipped/updates"] == 0 and finite_metrics(m)
    after = snapshot(tr)
    assert all(torch.isfinite(v).all() for a in after for v in after[a].values())
    assert not same(before["solver"], after["solver"])  # the entropy bonus still moves the policy


def empty_replies(monkeypatch, zero_tokens=False):
    """Every reply ends at once: only its end-of-turn token (or, ``zero_tokens``, not even that)."""
    original = marft.engines.hf.generate

    def generate(model, tok, chats, sampling, stop_ids, generator=None):
        g = original(model, tok, chats, sampling, stop_ids, generator)
        g.response_ids[:, 0] = stop_ids[0]
        g.response_mask[:, 1:] = False
        g.response_mask[:, 0] = not zero_tokens
        g.logprobs = torch.where(g.response_mask, g.logprobs, 0.0)
        g.truncated[:] = False
        g.texts = [""] * len(g.texts)
        return g

    monkeypatch.setattr(marft.engines.hf, "generate", generate)


@pytest.mark.parametrize("algorithm,zero_tokens", [("marft", False), ("marft-token", False), ("ippo", False),
                                                   ("grpo", False), ("marft", True), ("grpo", True)])
def test_empty_replies(overrides, monkeypatch, algorithm, zero_tokens):
    """A reply always holds at least its end-of-turn token (generation emits it); action-level
    training also copes with replies of no tokens at all. Token level needs a token to credit."""
    empty_replies(monkeypatch, zero_tokens)
    tr = trainer_for(overrides + [f"train.algorithm={algorithm}"])
    m = tr.iteration_step()
    assert m["responses/empty"] == 1.0 and m["responses/truncated"] == 0.0
    assert m["degenerate/same_reward"] == 1.0  # nothing starts with a vowel
    assert finite_metrics(m) and m["skipped/updates"] == 0


@pytest.mark.parametrize("algorithm", ["marft", "marft-token"])
def test_every_reply_truncated(overrides, monkeypatch, algorithm):
    monkeypatch.setattr(marft.engines.hf, "stop_token_ids", lambda model, tok: [])  # nothing ends a reply
    tr = trainer_for(overrides + [f"train.algorithm={algorithm}"])
    m = tr.iteration_step()
    assert m["responses/truncated"] == 1.0 and m["solver/reply_tokens"] == 3
    assert finite_metrics(m) and m["skipped/updates"] == 0


def test_degenerate_counts_by_hand():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [0.5], [0.5], [0.5], [0.5]])  # 8 episodes
    turns = [SimpleNamespace(texts=["", "a", " \n", "b"], truncated=torch.tensor([True, False, False, False])),
             SimpleNamespace(texts=["c", "d", "e", "f"], truncated=torch.tensor([True, True, False, False]))]
    out = SimpleNamespace(rewards=rewards, turns=turns)
    from marft.run.trainer import degenerate_stats

    grpo = SimpleNamespace(train=SimpleNamespace(algorithm="grpo", group_size=4))
    stats = degenerate_stats(grpo, out)
    assert stats == {"degenerate/same_reward": 0.5, "responses/empty": 2 / 8, "responses/truncated": 3 / 8}
    marft_ = SimpleNamespace(train=SimpleNamespace(algorithm="marft", group_size=4))
    assert degenerate_stats(marft_, out)["degenerate/same_reward"] == 0.0
    out.rewards = torch.zeros(8, 1)
    assert degenerate_stats(marft_, out)["degenerate/same_reward"] == 1.0


def test_resume_uses_the_configs_learning_rates(overrides, tmp_path):
    """After a stop, ``marft train --resume RUN train.lr=...`` must train at the new rate, not the
    one saved in the optimiser state."""
    tr = trainer_for(overrides)
    tr.iteration_step()
    path = tr.save()
    again = trainer_for(overrides + ["train.lr=1e-5", "train.critic_lr=2e-5"])
    again.load(path)
    assert again.iteration == 1
    assert {g["lr"] for lr in again.policy.learners.values() for g in lr.optimizer.param_groups} == {1e-5}
    assert {g["lr"] for o in again.critic.optimizers.values() for g in o.param_groups} == {2e-5}
