"""Shared fixtures: a tiny randomly initialised chat model with a real byte-level tokenizer and a
chat template, built offline in a temporary folder (a second or two), and a config pointing at it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Local copies of the benchmark data sets, laid out as MARFT_DATA_DIR wants them (docs/guides/offline-data.md),
# for the tests that read them (the data_dir fixture): MARFT_TEST_DATA_DIR, else a MARFT_DATA_DIR set when the
# tests start; without either those tests skip, saying so. MARFT_DATA_DIR itself is cleared, so that the other
# tests see the Hub (or its absence) as a user without copies does.
_DATA_GIVEN = os.environ.pop("MARFT_DATA_DIR", "")
if not os.environ.get("MARFT_TEST_DATA_DIR") and _DATA_GIVEN:
    os.environ["MARFT_TEST_DATA_DIR"] = _DATA_GIVEN


def _cpus() -> int:
    """The CPUs this process may use (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# `pytest -n auto` (pytest-xdist, as the README's test command runs the suite): each worker gets an equal
# share of the CPUs for torch, and so do the processes its tests start (OMP_NUM_THREADS), since workers
# whose threads outnumber the cores wait at each other's OpenMP barriers. A thread count set by the user
# is kept. Threads change no test's outcome: every comparison is between runs made with the same count.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from marft.engines.models import build_tiny_model  # noqa: E402,F401 - model.name: tiny's model (test_vllm.py imports it from here)


def varies(key: str, also: tuple[str, ...] = ()) -> bool:
    """Whether a metric depends on the clock, the machine or the process, so that two runs of the same
    seed need not share it: times (seconds, *_s, tokens per second), speeds (mfu/*, machine/*,
    throughput/*) and memory (memory/*); `also` names more prefixes (distributed/* where a Ray run is
    compared with one in process)."""
    return key == "seconds" or key.endswith("_s") or key.startswith(("mfu/", "machine/", "memory/", "throughput/", *also))


def timeless(metrics: dict, also: tuple[str, ...] = ()) -> dict:
    """A metrics line without the metrics that vary between runs of the same seed (`varies`)."""
    return {k: v for k, v in metrics.items() if not varies(k, also)}


def timeless_lines(path: Path) -> list[dict]:
    """A run's metrics.jsonl, each line `timeless`."""
    return [timeless(json.loads(line)) for line in Path(path).read_text().splitlines()]


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; .venv-vllm runs without it
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per CPU this process may use, at most 8 (the longest group, the Ray tests,
    bounds the suite's time beyond that)."""
    return max(1, min(8, _cpus()))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """With ``--dist loadgroup`` (pytest-xdist), a test file's tests run in one worker, in order, sharing
    its module fixtures, and every test that starts a Ray cluster runs in one worker too, one at a time.
    Tests marked ``gpu`` are skipped, with the reason, where no CUDA GPU is available."""
    for item in items if getattr(config.option, "dist", "no") == "loadgroup" else ():
        item.add_marker(pytest.mark.xdist_group("ray" if "ray" in item.keywords else item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none here); scripts/gpu_check.py runs these on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def data_dir(monkeypatch) -> Path:
    """MARFT_DATA_DIR set to the local copies of the benchmark data sets (GSM8K, MATH, MATH-500,
    MBPP); the test is skipped, with the reason, where there are none."""
    folder = os.environ.get("MARFT_TEST_DATA_DIR", "")
    if not folder or not Path(folder).is_dir():
        pytest.skip("no local copies of the benchmark data sets: set MARFT_TEST_DATA_DIR (or MARFT_DATA_DIR) to a folder "
                    "laid out as docs/guides/offline-data.md says (gsm8k/train.json, math/test500.jsonl, mbpp/mbpp.jsonl, ...)")
    monkeypatch.setenv("MARFT_DATA_DIR", folder)
    return Path(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory) -> Path:
    """A second tiny model with other weights (agents with their own base model)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-b"), seed=1)


@pytest.fixture
def tiny_overrides(tiny_model_dir, tmp_path) -> list[str]:
    """Config overrides that run the default team on the tiny model, quickly."""
    return [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
            "rollout.max_new_tokens=8", "rollout.episodes=4", f"output_dir={tmp_path / 'run'}",
            "eval.problems=4", "team.max_new_tokens={}"]


VOWEL_ENV = '''
from marft.envs.base import TurnBasedEnv, Problem, Grade

class Vowel(TurnBasedEnv):
    """Reward 1 when the reply starts with a vowel (about 1 in 10 for the untrained tiny model)."""
    def new_problem(self, rng, split, index):
        return Problem("Say a word.", None)
    def grade(self, problem, reply):
        return Grade(reply.strip()[:1].lower() in tuple("aeiou"), True)
'''


@pytest.fixture(scope="session")
def vowel_env_path(tmp_path_factory) -> Path:
    """A custom environment file: ``task.env=<path>:Vowel`` (a trivial task the tiny model can learn)."""
    path = tmp_path_factory.mktemp("vowel-env") / "vowel_env.py"
    path.write_text(VOWEL_ENV)
    return path
