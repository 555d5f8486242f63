"""Configuration: YAML + dotted overrides, presets, and one-line errors for bad input."""
import pytest

from marft.run.config import load_config, save_config
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
    from marft.maths.algorithms import ALGORITHMS

    with pytest.raises(UserError) as e:
        load_config(None, ["train.algorithm=mappo"])
    assert str(e.value) == ("config: train.algorithm must be one of marft, marft-token, ippo, grpo, dr-mas, at-grpo, "
                            "got 'mappo'")
    assert all(name in str(e.value) for name in ALGORITHMS)
    load_config(None, ["train.algorithm=ippo", "rollout.episodes=10", "train.group_size=4"])  # not grouped: any size


# --- hostile input: one line, exit 2, nothing run or written ------------------------------------

COOP = "configs/coop_duo_sum.yaml"


def cli_error(capsys, argv) -> str:
    """Run ``marft ARGV``: exit 2, no traceback, the error the last line of stderr (a command's
    header may come first); returns the message after ``marft: error: ``."""
    from marft.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 2, out.err
    assert "Traceback" not in out.err + out.out
    lines = [x for x in out.err.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("marft: error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], out.err
    return errors[0][len("marft: error: "):]


def test_agent_and_adapter_names_must_be_simple(capsys, tiny_overrides, tmp_path):
    escape = tmp_path / "pwnx"
    msg = cli_error(capsys, ["train", COOP, *tiny_overrides, "train.iterations=1",
                             f"team.agents=[{{name: s, adapter: {escape}}}, {{name: c}}]"])
    assert msg == (f"config: team.agents.0.adapter '{escape}' is not a simple name; use only letters, digits, "
                   "'_' and '-' (it names the agent's adapter folder)")
    assert not escape.exists() and not (tmp_path / "run").exists()
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, "team.agents=[{name: a.b}, {name: c}]"])
    assert msg == ("config: team.agents.0.name 'a.b' is not a simple name; use only letters, digits, '_' and '-' "
                   "(it names the agent's adapter folder)")
    assert not (tmp_path / "run").exists()
    load_config(None, ["team.agents=[{name: Agent_1-b, adapter: shared-2}, {name: c}]"])  # simple names pass


@pytest.mark.parametrize("override,shown", [("train.lr=.inf", "inf"), ("train.lr=1e400", "'1e400'"),
                                            ("train.lr=-.inf", "-inf"), ("train.lr=.nan", "nan"),
                                            ("eval.temperature=.inf", "inf"), ("cluster.worker_cpus=nan", "'nan'")])
def test_every_float_setting_must_be_finite(override, shown, capsys, tiny_overrides, tmp_path):
    key = override.split("=")[0]
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, override])
    assert msg == f"config: {key} must be a finite number, got {shown}"
    assert not (tmp_path / "run").exists()
    assert load_config(None, ["train.lr=3e-4"]).train.lr == 3e-4  # PyYAML's string, still a number


@pytest.mark.parametrize("value", ["1e10", "1e30", ".inf", "0"])
def test_env_timeout_has_an_upper_bound(value, capsys, tiny_overrides, tmp_path):
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, f"rollout.env_timeout_s={value}"])
    if value == ".inf":
        assert msg == "config: rollout.env_timeout_s must be a finite number, got inf"
    else:
        assert msg == ("config: rollout.env_timeout_s must be positive and at most 86400 seconds (a day), "
                       f"got {float(value):g}")
    assert not (tmp_path / "run").exists()
    assert load_config(None, ["rollout.env_timeout_s=86400"]).rollout.env_timeout_s == 86400


@pytest.mark.parametrize("graph,got", [("{solver: 5}", "5"), ("{solver: [[speaker]]}", "[['speaker']]"),
                                       ("{solver: {speaker: 1}}", "{'speaker': 1}")])
def test_graph_must_map_agents_to_lists_of_agents(graph, got, capsys, tiny_overrides, tmp_path):
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, f"team.graph={graph}"])
    assert msg == ("config: team.graph.solver must be a list of the agent names it sees, e.g. "
                   f"team.graph={{solver: [speaker]}}, got {got}")
    assert not (tmp_path / "run").exists()
    assert load_config(COOP, ["team.graph={solver: speaker}"]).team.graph == {"solver": "speaker"}  # one name


@pytest.mark.parametrize("options,message", [
    ("{agents: [x]}", "task.options agents is set by marft from team.agents (the agents' names); remove it from task.options"),
    ("{answering: [x]}", "task.options answering is set by marft from team.agents (the agents with answers: true); "
                         "remove it from task.options"),
    ("{horizon: 2}", "task.options horizon is a key of its own: set task.horizon instead"),
    ("{team: [x]}", "task.options team is set by marft from team.agents (the whole team, in acting order); "
                    "remove it from task.options"),
])
def test_task_options_the_framework_sets_are_rejected(options, message, capsys, tiny_overrides, tmp_path):
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, f"task.options={options}"])
    assert msg == f"config: {message}"
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError) as e:  # a mixture's task says where it is
        load_config(None, ["tasks=[{kind: coop, name: sum}, {kind: coop, name: lookup, options: {horizon: 2}}]",
                           "team.preset=coop2"])
    assert str(e.value) == "config: tasks.1.options horizon is a key of its own: set tasks.1.horizon instead"


def test_task_name_in_options_conflicts_with_task_name(capsys, tiny_overrides, tmp_path):
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, "task.options={name: lookup}"])
    assert msg == "config: task.options name is a key of its own: set task.name instead"
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="^config: task.options name is a key of its own: set task.name instead$"):
        load_config(None, ["task.options={name: chain_sum}"])  # reasoning_gym likewise


def test_adapters_trained_with_other_lora_settings_are_refused(capsys, tiny_overrides, tmp_path):
    from marft.engines.models import TeamModel
    from marft.team import build_team

    cfg = load_config(COOP, tiny_overrides)
    saved = tmp_path / "adapters"
    TeamModel(build_team(cfg.team), cfg.model).save_adapters(saved)  # alpha 16, q_proj and v_proj
    out = tmp_path / "eval.json"
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, "model.lora.alpha=1000", f"eval.output={out}",
                             "--adapters", str(saved)])
    assert msg == (f"adapter 'speaker' in {saved / 'speaker'} was trained with other LoRA settings "
                   "(model.lora.alpha=16, not 1000); set model.lora.alpha=16 to load it")
    assert not out.exists()
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, "model.lora.target_modules=[q_proj, k_proj, v_proj]",
                             f"eval.output={out}", "--adapters", str(saved)])
    assert msg == (f"adapter 'speaker' in {saved / 'speaker'} was trained with other LoRA settings "
                   "(model.lora.target_modules=[q_proj, v_proj], not [k_proj, q_proj, v_proj]); "
                   "set model.lora.target_modules=[q_proj,v_proj] to load it")
    assert not out.exists()


def test_wording_of_env_check_options_lookup_entries_and_model_files(capsys, tiny_overrides, tiny_model_dir, tmp_path):
    from marft.run.config import split_override
    from marft.envs.coop import CoopEnv

    with pytest.raises(UserError) as e:  # what marft env-check should call (marft/cli.py)
        split_override("badopt", "env-check option", "seed=1")
    assert str(e.value) == "env-check option 'badopt' must look like key=value, e.g. seed=1"
    with pytest.raises(UserError) as e:
        CoopEnv(["speaker", "solver"], ["solver"], name="lookup", entries=0)
    assert str(e.value) == "coop task option entries must be at least 1 (code-table rows each holding agent gets), got 0"
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, "task.name=lookup", "task.options={entries: 0}"])
    assert msg == "coop task option entries must be at least 1 (code-table rows each holding agent gets), got 0"
    msg = cli_error(capsys, ["eval", COOP, *tiny_overrides, f"model.name={tiny_model_dir / 'model.safetensors'}"])
    assert msg == (f"model {tiny_model_dir / 'model.safetensors'} is a file, not a model folder; give the folder "
                   f"that holds it: model.name={tiny_model_dir}")
    assert not (tmp_path / "run" / "eval.json").exists()  # eval makes its folder first, then builds the run


def test_code_task_limits_must_be_finite_and_bounded():
    from marft.envs.code import CodeEnv

    for key, v in (("timeout_s", float("inf")), ("test_timeout_s", 1e10), ("timeout_s", 0)):
        with pytest.raises(UserError) as e:
            CodeEnv(["coder"], ["coder"], name="humaneval", **{key: v})
        assert str(e.value) == (f"task option {key} must be a number of seconds, more than 0 and at most 86400 "
                                f"(a day), got {v!r}")
    with pytest.raises(UserError, match=r"^task option memory_mb must be a whole number, at least 1, got 0$"):
        CodeEnv(["coder"], ["coder"], name="humaneval", memory_mb=0)


def test_a_whole_float_is_taken_for_an_integer_and_a_fraction_is_not():
    # older run folders wrote rollout.vllm.kv_cache_gb: 2.0; their config.yaml must still load
    assert load_config("configs/duo_arithmetic.yaml", ["rollout.vllm.kv_cache_gb=2.0"]).rollout.vllm.kv_cache_gb == 2
    with pytest.raises(UserError, match="kv_cache_gb must be an integer, got 2.5"):
        load_config("configs/duo_arithmetic.yaml", ["rollout.vllm.kv_cache_gb=2.5"])


def test_ablation_is_refused_for_a_workflow():
    with pytest.raises(UserError, match="a workflow .task.kind workflow. calls whom it likes"):
        load_config("configs/workflow_duo.yaml", ["eval.without=[planner]"])
    load_config("configs/workflow_duo.yaml", ["eval.ablate=true"])  # a default of other configs: skipped, saying so
