"""The team: graphs, acting order, adapters, and what each agent's prompt contains."""
import pytest

from marft.run.config import load_config
from marft.team import agent_messages, build_team


def team_of(graph, names=("a", "b", "c", "d"), extra=()):
    agents = [f"team.agents={[{'name': n, 'prompt': f'You are {n}.'} for n in names]}"]
    return build_team(load_config(None, agents + [f"team.graph={graph}", *extra]).team)


def replies_for(team):
    return {n: f"<<reply of {n}>>" for n in team.names}


def seen_in_prompt(team, name):
    msgs = agent_messages(team[name], "PROBLEM", replies_for(team))
    text = msgs[-1]["content"]
    assert text.startswith("PROBLEM")
    return {n for n in team.names if f"<<reply of {n}>>" in text}


def test_chain_each_agent_sees_exactly_all_earlier():
    team = team_of("chain")
    assert team.names == ["a", "b", "c", "d"]
    for i, n in enumerate(team.names):
        assert seen_in_prompt(team, n) == set(team.names[:i])


def test_parallel_nobody_sees_anybody():
    team = team_of("parallel")
    for n in team.names:
        assert seen_in_prompt(team, n) == set()


def test_dag_order_and_visibility():
    # d acts first although listed last; b sees a and d; c sees only b
    team = team_of("{a: [d], b: [a, d], c: [b]}")
    assert team.names == ["d", "a", "b", "c"]
    assert seen_in_prompt(team, "d") == set()
    assert seen_in_prompt(team, "a") == {"d"}
    assert seen_in_prompt(team, "b") == {"a", "d"}
    assert seen_in_prompt(team, "c") == {"b"}
    # replies appear in acting order
    text = agent_messages(team["b"], "P", replies_for(team))[-1]["content"]
    assert text.index("<<reply of d>>") < text.index("<<reply of a>>")


def test_system_prompt_and_answering_defaults():
    team = team_of("chain", names=("x", "y"))
    msgs = agent_messages(team["x"], "obs", {})
    assert msgs == [{"role": "system", "content": "You are x."}, {"role": "user", "content": "obs"}]
    assert team.answering == ["y"]  # nobody marked as answering: the last agent answers


def test_adapters_own_shared_and_named():
    own = team_of("chain", names=("p", "s"))
    assert own.adapters == ["p", "s"]
    shared = team_of("chain", names=("p", "s"), extra=["team.share_adapter=true"])
    assert shared.adapters == ["team"] and {a.adapter for a in shared.agents} == {"team"}
    cfg = load_config(None, ["team.preset=trio", "team.agents.0.adapter=common", "team.agents.2.adapter=common"])
    team = build_team(cfg.team)
    assert team.adapters == ["common", "solver"]


def test_unknown_agent_lookup_is_a_user_error():
    from marft.errors import UserError

    with pytest.raises(UserError, match="unknown agent 'critic'; the team has a, b"):
        team_of("chain", names=("a", "b"))["critic"]


def test_reply_limits_by_agent_name_with_a_preset():
    from marft.errors import UserError

    team = build_team(load_config(None, ["team.preset=trio", "team.max_new_tokens={planner: 32, verifier: 8}"]).team)
    assert [(a.name, a.max_new_tokens) for a in team.agents] == [("planner", 32), ("solver", 0), ("verifier", 8)]
    with pytest.raises(UserError, match="team.max_new_tokens names agent 'planer', which is not in the team "
                                        r"\(planner, solver\); did you mean 'planner'\?"):
        load_config(None, ["team.max_new_tokens={planer: 32}"])
    # a limit for an agent of another team is left alone: the default config's planner limit with a code team
    coders = build_team(load_config(None, ["team.preset=code-duo", "team.max_new_tokens={planner: 32}"]).team)
    assert [a.max_new_tokens for a in coders.agents] == [0, 0]
    with pytest.raises(UserError, match="team.max_new_tokens.planner must be a positive number of tokens, got 0"):
        load_config(None, ["team.max_new_tokens={planner: 0}"])


def test_team_without_an_agent():
    from marft.run.config import load_config
    from marft.errors import UserError
    from marft.team import build_team

    team = build_team(load_config(None, ["team.preset=quartet"]).team)
    part = team.without(["reflector"])
    assert part.names == ["planner", "solver", "verifier"]
    assert part["verifier"].sees == ("planner", "solver")  # the reflector's message is gone
    assert part["solver"].adapter == "solver" and part["solver"].prompt == team["solver"].prompt
    assert team.without(["planner"])["solver"].sees == ()
    duo = build_team(load_config(None, ["team.preset=duo"]).team)
    with pytest.raises(UserError, match="leaves no answering agent"):
        duo.without(["solver"])
    with pytest.raises(UserError, match="unknown agent 'critic'"):
        duo.without(["critic"])


def test_eval_without_the_planner(tiny_overrides, tmp_path):
    import json

    from marft.cli import main

    out = tmp_path / "e.json"
    assert main(["eval", "configs/duo_arithmetic.yaml", *tiny_overrides, "eval.without=[planner]", f"eval.output={out}"]) == 0
    res = json.loads(out.read_text())
    assert res["without"] == ["planner"] and list(res["agents"]) == ["solver"]
