"""One adapter's policy update (marft/run/learner.py) on the tiny model: what it reports, that a batch of
the adapter's own turns learns exactly what the whole rollout's turns do, that skipped updates are
reported as they happen, and that the Ray learner (as a plain object) updates exactly as the
trainer does."""
import copy
import pickle

import pytest
import torch

from marft.maths import losses
from marft.api import prepare
from marft.run.config import load_config
from marft.distributed.actors import Learner
from marft.run.learner import AdapterLearner, PolicyBatch, UpdateStats, metric_prefix
from marft.assemble import build_trainer


@pytest.fixture
def overrides(tiny_model_dir, vowel_env_path, tmp_path):
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "task.kind=custom",
            f"task.env={vowel_env_path}:Vowel", "task.options={}", "rollout.max_new_tokens=3", "rollout.episodes=8",
            "rollout.temperature=1.0", "train.lr=1e-2", "train.epochs=2", "train.minibatch_size=4",
            "train.micro_batch_size=2", "team.max_new_tokens={}", f"output_dir={tmp_path / 'run'}"]


def planned(overrides, trained=None):
    """A trainer, its first rollout and the plan of its policy update (every random choice made)."""
    cfg = load_config("configs/duo_arithmetic.yaml", overrides)
    team, models, make_env = prepare(cfg)
    tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    out = tr.play(0)
    plan = tr.plan_policy(out, tr.targets(out), trained or team.names)
    return tr, out, plan


def weights(models, adapter):
    return {k: v.clone() for k, v in models.adapter_state(adapter).items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_update_reports_its_steps_work_and_gap(overrides):
    tr, out, plan = planned(overrides)
    rows, orders = plan["adapters"]["solver"]
    batch = PolicyBatch.of(out.turns, plan["advantages"], rows, orders)
    assert [t.agent for t in batch.turns] == ["solver"] and len(batch.rows) == 8
    before = weights(tr.models, "solver")
    seen = []
    st = AdapterLearner(tr.cfg, tr.models, "solver").update(batch, 0, on_update=seen.append)
    assert isinstance(st, UpdateStats)
    assert st.outcomes == seen == [True] * 4 and st.steps == 4 and st.updates_skipped == 0  # 2 epochs x 8 rows / 4
    assert st.micro_batches_skipped == 0 and not st.early_stop
    # the fast path reuses the first minibatch's own pass: only the other 4 rows are recomputed
    assert len(st.logprob_gap) == 4 and all(n > 0 for _, n in st.logprob_gap)
    assert 0 < st.behaviour_flops < st.learner_flops and st.behaviour_s > 0
    assert st.grad_norm > 0 and 0 <= st.clip_fraction <= 1
    assert list(st.metrics(metric_prefix("solver", 2))) == [
        "solver/policy_loss", "solver/entropy", "solver/approx_kl", "solver/clip_fraction", "solver/kl_ref",
        "solver/grad_norm", "solver/early_stop"]
    assert metric_prefix("team", 1) == "" and metric_prefix("team", 2) == "team/"
    assert not same(before, weights(tr.models, "solver"))


@pytest.mark.parametrize("extra", [[], ["train.algorithm=marft-token", "train.fast=false", "train.kl_coef=0.1"]])
def test_the_adapters_own_turns_learn_what_the_whole_rollout_does(overrides, extra):
    """PolicyBatch.of keeps only the turns the rows use, renumbered: the same update, bit for bit."""
    tr, out, plan = planned(overrides + extra)
    rows, orders = plan["adapters"]["solver"]
    start = weights(tr.models, "solver")
    results = []
    for batch in (PolicyBatch(out.turns, plan["advantages"], rows, orders),
                  PolicyBatch.of(out.turns, plan["advantages"], rows, orders)):
        tr.models.load_adapter_state("solver", start)
        st = AdapterLearner(tr.cfg, tr.models, "solver").update(batch, 0)
        results.append((st.metrics(), st.logprob_gap, st.learner_flops, weights(tr.models, "solver")))
    (m0, g0, f0, w0), (m1, g1, f1, w1) = results
    assert m0 == m1 and g0 == g1 and f0 == f1 and same(w0, w1)
    assert len(plan["advantages"]) == len(out.turns) > len(PolicyBatch.of(out.turns, plan["advantages"], rows, orders).turns)


def test_skipped_updates_are_reported_as_they_happen(overrides, monkeypatch):
    tr, out, plan = planned(overrides)
    rows, orders = plan["adapters"]["solver"]
    batch = PolicyBatch.of(out.turns, plan["advantages"], rows, orders)
    original = losses.ppo_policy_loss
    monkeypatch.setattr(losses, "ppo_policy_loss", lambda *a, **k: (lambda r: (r[0] * float("nan"), r[1]))(original(*a, **k)))
    before = weights(tr.models, "solver")
    logged = []
    st = AdapterLearner(tr.cfg, tr.models, "solver", log=logged.append).update(batch, 3)
    assert st.outcomes == [False] * 4 and st.steps == 0 and st.micro_batches_skipped == 8  # 2 micro-batches each
    assert st.policy_loss == st.grad_norm == 0.0  # means over no step
    assert sum("non-finite loss for agent solver at iteration 3; micro-batch skipped" in x for x in logged) == 8
    assert sum("update of adapter solver was skipped at iteration 3" in x for x in logged) == 4
    assert same(before, weights(tr.models, "solver"))

    class Stop(Exception):
        pass

    def stop_at_first_skip(good):
        if not good:
            raise Stop
    with pytest.raises(Stop):  # what the trainer does at train.max_bad_updates: the update ends there
        AdapterLearner(tr.cfg, tr.models, "solver", log=logged.append).update(batch, 3, on_update=stop_at_first_skip)
    assert same(before, weights(tr.models, "solver"))


def test_the_ray_learner_updates_exactly_as_the_trainer_does(overrides, monkeypatch):
    """The Ray policy part (marft.distributed.RayPolicy) sends each learner its adapter's batch as Ray
    would (pickled: the padded turns only), and the learner (a plain object here) updates exactly as
    the trainer's in-process learner: the same metrics, outcomes and weights."""
    from types import SimpleNamespace

    from marft.distributed import parts

    tr, out, plan = planned(overrides, trained=["solver"])
    targets = tr.targets(out)
    start = weights(tr.models, "solver")
    actor = Learner(tr.cfg, "solver", threads=torch.get_num_threads())
    assert isinstance(actor.learner, AdapterLearner) and not hasattr(actor, "trainer")  # no Trainer inside
    actor.load(start, copy.deepcopy(tr.policy.learners["solver"].optimizer.state_dict()))
    local_stats, local_updated = tr.update_policy(out, targets, ["solver"])  # the same plan: seeded by the iteration
    local_weights = weights(tr.models, "solver")

    sent, results = [], []

    def put(job):  # what Ray's store holds: the job as pickled, its packed rows left out
        job["batch"].packed_rows()
        received = pickle.loads(pickle.dumps(job))
        sent.append({**received, "packed": received["batch"].packed})  # before the learner packs its rows
        return received

    def update(job):
        results.append(actor.update(job))
        return results[-1]

    monkeypatch.setattr(parts, "_ray", lambda: SimpleNamespace(put=put))
    cluster = SimpleNamespace(bytes=dict.fromkeys(("learner_in", "learner_out"), 0), log=tr.log,
                              get=lambda refs, what: list(refs))
    ray_policy = parts.RayPolicy.__new__(parts.RayPolicy)
    ray_policy.cluster, ray_policy.cfg, ray_policy.models = cluster, tr.cfg, tr.models
    ray_policy.learners = {"solver": [SimpleNamespace(update=SimpleNamespace(remote=update))]}
    tr.models.load_adapter_state("solver", start)
    tr.policy = ray_policy
    stats, updated = tr.update_policy(out, targets, ["solver"])

    (job,) = sent
    assert job["packed"] is None and job["iteration"] == 0 and job["n_adapters"] == 1
    (res,) = results
    assert res["metrics"] == {k: v for k, v in local_stats.items() if k.startswith("solver/")}
    assert isinstance(res["stats"], UpdateStats) and res["stats"].outcomes == [True] * 4
    assert same(res["state"], local_weights) and same(weights(tr.models, "solver"), local_weights)
    assert stats == local_stats and updated == local_updated == ["solver"]
    assert cluster.bytes["learner_in"] > 0 and cluster.bytes["learner_out"] > 0
    assert actor.digest() != "" and res["messages"] == []
