"""Configuration: YAML + dotted overrides, presets, and one-line errors for bad input."""
import pytest

from marft.config import load_config, save_config
from marft.errors import UserError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_the_embedded_duo():
    cfg = load_config()
    assert cfg.model.name == "smollm2-135m"
    assert [a.name for a in cfg.team.agents] == ["planner", "solver"]
    assert [a.answers for a in cfg.team.agents] == [False, True]
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert cfg.task.kind == "reasoning_gym"


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "team: {preset: trio}\nrollout: {temperature: 0.5}\n")
    cfg = load_config(p, ["rollout.temperature=0.8", "team.agents.0.prompt=Plan briefly.",
                          "model.lora.target_modules=[q_proj, k_proj]", "rollout.top_k=5", "team.share_adapter=true"])
    assert cfg.rollout.temperature == 0.8 and isinstance(cfg.rollout.temperature, float)
    assert [a.name for a in cfg.team.agents] == ["planner", "solver", "verifier"]
    assert cfg.team.agents[0].prompt == "Plan briefly."
    assert cfg.model.lora.target_modules == ["q_proj", "k_proj"]
    assert cfg.rollout.top_k == 5 and cfg.team.share_adapter is True


def test_preset_from_override_and_anonymous_roles():
    cfg = load_config(None, ["team.preset=quartet-anon"])
    names = [a.name for a in cfg.team.agents]
    assert names == ["agent1", "agent2", "agent3", "agent4"]
    assert cfg.team.agents[2].prompt.startswith("You are agent 3 of 4")
    assert [a.answers for a in cfg.team.agents] == [False, True, False, True]


def test_saved_config_loads_back_identically(tmp_path):
    cfg = load_config(None, ["team.preset=trio", "rollout.episodes=7", "team.graph={solver: [planner], verifier: [solver]}"])
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg


BAD = [
    (["rollout.temprature=0.8"], "unknown key 'rollout.temprature' (did you mean 'rollout.temperature'?)"),
    (["rollout.temperature=hot"], "rollout.temperature must be a number, got 'hot'"),
    (["rollout.episodes=0"], "rollout.episodes must be at least 1"),
    (["rollout.top_p=1.5"], "rollout.top_p must be in (0, 1]"),
    (["model.lora.r=0"], "model.lora.r must be at least 1"),
    (["model.dtype=fp8"], "model.dtype must be auto, bfloat16, float16 or float32"),
    (["task.kind=chess"], "task.kind must be one of reasoning_gym, math, code, dataset, coop, workflow, custom"),
    (["task.kind=math"], "neither task.train_path nor task.test_path is set"),
    (["team.preset=octet"], "unknown team.preset 'octet'"),
    (["team.agents=[]"], "team.agents is empty; give at least one agent or a team.preset"),
    (["team.agents.5.prompt=x"], "index '5' in 'team.agents.5.prompt' is out of range"),
    (["team.agents.1.name=planner"], "agent name 'planner' is used twice"),
    (["team.graph={solver: [writer]}"], "team.graph.solver names agent 'writer', which is not in team.agents"),
    (["team.graph={planner: [solver], solver: [planner]}"], "team.graph has a cycle among planner, solver"),
    (["team.graph={solver: [solver]}"], "team.graph.solver lists itself"),
    (["team.graph=star"], "team.graph must be chain, parallel or a mapping"),
    (["temperature"], "override 'temperature' must look like key=value"),
    (["team.agents.0.answers=maybe"], "team.agents.0.answers must be true or false, got 'maybe'"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_config_gives_one_line_error(overrides, message):
    with pytest.raises(UserError) as e:
        load_config(None, overrides)
    text = str(e.value)
    assert message in text
    assert "\n" not in text


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="config file .*nope.yaml not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="not valid YAML at line 3"):
        load_config(write(tmp_path, "model:\n  name: [unclosed\n"))
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(UserError, match="config: unknown key 'modle'"):
        load_config(write(tmp_path, "modle: {name: x}\n"))


@pytest.mark.parametrize("algorithm", ["dr-mas", "at-grpo"])
def test_group_baselines_are_algorithms_with_groups_of_one_problem(algorithm):
    cfg = load_config(None, [f"train.algorithm={algorithm}", "rollout.episodes=12", "train.group_size=3"])
    assert cfg.train.algorithm == algorithm
    with pytest.raises(UserError) as e:
        load_config(None, [f"train.algorithm={algorithm}", "rollout.episodes=10", "train.group_size=4"])
    assert str(e.value) == f"config: rollout.episodes (10) must be a multiple of train.group_size (4) for {algorithm}"


def test_an_unknown_algorithm_lists_every_algorithm():
    from marft.algorithms import ALGORITHMS

    with pytest.raises(UserError) as e:
        load_config(None, ["train.algorithm=mappo"])
    assert str(e.value) == ("config: train.algorithm must be one of marft, marft-token, ippo, grpo, dr-mas, at-grpo, "
                            "got 'mappo'")
    assert all(name in str(e.value) for name in ALGORITHMS)
    load_config(None, ["train.algorithm=ippo", "rollout.episodes=10", "train.group_size=4"])  # not grouped: any size
