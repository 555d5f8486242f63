"""``marft env-check`` on a workflow (marft/run/workflow_check.py): the shipped agent programs play a few
episodes on the tiny model (``model.name: tiny``) and are reported (calls, steps, rewards, time); a
broken one gets its one-line finding, status 1, no traceback; what stops the check before any
episode (a wrong signature, missing keys) is a one-line error, status 2."""
from __future__ import annotations

import importlib.util
import re

import pytest

pytest.importorskip("openai")

from marft.cli import main  # noqa: E402

BROKEN = '''
def raises(problem, client):
    client.chat.completions.create(model="planner", messages=[{"role": "user", "content": problem["prompt"]}])
    raise ValueError("no plan today")


def unknown_agent(problem, client):
    client.chat.completions.create(model="planner", messages=[{"role": "user", "content": problem["prompt"]}])
    return client.chat.completions.create(model="judge", messages=[{"role": "user", "content": "?"}]).choices[0].message.content


def returns_nothing(problem, client):
    plan = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": problem["prompt"]}])
    client.chat.completions.create(model="solver", messages=[{"role": "user", "content": plan.choices[0].message.content}])


def planner_last(problem, client):
    return client.chat.completions.create(model="planner", messages=[{"role": "user", "content": problem["prompt"]}]).choices[0].message.content


def calls_nobody(problem, client):
    return "42"


def one_argument(problem):
    return "42"


def reward(answer, record):
    return 1.0
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Overrides that run a workflow config on the tiny model (built once into a cache of the tests' own)."""
    cache = tmp_path_factory.mktemp("marft-cache")
    return ["model.name=tiny", f"model.cache_dir={cache}", "model.dtype=float32", "model.device=cpu",
            "rollout.max_new_tokens=8", "team.max_new_tokens={}"]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    path = tmp_path_factory.mktemp("broken-workflows") / "broken.py"
    path.write_text(BROKEN)
    return path


def check(capsys, args, rc_expected):
    rc = main(["env-check", *args])
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert rc == rc_expected, out.err + out.out
    return out


def episodes(out: str) -> list[str]:
    """The report's per-episode lines: calls and steps, or why it failed."""
    return [x.strip() for x in out.splitlines() if x.startswith("    calls ") or x.startswith("    failed")]


@pytest.mark.parametrize("config,calls,steps", [
    ("configs/workflow_duo.yaml", "planner, solver", "[planner, solver]"),
    # two planner calls at once, then the solver until it boxes an answer (the tiny model never does: 3 tries)
    ("configs/workflow_loop.yaml", "planner, planner, solver, solver, solver", "[planner] [planner, solver] [solver] [solver]"),
    ("configs/workflow_tools.yaml", "planner, solver", "[planner, solver]"),  # the tiny model writes no tool call
])
def test_the_shipped_workflows_play_and_are_reported(capsys, tiny, config, calls, steps):
    out = check(capsys, [config, *tiny, "--episodes", "2"], 0).out
    assert "model tiny, 2 episode(s)" in out.splitlines()[0]
    lines = episodes(out)
    n = len(steps.split("] ["))
    assert lines == [f"calls {calls} -> {n} step(s): {steps}"] * 2, out
    assert re.search(r"reward \d\.\d\d.*; answer '", out)
    assert re.search(r"2 episodes in [\d.]+ s \([\d.]+ s generating \d+ tokens\): 2 played, 0 failed; mean reward", out)
    assert "played 2 episode(s) without a problem" in out


@pytest.mark.skipif(importlib.util.find_spec("langgraph") is None, reason="needs langgraph (pip install 'marft[langgraph]')")
def test_the_langgraph_workflow_plays_as_the_plain_one(capsys, tiny):
    out = check(capsys, ["configs/workflow_langgraph.yaml", *tiny, "--episodes", "2"], 0).out
    assert episodes(out) == ["calls planner, solver -> 1 step(s): [planner, solver]"] * 2, out


@pytest.mark.parametrize("fn,finding,calls", [
    ("raises", "the workflow raised ValueError: no plan today (every episode)", "failed after planner"),
    ("unknown_agent", "the workflow called agent 'judge', which the team does not have (its agents: planner, solver)",
     "failed after planner"),
    ("returns_nothing", "the workflow returned None (no answer); return the answer to grade", "calls planner, solver"),
    ("planner_last", "the workflow's last call was to planner, not to solver", "failed after planner"),
    ("calls_nobody", "the workflow called no agent; it must call the team's agents (planner, solver)", "failed:"),
])
def test_a_broken_workflow_gets_its_one_line_finding(capsys, tiny, broken, fn, finding, calls):
    out = check(capsys, [f"{broken}:{fn}", "dataset=examples/sums.jsonl", f"reward={broken}:reward", *tiny,
                         "--episodes", "2"], 1)
    errors = [x for x in out.err.strip().splitlines() if x.startswith("marft: error:")]
    assert len(errors) == 1 and errors[0] == out.err.strip().splitlines()[-1], out.err
    assert errors[0].startswith(f"marft: error: workflow {broken}:{fn}: ") and finding in errors[0], errors[0]
    assert errors[0].endswith("fix it and run marft env-check again")
    assert f"  - {finding}" in out.out or finding in out.out
    assert all(x.startswith(calls) for x in episodes(out.out)) and len(episodes(out.out)) == 2, out.out


def test_the_kind_form_takes_task_keys_and_config_keys(capsys, tiny, broken):
    """``marft env-check workflow workflow=... dataset=... reward=...``, as ``marft env-check dataset ...``."""
    out = check(capsys, ["workflow", "workflow=examples/duo_workflow.py:duo", "dataset=examples/sums.jsonl",
                         "reward=examples/duo_workflow.py:exact", "prompt_column=question", *tiny, "team.preset=duo",
                         "--episodes", "1"], 0).out
    assert out.startswith("env-check: workflow examples/duo_workflow.py:duo on examples/sums.jsonl (train split), "
                          "team planner -> solver, model tiny, 1 episode(s)")
    assert episodes(out) == ["calls planner, solver -> 1 step(s): [planner, solver]"]


@pytest.mark.parametrize("args,message", [
    (lambda b: [f"{b}:one_argument", "dataset=examples/sums.jsonl", f"reward={b}:reward"],
     "must take two arguments, workflow(problem, client); its signature is one_argument(problem)"),
    (lambda b: ["workflow", f"workflow={b}:raises"], "marft env-check of a workflow needs dataset=..., reward=...:"),
    (lambda b: ["workflow", f"workflow={b}:raises", "dataset=examples/sums.jsonl", f"reward={b}:reward", "colour=red"],
     "env-check option 'colour' is not a key of a workflow task"),
    (lambda b: [f"{b}:no_such_function", "dataset=examples/sums.jsonl"], "has no attribute 'no_such_function'"),
    (lambda b: ["configs/duo_arithmetic.yaml"], "runs a workflow (task.kind: workflow), but its task is reasoning_gym"),
    (lambda b: ["configs/workflow_duo.yaml", "--episodes", "0"], "--episodes must be at least 1, got 0"),
])
def test_what_stops_the_check_before_any_episode_is_one_line(capsys, broken, args, message):
    out = check(capsys, args(broken), 2)
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("marft: error: ") and message in lines[0], out.err


def test_a_refused_call_is_said_in_the_endpoints_words():
    from marft.run.workflow_check import reason
    raised = ("the workflow raised BadRequestError: Error code: 400 - {'error': {'message': 'n must be 1 (one reply per "
              "request), got 2', 'type': 'invalid_request_error', 'param': 'n', 'code': None}}")
    assert reason(raised, ["planner", "solver"]) == ("the workflow raised BadRequestError: the endpoint refused a call "
                                                     "(400: n must be 1 (one reply per request), got 2)")
    assert reason("the workflow ran past 5 s (timeout)", ["a"]) == "the workflow ran past 5 s (timeout)"
