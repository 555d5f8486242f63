"""The command line and evaluation, end to end on the tiny model."""
import json
import subprocess
import sys

import pytest
import torch

from marft.cli import main
from marft.maths.stats import accuracy_interval, wilson_interval


def test_wilson_interval_hand_values():
    lo, hi = wilson_interval(0, 8)
    assert lo == 0.0 and hi == pytest.approx(0.3244, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))


def test_accuracy_interval_clusters_samples_by_problem():
    # per-problem means 1, .5, .5, 0: mean .5, sd .4082, se .2041 -> n_eff = .25 / .2041^2 = 6;
    # Wilson at p .5, n 6: half-width 1.96 sqrt(.25/6 + 1.96^2/144) / (1 + 1.96^2/6) = .3124
    table = torch.tensor([[1, 1], [1, 0], [0, 1], [0, 0]])
    mean, lo, hi = accuracy_interval(table)
    assert mean == 0.5 and lo == pytest.approx(0.1876, abs=1e-4) and hi == pytest.approx(0.8124, abs=1e-4)
    # nothing solved: not the point [0, 0] but Wilson's 0 of 4 problems, [0, .4899]
    assert accuracy_interval(torch.zeros(4, 2)) == (0.0, 0.0, pytest.approx(0.4899, abs=1e-4))


def test_eval_prints_table_and_writes_json(tiny_overrides, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["eval", "configs/duo_arithmetic.yaml", *tiny_overrides, f"eval.output={out}", "eval.samples=2"])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "team accuracy" in printed and "planner: mean reply tokens" in printed
    # not a terminal: progress comes as log lines, the last one when all 4 x 2 episodes are done
    assert "evaluating: 8/8 episodes" in captured.err
    res = json.loads(out.read_text())
    assert (res["problems"], res["samples"]) == (4, 2)
    assert res["ci95"][0] <= res["accuracy"] <= res["ci95"][1]
    assert 0 < res["agents"]["solver"]["mean_tokens"] <= 8
    assert res["generated_tokens"] > 0 and res["tokens_per_s"] > 0
    assert len(res["per_problem_success"]) == 4
    # the first sample of each of the first eval.transcripts (default 4) problems, every agent's reply
    assert [t["problem"] for t in res["transcripts"]] == [0, 1, 2, 3]
    for t, solved in zip(res["transcripts"], res["per_problem_success"]):
        assert [x["agent"] for x in t["turns"]] == ["planner", "solver"]
        assert t["observation"].startswith("Problem: ") and all(isinstance(x["reply"], str) for x in t["turns"])
        assert t["correct"] <= (solved > 0)  # the first sample solved it only if some sample did


def test_eval_is_reproducible_with_a_fixed_seed(tiny_overrides, tmp_path):
    results = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["eval", "configs/duo_arithmetic.yaml", *tiny_overrides, f"eval.output={out}", "eval.temperature=1.0"]) == 0
        results.append(json.loads(out.read_text()))
    keys = ("per_problem_success", "agents", "generated_tokens", "extraction_rate")
    assert [results[0][k] for k in keys] == [results[1][k] for k in keys]


def test_adapters_saved_and_loaded_back(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marft.run.config import load_config
    from marft.engines.models import TeamModel
    from marft.team import build_team

    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu"])
    team = build_team(cfg.team)
    a = TeamModel(team, cfg.model)
    g = torch.Generator().manual_seed(0)
    for adapter in team.adapters:
        a.load_adapter_state(adapter, {k: torch.randn(v.shape, generator=g) for k, v in a.adapter_state(adapter).items()})
    a.save_adapters(tmp_path / "adapters")
    b = TeamModel(team, cfg.model)
    b.load_adapters(tmp_path / "adapters")
    for adapter in team.adapters:
        sa, sb = a.adapter_state(adapter), b.adapter_state(adapter)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # PEFT's own loader reads them too
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    solver = PeftModel.from_pretrained(base, tmp_path / "adapters" / "solver", adapter_name="solver")
    got = {k.replace(".solver", ""): v for k, v in solver.state_dict().items() if "lora_" in k}
    want = {k.replace(".solver", ""): v for k, v in a.bases[str(tiny_model_dir)].state_dict().items() if "lora_" in k and ".solver" in k}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_missing_adapters_folder_is_a_user_error(tiny_overrides, tmp_path, capsys):
    rc = main(["eval", "configs/duo_arithmetic.yaml", *tiny_overrides, "--adapters", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2 and "adapters folder" in err and "not found" in err


@pytest.mark.parametrize("args,message", [
    (["eval", "configs/nope.yaml"], "config file configs/nope.yaml not found"),
    (["eval", "configs/duo_arithmetic.yaml", "rollout.temprature=1"], "did you mean 'rollout.temperature'"),
    (["eval", "configs/duo_arithmetic.yaml", "model.name=/no/such/model"], "model '/no/such/model' not found"),
    (["eval", "configs/duo_arithmetic.yaml", "task.name=basic_arithmetik"], "unknown reasoning_gym dataset 'basic_arithmetik'"),
    (["eval", "configs/duo_arithmetic.yaml", "task.kind=math", "task.options={}", "task.test_path=/no/file.jsonl"], "does not exist"),
    (["env-check", "no_such_module:Env"], "cannot import"),
])
def test_user_errors_are_one_line_exit_2(args, message, capsys):
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("marft: error:")]
    assert len(errors) == 1 and message in errors[0] and errors[0] == err.splitlines()[-1]


def test_cli_process_exit_code_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {episodes: -3}\n")
    p = subprocess.run([sys.executable, "-m", "marft.cli", "eval", str(bad)], capture_output=True, text=True)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.strip() == "marft: error: config: rollout.episodes must be at least 1, got -3"
    p = subprocess.run([sys.executable, "-m", "marft.cli", "--debug", "eval", str(bad)], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" in p.stderr


ENV_FILE = '''
from marft.envs.base import TurnBasedEnv, Problem, Grade

class Good(TurnBasedEnv):
    def new_problem(self, rng, split, index):
        return Problem("Say hello.", "hello")
    def grade(self, problem, reply):
        return Grade("hello" in reply, True)

class NeverEnds(Good):
    def step(self, action):
        super().step(action)
        self.agents = list(self.possible_agents)
'''


def test_env_check_command(tmp_path, capsys):
    f = tmp_path / "my_env.py"
    f.write_text(ENV_FILE)
    assert main(["env-check", f"{f}:Good"]) == 0
    assert "conforms" in capsys.readouterr().out
    assert main(["env-check", f"{f}:NeverEnds"]) == 1
    out = capsys.readouterr().out
    assert "horizon" in out


def test_train_with_no_iterations_names_no_adapters(tiny_overrides, tmp_path, capsys):
    """``train.iterations=0`` (a baseline run) trains no adapters: the command says so instead of
    pointing at a checkpoint that does not exist, and shows the one evaluation once."""
    rc = main(["train", "configs/duo_arithmetic.yaml", *tiny_overrides, "train.iterations=0", "eval.ablate=false"])
    captured = capsys.readouterr()
    assert rc == 0 and "Traceback" not in captured.err
    assert not (tmp_path / "run" / "checkpoints").exists() and "trained adapters:" not in captured.err
    assert captured.err.strip().splitlines()[-1] == "no adapters were trained (train.iterations=0): the table is the untrained team's"
    assert "│ untrained" in captured.out and "│ trained" not in captured.out  # one row: nothing was trained
    assert json.loads((tmp_path / "run" / "eval_final.json").read_text()) == \
        json.loads((tmp_path / "run" / "eval_untrained.json").read_text())


def test_config_prints_every_key_as_a_run_would_use_it(tmp_path, capsys):
    """marft config CONFIG overrides: the config a run would get, defaults included, as YAML that
    loads back to the same config; a wrong key is the usual one line."""
    import yaml

    from marft.run.config import load_config, to_dict

    assert main(["config", "configs/coop_duo_sum.yaml", "train.lr=1e-4", "team.max_new_tokens={speaker: 9}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    want = to_dict(load_config("configs/coop_duo_sum.yaml", ["train.lr=1e-4", "team.max_new_tokens={speaker: 9}"]))
    assert printed == want and printed["train"]["lr"] == 1e-4 and "critic" in printed["train"]  # defaults too
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(printed))
    assert to_dict(load_config(str(tmp_path / "c.yaml"))) == want  # a run given it is the same run
    assert main(["config", "seed=4"]) == 0 and yaml.safe_load(capsys.readouterr().out)["seed"] == 4  # the defaults
    assert main(["config", "configs/coop_duo_sum.yaml", "train.lrr=1"]) == 2
    assert "unknown key 'train.lrr' (did you mean 'train.lr'?)" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    assert main(["config", str(tmp_path / "run")]) == 2
    assert f"(a run folder: its config is {tmp_path / 'run' / 'config.yaml'})" in capsys.readouterr().err
