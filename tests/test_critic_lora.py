"""The learning critic (``train.critic: lora``): its own LoRA adapter on the shared base model and
a value head, trained together. With the adapter's learning rate at 0 its values are the frozen
critic's for the same heads; its gradients reach only its adapter and heads; it learns; a stopped
run resumes to the uninterrupted one; the critic-quality metrics; the settings that cannot work."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import marft
from marft.assemble import build_trainer
from marft.errors import UserError
from marft.maths.algorithms import TargetInputs, TurnTargets
from marft.run.assemble import prepare
from marft.run.config import load_config
from marft.run.trainer import critic_quality

sys.path.insert(0, str(Path(__file__).parent))
import test_unchanged as U  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MADE: list = []


@pytest.fixture(autouse=True)
def close_trainers():
    threads = torch.get_num_threads()
    yield
    while MADE:
        MADE.pop().close()
    torch.set_num_threads(threads)


def _trainer(tmp_path, *extra):
    cfg = load_config(str(ROOT / U.DUO), [*U.BASE, *U.ENV, *extra, f"output_dir={tmp_path / 'run'}"])
    team, models, make_env = prepare(cfg)
    tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
    MADE.append(tr)
    return tr


def _frozen_targets(tr, out):
    """The targets a frozen critic with these heads gives (the base model with every adapter off)."""
    return tr.algo.targets(TargetInputs(tr.cfg.train, tr.team.names, tr.models, tr.heads, tr._critic_work), out)


def _critic_weights(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.models.adapter_state("critic").items()}


@pytest.mark.parametrize("algorithm", ["marft", "marft-token", "ippo"])
def test_at_learning_rate_zero_the_learning_critic_is_the_frozen_one(tmp_path, algorithm):
    """LoRA starts with B = 0, so the adapter adds exactly nothing; at train.critic_lora_lr=0 it stays
    so, and the values through it equal the frozen base's for the same heads, bit for bit, before
    and after two iterations (the heads themselves learn)."""
    tr = _trainer(tmp_path, f"train.algorithm={algorithm}", "train.critic=lora", "train.critic_lora_lr=0")
    before = _critic_weights(tr)
    heads = {k: {n: p.clone() for n, p in h.state_dict().items()} for k, h in tr.heads.items()}
    out = tr.play(0)
    for mine, frozen in zip(tr.targets(out), _frozen_targets(tr, out)):
        assert torch.equal(mine.values, frozen.values) and torch.equal(mine.advantages, frozen.advantages)
    for _ in range(2):
        tr.iteration_step()
    after = _critic_weights(tr)
    assert all(torch.equal(before[n], after[n]) for n in before)  # lr 0: the adapter did not move
    assert any(not torch.equal(heads[k][n], h.state_dict()[n]) for k, h in tr.heads.items() for n in heads[k])
    out = tr.play(2)
    for mine, frozen in zip(tr.targets(out), _frozen_targets(tr, out)):
        assert torch.equal(mine.values, frozen.values)


@pytest.mark.parametrize("algorithm", ["marft", "marft-token", "ippo"])
def test_the_critic_update_reaches_only_its_adapter_and_heads(tmp_path, algorithm):
    tr = _trainer(tmp_path, f"train.algorithm={algorithm}", "train.critic=lora")
    out = tr.play(0)
    targets = tr.targets(out)
    critic = tr.critic
    for p in tr.models.bases[next(iter(tr.models.bases))].parameters():
        p.grad = None
    key, head = next(iter(critic.heads.items()))
    rows = [(i, r) for i, t in enumerate(out.turns) if key in ("team", t.agent) for r in range(len(t.episodes))][:3]
    critic._minibatch_loss(out, targets, head, rows, 0.5).backward()
    named = dict(tr.models.bases[next(iter(tr.models.bases))].named_parameters())
    touched = {n for n, p in named.items() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert touched and all(".critic." in n for n in touched), sorted(touched)[:5]
    assert any("lora_B.critic" in n for n in touched)  # B = 0 at the start: A's gradient is 0, B's is not
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in head.parameters())


def test_the_critic_adapter_never_acts_for_an_agent(tmp_path):
    """The critic's adapter, moved far from 0 and used between the agents' passes (its features),
    leaves the team's rollout as it was: the same replies and rollout log-probabilities, bit for bit.
    (Were it to act in an agent's pass, or stay acting after the critic's, they would differ.)"""
    tr = _trainer(tmp_path, "train.algorithm=marft", "train.critic=lora")
    first = tr.play(0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in tr.models.adapter_parameters("critic"):
            p.add_(torch.randn_like(p))  # B as well as A: the adapter now changes every layer it sits on
    values = tr.targets(first)[0].values  # the critic's pass, through its adapter
    assert not torch.equal(values, _frozen_targets(tr, first)[0].values)  # the adapter does act for the critic
    again = tr.play(0)
    for a, b in zip(first.turns, again.turns):
        assert a.agent == b.agent and torch.equal(a.response_ids, b.response_ids) and torch.equal(a.logprobs, b.logprobs)


def test_a_learning_critic_learns_and_says_how_well(tmp_path):
    """Three iterations: the adapter moves, the value loss is reported, and so is how much of the
    returns' variance the values explain, with each agent's mean absolute advantage."""
    tr = _trainer(tmp_path, "train.algorithm=marft", "train.critic=lora", "train.critic_lora_lr=1e-3", "train.iterations=3")
    before = _critic_weights(tr)
    metrics = [tr.iteration_step() for _ in range(3)]
    after = _critic_weights(tr)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for m in metrics:
        assert m["value_loss"] > 0 and "critic/explained_variance" in m
        assert m["critic/explained_variance"] <= 1.0
        assert all(m[f"{a}/abs_advantage"] > 0 for a in tr.team.names)



def _two_turns(rewards, values, returns, advantages):
    """A rollout of 4 one-step episodes, speaker then solver, and its targets, for critic_quality."""
    turns = [SimpleNamespace(agent=a, episodes=torch.arange(4)) for a in ("speaker", "solver")]
    out = SimpleNamespace(turns=turns, rewards=torch.tensor(rewards).view(4, 1), dones=torch.ones(4, 1, dtype=torch.bool))
    targets = [TurnTargets(torch.zeros(0), torch.tensor(v), torch.tensor(a), torch.tensor(r))
               for v, r, a in zip(values, returns, advantages)]
    return out, targets


def test_critic_quality_against_hand_computed_values():
    """Returns 1,0,1,0 on both turns; values 0.5 on the speaker's, 0.9,0.1,0.6,0.4 on the solver's:
    Var(R) = 2/7 and Var(R - V) = 1.34/7 (unbiased, over the 8 entries), so 1 - 1.34/2 = 0.33."""
    out, targets = _two_turns([1.0, 0, 1, 0], [[0.5] * 4, [0.9, 0.1, 0.6, 0.4]], [[1.0, 0, 1, 0]] * 2,
                              [[0.5, -0.5, 0.5, -0.5], [0.1, -0.1, 0.4, -0.4]])
    m = critic_quality(["speaker", "solver"], ["team"], False, out, targets)
    assert m["critic/explained_variance"] == pytest.approx(0.33, abs=1e-6)
    assert m["speaker/abs_advantage"] == pytest.approx(0.5) and m["solver/abs_advantage"] == pytest.approx(0.25)
    per_agent = critic_quality(["speaker", "solver"], ["speaker", "solver"], False, out, targets)
    assert per_agent["critic/explained_variance/speaker"] == pytest.approx(1 - 1 / 1)  # constant 0.5: the mean, 0
    assert per_agent["critic/explained_variance/solver"] == pytest.approx(1 - (0.34 / 3) / (1 / 3), abs=1e-6)


def test_critic_quality_says_nothing_of_a_batch_whose_rewards_are_all_the_same():
    """Every episode failed: the returns differ only by rounding in the bootstrapped values, so the
    ratio would be noise over noise (a run's batch at 0% gave -1.9e15); it is left out, the
    advantages are still reported."""
    out, targets = _two_turns([0.0] * 4, [[0.3, 0.2, 0.1, 0.0], [0.0] * 4], [[1e-9, 0, 2e-9, 0], [0.0] * 4],
                              [[-0.3, -0.2, -0.1, 0.0], [0.0] * 4])
    m = critic_quality(["speaker", "solver"], ["team"], False, out, targets)
    assert "critic/explained_variance" not in m and m["speaker/abs_advantage"] == pytest.approx(0.15)


def test_critic_quality_reads_only_the_steps_that_happened():
    """Every episode solved at its first step and ended (horizon 2): the rewards [1, 0] per episode
    differ only through the padding after the end, and the returns (all 1) by rounding alone; that
    batch gave -2.6e15 when the padding was compared. Omitted; and so are returns that vary by no
    more than rounding whatever the rewards."""
    turns = [SimpleNamespace(agent=a, episodes=torch.arange(8)) for a in ("speaker", "solver")]
    out = SimpleNamespace(turns=turns, rewards=torch.tensor([[1.0, 0.0]] * 8),
                          dones=torch.tensor([[True, False]] * 8))
    ret = torch.ones(8)
    ret[3] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # 1 + 2^-23: rounding in a bootstrapped value
    targets = [TurnTargets(torch.zeros(0), torch.full((8,), 0.9), torch.full((8,), 0.1), ret) for _ in turns]
    assert "critic/explained_variance" not in critic_quality(["speaker", "solver"], ["team"], False, out, targets)
    out.rewards[0, 0] = 0.5  # the rewards now differ, the returns still only by rounding
    targets = [TurnTargets(torch.zeros(0), torch.full((8,), 0.9), torch.full((8,), 0.1), 1 + 1e-7 * torch.rand(8))
               for _ in turns]
    assert "critic/explained_variance" not in critic_quality(["speaker", "solver"], ["team"], False, out, targets)

def test_ippo_reports_each_agents_critic(tmp_path):
    m = _trainer(tmp_path, "train.algorithm=ippo", "train.critic=lora").iteration_step()
    assert {"value_loss/planner", "value_loss/solver"} <= m.keys()
    assert any(k.startswith("critic/explained_variance/") for k in m)


def test_a_learning_critic_run_stopped_and_resumed_is_the_same_run(tmp_path):
    """The critic's adapter goes into the checkpoint with the agents' (adapters/critic) and its
    optimiser into trainer.pt: a run resumed after iteration 1 ends as the uninterrupted one."""
    over = [*U.BASE, *U.ENV, "train.algorithm=marft", "train.critic=lora", "train.critic_lora_lr=1e-3"]
    with marft.MarftTrainer(marft.load_config(str(ROOT / U.DUO), [*over, f"output_dir={tmp_path / 'a'}"]), log=None) as t:
        t.train()
    with marft.MarftTrainer(marft.load_config(str(ROOT / U.DUO), [*over, "train.iterations=1", f"output_dir={tmp_path / 'b'}"]),
                            log=None) as t:
        t.train()
    with marft.MarftTrainer.resume(tmp_path / "b", ["train.iterations=2"], log=None) as t:
        t.train()
    a, b = U.summarise(tmp_path / "a"), U.summarise(tmp_path / "b")
    assert (tmp_path / "a" / "checkpoints" / "iter_000002" / "adapters" / "critic" / "adapter_model.safetensors").is_file()
    assert a["metrics"] == b["metrics"] and a["evaluations"] == b["evaluations"]
    assert a["checkpoints"]["iter_000002"] == b["checkpoints"]["iter_000002"]
    state = lambda run: torch.load(run / "checkpoints" / "iter_000002" / "trainer.pt", weights_only=False)  # noqa: E731
    sa, sb = state(tmp_path / "a")["critic_adapter_opt"], state(tmp_path / "b")["critic_adapter_opt"]
    assert all(torch.equal(x, y) for k in sa["state"] for x, y in zip(sa["state"][k].values(), sb["state"][k].values()))


@pytest.mark.parametrize("extra,says", [
    (["train.critic=value"], "train.critic must be head or lora"),
    (["train.critic=lora", "train.algorithm=grpo", "train.group_size=2"], "grpo has no critic"),
    (["train.critic=lora", "train.critic_lora_lr=-1"], "train.critic_lora_lr must be 0"),
])
def test_learning_critic_settings_that_cannot_work_say_why(extra, says):
    with pytest.raises(UserError) as e:
        load_config(str(ROOT / U.DUO), ["rollout.episodes=4", *extra])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_agent_adapter_named_critic_is_one_line(tmp_path):
    with pytest.raises(UserError, match="train.critic lora adds an adapter named 'critic'"):
        _trainer(tmp_path, "train.critic=lora", "team.agents.0.adapter=critic")


@pytest.mark.parametrize("algorithm", ["marft", "ippo"])
def test_agents_on_base_models_of_other_widths(tmp_path, algorithm):
    """The solver on a wider base model (hidden 96 against the planner's 64): ippo's heads each read
    their own agent's base, at its width; marft's one team head reads every state through the first
    agent's base (one feature space). An iteration runs and gives a value to every turn."""
    from marft.engines.models import build_tiny_model

    wide = build_tiny_model(tmp_path / "wide", seed=2, hidden=96)
    tr = _trainer(tmp_path, f"train.algorithm={algorithm}", f"team.agents.1.model={wide}")
    assert len(tr.models.bases) == 2
    widths = {k: h.net[0].in_features for k, h in tr.heads.items()}
    assert widths == ({"planner": 64, "solver": 96} if algorithm == "ippo" else {"team": 64})
    m = tr.iteration_step()
    losses = [v for k, v in m.items() if k.startswith("value_loss")]
    assert len(losses) == (2 if algorithm == "ippo" else 1) and all(v == v for v in losses)  # numbers: every turn valued


def test_token_level_marft_needs_one_base_model(tmp_path):
    from marft.engines.models import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=2)
    with pytest.raises(UserError, match="marft-token's critic reads each reply's tokens, which needs the team on one base "
                                        "model"):
        _trainer(tmp_path, "train.algorithm=marft-token", f"team.agents.1.model={other}")


def test_the_critic_adapter_has_no_dropout_at_work(tmp_path):
    """model.lora.dropout > 0: the agents' adapters never drop (the model is in eval mode); the critic's
    adapter, added after, made its dropout in training mode: two passes over one state differed."""
    tr = _trainer(tmp_path, "train.critic=lora", "model.lora.dropout=0.5")
    from marft.maths.critic import state_features

    torch.manual_seed(0)
    states = ["Problem: 1 + 2\n[step 0] speaker: three"] * 2
    with torch.no_grad():
        for p in tr.models.adapter_parameters("critic"):
            p.add_(0.1)  # a trained adapter (B starts at 0, which would hide the dropout)
        a = state_features(tr.models, "speaker", states, adapter="critic")
        b = state_features(tr.models, "speaker", states, adapter="critic")
    assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm,critic", [("marft", "lora"), ("ippo", "head"), ("marft-token", "lora")])
def test_a_checkpoints_critic_is_saved_whole_and_scored_on_held_out_episodes(tmp_path, algorithm, critic):
    """A checkpoint holds its critic as a folder (value_heads.safetensors and critic.json; a learning
    critic's adapter in adapters/critic), trainer.pt only the optimisers (a learning critic's update
    counts in the MFU, mfu/critic_update); marft.evaluate on the checkpoint loads it and scores it on
    the held-out episodes. With one step, gamma 1 and the reward at the end, every turn's return is
    its episode's reward whatever train.lam (0.5 here: the scoring takes lambda 1, no value of a later
    state in the return), so the critic's mean return is the evaluation's mean reward; heads rewritten
    to a constant give that constant as every value; the critic's adapter is the checkpoint's."""
    from safetensors.torch import load_file, save_file

    from marft.run.checkpoints import read_critic

    over = [*U.BASE, *U.ENV, "task.horizon=1", "train.lam=0.5", f"train.algorithm={algorithm}", f"train.critic={critic}",
            "train.iterations=1", f"output_dir={tmp_path / 'run'}"]
    cfg = marft.load_config(str(ROOT / U.DUO), over)
    with marft.MarftTrainer(cfg, log=None) as t:
        metrics = t.train().metrics[-1]
        trained = {k: {n: p.detach().clone() for n, p in h.state_dict().items()} for k, h in t.trainer.heads.items()}
    # a learning critic's update is model work (forward and backward through its adapter): in the MFU
    assert (metrics.get("mfu/critic_update", 0) > 0) == (critic == "lora")
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000001"
    about, heads = read_critic(ckpt)
    assert about == {"kind": critic, "algorithm": algorithm, "adapter": "critic" if critic == "lora" else None,
                     "team": ["planner", "solver"], "heads": {k: trained[k]["net.0.weight"].shape[1] for k in trained}}
    assert heads.keys() == trained.keys() and all(torch.equal(heads[k][n], trained[k][n]) for k in trained for n in trained[k])
    assert "heads" not in torch.load(ckpt / "trainer.pt", weights_only=False)
    assert (ckpt / "adapters" / "critic").is_dir() == (critic == "lora")

    result = marft.evaluate(cfg, tmp_path / "run")
    got = result["critic"]
    assert got["kind"] == critic and got["algorithm"] == algorithm and got["heads"].keys() == trained.keys()
    n = result["problems"] * result["samples"]
    for key, h in got["heads"].items():
        if algorithm == "marft-token":  # a value before each reply token
            assert h["entries"] == result["generated_tokens"]
        else:
            assert h["entries"] == (2 * n if key == "team" else n)  # every turn of the team, or the agent's own
            assert h["mean_return"] == pytest.approx(result["mean_reward"], abs=1e-6)
        assert h["mse"] >= 0 and (h["explained_variance"] is None or h["explained_variance"] <= 1)
    assert "critic" not in marft.evaluate(cfg, tmp_path / "run", critic=False)
    assert "critic" not in marft.evaluate(cfg, tmp_path / "run", without=["planner"])

    # the heads read are the checkpoint's: a last layer of 0 with bias 0.25 values every state 0.25
    saved = load_file(ckpt / "critic" / "value_heads.safetensors")
    flat = {name: torch.zeros_like(t) + (0.25 if name.endswith("net.4.bias") else 0.0) if "/net.4." in name else t
            for name, t in saved.items()}
    save_file(flat, ckpt / "critic" / "value_heads.safetensors")
    constant = marft.evaluate(cfg, tmp_path / "run")["critic"]["heads"]
    for key, h in constant.items():
        assert h["mean_value"] == pytest.approx(0.25) and h["mean_return"] == pytest.approx(got["heads"][key]["mean_return"], abs=1e-6)
    if critic == "lora":  # the critic's adapter is the checkpoint's: another one moves the values
        save_file(saved, ckpt / "critic" / "value_heads.safetensors")
        weights = ckpt / "adapters" / "critic" / "adapter_model.safetensors"
        save_file({k: v + 0.05 if "lora_B" in k else v for k, v in load_file(weights).items()}, weights)
        moved = marft.evaluate(cfg, tmp_path / "run")["critic"]["heads"]
        assert all(moved[k]["mean_value"] != got["heads"][k]["mean_value"] for k in got["heads"])


def test_episodes_that_fail_are_left_out_of_the_critics_score(tmp_path):
    """As training leaves them out: an episode whose environment failed (its reward 0 whatever was
    said) is not a return the critic could have predicted."""
    common = [*U.BASE, "task.kind=custom", "task.options={}", f"task.env={U.TASK}:Breaks", "task.horizon=1", "eval.problems=6"]
    cfg = marft.load_config(str(ROOT / U.DUO), [*common, "train.iterations=0", "eval.before=false",
                                                f"output_dir={tmp_path / 'run'}"])
    with marft.MarftTrainer(cfg, log=None) as t:
        t.save()
    result = marft.evaluate(cfg, tmp_path / "run")
    assert result["failed_episodes"] == 3
    h = result["critic"]["heads"]["team"]
    assert h["entries"] == 2 * 3  # the three even problems' two turns
    assert h["mean_return"] == pytest.approx(result["mean_reward"] * 6 / 3, abs=1e-6)


def test_a_checkpoint_written_before_the_critic_had_its_folder_resumes(tmp_path):
    """Checkpoints of earlier versions keep the heads in trainer.pt: they resume (to the run that was
    not stopped) and their critic is read; a checkpoint with no heads at all is one line."""
    import shutil

    from marft.run.checkpoints import read_critic

    over = [*U.BASE, *U.ENV, "train.critic=lora"]
    with marft.MarftTrainer(marft.load_config(str(ROOT / U.DUO), [*over, f"output_dir={tmp_path / 'a'}"]), log=None) as t:
        t.train()
    with marft.MarftTrainer(marft.load_config(str(ROOT / U.DUO), [*over, "train.iterations=1", f"output_dir={tmp_path / 'b'}"]),
                            log=None) as t:
        t.train()
    ckpt = tmp_path / "b" / "checkpoints" / "iter_000001"
    about, heads = read_critic(ckpt)
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    torch.save({**state, "heads": heads}, ckpt / "trainer.pt")  # as written before critic/ existed
    shutil.rmtree(ckpt / "critic")
    old_about, old_heads = read_critic(ckpt)
    assert old_about == about and all(torch.equal(old_heads["team"][n], heads["team"][n]) for n in heads["team"])
    with marft.MarftTrainer.resume(tmp_path / "b", ["train.iterations=2"], log=None) as t:
        t.train()
    a, b = U.summarise(tmp_path / "a"), U.summarise(tmp_path / "b")
    assert a["metrics"] == b["metrics"] and a["checkpoints"]["iter_000002"] == b["checkpoints"]["iter_000002"]

    torch.save(state, ckpt / "trainer.pt")  # neither critic/ nor heads in trainer.pt
    (tmp_path / "b" / "checkpoints" / "latest").write_text("iter_000001")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "iter_000002")
    with pytest.raises(UserError, match="has no value head 'team'") as e:
        marft.MarftTrainer.resume(tmp_path / "b", ["train.iterations=2"], log=None)
    assert "\n" not in str(e.value)


def test_a_critic_that_does_not_fit_the_team_is_one_line(tmp_path):
    cfg = marft.load_config(str(ROOT / U.DUO), [*U.BASE, *U.ENV, "train.algorithm=ippo", "train.iterations=1",
                                                f"output_dir={tmp_path / 'run'}"])
    with marft.MarftTrainer(cfg, log=None) as t:
        t.train()
    other = marft.load_config(str(ROOT / U.DUO), [*U.BASE, *U.ENV, "team.agents.0.name=writer", "team.agents.0.adapter=planner",
                                                  f"output_dir={tmp_path / 'e'}"])
    with pytest.raises(UserError, match="for team planner, solver, which does not fit the team writer, solver") as e:
        marft.evaluate(other, tmp_path / "run")
    assert "\n" not in str(e.value)


def test_a_new_run_starts_from_a_trained_critic(tmp_path):
    """model.init_critic: a new run's heads and critic adapter are those of the checkpoint named (a run
    folder: its latest); a frozen critic's heads start a learning critic (its adapter fresh); what
    cannot fit is one line each."""
    from marft.run.checkpoints import read_critic

    def config(name, *extra):
        return marft.load_config(str(ROOT / U.DUO), [*U.BASE, *U.ENV, "train.iterations=1", *extra, f"output_dir={tmp_path / name}"])

    for name, critic in (("lora", "lora"), ("head", "head")):
        with marft.MarftTrainer(config(name, f"train.critic={critic}"), log=None) as t:
            t.train()
    saved = read_critic(tmp_path / "lora" / "checkpoints" / "iter_000001")[1]["team"]
    with marft.MarftTrainer(config("warm", "train.critic=lora", f"model.init_critic={tmp_path / 'lora'}"), log=None) as t:
        assert all(torch.equal(t.trainer.heads["team"].state_dict()[n], saved[n]) for n in saved)
        from safetensors.torch import load_file

        want = load_file(tmp_path / "lora" / "checkpoints" / "iter_000001" / "adapters" / "critic" / "adapter_model.safetensors")
        got = t.models.adapter_state("critic")
        assert len(got) == len(want) and all(torch.equal(got[k], want[k]) for k in want)
    frozen = read_critic(tmp_path / "head" / "checkpoints" / "iter_000001")[1]["team"]
    with marft.MarftTrainer(config("warm2", "train.critic=lora", f"model.init_critic={tmp_path / 'head' / 'checkpoints' / 'iter_000001'}"),
                            log=None) as t:
        assert all(torch.equal(t.trainer.heads["team"].state_dict()[n], frozen[n]) for n in frozen)
        assert all(not v.any() for k, v in t.models.adapter_state("critic").items() if "lora_B" in k)  # a fresh adapter
    for extra, says in ((["train.critic=head", f"model.init_critic={tmp_path / 'lora'}"], "is a learning one"),
                        (["train.algorithm=ippo", f"model.init_critic={tmp_path / 'head'}"], "start from a critic of the same algorithm"),
                        ([f"model.init_critic={tmp_path}"], "holds no saved critic")):
        with pytest.raises(UserError, match=says) as e:
            marft.MarftTrainer(config("refused", *extra), log=None)
        assert "\n" not in str(e.value) and not (tmp_path / "refused").exists()  # a failed start leaves no folder
    with pytest.raises(UserError, match="grpo has no critic"):
        config("grpo", "train.algorithm=grpo", "train.group_size=2", f"model.init_critic={tmp_path / 'head'}")
