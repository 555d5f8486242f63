"""Hub data sets in configs (``hf:REPO:CONFIG:SPLIT``, ``task.dataset: openai/gsm8k``), the shapes the
loaders read, and the local-data override ``MARFT_DATA_DIR`` (marft/envs/sources.py,
docs/guides/offline-data.md): every shipped config that names a Hub data set runs offline through it."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from marft.run.config import load_config, task_list
from marft.envs import sources
from marft.envs.code import CodeEnv, load_mbpp, mbpp_problem
from marft.envs.dataset import load_splits
from marft.envs.math import MathEnv, grade_math, last_boxed, load_records, math_record
from marft.envs.sources import HubRef, gsm8k_answer, parse_hub
from marft.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# --- references and shapes (no data needed) -------------------------------------------------------


def test_hub_references():
    assert parse_hub("data/train.jsonl") is None and parse_hub("") is None
    assert parse_hub("hf:openai/gsm8k:main:train") == HubRef("openai/gsm8k", "main", "train")
    assert parse_hub("hf:HuggingFaceH4/MATH-500::test") == HubRef("HuggingFaceH4/MATH-500", "", "test")
    assert parse_hub("hf:google-research-datasets/mbpp:full") == HubRef("google-research-datasets/mbpp", "full", "")
    assert str(HubRef("google-research-datasets/mbpp", "full")) == "hf:google-research-datasets/mbpp:full"
    for bad in ("hf:gsm8k", "hf:openai/gsm8k:main:train:extra", "hf:/gsm8k", "hf:openai/gsm8k:ma in",
                "hf:openai/gsm8k:main:train[:10%]"):
        with pytest.raises(UserError, match=r"is not a Hub data set reference; write hf:owner/name\[:config\[:split\]\]"):
            parse_hub(bad)


def test_math_records_in_every_known_shape():
    gsm_hub = {"question": "Natalia sold 48 clips ...?", "answer": "48 + 24 = <<48+24=72>>72\n#### 1,072"}
    gsm_original = {"problem": "Natalia sold 48 clips ...?", "final_answer": "1072", "answer_with_process": "...\n#### 1,072"}
    math500 = {"problem": "Convert (0,3).", "solution": "... \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
               "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2}
    math_hub = {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "level": "Level 1", "type": "Algebra",
                "solution": "We have $\\boxed{1}$ first, then $\\frac{1}{2}\\cdot 2 = \\boxed{\\frac{2}{2}}$."}
    assert math_record(gsm_hub) == math_record(gsm_original) == ("Natalia sold 48 clips ...?", "1072")
    assert math_record(math500)[1] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert math_record(math_hub) == ("Compute $\\frac{1}{2}+\\frac{1}{2}$.", "\\frac{2}{2}")
    assert math_record({"problem": "x", "solution": "no box"}) == ("x", None)
    assert math_record({"answer": "1"}) == (None, "1") and math_record("text") == (None, None)
    assert gsm8k_answer("so\n#### 1,080") == "1080" and gsm8k_answer("#### -3.5") == "-3.5"
    assert gsm8k_answer("#### 1,2") == "1,2" and gsm8k_answer("no marker") is None and gsm8k_answer("x\n####") is None
    assert last_boxed("\\boxed{a} and \\fbox{b{c}}") == "b{c}" and last_boxed("so $\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("") is None


def test_mbpp_records_in_both_shapes():
    full = {"task_id": 11, "text": "Write a function to add.", "code": "def add(a, b):\n    return a + b",
            "test_list": ["assert add(1, 2) == 3"], "test_setup_code": "", "challenge_test_list": []}
    sanitized = {"source_file": "x.py", "task_id": 11, "prompt": "Write a function to add.",
                 "code": "def add(a, b):\n    return a + b", "test_imports": ["import math"],
                 "test_list": ["assert math.isclose(add(1, 2), 3)"]}
    a, b = mbpp_problem(full), mbpp_problem(sanitized)
    assert (a.task_id, a.entry, a.setup) == (11, "add", "") and (b.task_id, b.entry, b.setup) == (11, "add", "import math")
    assert a.prompt.startswith("Write a function to add.\nYour code should pass these tests:") and "assert add" in a.prompt
    for bad in ({"task_id": 1, "text": "x"}, {"task_id": True, "text": "x", "test_list": ["assert 1"]}, [1]):
        assert mbpp_problem(bad) is None


# --- the override on a folder of a few records (no data needed) ----------------------------------

def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _mbpp_row(task_id: int) -> dict:
    return {"task_id": task_id, "text": f"Write a function f{task_id} that doubles.", "code": f"def f{task_id}(x):\n    return 2 * x",
            "test_list": [f"assert f{task_id}(2) == 4"], "test_setup_code": "", "challenge_test_list": []}


@pytest.fixture
def copies(tmp_path, monkeypatch) -> Path:
    """A folder of local copies, a few records each: GSM8K's train split in the Hub's shape as .jsonl
    (what ``Dataset.to_json`` writes), its test split in the original release's shape."""
    d = tmp_path / "copies"
    _jsonl(d / "gsm8k" / "train.jsonl", [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i}=<<{i}+{i}={2 * i}>>\n#### {2 * i:,}"}
                                         for i in range(1, 1001, 100)])
    (d / "gsm8k" / "test.json").write_text(json.dumps([{"problem": "What is 2 + 3?", "final_answer": "5",
                                                        "answer_with_process": "2+3=5\n#### 5"}]))
    _jsonl(d / "math" / "test500.jsonl", [{"problem": "What is $1+1$?", "solution": "$\\boxed{2}$", "answer": "2",
                                           "subject": "Algebra", "level": 1, "unique_id": "a.json"}])
    (d / "math" / "train.json").write_text(json.dumps([{"problem": "What is $2+2$?", "final_answer": "4"}]))
    _jsonl(d / "mbpp" / "mbpp.jsonl", [_mbpp_row(i) for i in (2, 11, 12, 520, 601, 602)])
    monkeypatch.setenv("MARFT_DATA_DIR", str(d))
    return d


def test_math_and_code_read_the_local_copies(copies):
    env = MathEnv(["s"], ["s"], 1, train_path="hf:openai/gsm8k:main:train", test_path="hf:openai/gsm8k:main:test")
    assert (env.num_problems("train"), env.num_problems("test")) == (10, 1)
    env.reset(options={"split": "train", "index": 9})
    assert env.problem.prompt == "What is 901 + 901?" and env.problem.answer == "1802"  # '#### 1,802'
    assert env.grade(env.problem, "\\boxed{1802}").correct
    quartet = MathEnv(["s"], ["s"], 1, train_path="hf:DigitalLearningGmbH/MATH-lighteval:default:train",
                      test_path="hf:HuggingFaceH4/MATH-500::test")
    assert quartet.num_problems("train") == quartet.num_problems("test") == 1
    code = CodeEnv(["c"], ["c"], 1, test_path="hf:google-research-datasets/mbpp:full", workers=1)
    assert [p.task_id for p in code.splits["train"]] == [601, 602] and [p.task_id for p in code.splits["test"]] == [11, 12]
    assert sorted(load_mbpp("hf:google-research-datasets/mbpp:full:validation")) == [520]  # one file, split by task id
    assert sorted(load_mbpp("hf:google-research-datasets/mbpp::prompt")) == [2]


def test_the_dataset_task_reads_the_local_copies_with_the_hubs_columns(copies):
    data = load_splits("openai/gsm8k", "main", "train[:50%]", "test", "question", "answer")
    assert data["train"].column_names == data["test"].column_names == ["question", "answer"]
    assert len(data["train"]) == 5 and data["test"][0] == {"question": "What is 2 + 3?", "answer": "2+3=5\n#### 5"}
    from marft.envs.rewards import gsm8k

    assert gsm8k("\\boxed{5}", data["test"][0]) == 1.0 and gsm8k("\\boxed{202}", data["train"][1]) == 1.0
    mbpp = load_splits("google-research-datasets/mbpp", "full", "train", "validation", "text", "code")
    assert (len(mbpp["train"]), len(mbpp["test"])) == (2, 1)
    with pytest.raises(UserError, match=r"hf:HuggingFaceH4/MATH-500::train: MARFT_DATA_DIR has no local copy of "
                                        r"HuggingFaceH4/MATH-500 split 'train' \(it holds math/test500.jsonl \(test\)\); "
                                        r"unset MARFT_DATA_DIR to read the Hub, or give a file: task.dataset="):
        load_splits("HuggingFaceH4/MATH-500", "", "train", "test", "problem", "answer")


def test_two_mbpp_sources_are_split_together(tmp_path):
    _jsonl(tmp_path / "train.jsonl", [_mbpp_row(601)])
    _jsonl(tmp_path / "test.jsonl", [_mbpp_row(11)])
    env = CodeEnv(["c"], ["c"], 1, train_path=str(tmp_path / "train.jsonl"), test_path=str(tmp_path / "test.jsonl"), workers=1)
    assert (env.num_problems("train"), env.num_problems("test")) == (1, 1)
    with pytest.raises(UserError, match=r"the mbpp train split \(task ids 601-974\) is empty: '.*test.jsonl' holds none of "
                                        r"its problems; give the whole of MBPP \(mbpp.jsonl, or hf:google-research-datasets/mbpp:full\)"):
        CodeEnv(["c"], ["c"], 1, test_path=str(tmp_path / "test.jsonl"), workers=1)


def test_a_published_set_leaves_out_records_without_an_answer_and_says_so(tmp_path, monkeypatch, capsys):
    rows = [{"problem": f"p{i}", "final_answer": str(i)} for i in range(200)]
    rows[7]["final_answer"] = ""  # as 4 of the 7,500 records of MATH's training set
    (tmp_path / "math").mkdir()
    (tmp_path / "math" / "train.json").write_text(json.dumps(rows))
    monkeypatch.setenv("MARFT_DATA_DIR", str(tmp_path))
    assert len(load_records("hf:DigitalLearningGmbH/MATH-lighteval:default:train")) == 199
    assert "marft: warning: hf:DigitalLearningGmbH/MATH-lighteval:default:train: 1 of 200 records have no gold answer " \
           "that marft can read (train.json record 7); they are left out" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"train.json: record 7 has no 'final_answer' or 'answer' field"):  # a file of your own
        load_records(str(tmp_path / "math" / "train.json"))


ERRORS = [  # (the reference, MARFT_DATA_DIR relative to the copies' folder or None, the message)
    ("hf:openai/gsm8k:main:train", "nowhere",
     r"^MARFT_DATA_DIR=.*nowhere is not a folder; set it to the folder of local data set copies \(gsm8k/train.json, "
     r"math/test500.jsonl, mbpp/mbpp.jsonl, ...\) or unset it to read the Hub$"),
    ("hf:openai/gsm8k:main:train", "math",
     r"^hf:openai/gsm8k:main:train is read from MARFT_DATA_DIR=.*math, which has no gsm8k/train.json; put the local copy "
     r"there, unset MARFT_DATA_DIR to read the Hub, or give a file: task.train_path=path/to/file.jsonl$"),
    ("hf:openai/gsm8k:socratic:train", ".",
     r"^hf:openai/gsm8k:socratic:train: MARFT_DATA_DIR holds openai/gsm8k config 'main' only, not 'socratic'; name that "
     r"config, unset MARFT_DATA_DIR to read the Hub, or give a file: task.train_path=path/to/file.jsonl$"),
    ("hf:DigitalLearningGmbH/MATH-lighteval:default:test", ".",
     r"^hf:DigitalLearningGmbH/MATH-lighteval:default:test: MARFT_DATA_DIR has no local copy of "
     r"DigitalLearningGmbH/MATH-lighteval split 'test' \(it holds math/train.json \(train\)\); unset MARFT_DATA_DIR"),
    ("hf:openai/gsm8k:main:train", None,  # conftest sets HF_HUB_OFFLINE=1; the Hub's cache has no copy
     r"^data set 'openai/gsm8k' is not in the local Hugging Face datasets cache and HF_HUB_OFFLINE is set; set "
     r"MARFT_DATA_DIR to a folder of local copies \(for openai/gsm8k: gsm8k/train.json \(train\), gsm8k/test.json "
     r"\(test\)\), or give a file: task.train_path=path/to/file.jsonl$"),
    ("hf:someone/own-set:default:train", ".",  # no local copy known: the Hub, as without MARFT_DATA_DIR
     r"^data set 'someone/own-set' is not in the local Hugging Face datasets cache and HF_HUB_OFFLINE is set; "
     r"give a file: task.train_path=path/to/file.jsonl$"),
]


@pytest.mark.parametrize("ref,folder,message", ERRORS)
def test_what_goes_wrong_is_one_line(copies, monkeypatch, ref, folder, message):
    if folder is None:
        monkeypatch.delenv("MARFT_DATA_DIR")
    else:
        monkeypatch.setenv("MARFT_DATA_DIR", str(copies / folder))
    with pytest.raises(UserError, match=message) as e:
        MathEnv(["s"], ["s"], 1, train_path=ref).num_problems("train")
    assert "\n" not in str(e.value)


def test_hub_unreachable_fails_at_once_naming_the_override(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    with pytest.raises(UserError, match=r"^data set 'google-research-datasets/mbpp' is a Hub id, but the Hub "
                                        r"\(http://127.0.0.1:9\) cannot be reached \(.*\); set MARFT_DATA_DIR to a folder "
                                        r"of local copies \(for google-research-datasets/mbpp: mbpp/mbpp.jsonl\), or give a "
                                        r"file: task.test_path=path/to/file.jsonl, or set HF_HUB_OFFLINE=1"):
        CodeEnv(["c"], ["c"], 1, test_path="hf:google-research-datasets/mbpp:full", workers=1)
    assert time.perf_counter() - start < 10


# --- every shipped config that names a Hub data set, offline through MARFT_DATA_DIR -------------------

def _shipped_runs():
    """(name, config) of every config in configs/, and of every run of its sweeps."""
    from marft.experiments.sweep import load_sweep

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if "grids" in data or "grid" in data:
            sweep = load_sweep(path, missing_ok=True)  # runs from earlier runs: their adapters need not be here
            for run in sweep.runs:
                yield f"{path.name} {run.name}", load_config(sweep.base, [*sweep.common, *run.overrides])
        else:
            yield path.name, load_config(path)


def _names_hub_data(t) -> bool:
    if t.kind in ("math", "code"):
        return any(p.startswith(sources.PREFIX) for p in (t.train_path, t.test_path))
    return t.kind in ("dataset", "workflow") and sources.parse_hub(f"hf:{t.dataset}") is not None \
        and not (ROOT / t.dataset).exists()


def _hub_tasks():
    seen = {}
    for name, cfg in _shipped_runs():
        for t in task_list(cfg):
            if _names_hub_data(t):
                key = (name.split()[0], t.kind, t.name, t.train_path, t.test_path, t.dataset, t.dataset_config,
                       t.train_split, t.test_split)  # each file, and each task of a sweep once
                seen.setdefault(key, (name, cfg))
    return list(seen.values())


def test_no_shipped_config_names_a_path_outside_the_repository():
    for name, cfg in _shipped_runs():
        for t in task_list(cfg):
            for key in ("train_path", "test_path", "dataset"):
                value = getattr(t, key)
                if not value or value.startswith(sources.PREFIX) or (key == "dataset" and _names_hub_data(t)):
                    continue
                assert not Path(value).is_absolute() and (ROOT / value).resolve().is_relative_to(ROOT), (name, key, value)
                assert (ROOT / value).exists(), (name, key, value)


def test_every_config_naming_a_hub_data_set_runs_offline(data_dir):
    from marft.api import env_factory
    from marft.team import build_team

    tasks = _hub_tasks()
    configs = {name.split()[0] for name, _ in tasks}
    assert {"trio_gsm8k.yaml", "quartet_math500.yaml", "code_duo_mbpp.yaml", "duo_qwen_vllm_gpu.yaml",
            "duo_qwen7b_ray_2x8gpu.yaml", "dataset_gsm8k.yaml", "sweep_paper_small.yaml"} <= configs, configs
    sizes = {"hf:openai/gsm8k:main:train": 7473, "hf:openai/gsm8k:main:test": 1319, "hf:HuggingFaceH4/MATH-500:default:test": 500}
    for name, cfg in tasks:
        env = env_factory(cfg, build_team(cfg.team))()
        t = cfg.task
        for split in ("train", "test"):
            n = env.num_problems(split)
            ref = t.train_path if split == "train" and t.train_path else t.test_path or t.train_path
            if ref in sizes:
                assert n == sizes[ref], (name, split, n)
            assert n >= (300 if t.kind == "code" else 1000 if "MATH-500" not in ref else 500), (name, split, n)
            for i in (0, n // 2, n - 1):
                env.reset(options={"split": split, "index": i})
                p = env.problem
                assert isinstance(p.prompt, str) and len(p.prompt.strip()) > 10, (name, split, i)
                if t.kind == "math":  # the gold answer parses, and a reply that gives it is right
                    assert grade_math(f"So the answer is \\boxed{{{p.answer}}}.", p.answer).correct, (name, split, i, p.answer)
                elif t.kind == "code":
                    code = p.answer
                    assert code.tests and code.entry and code.entry in code.prompt, (name, split, i)
                else:
                    assert env.grade(p, f"\\boxed{{{gsm8k_answer(p.answer)}}}").score == 1.0, (name, split, i)
        if t.kind == "code":  # the canonical program passes its tests in the sandbox
            env.reset(options={"split": "test", "index": 0})
            assert env.grade(env.problem, f"```python\n{env.problem.answer.solution}\n```").correct
