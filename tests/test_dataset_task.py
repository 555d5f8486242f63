"""task.kind dataset: a task from a data set (read with ``datasets``, here local files) and a reward
function; building, splits, grading, one-line errors, env-check, and a tiny-model learning check."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from marft.cli import main
from marft.run.config import load_config
from marft.envs import DATASET_KEYS, KINDS, make_env_factory
from marft.envs.dataset import DatasetEnv, load_reward
from marft.errors import UserError


REWARDS = '''
SEEN = []

def exact(reply, record):
    return 1.0 if reply.strip() == str(record["answer"]) else 0.0

def flag(reply, record):
    return str(record["answer"]) in reply

def half(reply, record):
    return 0.5

def echo(reply, record):
    SEEN.append((reply, record))
    record["answer"] = "tampered"  # the environment's copy must not change
    return 0

def text(reply, record):
    return "1"

def nan(reply, record):
    return float("nan")

def nothing(reply, record):
    return None

def raises(reply, record):
    return record["no_such_column"]

def one_arg(reply):
    return 1.0

NOT_CALLABLE = 3
'''


def records(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "id": i} for i in range(start, start + n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "sums.jsonl", records(20))


@pytest.fixture
def rewards(tmp_path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def settings(**kw) -> dict:
    base = {"dataset": "", "dataset_config": "", "train_split": "train", "test_split": "test",
            "prompt_column": "question", "answer_column": "answer", "reward": "", "success_threshold": 1.0}
    assert set(base) == set(DATASET_KEYS)
    return {**base, **kw}


def factory(agents=("p", "s"), answering=("s",), horizon=1, options=None, **kw):
    return make_env_factory("dataset", list(agents), list(answering), horizon, "", dict(options or {}), "", "", "",
                            settings(**kw))


def play(env, replies: dict[str, str]):
    """One step: every agent in order gives its reply."""
    for agent in list(env.possible_agents):
        assert env.agent_selection == agent
        env.step(replies[agent])
    return env.last()


# --- building, splits ----------------------------------------------------------------------------

def test_builds_and_resets_on_both_splits(data_file, rewards):
    assert "dataset" in KINDS
    env = factory(dataset=str(data_file), reward=f"{rewards}:exact")()
    assert isinstance(env, DatasetEnv)
    # one file, no test split: the last tenth (2 of 20 records) is held out, in file order
    assert env.num_problems("train") == 18 and env.num_problems("test") == 2
    env.reset(seed=0, options={"split": "test", "index": 0})
    assert env.problem.prompt == "What is 18 + 18?" and env.problem.answer == "36"
    assert env.observe("p") == "What is 18 + 18?"
    assert env.observe("s") == "What is 18 + 18?\n\nGive the final answer in \\boxed{}."
    env.reset(seed=0, options={"split": "train", "index": 17})
    assert env.problem.prompt == "What is 17 + 17?"
    drawn = set()
    for seed in range(40):
        env.reset(seed=seed)
        drawn.add(env.problem.meta["index"])
    assert drawn <= set(range(18)) and len(drawn) > 5
    other = factory(dataset=str(data_file), reward=f"{rewards}:exact")()
    env.reset(seed=3)
    other.reset(seed=3)
    assert env.problem.prompt == other.problem.prompt
    with pytest.raises(UserError, match="index 2 is out of range: the test split .* has 2 records"):
        env.reset(options={"split": "test", "index": 2})


def test_named_splits_folders_and_slices(tmp_path, rewards):
    folder = tmp_path / "sums"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", records(6))
    write_jsonl(folder / "test.jsonl", records(3, start=100))
    env = factory(dataset=str(folder), reward=f"{rewards}:exact")()  # the folder's files are the splits
    assert (env.num_problems("train"), env.num_problems("test")) == (6, 3)
    env.reset(options={"split": "test", "index": 0})
    assert env.problem.prompt == "What is 100 + 100?"
    env = factory(dataset=str(folder), reward=f"{rewards}:exact", test_split="train")()  # evaluate on train
    assert env.num_problems("test") == 6
    single = write_jsonl(tmp_path / "one.jsonl", records(10))
    env = factory(dataset=str(single), reward=f"{rewards}:exact", train_split="train[:4]", test_split="train[-3:]")()
    assert (env.num_problems("train"), env.num_problems("test")) == (4, 3)
    env.reset(options={"split": "test", "index": 0})
    assert env.problem.prompt == "What is 7 + 7?"
    with pytest.raises(UserError, match=r"has no split 'validation' \(its splits: (train, test|test, train)\); "
                                        "set task.test_split to one of them"):
        factory(dataset=str(folder), reward=f"{rewards}:exact", test_split="validation")
    csv = tmp_path / "sums.csv"
    csv.write_text("question,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    env = factory(dataset=str(csv), reward=f"{rewards}:exact")()
    assert (env.num_problems("train"), env.num_problems("test")) == (1, 1)


def test_no_answer_column_and_instruction(tmp_path, rewards):
    path = write_jsonl(tmp_path / "words.jsonl", [{"question": "Say a word."}] * 4)
    env = factory(dataset=str(path), reward=f"{rewards}:half", answer_column="", options={"instruction": ""})()
    env.reset(seed=0)
    assert env.problem.answer is None and env.observe("s") == "Say a word."
    env = factory(dataset=str(path), reward=f"{rewards}:half", answer_column="",
                  options={"instruction": "Answer in one word."})()
    env.reset(seed=0)
    assert env.observe("s") == "Say a word.\n\nAnswer in one word."


# --- grading -------------------------------------------------------------------------------------

def test_grading_hand_checked(data_file, rewards):
    env = factory(dataset=str(data_file), reward=f"{rewards}:exact", horizon=2)()
    env.reset(options={"split": "train", "index": 3})  # What is 3 + 3? -> 6
    _, reward, term, trunc, info = play(env, {"p": "add them", "s": "5"})
    assert (reward, term, trunc, info["success"], info["extracted"]) == (0.0, False, False, False, True)
    assert env.agents == ["p", "s"]  # a second attempt
    assert "Feedback: The answer was wrong. Try again." in env.observe("p")
    _, reward, term, trunc, info = play(env, {"p": "add them", "s": " 6 "})
    assert (reward, term, trunc, info["success"]) == (1.0, True, False, True)
    assert env.agents == []

    # two answering agents: the team reward is their mean, success is the last one's
    env = factory(dataset=str(data_file), reward=f"{rewards}:flag", answering=("p", "s"))()
    env.reset(options={"split": "train", "index": 4})  # 8
    _, reward, *_ , info = play(env, {"p": "It is 8.", "s": "It is 9."})
    assert reward == 0.5 and info["success"] is False
    env.reset(options={"split": "train", "index": 4})
    _, reward, *_ , info = play(env, {"p": "no idea", "s": "8"})
    assert reward == 0.5 and info["success"] is True
    env.reset(options={"split": "train", "index": 4})
    _, reward, *_ , info = play(env, {"p": "", "s": ""})
    assert reward == 0.0 and info["extracted"] is False  # an empty reply: nothing extracted

    # a fractional reward: solved only at or above task.success_threshold
    env = factory(dataset=str(data_file), reward=f"{rewards}:half")()
    env.reset(seed=0)
    _, reward, term, trunc, info = play(env, {"p": "x", "s": "y"})
    assert (reward, info["success"], term, trunc) == (0.5, False, False, True)
    env = factory(dataset=str(data_file), reward=f"{rewards}:half", success_threshold=0.5)()
    env.reset(seed=0)
    assert play(env, {"p": "x", "s": "y"})[4]["success"] is True


def test_reward_gets_the_reply_and_a_copy_of_the_whole_record(data_file, rewards):
    env = factory(dataset=str(data_file), reward=f"{rewards}:echo", answering=("p", "s"))()
    seen = load_reward(f"{rewards}:echo").__globals__["SEEN"]
    seen.clear()
    env.reset(options={"split": "test", "index": 1})
    play(env, {"p": "first", "s": "second"})
    assert seen == [("first", {"question": "What is 19 + 19?", "answer": "tampered", "id": 19}),
                    ("second", {"question": "What is 19 + 19?", "answer": "tampered", "id": 19})]
    assert seen[0][1] is not seen[1][1]
    env.reset(options={"split": "test", "index": 1})
    assert env.problem.answer == "38" and env.problem.meta["record"]["answer"] == "38"


TRL_REWARDS = '''
SEEN = []
def accuracy(completions, answer, **kwargs):         # as written for TRL's GRPOTrainer
    SEEN.append((completions, answer, kwargs))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
def named(prompts, completions, id):                  # no **kwargs: given only what it names
    return [float(id == [3] and prompts == ["What is 3 + 3?"] and completions == ["6"])]
def two(completions, **kwargs):
    return [1.0, 0.0]
def ids(completions, completion_ids, **kwargs):
    return [1.0]
def unrelated(reply, record, completions=None):       # marft's own signature, with a parameter so named
    return 1.0
async def later(completions, **kwargs):
    return [1.0]
def by_prompt(prompts, completions, **kwargs):
    return [float(prompts == ["What is 2 + 2?"] and "problem" in kwargs)]
def as_tensor(completions, **kwargs):
    import torch
    return torch.tensor([0.5])
def as_generator(completions, **kwargs):
    return (0.25 for _ in completions)
def not_applicable(completions, **kwargs):
    return [None]
def needs_solution(completions, solution, **kwargs):
    return [1.0]
def positional(completions, /, **kwargs):
    return [1.0]
'''


@pytest.fixture
def trl_rewards(tmp_path) -> Path:
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return path


def test_a_trl_reward_function_is_called_as_trl_calls_it(data_file, trl_rewards):
    env = factory(dataset=str(data_file), reward=f"{trl_rewards}:accuracy")()
    seen = load_reward(f"{trl_rewards}:accuracy").fn.__globals__["SEEN"]
    seen.clear()
    env.reset(options={"split": "train", "index": 3})  # What is 3 + 3? -> 6
    assert play(env, {"p": "add", "s": " 6 "})[1] == 1.0
    env.reset(options={"split": "train", "index": 3})
    assert play(env, {"p": "add", "s": "5"})[1] == 0.0
    assert seen[0] == ([" 6 "], ["6"], {"prompts": ["What is 3 + 3?"], "question": ["What is 3 + 3?"], "id": [3]})

    env = factory(dataset=str(data_file), reward=f"{trl_rewards}:named")()  # only the keywords it takes
    env.reset(options={"split": "train", "index": 3})
    assert play(env, {"p": "add", "s": "6"})[1] == 1.0

    env = factory(dataset=str(data_file), reward=f"{trl_rewards}:two")()
    env.reset(options={"split": "train", "index": 0})
    env.step("plan")
    with pytest.raises(UserError, match=r"raised ValueError: a TRL reward function returns one reward per completion; "
                                        r"for one completion it returned 2 values on record"):
        env.step("answer")

    with pytest.raises(UserError, match=r"needs completion_ids, which marft does not pass to a TRL reward function .*"
                                        r"give it a default: ids\(completions, completion_ids, \*\*kwargs\)"):
        factory(dataset=str(data_file), reward=f"{trl_rewards}:ids")

    with pytest.raises(UserError, match=r"task.reward .*:later' is an async function; marft calls reward functions as "
                                        r"plain functions: define it with def, not async def"):
        factory(dataset=str(data_file), reward=f"{trl_rewards}:later")
    for fn, value in (("as_tensor", 0.5), ("as_generator", 0.25)):  # whatever TRL iterates
        env = factory(dataset=str(data_file), reward=f"{trl_rewards}:{fn}")()
        env.reset(options={"split": "train", "index": 0})
        assert play(env, {"p": "add", "s": "x"})[1] == value
    env = factory(dataset=str(data_file), reward=f"{trl_rewards}:not_applicable")()
    env.reset(options={"split": "train", "index": 0})
    env.step("plan")
    with pytest.raises(UserError, match=r"raised ValueError: returned \[None\] \(TRL's 'not applicable', which it skips\)"):
        env.step("answer")
    with pytest.raises(UserError, match=r"takes 'solution', which is no column of the data set \(its columns: question, "
                                        r"answer, id\); a TRL reward function gets the columns by name"):
        factory(dataset=str(data_file), reward=f"{trl_rewards}:needs_solution")
    with pytest.raises(UserError, match=r"has positional-only parameters; TRL and marft call it by keyword"):
        factory(dataset=str(data_file), reward=f"{trl_rewards}:positional")
    clash = write_jsonl(data_file.parent / "clash.jsonl", [{**r, "completions": "x"} for r in records(20)])
    with pytest.raises(UserError, match=r"the data set has a column 'completions' too; rename that column"):
        factory(dataset=str(clash), reward=f"{trl_rewards}:accuracy")

    # prompts come from task.prompt_column, also when the function was loaded (cached) for another column
    other = write_jsonl(data_file.parent / "problems.jsonl",
                        [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)])
    factory(dataset=str(data_file), reward=f"{trl_rewards}:by_prompt")()
    env = factory(dataset=str(other), reward=f"{trl_rewards}:by_prompt", prompt_column="problem")()
    env.reset(options={"split": "train", "index": 2})
    assert play(env, {"p": "add", "s": "4"})[1] == 1.0

    env = factory(dataset=str(data_file), reward=f"{trl_rewards}:unrelated")()  # reply beside completions: marft's
    env.reset(options={"split": "train", "index": 0})
    assert play(env, {"p": "add", "s": "x"})[1] == 1.0


@pytest.mark.parametrize("fn, message", [
    ("text", r"task.reward .*rewards.py:text returned '1' \(str\) on record 0 of the test split; it must return a finite number or a bool"),
    ("nan", r"returned nan \(float\) on record 0 of the test split"),
    ("nothing", r"returned None \(NoneType\)"),
    ("raises", r"task.reward .*rewards.py:raises raised KeyError: 'no_such_column' on record 0 of the test split"),
])
def test_bad_reward_values_name_the_function(data_file, rewards, fn, message):
    env = factory(dataset=str(data_file), reward=f"{rewards}:{fn}")()  # building does not call the reward
    env.reset(options={"split": "test", "index": 0})
    env.step("plan")
    with pytest.raises(UserError, match=message):
        env.step("answer")


# --- errors (one line each) ----------------------------------------------------------------------

def test_errors(tmp_path, data_file, rewards):
    r = f"{rewards}:exact"
    cases = [
        (dict(dataset=str(tmp_path / "missing.jsonl"), reward=r), r"data set file '.*missing.jsonl' does not exist"),
        (dict(dataset=str(data_file), reward=r, prompt_column="problem"),
         r"the train split has no column 'problem' \(its columns: question, answer, id\); set task.prompt_column"),
        (dict(dataset=str(data_file), reward=r, answer_column="final_answer"),
         r"no column 'final_answer' \(its columns: question, answer, id\); set task.answer_column to one of them, "
         r"or task.answer_column=''"),
        (dict(dataset=str(data_file), reward="exact"), r"task.reward 'exact' must look like 'package.module:function'"),
        (dict(dataset=str(data_file), reward=f"{tmp_path / 'nope.py'}:exact"), r"task.reward .*cannot import module .*nope.py.*no such file"),
        (dict(dataset=str(data_file), reward="no_such_module_xyz:f"), r"cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        (dict(dataset=str(data_file), reward=f"{rewards}:exct"),
         r"has no function 'exct' \(its functions: echo, exact, flag, half, nan, nothing, one_arg, raises, text\)"),
        (dict(dataset=str(data_file), reward=f"{rewards}:NOT_CALLABLE"), r"is a int, not a function reward\(reply, record\)"),
        (dict(dataset=str(data_file), reward=f"{rewards}:one_arg"),
         r"must take two arguments, reward\(reply, record\) \(or, as a TRL reward function, completions and \*\*kwargs\); "
         r"its signature is one_arg\(reply\)"),
        (dict(dataset=str(data_file)), r"task.kind dataset needs task.reward"),
        (dict(dataset=str(data_file), reward=[r, r]), r"task.reward must be one 'package.module:function' .*; for several "
                                                       r"\(TRL's reward_funcs\), write one function that returns their weighted sum"),
        (dict(dataset=str(data_file), reward=r, test_split="validation"),
         r"has no split 'validation' \(its splits: train\); set task.test_split"),
        (dict(dataset="openai/gsm8k", dataset_config="main", reward=r),  # conftest sets HF_HUB_OFFLINE=1
         r"data set 'openai/gsm8k' is not in the local Hugging Face datasets cache and HF_HUB_OFFLINE is set; "
         r"set MARFT_DATA_DIR to a folder of local copies, or use a local file or folder instead"),
    ]
    for kw, message in cases:
        with pytest.raises(UserError, match=message) as e:
            factory(**kw)
        assert "\n" not in str(e.value)

    empty_prompt = write_jsonl(tmp_path / "gap.jsonl", records(3) + [{"question": "  ", "answer": "0", "id": 3}])
    with pytest.raises(UserError, match=r"record 3 of the train split has an empty prompt in column 'question'"):
        factory(dataset=str(empty_prompt), reward=r)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match="is empty"):
        factory(dataset=str(tmp_path / "empty.jsonl"), reward=r)
    (tmp_path / "broken.jsonl").write_text('{"question": "a", "answer": "1"}\nnot json\n')
    with pytest.raises(UserError, match=r"cannot load data set .*broken.jsonl.*JSON parse error.*; fix the file"):
        factory(dataset=str(tmp_path / "broken.jsonl"), reward=r)
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(UserError, match=r"must end in .jsonl, .json, .csv or .parquet"):
        factory(dataset=str(tmp_path / "notes.txt"), reward=r)
    one = write_jsonl(tmp_path / "one.jsonl", records(1))
    with pytest.raises(UserError, match="too few to hold one out; .*task.test_split=train"):
        factory(dataset=str(one), reward=r)
    with pytest.raises(UserError, match="task.options reward is a key of its own: set task.reward instead"):
        factory(dataset=str(data_file), reward=r, options={"reward": r})
    with pytest.raises(UserError, match="cannot build the dataset environment DatasetEnv .*'oops'"):
        factory(dataset=str(data_file), reward=r, options={"oops": 1})


def test_hub_without_network_fails_at_once(monkeypatch, rewards, data_file):
    """Not offline, the Hub unreachable (a closed local port): one line at once, no retries."""
    import time

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"data set 'openai/gsm8k' is a Hub id, but the Hub \(http://127.0.0.1:9\) "
                                        r"cannot be reached \(.*\); set MARFT_DATA_DIR to a folder of local copies, or use a "
                                        r"local file or folder instead: task.dataset=path/to/train.jsonl"):
        factory(dataset="openai/gsm8k", dataset_config="main", reward=f"{rewards}:exact")
    assert time.perf_counter() - start < 10


def test_config_keys_and_validation(data_file, rewards):
    cfg = load_config(None, ["task.kind=dataset", f"task.dataset={data_file}", f"task.reward={rewards}:exact",
                             "task.success_threshold=0.5", "task.train_split=train[:50%]"])
    t = cfg.task
    assert (t.dataset, t.reward, t.success_threshold, t.train_split, t.test_split, t.prompt_column, t.answer_column,
            t.dataset_config) == (str(data_file), f"{rewards}:exact", 0.5, "train[:50%]", "test", "question", "answer", "")
    with pytest.raises(UserError, match="task.kind is dataset but task.dataset is not set"):
        load_config(None, ["task.kind=dataset", f"task.reward={rewards}:exact"])
    with pytest.raises(UserError, match="task.kind is dataset: set task.reward to module:function"):
        load_config(None, ["task.kind=dataset", f"task.dataset={data_file}"])
    with pytest.raises(UserError, match="task.success_threshold must be a finite number"):
        load_config(None, ["task.kind=dataset", f"task.dataset={data_file}", f"task.reward={rewards}:exact",
                           "task.success_threshold=.nan"])
    with pytest.raises(UserError, match=r"config: task.reward must be a string, got \['a.py:f', 'b.py:g'\]; it names one "
                                        r"function: for several \(TRL's reward_funcs\), write one that returns their weighted sum"):
        load_config(None, ["task.kind=dataset", f"task.dataset={data_file}", "task.reward=[a.py:f, b.py:g]"])
    cfg = load_config("configs/dataset_gsm8k.yaml")  # the example: valid without network (nothing is loaded yet)
    assert (cfg.task.kind, cfg.task.dataset, cfg.task.dataset_config) == ("dataset", "openai/gsm8k", "main")


def test_local_gsm8k_folder_with_the_shipped_reward(data_dir, monkeypatch):
    """The config's comment: a folder of one's own (here GSM8K's local copy) with its columns named."""
    from marft.api import env_factory
    from marft.team import build_team

    monkeypatch.delenv("MARFT_DATA_DIR")  # the folder itself, not the override
    cfg = load_config("configs/dataset_gsm8k.yaml", [f"task.dataset={data_dir / 'gsm8k'}", "task.prompt_column=problem",
                                                     "task.answer_column=final_answer"])
    env = env_factory(cfg, build_team(cfg.team))()
    assert (env.num_problems("train"), env.num_problems("test")) == (7473, 1319)
    env.reset(options={"split": "test", "index": 0})
    gold = env.problem.answer
    assert play(env, {"planner": "add", "solver": f"So \\boxed{{{gold}}}."})[1] == 1.0
    env.reset(options={"split": "test", "index": 0})
    assert play(env, {"planner": "add", "solver": "So \\boxed{-1}."})[1] == 0.0
    from marft.envs.rewards import gsm8k

    assert gsm8k("The answer is \\boxed{72}", {"question": "q", "answer": "She sold 48 + 24 = 72.\n#### 72"}) == 1.0


ROOT = Path(__file__).resolve().parents[1]
ROW_REWARDS = 'def score(reply, record):\n    return reply.strip() == record["answer"]\n\n' \
              'def text(reply, record):\n    return "1"\n\ndef one(reply):\n    return 1.0\n'


@pytest.fixture
def row_folder(tmp_path, monkeypatch):
    """The folder of docs/errors.md's dataset rows: data/qa.jsonl, data/gaps.jsonl, data/badline.jsonl, my_reward.py."""
    (tmp_path / "data").mkdir()
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]
    write_jsonl(tmp_path / "data" / "qa.jsonl", rows)
    write_jsonl(tmp_path / "data" / "gaps.jsonl", rows[:3] + [{"question": "", "answer": "6"}] + rows[4:])
    (tmp_path / "data" / "badline.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": \n')
    (tmp_path / "my_reward.py").write_text(ROW_REWARDS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["task.reward=my_reward.py:score"], "config: task.kind is dataset but task.dataset is not set; give a Hub id "
     "(openai/gsm8k) or a .jsonl, .json, .csv or .parquet file or folder"),
    (["task.dataset=data/sums.jsonl", "task.reward=my_reward.py:score"], "data set file 'data/sums.jsonl' does not exist; "
     "set task.dataset to a .jsonl, .json, .csv or .parquet file, a folder of them, or a Hub id like openai/gsm8k"),
    (["task.dataset=data/badline.jsonl", "task.reward=my_reward.py:score"], "cannot load data set 'data/badline.jsonl': "
     "ArrowInvalid: JSON parse error: Invalid value. in row 1; fix the file"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_reward.py:score", "task.prompt_column=problem"],
     "data set 'data/qa.jsonl': the train split has no column 'problem' (its columns: question, answer); "
     "set task.prompt_column to one of them"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_reward.py:score", "task.answer_column=final_answer"],
     "data set 'data/qa.jsonl': the train split has no column 'final_answer' (its columns: question, answer); "
     "set task.answer_column to one of them, or task.answer_column='' if the reward needs no answer column"),
    (["task.dataset=data/gaps.jsonl", "task.reward=my_reward.py:score"], "data set 'data/gaps.jsonl': record 3 of the "
     "train split has an empty prompt in column 'question'; fix or remove that record"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_reward.py:score", "task.test_split=validation"],
     "data set 'data/qa.jsonl' has no split 'validation' (its splits: train); set task.test_split to one of them"),
    (["task.dataset=openai/gsm8k", "task.dataset_config=main", "task.reward=marft.envs.rewards:gsm8k"],  # HF_HUB_OFFLINE=1
     "data set 'openai/gsm8k' is not in the local Hugging Face datasets cache and HF_HUB_OFFLINE is set; set MARFT_DATA_DIR "
     "to a folder of local copies, or use a local file or folder instead: task.dataset=path/to/train.jsonl (.jsonl, .json, "
     ".csv, .parquet)"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_reward.py"], "config: task.kind is dataset: set task.reward to "
     "module:function or path/to/file.py:function, called as reward(reply, record) -> float"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_rewards.py:score"],
     "task.reward 'my_rewards.py:score': cannot import module 'my_rewards.py': no such file"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_reward.py:scor"], "task.reward 'my_reward.py:scor': module "
     "'my_reward.py' has no function 'scor' (its functions: one, score, text); check the name after ':'"),
    (["task.dataset=data/qa.jsonl", "task.reward=my_reward.py:one"], "task.reward 'my_reward.py:one' must take two "
     "arguments, reward(reply, record) (or, as a TRL reward function, completions and **kwargs); its signature is one(reply)"),
])
def test_errors_md_rows(row_folder, capsys, args, message):
    """The rows of docs/errors.md for task.kind=dataset, through marft eval: one line, status 2."""
    rc = main(["eval", str(ROOT / "configs" / "duo_arithmetic.yaml"), "task.kind=dataset", "task.options={}", *args])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines()[-1] == f"marft: error: {message}", err
    assert "Traceback" not in err
    assert f"`marft: error: {message}`" in (ROOT / "docs" / "errors.md").read_text()


def test_errors_md_reward_value_row(row_folder, capsys):
    assert main(["env-check", "dataset", "dataset=data/qa.jsonl", "reward=my_reward.py:text"]) == 1
    out, err = capsys.readouterr()
    assert ("  - step() at step 0 by 'bob' raised UserError: task.reward my_reward.py:text returned '1' (str) on record 6 "
            "of the train split; it must return a finite number or a bool") in out.splitlines()
    assert err.strip() == ("marft: error: environment dataset does not conform (2 problem(s) listed above); "
                           "fix them and run marft env-check again")


# --- env-check -----------------------------------------------------------------------------------

def test_env_check(data_file, rewards, capsys):
    assert main(["env-check", "dataset", f"dataset={data_file}", f"reward={rewards}:exact"]) == 0
    assert capsys.readouterr().out.startswith("env-check: dataset conforms (")
    assert main(["env-check", "marft.envs.dataset:DatasetEnv", f"dataset={data_file}", f"reward={rewards}:flag"]) == 0
    capsys.readouterr()
    assert main(["env-check", "dataset", f"dataset={data_file}", f"reward={rewards}:nan"]) == 1  # a reward bug
    out = capsys.readouterr().out
    assert "returned nan (float) on record" in out and "rewards.py:nan" in out
    assert main(["env-check", "dataset", f"dataset={data_file}", f"reward={rewards}:one_arg"]) == 2  # bad input
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must take two arguments" in err
    assert main(["env-check", "dataset", "dataset=nowhere/data.jsonl", f"reward={rewards}:exact"]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- learning --------------------------------------------------------------------------------------

VOWEL_REWARD = '''
def vowel(reply, record):
    """1 when the reply starts with a vowel (about 1 in 10 for the untrained tiny model)."""
    return reply.strip()[:1].lower() in tuple("aeiou")

def vowel_trl(completions, **kwargs):
    """The same, written for TRL's GRPOTrainer."""
    return [float(c.strip()[:1].lower() in tuple("aeiou")) for c in completions]
'''


@pytest.mark.slow  # over 15 s on 2 cores; kept out of the default suite (15 minutes), run with -m slow
def test_team_learns_a_dataset_task(tiny_model_dir, vowel_env_path, tmp_path):
    """The vowel check of tests/test_train.py with the task as a JSONL file and a reward function: it
    learns, and its rewards are those of the class-based Vowel task (same prompt, same seeds), with
    the reward written for marft and written for TRL alike."""
    from marft.api import prepare
    from marft.assemble import build_trainer

    data = write_jsonl(tmp_path / "words.jsonl", [{"question": "Say a word."}] * 10)
    reward = tmp_path / "vowel_reward.py"
    reward.write_text(VOWEL_REWARD)
    common = [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", "task.options={}",
              "rollout.max_new_tokens=2", "rollout.episodes=32", "eval.problems=4",
              "rollout.temperature=1.0", "train.lr=1e-2", "train.critic_lr=1e-4", "train.epochs=2",
              "train.minibatch_size=16", "train.entropy_coef=0", "team.max_new_tokens={}",
              f"output_dir={tmp_path / 'run'}", "train.algorithm=marft"]
    curves = []
    for task in (["task.kind=dataset", f"task.dataset={data}", f"task.reward={reward}:vowel", "task.answer_column="],
                 ["task.kind=custom", f"task.env={vowel_env_path}:Vowel"],
                 ["task.kind=dataset", f"task.dataset={data}", f"task.reward={reward}:vowel_trl", "task.answer_column="]):
        cfg = load_config("configs/duo_arithmetic.yaml", common + task)
        team, models, make_env = prepare(cfg)
        tr = build_trainer(cfg, team, models, make_env, log=lambda m: None)
        curves.append([tr.iteration_step()["reward"] for _ in range(16)])
    rewards = curves[0]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.25, rewards
    assert curves[0] == curves[1] == curves[2], curves


def test_a_reward_function_that_calls_sys_exit_is_one_line():
    import sys as _sys

    from marft.envs.dataset import score_reply
    from marft.errors import UserError

    with pytest.raises(UserError, match="task.reward r.py:f raised SystemExit"):
        score_reply(lambda reply, record: _sys.exit(3), "r.py:f", "x", {}, "problem 0")


def test_the_trl_style_example_config_trains(tiny_overrides, capsys):
    """configs/solo_grpo.yaml (one agent, GRPO, examples/trl_rewards.py:accuracy written for TRL):
    its reward grades as written, and one iteration trains and saves on the tiny model."""
    from marft.api import env_factory
    from marft.team import build_team

    cfg = load_config(str(ROOT / "configs" / "solo_grpo.yaml"))
    assert (cfg.team.preset, cfg.train.algorithm, cfg.task.reward) == ("solo", "grpo", "examples/trl_rewards.py:accuracy")
    env = env_factory(cfg, build_team(cfg.team))()
    env.reset(options={"split": "test", "index": 0})
    gold = env.problem.answer
    assert play(env, {"solver": f"So the sum is \\boxed{{{gold}}}."})[1] == 1.0
    env.reset(options={"split": "test", "index": 0})
    assert play(env, {"solver": f"\\boxed{{{int(gold) + 1}}}"})[1] == 0.0
    assert main(["train", str(ROOT / "configs" / "solo_grpo.yaml"), *tiny_overrides, "train.iterations=1",
                 "eval.samples=1", "eval.before=false"]) == 0
    run = Path([o for o in tiny_overrides if o.startswith("output_dir=")][0].split("=", 1)[1])
    assert (run / "checkpoints" / "iter_000001" / "adapters" / "solver" / "adapter_config.json").is_file()
    capsys.readouterr()
