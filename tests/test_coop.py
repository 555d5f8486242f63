"""Cooperative tasks (marft/envs/coop.py): per-agent observations, held-out problems that are
distinct texts never trained on, grading, and that no agent can do better than chance alone."""
from __future__ import annotations

import collections
import random
from functools import partial

import pytest

from marft.envs.check import check_env
from marft.envs.coop import WORDS, CoopEnv
from marft.errors import UserError

DUO = (["speaker", "solver"], ["solver"])
TRIO = (["speaker1", "speaker2", "solver"], ["solver"])


@pytest.mark.parametrize("name", ["sum", "lookup"])
def test_coop_envs_conform(name):
    assert check_env(partial(CoopEnv, name=name)) == []


def _episode(env, seed=None, index=None):
    env.reset(seed=seed, options={"split": "test", "index": index} if index is not None else None)
    return {a: env.observe(a) for a in env.possible_agents}


def test_each_agent_sees_only_its_own_part_and_the_critic_sees_all():
    env = CoopEnv(*TRIO, name="sum")
    obs = _episode(env, seed=7)
    item, *values = env.problem.meta["key"]
    assert env.problem.answer == sum(values)
    for a, v in zip(env.possible_agents, values):
        assert f"You hold {v} " in obs[a]
    assert len(set(obs.values())) == 3
    assert "boxed" in obs["solver"] and "boxed" not in obs["speaker1"]
    state = env.state()
    for a, v in zip(env.possible_agents, values):
        assert f"{a} holds {v}" in state

    env = CoopEnv(*DUO, name="lookup", entries=3)
    obs = _episode(env, seed=3)
    words, nums, asked = env.problem.meta["key"]
    assert len(words) == 3 and env.problem.answer == nums[asked]
    table = [f"{WORDS[w]}={v}" for w, v in zip(words, nums)]
    assert all(row in obs["speaker"] for row in table)
    assert not any(row in obs["solver"] for row in table)  # the solver holds the word, never the table
    assert all(row in env.state() for row in table)


@pytest.mark.parametrize("name,agents,kwargs", [("sum", DUO, {}), ("sum", TRIO, {}), ("lookup", DUO, {}),
                                                ("sum", DUO, {"max_value": 4, "items": 2})])
def test_held_out_problems_are_distinct_texts_never_trained_on(name, agents, kwargs):
    env = CoopEnv(*agents, name=name, **kwargs)
    size = env.num_problems("test")
    n = min(256, size) if size else 256
    test = [env.problem.prompt for i in range(n) if _episode(env, seed=i, index=i) is not None]
    assert len(set(test)) == n  # distinct until the held-out set runs out
    train = {env.problem.prompt for s in range(3000) if _episode(env, seed=s) is not None}
    assert not set(test) & train
    again = CoopEnv(*agents, name=name, **kwargs)
    assert [_episode(again, index=i) and again.problem.prompt for i in range(5)] == test[:5]
    other = CoopEnv(*agents, name=name, seed=1, **kwargs)
    if size is None or size > 20:
        assert [_episode(other, index=i) and other.problem.prompt for i in range(5)] != test[:5]


def test_a_small_task_says_how_many_problems_it_holds_out():
    env = CoopEnv(*DUO, name="sum", max_value=4, items=2)  # 25 held out: one item word x 5 x 5
    size = env.num_problems("test")
    assert size == 25
    assert len({_episode(env, index=i) and env.problem.prompt for i in range(size)}) == size
    with pytest.raises(ValueError, match="does not exist"):
        _episode(env, index=size)


@pytest.mark.parametrize("name,agents,chance,options", [("sum", DUO, 0.1, {}), ("sum", TRIO, 0.1, {}),
                                                         ("sum", TRIO, 0.1, {"relay": True}), ("lookup", DUO, 0.1, {})])
def test_alone_the_answering_agent_is_at_chance(name, agents, chance, options):
    """The best any policy can do from the solver's observation alone: for each observation text, the
    most frequent gold answer, learnt on 20,000 training problems and scored on 5,000 others. By
    construction that is the chance level (1 in 10 numbers)."""
    env = CoopEnv(*agents, name=name, **options)
    by_obs = collections.defaultdict(collections.Counter)
    for s in range(20000):
        _episode(env, seed=s)
        by_obs[env.observe("solver")][env.problem.answer] += 1
    right = 0
    for s in range(20000, 25000):
        _episode(env, seed=s)
        guess = by_obs[env.observe("solver")].most_common(1)
        right += bool(guess) and guess[0][0] == env.problem.answer
    assert right / 5000 < chance * 1.3
    # while the team, whose messages carry every part, determines the answer exactly
    seen = collections.defaultdict(set)
    for s in range(2000):
        _episode(env, seed=s)
        seen[env.state()].add(env.problem.answer)
    assert all(len(v) == 1 for v in seen.values())


@pytest.mark.parametrize("reply,correct,extracted", [
    ("3 + 4 = 7, so \\boxed{7}", True, True), ("\\boxed{8}", False, True), ("The answer is 7.", True, True),
    ("I do not know", False, False), ("\\boxed{seven}", False, True)])
def test_grading(reply, correct, extracted):
    env = CoopEnv(*DUO, name="sum")
    env.reset(seed=0)
    env.problem.answer = 7
    g = env.grade(env.problem, reply)
    assert (g.correct, g.extracted) == (correct, extracted)


def test_an_episode_rewards_the_team_for_the_solvers_answer():
    env = CoopEnv(*DUO, name="sum")
    env.reset(seed=5)
    env.step(f"I hold {env.problem.meta['key'][1]} things.")
    env.step(f"\\boxed{{{env.problem.answer}}}")
    assert env.rewards == {"speaker": 1.0, "solver": 1.0} and not env.agents
    assert env.infos["solver"]["success"]


@pytest.mark.parametrize("kwargs,msg", [
    ({"name": "product"}, "unknown coop task"), ({"max_value": -1}, "min_value"),
    ({"min_value": 5, "max_value": 2}, "min_value"), ({"items": 1}, "items"), ({"max_value": "9"}, "whole number"),
    ({"name": "lookup", "entries": 7}, "entries"), ({"test_share": 1.0}, "test_share"),
    ({"relay": 1}, "relay must be true or false"), ({"name": "lookup", "relay": True}, "relay is for the sum task")])
def test_bad_options_are_user_errors(kwargs, msg):
    with pytest.raises(UserError, match=msg):
        CoopEnv(*DUO, **kwargs)
    with pytest.raises(UserError, match="at least 2 agents"):
        CoopEnv(["solver"], ["solver"], name="sum")


def test_random_draws_cover_the_space():
    env = CoopEnv(*DUO, name="sum", max_value=2, items=4)  # train: 3 item words x 3 x 3
    keys = {(_episode(env, seed=random.Random(i).randrange(10**9)), env.problem.meta["key"])[1] for i in range(500)}
    assert keys == {(i, a, b) for i in range(3) for a in range(3) for b in range(3)}
    assert env.num_problems("test") == 9


@pytest.mark.parametrize("config", ["coop_duo_sum", "coop_trio_sum", "coop_trio_relay", "coop_duo_lookup"])
def test_coop_configs_train_and_evaluate_on_the_tiny_model(config, tiny_overrides, tmp_path):
    """Each shipped cooperative config trains (one iteration) and evaluates: the held-out problems
    are counted as distinct texts, and the ablation evaluates the solver without each speaker."""
    import json
    from pathlib import Path

    from marft.cli import main

    run = tmp_path / config
    args = ["train", str(Path(__file__).parents[1] / "configs" / f"{config}.yaml"), *tiny_overrides,
            "train.iterations=1", "train.eval_every=0", "eval.problems=6", "eval.before=false", f"output_dir={run}"]
    assert main(args) == 0
    final = json.loads((run / "eval_final.json").read_text())
    assert final["problems"] == 6 and final["distinct_problems"] == 6
    speakers = [a for a in final["agents"] if a != "solver"]
    for s in speakers:
        assert (run / f"eval_final_without_{s}.json").is_file()
    alone = run / f"eval_final_without_{'+'.join(speakers)}.json"  # the solver alone (in a duo: the one above)
    assert json.loads(alone.read_text())["without"] == speakers
    assert len(list(run.glob("eval_final_without_*.json"))) == len(speakers) + (len(speakers) > 1)
    machine = json.loads((run / "machine.json").read_text())  # every run folder says where it ran
    assert len(machine) == 1 and machine[0]["from_iteration"] == 0
    assert machine[0]["device"] == "cpu" and machine[0]["dtype"] == "float32" and machine[0]["cpu"]
    assert final["machine"]["dtype"] == "float32"
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["iteration"] == 1 and set(speakers) <= {k.split("/")[0] for k in first}


def test_the_solver_alone_still_gets_its_own_part_of_the_whole_problem():
    """An ablation builds the environment for part of the team: the parts are still dealt for the
    whole team and the answer is the whole team's, so the solver alone is at chance."""
    from marft.run.config import load_config
    from marft.team import build_team

    team = build_team(load_config("configs/coop_trio_sum.yaml").team)
    alone = team.without(["speaker1"]).without(["speaker2"])
    assert alone.names == ["solver"] and alone.whole == ["speaker1", "speaker2", "solver"]
    whole, part = CoopEnv(*TRIO, name="sum"), CoopEnv(["solver"], ["solver"], name="sum", team=alone.whole)
    for env in (whole, part):
        env.reset(seed=11)
    assert part.problem.answer == whole.problem.answer == sum(whole.problem.meta["key"][1:])
    assert part.observe("solver") == whole.observe("solver") and part.state() == whole.state()
    assert part.possible_agents == ["solver"]
    with pytest.raises(ValueError, match="not a part of the team"):
        CoopEnv(["solver", "speaker1"], ["solver"], team=TRIO[0])


def test_relay_asks_each_later_speaker_for_the_running_total():
    """relay: the first speaker states its number, each later one the total so far (its number
    added to what it heard), the solver adds its number to the last total; a duo is unchanged."""
    quartet = (["speaker1", "speaker2", "speaker3", "solver"], ["solver"])
    env = CoopEnv(*quartet, name="sum", relay=True, max_value=4)
    obs = _episode(env, seed=3)
    values = env.problem.meta["key"][1:]
    assert '"I hold' in obs["speaker1"] and "so far" not in obs["speaker1"]
    for k, a in ((1, "speaker2"), (2, "speaker3")):
        assert '"We hold T' in obs[a] and f"their number plus your {values[k]}." in obs[a], obs[a]
    assert "the team holds so far. Add your" in obs["solver"] and f"Add your {values[3]} to that number." in obs["solver"]
    plain = CoopEnv(*quartet, name="sum", max_value=4)
    assert _episode(plain, seed=3)["speaker1"] == obs["speaker1"] and env.state() == plain.state()
    assert "so far" not in _episode(plain, seed=3)["speaker2"]
    assert _episode(CoopEnv(*DUO, name="sum", relay=True), seed=3) == _episode(CoopEnv(*DUO, name="sum"), seed=3)


def test_the_relay_trio_starts_from_a_trained_duo(tiny_overrides, tiny_model_dir, tmp_path):
    """configs/coop_trio_relay_from_duo.yaml: the duo trains first; the trio's adapters start from its
    roles (speaker1 from the speaker, speaker2 and the solver from the solver)."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from test_rollout import make
    from marft.cli import main
    from marft.run.config import load_config

    configs = Path(__file__).parents[1] / "configs"
    duo = tmp_path / "duo"
    assert main(["train", str(configs / "coop_duo_sum.yaml"), *tiny_overrides, "train.iterations=1", "train.eval_every=0",
                 "eval.problems=2", "eval.before=false", "eval.ablate=false", f"output_dir={duo}"]) == 0
    shipped = load_config(configs / "coop_trio_relay_from_duo.yaml").model.init_adapters
    roles = {a: Path(p).name for a, p in shipped.items()}
    assert roles == {"speaker1": "speaker", "speaker2": "solver", "solver": "solver"}
    adapters = duo / "checkpoints" / "iter_000001" / "adapters"
    init = "{" + ", ".join(f"{a}: {adapters / r}" for a, r in roles.items()) + "}"
    cfg, _, trio = make(["team.preset=coop3", f"model.init_adapters={init}"], tiny_model_dir)
    trio.init_adapters(cfg.model.init_adapters)  # as a new run starts
    for a, r in roles.items():
        want, got = load_file(str(adapters / r / "adapter_model.safetensors")), trio.adapter_state(a)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert any(v.any() for k, v in want.items() if "lora_B" in k)  # trained: not LoRA's zero start
