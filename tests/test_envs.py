"""Environments: math grading, reasoning-gym extraction, the two shipped tasks, the conformance check."""
from __future__ import annotations

import json
import random
from functools import partial

import pytest

from marft.envs import Grade, Problem, TurnBasedEnv, make_env_factory
from marft.envs.check import check_env, load_env_class, main_check
from marft.envs.gym import ReasoningGymEnv, extract_answer
from marft.envs.math import MathEnv, grade_math
from marft.errors import UserError



# --- math grading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("reply, gold, correct, extracted", [
    ("So the total is \\boxed{72}.", "72", True, True),
    ("The answer is 72", "72", True, True),
    ("Janet sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18 every day.", "18", True, True),
    ("\\boxed{1234}", "1,234", True, True),
    ("\\boxed{1,234}", "1234", True, True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True, True),
    ("The answer is \\frac{1}{2}", "0.5", True, True),
    ("$\\frac{\\sqrt{6}}{2}$", "\\frac{\\sqrt6}2", True, True),
    ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", True, True),
    ("First 3, then 5, so \\boxed{8}", "8", True, True),
    ("\\boxed{71}", "72", False, True),
    ("The answer is 7", "\\frac{1}{2}", False, True),
    ("I have no idea.", "72", False, False),
    ("", "72", False, False),
    ("\\boxed{}", "72", False, False),
])
def test_grade_math(reply, gold, correct, extracted):
    g = grade_math(reply, gold)
    assert (g.correct, g.extracted) == (correct, extracted)
    assert (g.answer is not None) == extracted
    assert (g.feedback == "") == correct


# --- reasoning-gym answer extraction --------------------------------------------------------------

@pytest.mark.parametrize("reply, answer", [
    ("so \\boxed{42}", "42"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{ {a, {b}} }", "{a, {b}}"),
    ("\\boxed{-7} and an unclosed \\boxed{3", "-7"),
    ("<answer>17</answer> and later <answer> 18 </answer>", "18"),
    ("<answer>49*(85 - 1)/14 - 42 - 73</answer>", "49*(85 - 1)/14 - 42 - 73"),
    ("The answer is 12.", "12"),
    ("**Answer:** $-3$", "-3"),
    ("Final answer: 1,234", "1234"),
    ("2 + 3 = 5, then 5 * 4 = 20", "20"),
    ("10 - 3 gives 7", "7"),
    ("we get -5", "-5"),
    ("it costs 3.25 dollars", "3.25"),
    ("\\boxed{9} beats 'the answer is 8' and 7", "9"),
    ("I don't know", None),
    ("", None),
    ("\\boxed{}", None),
])
def test_extract_answer(reply, answer):
    assert extract_answer(reply) == answer


# --- MathEnv --------------------------------------------------------------------------------------

RECORDS = [
    {"problem": "What is 2 + 3?", "final_answer": "5"},
    {"problem": "What is half of 1?", "final_answer": "\\frac{1}{2}"},
    {"problem": "What is 1000 + 234?", "final_answer": "1,234"},
]


@pytest.fixture
def json_file(tmp_path):
    p = tmp_path / "train.json"
    p.write_text(json.dumps(RECORDS))
    return str(p)


@pytest.fixture
def jsonl_file(tmp_path):  # MATH-500 shape: 'answer', extra fields
    p = tmp_path / "test.jsonl"
    rows = [{"problem": f"What is {i} * 10?", "answer": str(10 * i), "solution": "..."} for i in range(1, 5)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def play(env, replies: list[str]):
    """Step the given replies in order; return last() after each completed step."""
    out = []
    for r in replies:
        env.step(r)
        if env.agent_selection == env.possible_agents[0]:
            out.append(env.last())
    return out


def test_math_env_indexing_both_shapes(json_file, jsonl_file):
    env = MathEnv(agents=["solver"], answering=["solver"], horizon=1, train_path=json_file, test_path=jsonl_file)
    assert env.num_problems("train") == 3 and env.num_problems("test") == 4
    env.reset(seed=0, options={"split": "train", "index": 2})
    assert env.problem.prompt == "What is 1000 + 234?" and env.problem.answer == "1,234"
    env.reset(seed=0, options={"split": "test", "index": 1})
    assert env.problem.prompt == "What is 2 * 10?" and env.problem.answer == "20"
    with pytest.raises(UserError, match="index 4 is out of range"):
        env.reset(options={"split": "test", "index": 4})
    drawn = set()
    for seed in range(30):
        env.reset(seed=seed)
        drawn.add(env.problem.prompt)
    assert drawn == {r["problem"] for r in RECORDS}
    env.reset(seed=7)
    first = env.problem.prompt
    env.reset(seed=7)
    assert env.problem.prompt == first


def test_math_env_split_fallback(json_file):
    env = MathEnv(agents=["s"], answering=["s"], horizon=1, train_path=json_file)
    env.reset(options={"split": "test", "index": 0})
    assert env.problem.prompt == RECORDS[0]["problem"]
    with pytest.raises(UserError, match="train_path"):
        MathEnv(agents=["s"], answering=["s"], horizon=1)


def test_math_env_reward_is_fraction_of_answering_agents(json_file):
    env = MathEnv(agents=["a", "b"], answering=["a", "b"], horizon=1, train_path=json_file)
    env.reset(options={"split": "train", "index": 0})  # gold 5
    (_, reward, term, trunc, info), = play(env, ["\\boxed{5}", "\\boxed{6}"])
    assert reward == 0.5 and env.rewards == {"a": 0.5, "b": 0.5}
    assert info["success"] is False  # success follows the last answering agent
    assert (term, trunc) == (False, True) and env.agents == []

    env.reset(options={"split": "train", "index": 0})
    (_, reward, term, _, info), = play(env, ["\\boxed{6}", "\\boxed{5}"])
    assert reward == 0.5 and info["success"] is True and term is True


def test_math_env_multi_turn(json_file):
    env = MathEnv(agents=["planner", "solver"], answering=["solver"], horizon=2, train_path=json_file)
    env.reset(options={"split": "train", "index": 1})  # gold 1/2
    (_, r0, term, trunc, info), = play(env, ["plan", "\\boxed{3}"])
    assert (r0, term, trunc, info["extracted"]) == (0.0, False, False, True)
    assert env.agents == ["planner", "solver"] and env.agent_selection == "planner"
    obs = env.observe("solver")
    assert "Feedback: The answer 3 is wrong." in obs and "\\boxed{3}" in obs and "\\boxed{}" in obs
    (_, r1, term, trunc, info), = play(env, ["plan again", "no idea"])
    assert (r1, term, trunc, info["extracted"]) == (0.0, False, True, False)
    assert env.agents == []
    with pytest.raises(RuntimeError):
        env.step("more")

    env.reset(options={"split": "train", "index": 1})
    (_, r0, term, trunc, info), = play(env, ["plan", "It is 0.5, so \\boxed{0.5}"])
    assert (r0, term, trunc, info["success"]) == (1.0, True, False, True)
    assert env.agents == []


def test_math_env_bad_files(tmp_path):
    def load(path):
        MathEnv(agents=["s"], answering=["s"], horizon=1, train_path=str(path)).reset(seed=0)

    with pytest.raises(UserError, match="does not exist"):
        load(tmp_path / "missing.json")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match="empty.jsonl.*empty"):
        load(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "2"}\n{"problem": "c", answer: 3}\n')
    with pytest.raises(UserError, match="bad.jsonl: line 3 is not valid JSON"):
        load(bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"problem": "a", "answer": "1"},')
    with pytest.raises(UserError, match="bad.json: not valid JSON"):
        load(bad_json)
    no_answer = tmp_path / "noanswer.json"
    no_answer.write_text(json.dumps([{"problem": "a", "answer": "1"}, {"problem": "b", "solution": "2"}]))
    with pytest.raises(UserError, match="noanswer.json: record 1 has no 'final_answer' or 'answer' field"):
        load(no_answer)
    no_problem = tmp_path / "noproblem.jsonl"
    no_problem.write_text('{"text": "a", "answer": "1"}\n')  # ('question' is GSM8K's on the Hub: it would do)
    with pytest.raises(UserError, match=r"noproblem.jsonl: line 1 has no 'problem' or 'question' field \(a non-empty string\)"):
        load(no_problem)
    not_list = tmp_path / "dict.json"
    not_list.write_text('{"problem": "a", "answer": "1"}')
    with pytest.raises(UserError, match="expected a JSON list"):
        load(not_list)


def test_math_env_rereads_a_changed_file(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps(RECORDS[:1]))
    env = MathEnv(agents=["s"], answering=["s"], horizon=1, train_path=str(p))
    assert env.num_problems("train") == 1
    p.write_text(json.dumps(RECORDS))
    assert env.num_problems("train") == 3


def test_gsm8k_gold_answers_grade_correct(data_dir):  # GSM8K's local copy (MARFT_DATA_DIR; skipped without one)
    env = MathEnv(agents=["s"], answering=["s"], horizon=1, test_path="hf:openai/gsm8k:main:test")
    assert env.num_problems("test") == 1319
    for i in range(20):
        env.reset(options={"split": "test", "index": i})
        g = env.grade(env.problem, f"Reasoning... \\boxed{{{env.problem.answer}}}")
        assert g.correct and g.extracted, (i, env.problem.answer)
        assert not env.grade(env.problem, f"\\boxed{{{env.problem.answer}1}}").correct


# --- ReasoningGymEnv ------------------------------------------------------------------------------

def gym_env(**options):
    return ReasoningGymEnv(agents=["solver"], answering=["solver"], horizon=1, **options)


def test_gym_test_split_is_deterministic_and_disjoint_from_train():
    a, b = gym_env(), gym_env()
    tests = []
    for i in range(20):
        a.reset(seed=123, options={"split": "test", "index": i})
        b.reset(seed=0, options={"split": "test", "index": i})
        assert a.problem.prompt == b.problem.prompt
        tests.append(a.problem.prompt)
    assert len(set(tests)) == 20
    trains = []
    for seed in range(50):
        a.reset(seed=seed)
        assert a.problem.meta["key"] % 2 == 1 and a.problem.meta["split"] == "train"
        trains.append(a.problem.prompt)
    assert len(set(trains)) > 40 and not set(trains) & set(tests)
    a.reset(seed=5)
    again = a.problem.prompt
    b.reset(seed=5)
    assert b.problem.prompt == again
    other_seed = gym_env(seed=1)
    other_seed.reset(options={"split": "test", "index": 0})
    assert other_seed.problem.prompt != tests[0]
    assert a.num_problems("train") is None and a.num_problems("test") is None


def test_gym_grading_basic_arithmetic():
    env = gym_env(min_terms=2, max_terms=3, max_digits=3)
    env.reset(options={"split": "test", "index": 3})
    gold = env.problem.answer["answer"]
    right = env.grade(env.problem, f"Let me compute. The result is \\boxed{{{gold}}}.")
    assert right.correct and right.extracted and right.answer == gold
    wrong = env.grade(env.problem, f"\\boxed{{{int(gold) + 1}}}")
    assert not wrong.correct and wrong.extracted
    partial_credit = env.grade(env.problem, f"\\boxed{{{gold} apples}}")  # reasoning-gym scores this > 0
    assert env._scorer.score_answer(partial_credit.answer, env.problem.answer) > 0 and not partial_credit.correct
    none = env.grade(env.problem, "no idea")
    assert not none.correct and not none.extracted
    env.step(f"\\boxed{{{gold}}}")
    _, reward, term, _, info = env.last()
    assert reward == 1.0 and term and info["success"] and env.agents == []
    assert "\\boxed{}" in gym_env().answer_instruction()


def test_gym_bad_names_and_options():
    with pytest.raises(UserError, match="unknown reasoning_gym dataset 'basic_arithmetik'.*basic_arithmetic"):
        gym_env(name="basic_arithmetik")
    with pytest.raises(UserError, match="no_such_option.*min_terms"):
        gym_env(no_such_option=1)
    with pytest.raises(UserError, match="min_terms must be positive"):
        gym_env(min_terms=0)


# --- make_env_factory -----------------------------------------------------------------------------

def test_make_env_factory(json_file):
    f = make_env_factory("reasoning_gym", ["p", "s"], ["s"], 2, "chain_sum", {"min_terms": 2, "max_terms": 2},
                         "", "", "")
    e1, e2 = f(), f()
    assert e1 is not e2 and isinstance(e1, ReasoningGymEnv) and e1.horizon == 2 and e1.answering == ["s"]
    f = make_env_factory("math", ["s"], ["s"], 1, "", {}, json_file, "", "")
    assert isinstance(f(), MathEnv)
    f = make_env_factory("custom", ["s"], ["s"], 1, "", {"name": "chain_sum"}, "", "", "marft.envs.gym:ReasoningGymEnv")
    assert f().name == "chain_sum"
    with pytest.raises(UserError, match="unknown task kind"):
        make_env_factory("nope", ["s"], ["s"], 1, "", {}, "", "", "")
    with pytest.raises(UserError, match="does not exist"):
        make_env_factory("math", ["s"], ["s"], 1, "", {}, "/nonexistent/x.json", "", "")
    with pytest.raises(UserError, match="unexpected keyword argument 'oops'"):
        make_env_factory("math", ["s"], ["s"], 1, "", {"oops": 1}, json_file, "", "")
    with pytest.raises(UserError, match="unknown reasoning_gym dataset"):
        make_env_factory("reasoning_gym", ["s"], ["s"], 1, "nope", {}, "", "", "")


# --- the conformance check ------------------------------------------------------------------------

class Toy(TurnBasedEnv):
    """Answer 4 to 'What is 2 + 2?' (a correct env to break in the tests below)."""

    def new_problem(self, rng, split, index):
        n = index if index is not None else rng.randrange(100)
        return Problem(f"What is {n} + {n}?", str(2 * n))

    def grade(self, problem, reply):
        ok = problem.answer in reply
        return Grade(ok, ok, problem.answer if ok else None)


class ObserveNone(Toy):
    def observe(self, agent):
        return None


class NeverEnds(Toy):
    def step(self, action):
        super().step(action)
        self.agents = list(self.possible_agents)


class WrongOrder(Toy):
    def reset(self, seed=None, options=None):
        super().reset(seed, options)
        self.agent_selection = self.possible_agents[-1]


class NanReward(Toy):
    def step(self, action):
        super().step(action)
        if self.agent_selection == self.possible_agents[0]:
            self.rewards = {a: float("nan") for a in self.possible_agents}


class RandomProblem(Toy):
    def new_problem(self, rng, split, index):
        return super().new_problem(random.Random(), split, None)


class NoInfos(Toy):
    def step(self, action):
        super().step(action)
        self.infos = {a: {} for a in self.possible_agents}


class RaisesOnTest(Toy):
    def new_problem(self, rng, split, index):
        if split == "test":
            raise KeyError("no test split")
        return super().new_problem(rng, split, index)


def test_check_env_passes_on_shipped_envs(json_file):
    assert check_env(Toy) == []
    assert check_env(partial(MathEnv, train_path=json_file)) == []
    assert check_env(partial(ReasoningGymEnv, name="basic_arithmetic")) == []


@pytest.mark.parametrize("cls, expected", [
    (ObserveNone, "observe('alice') returned NoneType, expected a non-empty str"),
    (NeverEnds, "after 2 wrong steps with horizon=2; the episode must end"),
    (WrongOrder, "agent_selection is 'bob' at step 0, turn 0, expected 'alice'"),
    (NanReward, "reward is nan, expected a finite float"),
    (RandomProblem, "different first observations"),
    (NoInfos, "infos['alice']['success'] after step 0 is None, expected bool"),
    (RaisesOnTest, "reset(seed=0, options={'split': 'test', 'index': 0}) raised KeyError: 'no test split'"),
])
def test_check_env_reports_broken_envs(cls, expected):
    problems = check_env(cls)
    assert any(expected in p for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_check_env_reports_construction_failure():
    def factory(**kwargs):
        raise TypeError("missing option 'level'")

    assert check_env(factory) == ["construction with agents=['alice', 'bob'], answering=['bob'], horizon=2 "
                                  "raised TypeError: missing option 'level'"]


def test_load_env_class_and_main_check(tmp_path, capsys):
    assert load_env_class("marft.envs.math:MathEnv") is MathEnv
    f = tmp_path / "my_env.py"
    f.write_text("from marft.envs.base import Grade, Problem, TurnBasedEnv\n"
                 "class Mine(TurnBasedEnv):\n"
                 "    def new_problem(self, rng, split, index):\n"
                 "        return Problem('Say yes.', 'yes')\n"
                 "    def grade(self, problem, reply):\n"
                 "        return Grade('yes' in reply, True, reply)\n"
                 "class Broken(Mine):\n"
                 "    def observe(self, agent):\n"
                 "        return 3\n"
                 "NOT_CALLABLE = 3\n")
    assert load_env_class(f"{f}:Mine").__name__ == "Mine"
    with pytest.raises(UserError, match="cannot import module 'no_such_module_xyz'"):
        load_env_class("no_such_module_xyz:Env")
    with pytest.raises(UserError, match="has no attribute 'Nope'"):
        load_env_class("marft.envs.math:Nope")
    with pytest.raises(UserError, match="not a class"):
        load_env_class(f"{f}:NOT_CALLABLE")
    with pytest.raises(UserError, match="no such file"):
        load_env_class(f"{tmp_path}/missing.py:Env")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_xyz\n")
    with pytest.raises(UserError, match="cannot import module .*broken.py.*ModuleNotFoundError"):
        load_env_class(f"{broken}:Env")
    with pytest.raises(UserError, match="must look like"):
        load_env_class("marft.envs.math")

    assert main_check(f"{f}:Mine", {}) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"env-check: {f}:Mine conforms (") and "checks)" in out
    assert main_check("marft.envs.gym:ReasoningGymEnv", {"name": "chain_sum"}) == 0
    assert main_check(f"{f}:Broken", {}) == 1
    out = capsys.readouterr().out
    assert "problem(s)" in out and "  - observe('alice') returned int, expected a non-empty str" in out


def test_grade_math_in_a_worker_thread():
    """math-verify's signal timeout would raise ValueError outside the main thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(grade_math, "\\boxed{72}", "72").result().correct


def test_a_module_name_resolves_from_the_working_directory(tmp_path):
    """`marft env-check my_env:Mine` run in the folder that holds my_env.py (the console script,
    whose sys.path does not hold the working directory, unlike `python -m`), as uvicorn and pytest
    resolve `module:attr`."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "my_env_cwd.py").write_text(
        "from marft.envs.base import Grade, Problem, TurnBasedEnv\n"
        "class Mine(TurnBasedEnv):\n"
        "    def new_problem(self, rng, split, index):\n"
        "        return Problem('Say yes.', 'yes')\n"
        "    def grade(self, problem, reply):\n"
        "        return Grade('yes' in reply, True, reply)\n")
    script = Path(sys.executable).parent / "marft"
    r = subprocess.run([str(script), "env-check", "my_env_cwd:Mine"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "env-check: my_env_cwd:Mine conforms" in r.stdout, r.stderr
    r = subprocess.run([str(script), "env-check", "my_env_nowhere:Mine"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "cannot import module 'my_env_nowhere'" in r.stderr
