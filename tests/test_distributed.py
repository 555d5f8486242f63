"""Scale-out on Ray (marft.distributed) on a local two-CPU Ray cluster with the tiny model: one
rollout worker and one learner per adapter repeat the in-process run exactly (metrics, weights, and
across a checkpoint, and through ``marft train`` stopped and ``--resume``d; for dr-mas and at-grpo too, and with a learning
critic, which the driver keeps); with two workers every
worker holds the learners' weights after every update and the team learns; two data-parallel
learners per adapter (gloo) train as one; a rollout worker that dies mid-rollout is replaced (a
replacement that dies while starting too, up to ``cluster.max_worker_restarts``) and its shard
replayed exactly; a learner that dies stops the run with its checkpoint intact. The
shard/merge helpers and the cluster section's checks are tested without Ray."""
import json
import math
import os
import signal

import pytest
import torch

from marft.api import prepare
from marft.cli import main
from marft.run.config import load_config
from marft.errors import UserError
from marft.turns import merge_rollouts
from marft.run.checkpoints import latest_checkpoint
from marft.assemble import build_trainer
from marft.run.episodes import LocalEpisodes
from marft.run.trainer import Trainer
from marft.run.updates import LocalPolicy
from conftest import timeless

from test_train import snapshot, trainer_for, vowel_overrides  # noqa: F401 - fixtures

CLUSTER = ["cluster.rollout_workers=1", "cluster.worker_cpus=0.5", "cluster.learner_cpus=0.5", "threads=1"]
SMALL = ["rollout.episodes=8", "train.minibatch_size=4", "train.micro_batch_size=2", "rollout.max_new_tokens=4", "threads=1"]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'marft[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


MADE: list = []


@pytest.fixture(autouse=True)
def close_actors():
    """A failed test must not leave actors holding the cluster's CPUs for the next one; and the
    torch threads these runs set (threads=1) must not change the numerics of later test files."""
    threads = torch.get_num_threads()
    yield
    while MADE:
        MADE.pop().close()
    torch.set_num_threads(threads)


def distributed_for(overrides):
    """A trainer with the Ray parts (the config's cluster section asks for rollout workers)."""
    from marft.distributed import RayEpisodes, RayPolicy

    cfg = load_config("configs/duo_arithmetic.yaml", overrides)
    team, models, make_env = prepare(cfg)
    tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    MADE.append(tr)
    assert isinstance(tr.episodes, RayEpisodes) and isinstance(tr.policy, RayPolicy)
    return tr


def digests(tr) -> dict:
    """The adapter digests every rollout worker and every learner holds."""
    return {"workers": tr.episodes.digests(), "learners": tr.policy.digests()}


def comparable(m: dict) -> dict:
    """The metrics that do not depend on time or on where the run ran."""
    return timeless(m, also=("distributed/",))


# ---------------------------------------------------------------------------- without Ray
def test_shards_are_consecutive_and_balanced():
    from marft.distributed import shard

    items = list(range(10))
    parts = shard(items, 3)
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert shard(items[:2], 4) == [[0], [1]]  # never an empty shard
    assert [x for p in shard(items, 4) for x in p] == items


def test_merged_shards_are_the_whole_batch(vowel_overrides):
    tr = trainer_for(vowel_overrides + SMALL + ["task.horizon=2"])
    out = tr.play(0)
    E = len(out.steps)
    halves = [out.select(torch.arange(E) < 3), out.select(torch.arange(E) >= 3)]
    merged = merge_rollouts(halves, tr.team.names)
    assert torch.equal(merged.rewards, out.rewards) and torch.equal(merged.dones, out.dones)
    assert [(t.step, t.agent) for t in merged.turns] == [(t.step, t.agent) for t in out.turns]
    for a, b in zip(merged.turns, out.turns):
        order = torch.argsort(a.episodes)
        assert torch.equal(a.episodes[order], b.episodes)
        for name in ("prompt", "response"):  # the same tokens, whatever the padding
            ma, mb = getattr(a, f"{name}_mask")[order], getattr(b, f"{name}_mask")
            ia, ib = getattr(a, f"{name}_ids")[order], getattr(b, f"{name}_ids")
            assert [r[m].tolist() for r, m in zip(ia, ma)] == [r[m].tolist() for r, m in zip(ib, mb)]
        la, lb = a.logprobs[order], b.logprobs[order]
        assert all(torch.equal(x[m], y[n]) for x, m, y, n in zip(la, a.response_mask[order], lb, b.response_mask))
        assert [a.texts[i] for i in order] == b.texts


@pytest.mark.parametrize("override, message", [
    ("cluster.learners_per_adapter=0", "cluster.learners_per_adapter must be at least 1"),
    ("cluster.colocate=[[planner, critic]]", "cluster.colocate names 'critic', which is not one of the team's adapters"),
    ("cluster.colocate=[[planner], [planner, solver]]", "names adapter 'planner' in two groups"),
    ("cluster.worker_gpus=-1", "cluster.worker_gpus must be 0 or more"),
    ("cluster.address=somewhere", "cluster.address must be local, auto"),
])
def test_cluster_section_is_checked(override, message):
    with pytest.raises(UserError, match=message):
        load_config("configs/duo_arithmetic.yaml", [override])


@pytest.mark.parametrize("overrides, message", [
    (["model.device=cuda", "cluster.worker_gpus=1"], r"model.device is 'cuda' but cluster.learner_gpus is 0"),
    (["model.device=cuda:1", "cluster.learner_gpus=1"], r"model.device is 'cuda:1' but cluster.worker_gpus is 0"),
    (["cluster.learners_per_adapter=2", "train.fast=true", "cluster.learner_gpus=0.5"], "two ranks of an adapter on one GPU"),
])
def test_a_cluster_on_gpus_is_checked(overrides, message):
    """Checked when the config loads, on any machine: actors see only the GPUs Ray gives them, and
    NCCL cannot join two ranks on one GPU."""
    with pytest.raises(UserError, match=message):
        load_config("configs/duo_arithmetic.yaml", ["cluster.rollout_workers=2", *overrides])


def test_each_actor_must_fit_on_one_node():
    """Totals that fit can leave Ray waiting for ever: a learner of 2 GPUs on nodes of 1 GPU each, a
    colocated pair's bundle on no node with its CPUs. Checked against each live node, in one line."""
    from types import SimpleNamespace

    from marft.distributed.parts import RayCluster

    def check(overrides, nodes):
        c = RayCluster.__new__(RayCluster)
        c.cfg = load_config("configs/duo_arithmetic.yaml", ["cluster.rollout_workers=2", *overrides])
        c.team = SimpleNamespace(adapters=["planner", "solver"])
        c._check_nodes(nodes)

    gpu_nodes = [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}]  # 2 GPUs in all, one a node
    check(["cluster.learner_gpus=1", "cluster.worker_gpus=0.5"], gpu_nodes)  # fits
    with pytest.raises(UserError, match=r"the learner of planner asks for 1 CPUs and 2 GPUs on one machine, but no node "
                                        r"of the Ray cluster has that much \(the most any node has: 8 CPUs, 1 GPUs\)"):
        check(["cluster.learner_gpus=2", "cluster.worker_gpus=0.5"], gpu_nodes)
    with pytest.raises(UserError, match=r"the colocated learners of planner, solver asks for 6 CPUs .* lower "
                                        r"cluster.learner_cpus / cluster.learner_gpus"):
        check(["cluster.learner_cpus=3", "cluster.colocate=[[planner, solver]]"], [{"CPU": 4}, {"CPU": 4}])
    with pytest.raises(UserError, match=r"a rollout worker asks for 3 CPUs and 0 GPUs"):
        check(["cluster.worker_cpus=3"], [{"CPU": 2}, {"CPU": 2}, {"CPU": 2}])
    check(["cluster.worker_cpus=3"], [{"CPU": 2}, {"CPU": 4}])  # one node large enough


def test_what_crosses_to_another_process_is_on_the_cpu():
    """An optimiser's state and adapter weights, nested as torch makes them, come back with every
    tensor on the CPU, detached, and everything else as it was."""
    from marft.distributed.actors import on_cpu

    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.sum().backward()
    opt.step()
    state = on_cpu(opt.state_dict())
    assert state["param_groups"] == opt.state_dict()["param_groups"]
    moved = state["state"][0]
    assert set(moved) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(t.device.type == "cpu" and not t.requires_grad for t in moved.values())
    assert torch.equal(moved["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert on_cpu({"a": [w, (w, 3)], "b": "x"})["a"][1][1] == 3
    from collections import namedtuple
    Pair = namedtuple("Pair", "weight n")
    moved = on_cpu(Pair(w, 2))
    assert type(moved) is Pair and moved.n == 2 and not moved.weight.requires_grad


# ---------------------------------------------------------------------------- on Ray
@pytest.mark.ray
def test_one_worker_repeats_the_in_process_run_and_resumes(ray_cluster, vowel_overrides, tmp_path):
    local = trainer_for(vowel_overrides + SMALL)
    expected = [comparable(local.iteration_step()) for _ in range(2)]
    dist = distributed_for(vowel_overrides + SMALL + CLUSTER + [f"output_dir={tmp_path / 'd'}"])
    got = [comparable(dist.iteration_step())]
    ckpt = dist.save()
    dist.close()
    resumed = distributed_for(vowel_overrides + SMALL + CLUSTER + [f"output_dir={tmp_path / 'd'}"])
    resumed.load(ckpt)  # the optimiser states went from the learners into the checkpoint and back
    got.append(comparable(resumed.iteration_step()))
    assert got == expected
    mine, theirs = snapshot(resumed), snapshot(local)
    assert all(torch.equal(mine[a][k], theirs[a][k]) for a in mine for k in mine[a])
    d = digests(resumed)
    assert d["workers"][0] == {a: d["learners"][a][0] for a in d["learners"]}
    resumed.close()


@pytest.mark.ray
def test_a_learning_critic_on_ray_repeats_the_in_process_run_and_resumes(ray_cluster, vowel_overrides, tmp_path):
    """train.critic=lora on Ray: the driver keeps the critic (its adapter on the driver's model, sent to
    no worker or learner) and checkpoints it (adapters/critic, critic/); with one worker the run is
    the in-process one, metrics (value loss, explained variance) and the critic's adapter and heads,
    across a checkpoint."""
    over = vowel_overrides + SMALL + ["train.critic=lora"]
    local = trainer_for(over)
    expected = [comparable(local.iteration_step()) for _ in range(2)]
    assert "value_loss" in expected[0]
    dist = distributed_for(over + CLUSTER + [f"output_dir={tmp_path / 'd'}"])
    got = [comparable(dist.iteration_step())]
    ckpt = dist.save()
    dist.close()
    assert (ckpt / "critic" / "value_heads.safetensors").is_file() and (ckpt / "adapters" / "critic").is_dir()
    resumed = distributed_for(over + CLUSTER + [f"output_dir={tmp_path / 'd'}"])
    resumed.load(ckpt)
    got.append(comparable(resumed.iteration_step()))
    assert got == expected
    mine, theirs = resumed.models.adapter_state("critic"), local.models.adapter_state("critic")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert all(torch.equal(a, b) for a, b in zip(resumed.heads["team"].state_dict().values(),
                                                  local.heads["team"].state_dict().values()))
    assert "critic" not in digests(resumed)["workers"][0]
    resumed.close()


@pytest.mark.ray
def test_pipelined_on_ray_repeats_the_in_process_pipelined_run_and_resumes(ray_cluster, vowel_overrides, tmp_path):
    """Asynchronous training on Ray (train.max_staleness=1, pipelined): the rollout worker plays
    batch t with version t - 1, queued behind it while the learners train batch t - 1; with one
    worker it is the in-process pipelined run (generation threads on a replica), metrics and
    weights; stopped after iteration 2 (its checkpoint keeps version 1) and resumed, the same."""
    over = vowel_overrides + SMALL + ["train.max_staleness=1", "train.iterations=3"]
    timeless = lambda m: {k: v for k, v in comparable(m).items() if k not in ("async/ahead", "async/discarded")}  # noqa: E731
    local = trainer_for(over)
    expected = [timeless(local.iteration_step()) for _ in range(3)]
    local.close()
    assert [m["async/staleness_max"] for m in expected] == [0, 1, 1]
    dist = distributed_for(over + CLUSTER + [f"output_dir={tmp_path / 'd'}"])
    got = [timeless(dist.iteration_step()) for _ in range(2)]
    ckpt = dist.save()
    dist.close()
    resumed = distributed_for(over + CLUSTER + [f"output_dir={tmp_path / 'd'}"])
    resumed.load(ckpt)
    got.append(timeless(resumed.iteration_step()))
    assert got == expected
    mine, theirs = snapshot(resumed), snapshot(local)
    assert all(torch.equal(mine[a][k], theirs[a][k]) for a in mine for k in mine[a])
    resumed.close()


@pytest.mark.ray
@pytest.mark.parametrize("algorithm", ["dr-mas", "at-grpo"])
def test_one_worker_repeats_the_in_process_run_of_a_group_baseline(ray_cluster, vowel_overrides, algorithm):
    """The critic-free multi-agent baselines on Ray: a two-step task, one shared adapter."""
    over = vowel_overrides + SMALL + [f"train.algorithm={algorithm}", "train.group_size=4", "task.horizon=2",
                                      "team.share_adapter=true"]
    local = trainer_for(over)
    expected = comparable(local.iteration_step())
    dist = distributed_for(over + CLUSTER)
    assert comparable(dist.iteration_step()) == expected
    mine, theirs = snapshot(dist), snapshot(local)
    assert all(torch.equal(mine[a][k], theirs[a][k]) for a in mine for k in mine[a])
    dist.close()


@pytest.mark.ray
@pytest.mark.slow  # over 15 s on 2 cores; kept out of the default suite (15 minutes), run with -m slow
def test_two_workers_hold_the_learners_weights_and_the_team_learns(ray_cluster, vowel_overrides):
    tr = distributed_for(vowel_overrides + CLUSTER + ["cluster.rollout_workers=2"])
    rewards = []
    for _ in range(16):
        m = tr.iteration_step()
        rewards.append(m["reward"])
        d = digests(tr)
        learners = {a: ranks[0] for a, ranks in d["learners"].items()}
        assert d["workers"] == [learners, learners]  # every worker acts with the weights just learned
        assert m["distributed/rollout_workers"] == 2 and m["distributed/bytes_weights"] > 0
    tr.close()
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.25, rewards


@pytest.mark.ray
def test_data_parallel_learners_give_one_learners_gradients(ray_cluster, vowel_overrides):
    from marft.distributed.actors import Learner
    from marft.run.learner import PolicyBatch

    overrides = vowel_overrides + SMALL + ["train.micro_batch_size=1"]  # 4 micro-batches: 2 per learner
    local = trainer_for(overrides)
    out = local.play(0)
    targets = local.targets(out)
    plan = local.plan_policy(out, targets, local.team.names)
    rows, orders = plan["adapters"]["solver"]
    job = {"iteration": 0, "batch": PolicyBatch.of(out.turns, plan["advantages"], rows, orders), "n_adapters": 2}
    cfg = local.cfg
    one = Learner(cfg, "solver", threads=1).gradients(job)
    remote = ray_cluster.remote(Learner).options(num_cpus=0.5)
    pair = [remote.remote(cfg, "solver", 1, rank, 2) for rank in range(2)]
    host, port = ray_cluster.get(pair[0].address.remote())
    ray_cluster.get([p.join.remote(host, port) for p in pair])
    both = ray_cluster.get([p.gradients.remote(job) for p in pair])
    for g in both:
        assert len(g) == len(one)
        for a, b in zip(g, one):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(*both))  # the two ranks hold the same sum
    assert any(float(g.abs().sum()) > 0 for g in one)
    for p in pair:
        ray_cluster.kill(p)


@pytest.mark.ray
@pytest.mark.slow  # over 15 s on 2 cores; kept out of the default suite (15 minutes), run with -m slow
def test_two_learners_per_adapter_train_as_one_through_the_trainer(ray_cluster, vowel_overrides):
    """``cluster.learners_per_adapter=2`` through the real trainer with the Ray parts for three iterations:
    each adapter's two gloo learners (one micro-batch of each minibatch each, gradients summed)
    give the one-process run's metrics and weights, within float tolerance; both ranks and the
    worker hold the same weights."""
    local = trainer_for(vowel_overrides + SMALL)
    expected = [comparable(local.iteration_step()) for _ in range(3)]
    tr = distributed_for(vowel_overrides + SMALL + CLUSTER + ["cluster.learners_per_adapter=2", "cluster.learner_cpus=0.25"])
    got = [comparable(tr.iteration_step()) for _ in range(3)]
    assert len(tr.policy.learners["solver"]) == 2
    for e, g in zip(expected, got):
        # the behaviour/learner log-prob gap is reported from rank 0's micro-batches only (a half of them)
        e.pop("rollout/logprob_gap", None), g.pop("rollout/logprob_gap", None)
        assert e.keys() == g.keys()
        for k in e:
            close = isinstance(e[k], float) and math.isclose(e[k], g[k], rel_tol=1e-5, abs_tol=1e-7)
            assert close or e[k] == g[k], (e["iteration"], k, e[k], g[k])
    mine, theirs = snapshot(tr), snapshot(local)
    assert all(torch.allclose(mine[a][k], theirs[a][k], rtol=1e-5, atol=1e-7) for a in mine for k in mine[a])
    d = digests(tr)
    assert all(len(set(ranks)) == 1 for ranks in d["learners"].values())  # the ranks agree
    assert d["workers"][0] == {a: ranks[0] for a, ranks in d["learners"].items()}
    tr.close()


DYING_ENV = '''
import os
from pathlib import Path
from marft.envs.base import TurnBasedEnv, Problem, Grade

DIE, BROKEN = Path(__file__).with_suffix(".die"), Path(__file__).with_suffix(".broken")
if BROKEN.exists() and int(BROKEN.read_text()) > 0:  # BROKEN counts the processes that fail to load this file
    BROKEN.write_text(str(int(BROKEN.read_text()) - 1))
    raise RuntimeError("this replacement is broken")

class Dying(TurnBasedEnv):
    """The vowel task, whose process exits the first time it grades while DIE exists."""
    def new_problem(self, rng, split, index):
        return Problem("Say a word.", None)
    def grade(self, problem, reply):
        if DIE.exists():
            DIE.unlink()
            os._exit(1)
        return Grade(reply.strip()[:1].lower() in tuple("aeiou"), True)
'''


@pytest.mark.ray
def test_a_rollout_worker_that_dies_is_replaced_and_its_shard_replayed_exactly(ray_cluster, vowel_overrides, tmp_path):
    """Real actors: the worker's process exits in the middle of iteration 2's rollout (while grading,
    after both agents generated); its first replacement dies while starting (the environment file
    fails to load), the second takes over and replays the shard with the same seeds, so iteration 2's
    metrics and the weights after it equal an undisturbed run's. In iteration 3 the same again goes
    past cluster.max_worker_restarts=3: the run stops with one line naming the last cause."""
    env = tmp_path / "dying.py"
    env.write_text(DYING_ENV)
    die, broken = env.with_suffix(".die"), env.with_suffix(".broken")
    over = vowel_overrides + SMALL + [f"task.env={env}:Dying"]
    local = trainer_for(over)
    expected = [comparable(local.iteration_step()) for _ in range(2)]
    tr = distributed_for(over + CLUSTER + ["cluster.max_worker_restarts=3"])
    first = tr.iteration_step()
    die.touch()  # the worker dies in the middle of the next rollout
    broken.write_text("1")  # and so does its first replacement, while starting
    second = tr.iteration_step()
    assert not die.exists() and broken.read_text() == "0"  # both happened
    assert first["distributed/worker_restarts"] == 0 and second["distributed/worker_restarts"] == 2
    assert [comparable(first), comparable(second)] == expected  # the replay is exact
    mine, theirs = snapshot(tr), snapshot(local)
    assert all(torch.equal(mine[a][k], theirs[a][k]) for a in mine for k in mine[a])
    d = digests(tr)
    assert d["workers"][0] == {a: d["learners"][a][0] for a in d["learners"]}
    die.touch()  # restart 3 (allowed), then 4 while starting: past the cap
    broken.write_text("1")
    with pytest.raises(UserError, match=r"rollout workers died 4 times \(more than cluster.max_worker_restarts=3\); "
                                        r"the last one while starting \(.*this replacement is broken.*\) at iteration 3"):
        tr.iteration_step()
    tr.close()


@pytest.mark.ray
def test_a_rollout_worker_that_dies_while_playing_ahead_is_replaced_exactly(ray_cluster, vowel_overrides, tmp_path):
    """Asynchronous (train.max_staleness=1, pipelined): the worker dies grading batch 0, with batch 1
    queued behind it; the replacement gets batch 0's version, plays its shard again, and takes
    batch 1 (and its version) again, so the run equals the in-process pipelined run."""
    env = tmp_path / "dying.py"
    env.write_text(DYING_ENV)
    over = vowel_overrides + SMALL + [f"task.env={env}:Dying", "train.max_staleness=1", "train.iterations=3"]
    timeless = lambda m: {k: v for k, v in comparable(m).items() if k not in ("async/ahead", "async/discarded")}  # noqa: E731
    local = trainer_for(over)
    expected = [timeless(local.iteration_step()) for _ in range(3)]
    local.close()
    tr = distributed_for(over + CLUSTER + ["cluster.max_worker_restarts=3"])
    env.with_suffix(".die").touch()  # the worker dies the first time it grades
    got = [tr.iteration_step() for _ in range(3)]
    assert not env.with_suffix(".die").exists()
    assert [m["distributed/worker_restarts"] for m in got] == [1, 0, 0]
    assert [timeless(m) for m in got] == expected
    mine, theirs = snapshot(tr), snapshot(local)
    assert all(torch.equal(mine[a][k], theirs[a][k]) for a in mine for k in mine[a])
    tr.close()


@pytest.mark.ray
def test_a_learner_that_dies_stops_the_run_with_its_checkpoint_intact(ray_cluster, vowel_overrides, tmp_path):
    tr = distributed_for(vowel_overrides + SMALL + CLUSTER + [f"output_dir={tmp_path / 'run'}"])
    tr.iteration_step()
    ckpt = tr.save()
    ray_cluster.kill(tr.policy.learners["solver"][0])
    with pytest.raises(UserError, match=r"the learner of adapter solver died at iteration 2 .*checkpoint.*is intact: marft train --resume"):
        tr.iteration_step()
    assert latest_checkpoint(tmp_path / "run") == ckpt and (ckpt / "trainer.pt").is_file()
    tr.close()


@pytest.mark.ray
@pytest.mark.slow  # over 15 s on 2 cores; kept out of the default suite (15 minutes), run with -m slow
def test_train_command_on_ray_stopped_and_resumed_matches_one_process(ray_cluster, vowel_overrides, tmp_path, monkeypatch):
    """``marft train`` on Ray, stopped by Ctrl-C during iteration 1 (it writes a checkpoint and exits
    130) and continued with ``marft train --resume`` through the command line, ends as the
    one-process run that was never interrupted: metrics, weights and final evaluation."""
    base = vowel_overrides + SMALL + ["train.iterations=2", "eval.problems=2", "eval.before=false"]
    assert main(["train", "configs/duo_arithmetic.yaml", *base, f"output_dir={tmp_path / 'local'}"]) == 0
    step = Trainer.iteration_step

    def interrupted(self):  # Ctrl-C as iteration 1 of the Ray run begins
        if self.iteration == 0 and self.cfg.cluster.rollout_workers > 0:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self)

    monkeypatch.setattr(Trainer, "iteration_step", interrupted)
    ray_run = tmp_path / "ray"
    assert main(["train", "configs/duo_arithmetic.yaml", *base, *CLUSTER, f"output_dir={ray_run}"]) == 130
    assert latest_checkpoint(ray_run).name == "iter_000001" and not (ray_run / "eval_final.json").exists()
    monkeypatch.setattr(Trainer, "iteration_step", step)
    assert main(["train", "--resume", str(ray_run)]) == 0
    read = lambda d: [comparable(json.loads(x)) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert len(read("ray")) == 2 and read("ray") == read("local")
    lines = (ray_run / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x)["distributed/bytes_rollout"] > 0 for x in lines)  # both iterations ran on Ray
    a, b = latest_checkpoint(tmp_path / "local"), latest_checkpoint(ray_run)
    assert a.name == b.name == "iter_000002"
    weights = sorted(a.rglob("*.safetensors"))
    assert weights and all(f.read_bytes() == (b / f.relative_to(a)).read_bytes() for f in weights)
    ev = lambda d: json.loads((tmp_path / d / "eval_final.json").read_text())["per_problem_success"]  # noqa: E731
    assert ev("ray") == ev("local")


@pytest.mark.ray
def test_more_gpus_than_the_cluster_has_is_one_line(ray_cluster, vowel_overrides):
    with pytest.raises(UserError, match=r"asks for 1 GPUs .* but the Ray cluster has 0"):
        distributed_for(vowel_overrides + SMALL + CLUSTER + ["cluster.worker_gpus=1"])


def test_local_trainer_is_untouched_by_the_cluster_section(vowel_overrides):
    tr = trainer_for(vowel_overrides + SMALL)
    assert type(tr) is Trainer and tr.cfg.cluster.rollout_workers == 0
    assert type(tr.episodes) is LocalEpisodes and type(tr.policy) is LocalPolicy  # no Ray part


@pytest.mark.ray
def test_colocated_learners_share_one_placement_group(ray_cluster, vowel_overrides):
    from ray.util.placement_group import placement_group_table

    tr = distributed_for(vowel_overrides + SMALL + CLUSTER + ["cluster.colocate=[[planner, solver]]"])
    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1 and groups[0]["strategy"] == "STRICT_PACK"
    m = tr.iteration_step()
    assert m["iteration"] == 1 and "planner/policy_loss" in m and "solver/policy_loss" in m


def test_an_actors_cause_of_death_is_named():
    """An actor that died of an error in its constructor: the run's one line names that error."""
    from marft.distributed.parts import _cause

    msg = ("The actor died because of an error raised in its creation task, ray::Learner.__init__()\n"
           "Traceback (most recent call last):\n  File \"actors.py\", line 29, in _build\n"
           "ImportError: cannot import name 'prepare' from 'marft.cli'\n")
    assert _cause(RuntimeError(msg)) == "ImportError: cannot import name 'prepare' from 'marft.cli'"
    assert _cause(RuntimeError("The actor is dead because its worker process has died.")) == "RuntimeError"


def test_a_replacement_worker_that_dies_while_starting_is_replaced_too(monkeypatch):
    """RayEpisodes._replace_worker with stand-ins for Ray and the actors: the first replacement dies
    while loading the adapters, the second takes them; both count as restarts, and past
    cluster.max_worker_restarts the run stops with one line naming the cause."""
    import types

    pytest.importorskip("ray", reason="Ray is not installed (pip install 'marft[ray]')")
    import ray.exceptions

    from marft.distributed import parts

    class Call:
        def __init__(self, ok, why=""):
            self.ok, self.why = ok, why

    class Worker:
        def __init__(self, ok):
            self.loaded = None
            self.set_adapters = types.SimpleNamespace(remote=lambda version, states: self._set(ok, version, states))

        def _set(self, ok, version, states):
            if ok:
                self.loaded = (version, states)
            return Call(ok, "ImportError: no module named broken")

    class FakeRay:
        exceptions = ray.exceptions
        killed: list = []

        def kill(self, actor, no_restart):
            self.killed.append(actor)

        def get(self, call):
            if not call.ok:
                raise ray.exceptions.RayActorError(error_msg=call.why)
            return None

    fake = FakeRay()
    monkeypatch.setattr(parts, "_ray", lambda: fake)
    t = parts.RayEpisodes.__new__(parts.RayEpisodes)
    fresh = iter([Worker(False), Worker(True), Worker(False), Worker(False)])
    lines: list = []
    t.cfg = types.SimpleNamespace(cluster=types.SimpleNamespace(max_worker_restarts=3))
    t.cluster = types.SimpleNamespace(iteration=4, run_dir="runs/r", log=lines.append,
                                      team=types.SimpleNamespace(adapters=["planner", "solver"]))
    t.restarts, t.version = 0, 7
    t.models = types.SimpleNamespace(adapter_state=lambda a: {"w": a})
    t._new_worker = lambda: next(fresh)
    dead = Worker(True)
    t.workers = [dead]
    t._replace_worker(0, "while playing (ActorDiedError)")
    assert t.restarts == 2 and t.workers[0].loaded == (7, {"planner": {"w": "planner"}, "solver": {"w": "solver"}})
    assert "while starting (ImportError: no module named broken)" in lines[1] and fake.killed[0] is dead
    with pytest.raises(UserError, match=r"died 4 times \(more than cluster.max_worker_restarts=3\); the last one while "
                                        r"starting \(ImportError: no module named broken\) at iteration 5"):
        t._replace_worker(0, "while playing (ActorDiedError)")


def test_an_adapter_load_that_fails_on_a_live_worker_stops_the_run(monkeypatch):
    """Asynchronous training queues adapter loads on the workers without waiting; one that raised
    (the worker alive) would have played its batch with the adapters before. It is looked at once
    the worker's batch is back: one line, not a batch silently stamped with the wrong version."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'marft[ray]')")
    import ray.exceptions

    from marft.distributed import parts

    class FakeRay:
        exceptions = ray.exceptions

        def get(self, ref):
            if ref == "bad":
                raise ray.exceptions.RayTaskError("set_adapters", "Traceback ...\nValueError: shapes differ",
                                                  ValueError("shapes differ"))
            if ref == "dead":
                raise ray.exceptions.RayActorError(error_msg="ActorDiedError")
            return None

    monkeypatch.setattr(parts, "_ray", lambda: FakeRay())
    t = parts.RayEpisodes.__new__(parts.RayEpisodes)
    t.loads = {0: ["ok", "dead"], 1: ["ok", "bad"]}
    t._check_loads(0)  # a dead worker's loads: its batch is replayed elsewhere, no error here
    assert 0 not in t.loads
    with pytest.raises(UserError, match=r"rollout worker 1 could not load the adapters it was sent \(ValueError: shapes "
                                        r"differ\); the run stops"):
        t._check_loads(1)


def test_an_error_inside_a_learner_stops_the_run_in_one_line(monkeypatch, tmp_path):
    """A learner that raises (a CUDA out-of-memory, the actor alive) ends the run with one line
    naming the error and the checkpoint, as a learner that dies does (it was a raw Ray traceback)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'marft[ray]')")
    import ray.exceptions

    from marft.distributed import parts

    class FakeRay:
        exceptions = ray.exceptions

        def get(self, refs):
            raise ray.exceptions.RayTaskError("update", "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. "
                                              "Tried to allocate 2.00 GiB", RuntimeError("oom"))

    monkeypatch.setattr(parts, "_ray", lambda: FakeRay())
    cluster = parts.RayCluster.__new__(parts.RayCluster)
    cluster.run_dir, cluster.iteration = tmp_path, 3
    with pytest.raises(UserError, match=r"the learner of adapter solver failed at iteration 4 \(OutOfMemoryError: CUDA out "
                                        r"of memory\. Tried to allocate 2\.00 GiB\); the run stops, no checkpoint had been "
                                        r"written yet"):
        cluster.get(["ref"], "the learner of adapter solver")
