"""Every row of docs/errors.md: a wrong input gets one line ``marft: error: ...`` that names the
problem, a non-zero status (2 for user errors, as argparse), no traceback (``--debug`` shows it),
and a failed ``--resume`` leaves the run folder byte for byte as it was."""
import hashlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import VOWEL_ENV
from marft.run.checkpoints import latest_checkpoint
from marft.cli import main

CONFIG = "configs/duo_arithmetic.yaml"
ERRORS_MD = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
E = "marft: error: "

ENVS = VOWEL_ENV + '''
class NeverEnds(Vowel):
    def step(self, action):
        super().step(action)
        self.agents = list(self.possible_agents)
'''


@pytest.fixture(scope="module")
def f(tiny_model_dir, tmp_path_factory):
    """Bad inputs of every kind, and a trained run folder (1 iteration) to resume."""
    d = tmp_path_factory.mktemp("bad-inputs")
    (d / "envs.py").write_text(ENVS)
    (d / "broken_env.py").write_text("import no_such_dependency_xyz\n")
    (d / "bad.yaml").write_text("model: [\n")
    (d / "binary.yaml").write_bytes(bytes(range(256)) * 4)  # not text at all
    (d / "empty.jsonl").write_text("")
    (d / "badline.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": \n')
    (d / "noanswer.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    (d / "mbpp_badline.jsonl").write_text('{"task_id": 11, "text": "x", "test_list": ["assert f() is None"]}\n'
                                          '{"task_id": 12, "text": \n')
    (d / "mbpp_notrecord.jsonl").write_text('{"task_id": 11, "text": "x"}\n')
    nochat = shutil.copytree(tiny_model_dir, d / "nochat")
    (nochat / "chat_template.jinja").unlink(missing_ok=True)
    t5 = shutil.copytree(tiny_model_dir, d / "t5")
    (t5 / "model.safetensors").unlink()
    from transformers import T5Config

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=400).save_pretrained(t5)
    tiny = [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "rollout.max_new_tokens=2",
            "rollout.episodes=4", "eval.problems=2", "train.minibatch_size=4"]
    vowel = ["task.kind=custom", f"task.env={d / 'envs.py'}:Vowel", "task.options={}"]
    run = d / "run"
    assert main(["train", CONFIG, *tiny, *vowel, "train.iterations=1", f"output_dir={run}"]) == 0
    return SimpleNamespace(d=d, tiny=[*tiny, f"output_dir={d / 'out'}"], vowel=vowel, run=run, model=tiny_model_dir)


def one_line_error(capsys, rc_expected=2) -> str:
    """The single ``marft: error:`` line (the last of stderr); fails on a traceback."""
    return check_error(capsys.readouterr(), rc_expected)


def check_error(captured, rc_expected) -> str:
    err = captured.err
    assert "Traceback" not in err and "Traceback" not in captured.out
    lines = [x for x in err.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("marft: error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    return errors[0]


def assert_documented(line: str, paths: tuple[tuple[str, str], ...] = ()) -> None:
    """``line``, with this test's paths (and process ids) replaced by the ones docs/errors.md shows,
    is the whole message of a row there."""
    for here, there in paths:
        line = line.replace(here, there)
    assert f"`{line}`" in ERRORS_MD.read_text(), f"docs/errors.md has no row with the line {line}"


def math(path):
    return ["task.kind=math", "task.options={}", f"task.test_path={path}"]


def code(path):
    return ["task.kind=code", "task.name=mbpp", "task.options={}", f"task.test_path={path}"]


# (row id, args built from the fixture, the message): a message that starts with "marft: error: " is
# a row of docs/errors.md, run as the row shows it, and must be the whole line, word for word, as
# the row has it; any other is text the line must hold (rows whose line names this test's paths)
ROWS = [
    # configs
    ("config-missing", lambda f: ["eval", "configs/nope.yaml"],
     E + "config file configs/nope.yaml not found; give the path of a YAML file such as configs/duo_arithmetic.yaml"),
    ("config-not-yaml", lambda f: ["eval", str(f.d / "bad.yaml")], "is not valid YAML at line 2"),
    ("config-not-text", lambda f: ["eval", str(f.d / "binary.yaml")], "is not UTF-8 text (byte 0x80 at offset 128)"),
    ("kind-override-keeps-options", lambda f: ["eval", CONFIG, *f.tiny, "task.kind=math", f"task.test_path={f.d / 'empty.jsonl'}"],
     E + "task.options {'min_terms': 2, 'max_terms': 2, 'min_digits': 1, 'max_digits': 1, 'operators': ['+'], "
     "'allow_parentheses': False, 'allow_negation': False} in configs/duo_arithmetic.yaml are options of task.kind "
     "reasoning_gym, not of math; add task.options={} (or the math task's own options) to the command line"),
    ("unknown-key", lambda f: ["eval", CONFIG, *f.tiny, "rollout.temprature=1"],
     E + "config: unknown key 'rollout.temprature' (did you mean 'rollout.temperature'?)"),
    ("wrong-type", lambda f: ["eval", CONFIG, *f.tiny, "rollout.episodes=abc"],
     E + "config: rollout.episodes must be an integer, got 'abc'"),
    ("out-of-range", lambda f: ["eval", CONFIG, *f.tiny, "rollout.temperature=-1"],
     E + "config: rollout.temperature must be positive, got -1.0"),
    ("override-without-value", lambda f: ["eval", CONFIG, "rollout.temperature"],
     E + "override 'rollout.temperature' must look like key=value, e.g. rollout.temperature=0.8"),
    ("section-not-mapping", lambda f: ["eval", CONFIG, "rollout=5"], E + "config: rollout must be a mapping of keys, got 5"),
    ("empty-team", lambda f: ["eval", CONFIG, *f.tiny, "team.agents=[]"],
     E + "config: team.agents is empty; give at least one agent or a team.preset such as duo"),
    ("unknown-preset", lambda f: ["eval", CONFIG, *f.tiny, "team.preset=octet"],
     E + "config: unknown team.preset 'octet'; choose one of solo, duo, trio, quartet, coop2, coop3, coop4, code-solo, "
     "code-duo, code-trio, solo-anon, duo-anon, trio-anon, quartet-anon, coop2-anon, coop3-anon, coop4-anon, code-solo-anon, "
     "code-duo-anon, code-trio-anon, or list team.agents yourself"),
    ("graph-cycle", lambda f: ["eval", CONFIG, *f.tiny, "team.agents=[{name: a}, {name: b}]", "team.graph={a: [b], b: [a]}"],
     E + "config: team.graph has a cycle among a, b; agents within a step must form a DAG"),
    ("agent-twice", lambda f: ["eval", CONFIG, *f.tiny, "team.agents=[{name: a}, {name: a}]"],
     E + "config: agent name 'a' is used twice in team.agents; names must be unique"),
    ("graph-unknown-agent", lambda f: ["eval", CONFIG, *f.tiny, "team.graph={judge: [planner]}"],
     E + "config: team.graph names agent 'judge', which is not in team.agents (planner, solver)"),
    ("agent-index", lambda f: ["eval", CONFIG, *f.tiny, "team.agents.5.prompt=Plan."],
     E + "config: team.agents has 2 entries; index '5' in 'team.agents.5.prompt' is out of range"),
    ("adapter-two-models", lambda f: ["eval", CONFIG, *f.tiny, "team.agents=[{name: a1, adapter: shared}, "
                                      f"{{name: a2, adapter: shared, model: {f.d / 'nochat'}}}]"],
     "adapter 'shared' is used by agents on different base models"),
    ("adapters-missing", lambda f: ["eval", CONFIG, *f.tiny, "--adapters", str(f.d / "none")], "adapters folder"),
    ("adapters-other-team", lambda f: ["eval", CONFIG, *f.tiny, "--adapters", str(f.run / "checkpoints/iter_000001/adapters"),
                                       "team.preset=trio"], "has no adapter 'verifier'"),
    ("adapters-other-rank", lambda f: ["eval", CONFIG, *f.tiny, "model.lora.r=4", "--adapters",
                                       str(f.run / "checkpoints/iter_000001/adapters")], "was trained with other LoRA settings (model.lora.r=8, not 4); set model.lora.r=8 to load it"),
    ("init-critic-none", lambda f: ["train", CONFIG, *f.tiny, f"model.init_critic={f.d}"],
     "holds no saved critic (give a checkpoint, or a run folder with one, of a run of marft, marft-token or ippo)"),
    ("init-critic-other-algorithm", lambda f: ["train", CONFIG, *f.tiny, "train.algorithm=ippo", f"model.init_critic={f.run}"],
     "is marft's for team planner, solver; this run is ippo's for team planner, solver: start from a critic of the same "
     "algorithm and team"),
    ("output-dir-is-a-file", lambda f: ["train", CONFIG, *f.tiny, f"output_dir={f.d / 'envs.py'}"], "cannot create the folder"),
    ("engine-vllm-missing", lambda f: ["eval", CONFIG, *f.tiny, "rollout.engine=vllm"],
     E + "rollout.engine=vllm needs vLLM, which is not installed: on a GPU machine pip install 'marft[vllm]'; on a CPU run "
     "bash scripts/setup.sh --vllm (vLLM's CPU build), or use rollout.engine=hf (ModuleNotFoundError: No module named 'vllm')"),
    ("schedule-async-hf", lambda f: ["eval", CONFIG, *f.tiny, "rollout.schedule=async"],
     E + "config: rollout.schedule async needs rollout.engine=vllm (the hf engine generates one batch per agent turn)"),
    ("compile-vllm", lambda f: ["eval", CONFIG, *f.tiny, "rollout.engine=vllm", "rollout.compile=true"],
     E + "config: rollout.compile is the hf engine's; vLLM compiles its own steps: set rollout.vllm.enforce_eager=false instead"),
    ("compile-plain-loop", lambda f: ["train", CONFIG, *f.tiny, "train.fast=false", "train.compile=true"],
     E + "config: train.compile needs train.fast: true (train.fast=false keeps the plain loop and passes, uncompiled, to "
     "measure against)"),
    ("device-without-gpu", lambda f: ["eval", CONFIG, *f.tiny, "model.device=cuda"],
     E + "config: model.device is 'cuda' but no CUDA GPU is available here; use model.device=cpu or auto"),
    # models
    ("model-missing", lambda f: ["eval", CONFIG, *f.tiny, "model.name=/data/models/qwen"],
     E + "model '/data/models/qwen' not found: not a folder, not a .gguf file and not a hub id like Qwen/Qwen2.5-0.5B-Instruct"),
    ("model-gguf-missing", lambda f: ["eval", CONFIG, *f.tiny, "model.name=/data/model.gguf"],
     E + "model file /data/model.gguf not found; give the path of a .gguf file"),
    ("model-folder-no-config", lambda f: ["eval", CONFIG, *f.tiny, f"model.name={f.d}"], "has no config.json"),
    ("model-not-causal", lambda f: ["eval", CONFIG, *f.tiny, f"model.name={f.d / 't5'}"], "is not a causal language model"),
    ("model-no-chat-template", lambda f: ["eval", CONFIG, *f.tiny, f"model.name={f.d / 'nochat'}"],
     "has a tokenizer without a chat template"),
    ("hub-offline", lambda f: ["eval", CONFIG, *f.tiny, "model.name=nobody/no-such-model"],
     "model 'nobody/no-such-model' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
    ("lora-targets", lambda f: ["eval", CONFIG, *f.tiny, "model.lora.target_modules=[foo]"], "do not fit model"),
    # data
    ("data-missing", lambda f: ["eval", CONFIG, *f.tiny, *math(f.d / "none.jsonl")], "does not exist"),
    ("data-empty", lambda f: ["eval", CONFIG, *f.tiny, *math(f.d / "empty.jsonl")], "is empty"),
    ("data-bad-line", lambda f: ["eval", CONFIG, *f.tiny, *math(f.d / "badline.jsonl")], "line 2 is not valid JSON"),
    ("data-no-answer", lambda f: ["eval", CONFIG, *f.tiny, *math(f.d / "noanswer.jsonl")], "line 2 has no 'final_answer' or 'answer'"),
    ("mbpp-missing", lambda f: ["eval", CONFIG, *f.tiny, *code(f.d / "none.jsonl")], "MBPP file"),
    ("mbpp-bad-line", lambda f: ["eval", CONFIG, *f.tiny, *code(f.d / "mbpp_badline.jsonl")], "line 2 is not valid JSON"),
    ("mbpp-not-a-record", lambda f: ["eval", CONFIG, *f.tiny, *code(f.d / "mbpp_notrecord.jsonl")],
     "line 1 is not an MBPP record (needs task_id, text and test_list)"),
    ("code-bad-reward", lambda f: ["eval", CONFIG, *f.tiny, *code(f.d / "mbpp_notrecord.jsonl"), "task.options={reward: best}"],
     E + "task option reward='best': expected 'all' (every test passes) or 'fraction'"),
    ("code-unknown-task", lambda f: ["eval", CONFIG, *f.tiny, *code(f.d / "none.jsonl"), "task.name=apps"],
     E + "unknown code task 'apps'; expected 'mbpp' or 'humaneval'"),
    ("gym-unknown-dataset", lambda f: ["eval", CONFIG, *f.tiny, "task.name=basic_arithmetik"],
     E + "unknown reasoning_gym dataset 'basic_arithmetik'; did you mean basic_arithmetic, bitwise_arithmetic, "
     "decimal_arithmetic? e.g. basic_arithmetic, chain_sum, gsm_symbolic, countdown (106 in all, see "
     "reasoning_gym.factory.DATASETS)"),
    ("gym-bad-option", lambda f: ["eval", CONFIG, *f.tiny, "task.options={bogus: 1}"],
     E + "bad options {'bogus': 1} for reasoning_gym dataset 'basic_arithmetic': BasicArithmeticDatasetConfig.__init__() got "
     "an unexpected keyword argument 'bogus' (its options: min_terms, max_terms, min_digits, max_digits, operators, "
     "allow_parentheses, allow_negation, format_style, whitespace)"),
    # environments
    ("env-import-error", lambda f: ["env-check", f"{f.d / 'broken_env.py'}:X"], "No module named 'no_such_dependency_xyz'"),
    ("env-no-module", lambda f: ["env-check", "my_pkg.envs:MyEnv"],
     E + "cannot import module 'my_pkg.envs': ModuleNotFoundError: No module named 'my_pkg'"),
    ("env-no-class", lambda f: ["env-check", f"{f.d / 'envs.py'}:Nope"], "has no attribute 'Nope'"),
    ("task-env-import-error", lambda f: ["eval", CONFIG, *f.tiny, "task.kind=custom", "task.options={}",
                                         f"task.env={f.d / 'broken_env.py'}:X"], "cannot import module"),
    # paths of the wrong kind: say what they are, not "not found"
    ("config-is-a-folder", lambda f: ["eval", str(f.run), *f.tiny],
     "is a folder; give the path of a YAML file such as configs/duo_arithmetic.yaml (a run folder: marft eval"),
    ("train-config-is-a-folder", lambda f: ["train", str(f.run)], "(a run folder: continue it with marft train --resume"),
    ("adapters-is-a-file", lambda f: ["eval", CONFIG, *f.tiny, "--adapters", str(f.d / "bad.yaml")],
     "is a file, not a folder; give a checkpoint's adapters/ folder, a checkpoint or a run folder"),
    ("adapters-folder-without-adapters", lambda f: ["eval", CONFIG, *f.tiny, "--adapters", str(f.d)],
     "holds no adapters (no subfolder with an adapter_config.json)"),
    ("resume-a-file", lambda f: ["train", "--resume", str(f.d / "bad.yaml")],
     "bad.yaml is a file, not a run folder; resume takes the output_dir of an earlier marft train run (to start a new run"),
    ("resume-a-checkpoint", lambda f: ["train", "--resume", str(f.run / "checkpoints" / "iter_000001")],
     "iter_000001 is a checkpoint, not a run folder; give the run folder"),
    # command line
    ("unknown-command", lambda f: ["trian", CONFIG],
     E + "argument COMMAND: invalid choice: 'trian' (choose from 'eval', 'train', 'sweep', 'report', 'serve', 'config', 'env-check'); "
     "see marft --help"),
    ("unknown-flag", lambda f: ["eval", CONFIG, "--adpaters", "runs/duo/checkpoints/iter_000002/adapters"],
     E + "unrecognized arguments: --adpaters runs/duo/checkpoints/iter_000002/adapters; see marft eval --help"),
    ("no-command", lambda f: [], E + "the following arguments are required: COMMAND; see marft --help"),
    ("train-without-config", lambda f: ["train"],
     E + "marft train needs a config file (e.g. configs/duo_arithmetic.yaml) or --resume RUN_DIR"),
]


@pytest.mark.parametrize("row,args,message", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_exit_2(f, capsys, row, args, message):
    if row == "device-without-gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    if row == "engine-vllm-missing" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    if row in ("model-missing", "model-gguf-missing") and any(Path(p).exists() for p in ("/data/models/qwen", "/data/model.gguf")):
        pytest.skip("the row's model path exists on this machine")
    rc = main(args(f))
    line = one_line_error(capsys)
    if message.startswith(E):  # the whole line, as docs/errors.md shows it
        assert rc == 2 and line == message, line
        assert_documented(line)
    else:
        assert rc == 2 and message in line, line


def test_env_failing_conformance_exits_1(f, capsys):
    rc = main(["env-check", f"{f.d / 'envs.py'}:NeverEnds"])
    captured = capsys.readouterr()
    line = check_error(captured, 1)
    assert rc == 1 and "does not conform (1 problem(s) listed above)" in line
    assert "the episode must end" in captured.out


# ---------------------------------------------------------------- checkpoints and resume

def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def run(f, tmp_path):
    """A copy of the trained run folder (1 iteration, duo, marft)."""
    return shutil.copytree(f.run, tmp_path / "run")


def truncate(path: Path, keep: int = 300) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def foreign_trainer_state(path: Path) -> None:
    """Make the checkpoint claim another team (as if copied in from a trio's run)."""
    state = torch.load(path, weights_only=False)
    state["team"] = state["adapters"] = ["planner", "solver", "verifier"]
    torch.save(state, path)


CKPT = "checkpoints/iter_000001"
RESUME_ROWS = [
    # (row id, how the run folder is damaged, extra arguments, text the message must hold)
    ("truncated-trainer-state", lambda r: truncate(r / CKPT / "trainer.pt"), [], "cannot be read"),
    ("truncated-adapter", lambda r: truncate(r / CKPT / "adapters/solver/adapter_model.safetensors"), [],
     "adapter 'solver' in"),
    ("corrupt-checkpoint-config", lambda r: (r / CKPT / "config.yaml").write_text("team: [\n"), [], "is not valid YAML"),
    ("no-trainer-state", lambda r: (r / CKPT / "trainer.pt").unlink(), [], "has no trainer.pt"),
    ("foreign-checkpoint", lambda r: foreign_trainer_state(r / CKPT / "trainer.pt"), [],
     "was written for team ['planner', 'solver', 'verifier']"),
    ("other-preset", None, ["team.preset=trio"], "--resume cannot change team.preset (duo -> trio)"),
    ("other-agents", None, ["team.agents=[{name: x}, {name: y}, {name: z}]"], "--resume cannot change the team's agents"),
    ("other-sharing", None, ["team.share_adapter=true"], "--resume cannot change team.share_adapter (False -> True)"),
    ("other-algorithm", None, ["train.algorithm=ippo"], "--resume cannot change train.algorithm (marft -> ippo)"),
    ("other-lora", None, ["model.lora.r=4"], "--resume cannot change model.lora"),
    ("other-critic", None, ["train.critic=lora"], "--resume cannot change train.critic (head -> lora)"),
    ("bad-override", None, ["train.lr=-1"], "train.lr must be positive"),
    ("latest-names-a-missing-checkpoint", lambda r: (r / "checkpoints/latest").write_text("iter_000999"), [],
     "checkpoints/latest names checkpoint iter_000999, which is missing from"),
    ("latest-empty", lambda r: (r / "checkpoints/latest").write_text(""), [],
     "checkpoints/latest does not name a checkpoint (it is empty or not a folder name such as iter_000002); write the "
     "name of one that is there (iter_000001) into"),
    ("adapter-config-missing", lambda r: (r / CKPT / "adapters/solver/adapter_config.json").unlink(), [],
     "adapter 'solver' in"),
    ("checkpoint-config-missing", lambda r: (r / CKPT / "config.yaml").unlink(), [],
     "iter_000001 has no config.yaml; it is incomplete or not a marft checkpoint"),
]


@pytest.mark.parametrize("row,damage,extra,message", RESUME_ROWS, ids=[r[0] for r in RESUME_ROWS])
def test_failed_resume_harms_nothing(run, capsys, row, damage, extra, message):
    if damage:
        damage(run)
    before = tree_hash(run)
    rc = main(["train", "--resume", str(run), "train.iterations=2", *extra])
    line = one_line_error(capsys)
    assert rc == 2 and message in line, line
    assert tree_hash(run) == before  # checkpoints, metrics.jsonl, config.yaml, eval files untouched


def test_resume_of_a_missing_or_empty_run_folder(f, tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "run folder" in one_line_error(capsys) and not (tmp_path / "nothing").exists()
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    assert "has no complete checkpoint to resume from" in one_line_error(capsys)
    assert list((tmp_path / "empty").iterdir()) == []


def test_new_run_into_a_folder_with_checkpoints(f, run, capsys):
    before = tree_hash(run)
    assert main(["train", CONFIG, *f.tiny, *f.vowel, f"output_dir={run}"]) == 2
    line = one_line_error(capsys)
    assert line == (f"marft: error: run folder {run} already has checkpoints; continue it with --resume {run} "
                    f"(in Python: MarftTrainer.resume({str(run)!r})) or choose another output_dir=..."), line
    assert_documented(line, ((str(run), "runs/duo"),))
    assert tree_hash(run) == before


def test_a_run_another_process_trains_is_left_alone(f, run, capsys):
    """While another process trains the run (it holds the folder's lock), neither a resume nor a new
    run into the folder starts: one line naming that process, the folder untouched."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from marft.run.folder import RunFolder; "
                               "r = RunFolder(sys.argv[1]); r.hold(); print('held', flush=True); sys.stdin.read()", str(run)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = tree_hash(run)
        assert main(["train", "--resume", str(run), "train.iterations=2"]) == 2
        line = one_line_error(capsys)
        assert line == (f"marft: error: run folder {run} is being trained by process {holder.pid} now; wait for it to end, "
                        f"or stop it with kill -TERM {holder.pid} (it saves a checkpoint first), then run this again")
        assert_documented(line, ((str(run), "runs/r"), (f"process {holder.pid}", "process 4242"),
                                 (f"-TERM {holder.pid}", "-TERM 4242")))
        assert main(["train", CONFIG, *f.tiny, *f.vowel, f"output_dir={run}"]) == 2
        assert f"is being trained by process {holder.pid} now" in one_line_error(capsys)
        assert tree_hash(run) == before
    finally:
        holder.communicate("")  # it ends, and the lock with it
    assert main(["train", "--resume", str(run), "train.iterations=2"]) == 0


def test_missing_adapter_config_is_named(run, capsys):
    (run / CKPT / "adapters/solver/adapter_config.json").unlink()
    assert main(["train", "--resume", str(run), "train.iterations=2"]) == 2
    line = one_line_error(capsys)
    assert line.endswith(f"adapter 'solver' in {run / CKPT / 'adapters/solver'} has no adapter_config.json; the adapter is "
                         "incomplete: replace it or use an earlier checkpoint"), line


def test_a_config_given_with_resume_must_be_the_runs(f, run, tmp_path, capsys):
    """``marft train CONFIG --resume RUN`` (as TRL users pass both): CONFIG is checked against the
    run's own config, not ignored; the same config resumes, another is one line and harms nothing."""
    other = tmp_path / "other.yaml"
    other.write_text((run / "config.yaml").read_text().replace("\n  lr: 0.0005", "\n  lr: 0.001"))
    before = tree_hash(run)
    assert main(["train", str(other), "--resume", str(run), "train.iterations=2"]) == 2
    line = one_line_error(capsys)
    assert f"{other} is not the config of run {run} ({run / CKPT / 'config.yaml'}): train.lr: 0.0005 in the run, 0.001 in" in line
    assert "give a change as an override (train.lr=0.001), or leave" in line
    assert tree_hash(run) == before
    assert main(["train", CONFIG, "--resume", str(run), *f.tiny[:-1], "train.iterations=2", "train.algorithm=ippo"]) == 2
    assert "--resume cannot change train.algorithm (marft -> ippo)" in one_line_error(capsys)
    assert tree_hash(run) == before
    same = tmp_path / "same.yaml"
    same.write_text((run / "config.yaml").read_text())
    assert main(["train", str(same), "--resume", str(run), "train.iterations=2"]) == 0
    assert latest_checkpoint(run).name == "iter_000002"


def test_a_new_run_never_overwrites_the_config_it_was_given(f, tmp_path, capsys, monkeypatch):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.yaml").write_text("# my notes\n" + Path(CONFIG).read_text())
    before = tree_hash(user)
    for out in (f"output_dir={user}", "output_dir="):  # empty: the current folder
        monkeypatch.chdir(user)
        rc = main(["train", "config.yaml", *f.tiny, *f.vowel, out])
        monkeypatch.undo()
        line = one_line_error(capsys)
        assert rc == 2 and "holds config.yaml, the config file you gave, which marft train would overwrite with its own " \
            "config.yaml; choose another output_dir=..." in line, line
        assert tree_hash(user) == before


def test_a_new_run_never_overwrites_an_earlier_runs_results(f, run, capsys):
    """An earlier run's folder without checkpoints (weights not kept, as in results/) is not overwritten."""
    shutil.rmtree(run / "checkpoints")
    before = tree_hash(run)
    assert main(["train", CONFIG, *f.tiny, *f.vowel, f"output_dir={run}"]) == 2
    line = one_line_error(capsys)
    assert line == (f"marft: error: output_dir {run} already holds eval_final.json of an earlier run, which a new run would "
                    "overwrite, and no checkpoint to resume from; choose another output_dir=..., or move that run's files away first")
    assert_documented(line, ((str(run), "runs/r"),))
    assert tree_hash(run) == before
    import marft

    with pytest.raises(marft.UserError, match="already holds eval_final.json of an earlier run"):  # the Python API too
        marft.MarftTrainer(marft.load_config(CONFIG, [*f.tiny, *f.vowel, f"output_dir={run}"]), log=None)
    assert tree_hash(run) == before


def test_eval_output_that_is_a_folder_fails_before_evaluating(f, tmp_path, capsys):
    out = tmp_path / "e1"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    assert main(["eval", CONFIG, *f.tiny, f"eval.output={out}"]) == 2
    captured = capsys.readouterr()
    line = check_error(captured, 2)
    assert line == f"marft: error: eval.output {out} is a folder; give the path of a file to write, e.g. eval.output={out / 'eval.json'}"
    assert "evaluating" not in captured.err and captured.out == ""  # nothing evaluated, then lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1"] and (out / "mine.txt").read_text() == "kept"


def test_resume_still_works_after_the_checks(run, capsys):
    assert main(["train", "--resume", str(run), "train.iterations=2"]) == 0
    assert (run / "checkpoints" / "iter_000002").is_dir()


def test_debug_shows_the_traceback_and_no_debug_does_not(f):
    cmd = [sys.executable, "-m", "marft.cli", "eval", CONFIG, "rollout.temprature=1"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "marft: error: config: unknown key 'rollout.temprature' (did you mean 'rollout.temperature'?)"]
    p = subprocess.run([*cmd[:3], "--debug", *cmd[3:]], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" in p.stderr and "UserError" in p.stderr
    p = subprocess.run([*cmd[:3], "--debug", "trian"], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_hub_id_without_network_fails_at_once(f, capsys, monkeypatch):
    """No retries, no download attempt: the Hub is probed once (here a closed port on this machine)."""
    import huggingface_hub.constants
    import transformers

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")

    def no_download(*a, **k):
        raise AssertionError("from_pretrained was called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_download)
    rc = main(["eval", CONFIG, *f.tiny, "model.name=nobody/no-such-model"])
    line = one_line_error(capsys)
    assert rc == 2 and "is a hub id, but the Hub (http://127.0.0.1:9) cannot be reached" in line, line
    assert "give its folder: model.name=/path/to/folder" in line
