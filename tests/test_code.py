"""Code tasks: extracting programs, the test harness (including programs that cheat), pass@k, the
environment's team and multi-turn behaviour, and the canonical solutions of MBPP and HumanEval."""
import json
import os

import pytest

from marft.envs.code import CodeEnv, CodeProblem, extract_code, load_humaneval, load_mbpp, run_tests
from marft.maths.stats import pass_at_k
from marft.errors import UserError
from marft.envs.sandbox import Limits, Sandbox

MBPP = "hf:google-research-datasets/mbpp:full"  # read from MARFT_DATA_DIR's copy (the data_dir fixture)
SB = Sandbox(Limits(wall_s=10, cpu_s=10), workers=2)
ADD = CodeProblem("t1", "Write add(a, b).", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0",
                                             "assert add(2, 2) == 4"], "add")
GOOD = "def add(a, b):\n    return a + b\n"


def score(program: str, problem: CodeProblem = ADD):
    return run_tests(SB, [(program, problem)], test_timeout_s=2)[0]


# --- extraction ------------------------------------------------------------------------------

def test_extract_fenced_bare_and_unterminated():
    assert extract_code(f"Sure!\n```python\n{GOOD}```\nDone.", "add") == GOOD.strip()
    assert extract_code(f"```\n{GOOD}```", "add") == GOOD.strip()
    assert extract_code(f"Here:\n```python\n{GOOD}", "add") == GOOD.strip()  # cut at max tokens
    assert extract_code(f"The function is below.\n{GOOD}\nIt adds.", "add") == GOOD.strip()
    assert extract_code("I do not know.", "add") is None
    assert extract_code("```python\ndef add(a, b)\n    return\n```", "add") is None  # does not parse


def test_extract_prefers_the_last_block_defining_the_entry_point():
    reply = ("```python\ndef add(a, b):\n    return a - b\n```\nFixed:\n```python\ndef add(a, b):\n    return a + b\n```"
             "\nUsage:\n```python\nprint(add(1, 2))\n```")
    assert extract_code(reply, "add") == "def add(a, b):\n    return a + b"


def test_extract_completes_a_humaneval_body_with_its_prompt():
    stub = 'def inc(x: int) -> int:\n    """Add one."""\n'
    code = extract_code("```python\nreturn x + 1\n```", "inc", stub)
    assert code == stub + "    return x + 1"


# --- harness ---------------------------------------------------------------------------------

def test_harness_counts_tests_and_explains_failures():
    assert (score(GOOD).passed, score(GOOD).total) == (3, 3)
    half = score("def add(a, b):\n    return 3\n")
    assert half.passed == 1 and not half.all_passed
    assert half.errors[0] == "" and "add(-1, 1) == 0" in half.errors[1] and "left side is 3" in half.errors[1]
    broken = score("def add(a, b):\n    return a +\n")
    assert broken.passed == 0 and "SyntaxError" in broken.errors[0]
    one = CodeProblem("t1", "", ADD.tests[:1], "add")
    slow = run_tests(SB, [("def add(a, b):\n    while True: pass\n", one)], test_timeout_s=0.5)[0]
    assert slow.passed == 0 and slow.errors == ["the test timed out"]


CHEATS = {
    "exit 0 before the tests": "import sys\ndef add(a, b):\n    return 42\nsys.exit(0)",
    "os._exit(0) before the tests": "import os\ndef add(a, b):\n    return 42\nos._exit(0)",
    "exit 0 during a test": "import sys\ndef add(a, b):\n    sys.exit(0)",
    "print fake results": "def add(a, b):\n    print('{\"test\": 0, \"passed\": true}')\n    return 42",
    "an object equal to everything": "class A:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                                     "def add(a, b):\n    return A()",
    "an int subclass equal to everything": "class I(int):\n    def __eq__(self, o): return True\n"
                                           "def add(a, b):\n    return I(5)",  # read as the plain 5 it holds
    "a list holding a cheat": "class A:\n    def __eq__(self, o): return True\ndef add(a, b):\n    return [A()]",
    "patched builtins": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
                        "builtins.isinstance = lambda *a: True\ndef add(a, b):\n    return 42",
    "raising a BaseException": "def add(a, b):\n    raise KeyboardInterrupt",
}


@pytest.mark.parametrize("name", list(CHEATS))
def test_programs_that_cheat_do_not_score(name):
    rep = score(CHEATS[name])
    assert rep.passed == 0, (name, rep)


def test_patching_helpers_used_by_the_tests_does_not_help():
    p = CodeProblem("t2", "", ["import math\nassert math.isclose(area(1), 3.14159, rel_tol=1e-3)",
                               "assert sorted(area(2)) == [1, 2]"], "area")
    cheat = "import math\nmath.isclose = lambda *a, **k: True\nsorted = lambda x: [1, 2]\ndef area(r):\n    return 0"
    assert score(cheat, p).passed == 0
    assert score("import math\ndef area(r):\n    return math.pi * r * r if r == 1 else [2, 1]", p).passed == 2


def test_not_and_boolean_operators_are_judged_too():
    p = CodeProblem("t3", "", ["assert not is_odd(2)", "assert is_odd(3) and is_odd(5)"], "is_odd")
    assert score("def is_odd(n):\n    return n % 2 == 1", p).passed == 2
    cheat = "class B:\n    def __bool__(self): return False\ndef is_odd(n):\n    return B()"
    assert score(cheat, p).passed == 0


# --- pass@k ----------------------------------------------------------------------------------

def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - (7 * 6 * 5 * 4 * 3) / (10 * 9 * 8 * 7 * 6))
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


# --- the environment -------------------------------------------------------------------------

def _mbpp_file(tmp_path) -> str:
    """Three MBPP-shaped records: one per split we use."""
    records = [
        {"task_id": 11, "text": "Write a function to add two numbers.", "code": GOOD,
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 5) == 7"],
         "test_setup_code": "", "challenge_test_list": []},
        {"task_id": 511, "text": "Write a function to negate.", "code": "def neg(x):\n    return -x",
         "test_list": ["assert neg(1) == -1"], "test_setup_code": "", "challenge_test_list": []},
        {"task_id": 601, "text": "Write a function to double.", "code": "def dbl(x):\n    return 2 * x",
         "test_list": ["assert dbl(1) == 2", "assert dbl(3) == 6"], "test_setup_code": "", "challenge_test_list": []},
    ]
    path = tmp_path / "mbpp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def _play(env, replies: dict[str, str]):
    for agent in env.possible_agents:
        assert env.agent_selection == agent
        env.step(replies[agent])
    return env.last()


def test_mbpp_splits_and_prompt(tmp_path):
    env = CodeEnv(["coder"], ["coder"], name="mbpp", test_path=_mbpp_file(tmp_path))
    assert env.num_problems("test") == 1 and env.num_problems("train") == 1
    env.reset(options={"split": "test", "index": 0})
    obs = env.observe("coder")
    assert "add two numbers" in obs and "assert add(1, 2) == 3" in obs and "```python" in obs
    assert CodeEnv(["c"], ["c"], test_path=_mbpp_file(tmp_path), test_split="validation").splits["test"][0].task_id == 511


def test_coder_tester_team_grades_the_last_program(tmp_path):
    path = _mbpp_file(tmp_path)
    env = CodeEnv(["coder", "tester"], ["coder", "tester"], name="mbpp", test_path=path)
    bad, good = "```python\ndef add(a, b):\n    return a - b\n```", f"```python\n{GOOD}```"
    env.reset(options={"split": "test", "index": 0})
    _, reward, done, _, info = _play(env, {"coder": bad, "tester": good})  # the tester fixes it
    assert info["success"] and reward == 0.5 and done  # coder wrong, tester right
    env.reset(options={"split": "test", "index": 0})
    _, reward, _, _, info = _play(env, {"coder": good, "tester": "APPROVED: the code is correct."})
    assert info["success"] and reward == 1.0  # approval keeps the coder's program
    env.reset(options={"split": "test", "index": 0})
    _, reward, _, _, info = _play(env, {"coder": good, "tester": bad})  # the tester breaks it
    assert not info["success"] and reward == 0.5


def test_multi_turn_feedback_and_fraction_reward(tmp_path):
    env = CodeEnv(["coder"], ["coder"], horizon=2, name="mbpp", test_path=_mbpp_file(tmp_path), reward="fraction")
    env.reset(options={"split": "test", "index": 0})
    _, reward, done, truncated, info = _play(env, {"coder": "```python\ndef add(a, b):\n    return 3\n```"})
    assert reward == pytest.approx(1 / 3) and not done and not truncated and not info["success"]
    obs = env.observe("coder")
    assert "1 of 3 tests passed" in obs and "assert add(0, 0) == 0" in obs and "left side is 3" in obs
    _, reward, done, _, info = _play(env, {"coder": f"```python\n{GOOD}```"})
    assert reward == 1.0 and done and info["success"] and not env.agents


def test_bad_code_task_options_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        CodeEnv(["c"], ["c"], test_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="reward"):
        CodeEnv(["c"], ["c"], test_path=_mbpp_file(tmp_path), reward="most")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": 11, "text": "x", "test_list": ["assert 1"]}\n{not json\n')
    with pytest.raises(UserError, match="line 2"):
        load_mbpp(str(bad))


# --- canonical solutions ---------------------------------------------------------------------

def _canonical_pass_rate(problems) -> tuple[float, list]:
    jobs = [(extract_code(f"```python\n{p.solution}\n```", p.entry, p.stub), p) for p in problems]
    reps = run_tests(Sandbox(Limits(wall_s=20, cpu_s=20), workers=os.cpu_count() or 2), jobs, test_timeout_s=10)
    failing = [p.task_id for p, r in zip(problems, reps) if not r.all_passed]
    return 1 - len(failing) / len(problems), failing


@pytest.mark.slow  # all 974 MBPP solutions through the sandbox: 40 s on 2 cores
def test_mbpp_canonical_solutions_pass_and_wrong_ones_fail(data_dir):
    problems = list(load_mbpp(MBPP).values())
    rate, failing = _canonical_pass_rate(problems)
    assert sorted(failing) == [341, 596, 642], failing  # 971/974: the three with order- or size-dependent asserts
    wrong = run_tests(SB, [("def f(*a, **k):\n    return None\n" + f"{p.entry} = f", p) for p in problems[:40]])
    assert all(r.passed == 0 for r in wrong)


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    problems = load_humaneval()
    assert len(problems) == 164
    rate, failing = _canonical_pass_rate(problems)
    assert failing == [], failing  # 164/164
    wrong = run_tests(SB, [(p.stub + "    return None\n", p) for p in problems[:40]])
    assert all(r.passed == 0 for r in wrong)


# --- end to end: marft eval and marft train on a coder -> tester duo -----------------------------

def test_eval_and_train_a_code_duo_end_to_end(tiny_model_dir, tmp_path, capsys):
    from marft.cli import main

    path = _mbpp_file(tmp_path)
    common = [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "rollout.max_new_tokens=8",
              "rollout.episodes=4", f"task.test_path={path}", "task.options.workers=2", "eval.problems=4"]
    out = tmp_path / "eval.json"
    assert main(["eval", "configs/code_duo_mbpp.yaml", *common, "eval.samples=2", f"eval.output={out}",
                 f"output_dir={tmp_path / 'e'}"]) == 0
    printed = capsys.readouterr().out
    assert "pass@2" in printed and "coder: mean reply tokens" in printed and "tester" in printed
    res = json.loads(out.read_text())
    assert (res["problems"], res["samples"]) == (1, 2)  # the tiny file's test split holds one problem
    assert set(res["pass_at_k"]) == {"1", "2"} and len(res["solved_by_turn"]) == 2  # horizon 2
    assert res["pass_at_k"]["1"] == res["accuracy"] == 0.0  # random weights write no program
    assert res["mean_steps"] == 2.0  # so every episode used its second attempt
    run = tmp_path / "t"
    assert main(["train", "configs/code_duo_mbpp.yaml", *common, "train.iterations=1", "train.minibatch_size=4",
                 "eval.problems=1", f"output_dir={run}"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1
    adapters = run / "checkpoints" / "iter_000001" / "adapters"
    assert (adapters / "coder" / "adapter_config.json").exists() and (adapters / "tester" / "adapter_config.json").exists()
