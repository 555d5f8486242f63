"""Agent programs as episodes (marft/serving/workflow.py): the default duo written as a plain `openai`-client
workflow, served through the real HTTP endpoint, gives the same rollout as the built-in team
(the same prompt and reply token ids, log-probabilities, critic states and rewards); a workflow the
config cannot express (parallel calls, then a loop) becomes micro-steps in call order; failing,
hanging and idle workflows fail alone."""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("openai")

from test_rollout import EchoEnv, make, perturb  # noqa: E402
from marft.engines.hf import HFEngine  # noqa: E402
from marft.engines.generation import Sampling  # noqa: E402
from marft.run.rollout import rollout  # noqa: E402
from marft.serving.serve import serve_team  # noqa: E402
from marft.serving.workflow import play_workflows  # noqa: E402

SAMPLING = Sampling(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def duo(tiny_model_dir):
    cfg, team, models = make(["team.max_new_tokens={planner: 5}"], tiny_model_dir)
    for k, adapter in enumerate(team.adapters):
        perturb(models, adapter, seed=k)
    return team, models, HFEngine(models)


def problems_of(team, n):
    """Each problem's record: its text and what each agent is shown (the environment's observations)."""
    out, envs = [], []
    for i in range(n):
        env = EchoEnv(team.names, team.answering, 1)
        env.reset(seed=i, options={"split": "test", "index": i})
        out.append({"prompt": env.problem.prompt, "answer": env.problem.answer, "index": i,
                    **{a: env.observe(a) for a in team.names}})
        envs.append(env)
    return out, envs


def test_the_default_duo_as_a_workflow_gives_the_built_in_rollout(duo):
    team, models, engine = duo
    planner, solver = team["planner"], team["solver"]

    def workflow(problem, client):  # the duo, as a user would write it with the openai client
        plan = client.chat.completions.create(model="planner", messages=[
            {"role": "system", "content": planner.prompt}, {"role": "user", "content": problem["planner"]}])
        text = plan.choices[0].message.content
        answer = client.chat.completions.create(model="solver", messages=[
            {"role": "system", "content": solver.prompt},
            {"role": "user", "content": problem["solver"] + "\n\nMessages from your teammates:\n[planner]\n" + text.strip()}])
        return answer.choices[0].message.content

    n = 5
    problems, envs = problems_of(team, n)
    built_in = rollout(team, engine, lambda: EchoEnv(team.names, team.answering, 1),
                       [(i, {"split": "test", "index": i}) for i in range(n)], SAMPLING, 1, torch.Generator().manual_seed(3))
    with serve_team(models, team, engine, SAMPLING) as server:
        server.generator = torch.Generator().manual_seed(3)
        def reward(answer, problem):  # the environment's own grader
            env = envs[problem["index"]]
            return float(env.grade(env.problem, answer).correct)

        ours = play_workflows(team, server, workflow, problems, reward)
        assert server.batches == [("planner", n), ("solver", n)]  # every episode waited for the batch
    assert [(t.step, t.agent) for t in ours.turns] == [(t.step, t.agent) for t in built_in.turns]
    for a, b in zip(ours.turns, built_in.turns):
        assert torch.equal(a.episodes, b.episodes)
        for r in range(len(a.episodes)):
            assert a.prompt_ids[r][a.prompt_mask[r]].tolist() == b.prompt_ids[r][b.prompt_mask[r]].tolist()
            assert a.response_ids[r][a.response_mask[r]].tolist() == b.response_ids[r][b.response_mask[r]].tolist()
            assert torch.equal(a.logprobs[r][a.response_mask[r]], b.logprobs[r][b.response_mask[r]])
        assert a.texts == b.texts and a.states == b.states and torch.equal(a.truncated, b.truncated)
    assert torch.equal(ours.rewards, built_in.rewards) and torch.equal(ours.dones, built_in.dones)
    assert torch.equal(ours.success, built_in.success) and torch.equal(ours.steps, built_in.steps)


def test_parallel_calls_then_a_loop_become_micro_steps_in_call_order(duo):
    team, models, engine = duo
    from concurrent.futures import ThreadPoolExecutor

    def workflow(problem, client):
        ask = lambda agent, text: client.chat.completions.create(  # noqa: E731
            model=agent, messages=[{"role": "user", "content": text}]).choices[0].message.content
        with ThreadPoolExecutor(2) as pool:  # two planners' views at once
            views = list(pool.map(lambda k: ask("planner", f"{problem['prompt']} View {k}."), range(2)))
        answer, tries = "", 0
        while tries < 3 and problem["answer"] not in answer:  # the solver again until the check passes
            answer = ask("solver", problem["prompt"] + " " + " ".join(views))
            tries += 1
        return answer

    problems, _ = problems_of(team, 3)
    with serve_team(models, team, engine, SAMPLING) as server:
        out = play_workflows(team, server, workflow, problems, lambda a, p: float(p["answer"] in a))
    assert not out.failed.any()
    planner_steps = sorted({t.step for t in out.turns if t.agent == "planner"})
    assert planner_steps == [0, 1]  # the two parallel calls: the planner at step 0, again at step 1
    assert min(t.step for t in out.turns if t.agent == "solver") == 1  # the solver joins step 1, then one step a try
    solver_calls = {e: sum(1 for t in out.turns if t.agent == "solver" and e in t.episodes.tolist()) for e in range(3)}
    assert all(1 <= c <= 3 for c in solver_calls.values())
    for e in range(3):
        last = int(out.steps[e]) - 1
        assert out.dones[e, last] and out.dones[e].sum() == 1
        assert out.rewards[e, last] == float(out.success[e])
    # the critic's state before a call holds every earlier reply of the episode
    later = [t for t in out.turns if t.agent == "solver"][0]
    assert all(s.startswith("Problem: Compute") and s.count("[step") == 2 for s in later.states)
    # each turn keeps the messages the program sent (transcripts show them), through select and merge
    for t in out.turns:
        for e, m in zip(t.episodes.tolist(), t.messages):
            assert len(m) == 1 and m[0]["role"] == "user" and m[0]["content"].startswith(problems[e]["prompt"] + " ")
            assert (" View " in m[0]["content"]) == (t.agent == "planner")
    from marft.turns import merge_rollouts
    keep = torch.arange(3) < 2
    merged = merge_rollouts([out.select(keep), out.select(~keep)], team.names)
    flat = lambda r: sorted(str(m) for t in r.turns for m in t.messages)  # noqa: E731
    assert flat(merged) == flat(out) and len(flat(out)) == sum(len(t.texts) for t in out.turns)


def test_failing_hanging_and_idle_workflows_fail_alone(duo):
    team, models, engine = duo

    def workflow(problem, client):
        i = int(problem["prompt"].split()[1])
        if i == 1:
            raise ValueError("my tool broke")
        if i == 2:
            time.sleep(30)
        if i == 3:
            return "nothing asked"
        agent = {5: "planner", 6: "critic"}.get(i, "solver")  # 5 ends on the planner; 6 asks an agent the team lacks
        text = client.chat.completions.create(model=agent, messages=[{"role": "user", "content": problem["prompt"]}]
                                              ).choices[0].message.content
        if i == 7:  # sys.exit() in a workflow fails its episode (it used to end the thread silently: a success)
            raise SystemExit(3)
        return text

    problems, _ = problems_of(team, 8)
    t0 = time.monotonic()
    with serve_team(models, team, engine, SAMPLING) as server:
        out = play_workflows(team, server, workflow, problems, lambda a, p: 1.0, timeout_s=3)
    assert time.monotonic() - t0 < 20
    assert out.failed.tolist() == [False, True, True, True, False, True, True, True]
    assert "ValueError: my tool broke" in out.infos[1]["error"] and "SystemExit: 3" in out.infos[7]["error"]
    assert "timeout" in out.infos[2]["error"] and "called no agent" in out.infos[3]["error"]
    assert "last call was to planner, not to solver" in out.infos[5]["error"]
    assert "NotFoundError" in out.infos[6]["error"] and "'critic' does not exist" in out.infos[6]["error"]
    assert out.success.tolist() == [True, False, False, False, True, False, False, False]
    kept = out.select(~out.failed)
    assert [t.episodes.tolist() for t in kept.turns] == [[0, 1]]


class SlowPlanner:
    """The engine, but the planner's batches take 1.5 s (a large model), so that a client may give up."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, agent, chats, sampling, generator):
        if agent == "planner":
            time.sleep(1.5)
        return self.engine.generate(agent, chats, sampling, generator)


def test_calls_the_program_did_not_wait_for_are_not_its_episodes(duo):
    """Episode 0 returns, leaving a thread that calls the planner after: that call is refused (400,
    episode_ended) and recorded nowhere. Episode 1 gives up on its planner call (its own 0.5 s
    timeout) and asks the solver without a plan: the planner's call, generated all the same, is not
    part of its episode. Episode 2's reward hangs: it fails alone, after reward_timeout_s."""
    import threading

    import openai

    team, models, engine = duo
    late: list = []

    def workflow(problem, client):
        i = problem["index"]
        ask = {"messages": [{"role": "user", "content": problem["prompt"]}]}
        if i == 1:
            try:
                client.with_options(timeout=0.5).chat.completions.create(model="planner", **ask)
            except openai.APITimeoutError:
                pass
        else:
            client.chat.completions.create(model="planner", **ask)
        text = client.chat.completions.create(model="solver", **ask).choices[0].message.content
        if i == 0:
            def after():
                time.sleep(0.3)
                try:
                    client.chat.completions.create(model="planner", **ask)
                except openai.BadRequestError as e:
                    late.append(e.code)
            t = threading.Thread(target=after)
            t.start()
            late.append(t)
        return text

    def reward(answer, problem):
        if problem["index"] == 2:
            time.sleep(30)
        return 1.0

    problems, _ = problems_of(team, 3)
    t0 = time.monotonic()
    with serve_team(models, team, SlowPlanner(engine), SAMPLING) as server:
        out = play_workflows(team, server, workflow, problems, reward, timeout_s=20, reward_timeout_s=1)
        late[0].join(10)
    assert time.monotonic() - t0 < 15
    assert late[1:] == ["episode_ended"]
    assert out.failed.tolist() == [False, False, True] and "reward function timed out" in out.infos[2]["error"]
    assert [(t.step, t.agent, t.episodes.tolist()) for t in out.turns] == [
        (0, "planner", [0, 2]), (0, "solver", [0, 1, 2])]  # episode 1's planner call is not its own


def test_an_abandoned_async_workflow_is_cancelled(duo):
    """An async workflow that retries for ever (every call refused) runs past its time: its episode
    fails, and its task is cancelled at its next await, so its thread ends instead of calling on."""
    import asyncio
    import threading

    team, models, engine = duo
    tries = []

    async def workflow(problem, client):
        ask = {"messages": [{"role": "user", "content": problem["prompt"]}]}
        if problem["index"] == 1:
            while True:
                try:
                    await client.chat.completions.create(model="critic", **ask)  # no such agent: a 404
                except Exception:  # noqa: BLE001 - a program that swallows everything
                    tries.append(1)
                    await asyncio.sleep(0.01)
        await client.chat.completions.create(model="planner", **ask)
        return (await client.chat.completions.create(model="solver", **ask)).choices[0].message.content

    problems, _ = problems_of(team, 2)
    with serve_team(models, team, engine, SAMPLING) as server:
        out = play_workflows(team, server, workflow, problems, lambda a, p: 1.0, timeout_s=8)
    assert out.failed.tolist() == [False, True] and "timeout" in out.infos[1]["error"] and tries, out.infos
    deadline = time.monotonic() + 10
    while any(t.name == "marft-workflow-1" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "marft-workflow-1" for t in threading.enumerate())


def test_64_concurrent_episodes_are_one_batch_per_agent(duo):
    team, models, engine = duo

    def workflow(problem, client):
        ask = lambda agent: client.chat.completions.create(  # noqa: E731
            model=agent, messages=[{"role": "user", "content": problem[agent]}]).choices[0].message.content
        ask("planner")
        return ask("solver")

    problems, _ = problems_of(team, 64)
    with serve_team(models, team, engine, SAMPLING) as server:
        out = play_workflows(team, server, workflow, problems, lambda a, p: 1.0, timeout_s=120)
        assert server.batches == [("planner", 64), ("solver", 64)]
    assert not out.failed.any() and [len(t.episodes) for t in out.turns] == [64, 64]


def _closed(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("stop", [False, True], ids=["to the end", "stopped"])
def test_no_port_is_left_open_after_a_run(stop, tiny_overrides, tmp_path, monkeypatch):
    """Every endpoint a workflow run opened (one per rollout) is closed once the run is over, also
    when it was stopped in the middle (what Ctrl-C and SIGTERM do: MarftTrainer.stop)."""
    import marft
    from marft.serving.serve import TeamServer

    ports, start = [], TeamServer.start

    def recording(self):
        out = start(self)
        ports.append(self.port)
        return out

    monkeypatch.setattr(TeamServer, "start", recording)
    cfg = marft.load_config("configs/workflow_duo.yaml", [*tiny_overrides, "train.iterations=3", "train.eval_every=0",
                                                          "eval.problems=2", "eval.samples=1", "eval.before=false"])
    trainer = marft.MarftTrainer(cfg)
    if stop:
        trainer.callbacks.append(lambda m: trainer.stop() if m["iteration"] == 1 else None)
    result = trainer.train()
    trainer.close()
    assert result.stopped == stop and len(ports) == (1 if stop else 4)  # 3 rollouts and the final evaluation
    assert all(_closed(p) for p in ports)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_marft_serve_stops_on_a_signal_and_frees_its_port(sig, tiny_model_dir, tmp_path):
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    args = [str(Path(sys.executable).parent / "marft"), "serve", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}",
            "model.dtype=float32", "model.device=cpu", f"output_dir={tmp_path}", "--port", "0"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"127\.0\.0\.1:(\d+)/v1", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    port = int(m.group(1))
    assert not _closed(port)
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=60) == 0 and _closed(port)


WORKFLOW = '''
from marft.team import preset_agents

PROMPTS = {a["name"]: a["prompt"] for a in preset_agents("duo")}
INSTRUCTION = "Give the final answer in \\\\boxed{}."


def duo(problem, client):
    """The default planner -> solver duo, written with the openai client."""
    plan = client.chat.completions.create(model="planner", messages=[
        {"role": "system", "content": PROMPTS["planner"]}, {"role": "user", "content": problem["prompt"]}])
    text = plan.choices[0].message.content
    answer = client.chat.completions.create(model="solver", messages=[
        {"role": "system", "content": PROMPTS["solver"]},
        {"role": "user", "content": problem["prompt"] + "\\n\\n" + INSTRUCTION
         + "\\n\\nMessages from your teammates:\\n[planner]\\n" + text.strip()}])
    return answer.choices[0].message.content


async def duo_async(problem, client):
    plan = await client.chat.completions.create(model="planner", messages=[
        {"role": "system", "content": PROMPTS["planner"]}, {"role": "user", "content": problem["prompt"]}])
    text = plan.choices[0].message.content
    answer = await client.chat.completions.create(model="solver", messages=[
        {"role": "system", "content": PROMPTS["solver"]},
        {"role": "user", "content": problem["prompt"] + "\\n\\n" + INSTRUCTION
         + "\\n\\nMessages from your teammates:\\n[planner]\\n" + text.strip()}])
    return answer.choices[0].message.content
'''


@pytest.mark.parametrize("name", ["duo", "duo_async"])
def test_the_duo_as_a_workflow_trains_as_the_built_in_duo(name, tiny_model_dir, tmp_path):
    """`marft train` with task.kind workflow, through the real endpoint and openai client, equals the
    built-in duo on the same data set task: metrics of every iteration, evaluations, adapter weights."""
    import json

    from test_api import comparable
    from test_dataset_task import REWARDS, records, write_jsonl
    from marft.run.checkpoints import latest_checkpoint
    from marft.cli import main

    data = write_jsonl(tmp_path / "sums.jsonl", records(20))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "my_team.py").write_text(WORKFLOW)
    common = ["configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
              "rollout.max_new_tokens=6", "rollout.episodes=4", "team.max_new_tokens={planner: 4}",
              "rollout.temperature=1.0", "train.iterations=2", "train.minibatch_size=4", "eval.problems=3",
              "eval.ablate=false", f"task.dataset={data}", f"task.reward={tmp_path / 'rewards.py'}:exact",
              "task.options={instruction: 'Give the final answer in \\boxed{}.'}"]
    built_in, ours = tmp_path / "built_in", tmp_path / "workflow"
    assert main(["train", *common, "task.kind=dataset", f"output_dir={built_in}"]) == 0
    assert main(["train", *common, "task.kind=workflow", f"task.workflow={tmp_path / 'my_team.py'}:{name}",
                 f"output_dir={ours}"]) == 0
    assert comparable(ours) == comparable(built_in)
    for tag in ("untrained", "final"):
        a, b = (json.loads((d / f"eval_{tag}.json").read_text()) for d in (ours, built_in))
        assert a["per_problem_success"] == b["per_problem_success"] and a["mean_reward"] == b["mean_reward"]
    wa, wb = latest_checkpoint(ours), latest_checkpoint(built_in)
    files = sorted(wb.rglob("*.safetensors"))
    assert files and all(f.read_bytes() == (wa / f.relative_to(wb)).read_bytes() for f in files)
    from safetensors.torch import load_file
    moved = [v for f in files for k, v in load_file(f).items() if "lora_B" in k]
    assert moved and any(v.abs().sum() > 0 for v in moved)  # training moved the adapters (B starts at 0)


@pytest.mark.parametrize("spec,message", [
    ("", "task.kind workflow needs task.workflow"),
    ("no_colon", "must look like"),
    ("{file}:missing", "has no function 'missing'"),
    ("no_such_module_q:duo", "cannot import module 'no_such_module_q'"),
])
def test_a_bad_workflow_is_one_line(spec, message, tiny_model_dir, tmp_path, capsys):
    from test_dataset_task import REWARDS, records, write_jsonl
    from marft.cli import main

    data = write_jsonl(tmp_path / "sums.jsonl", records(5))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "my_team.py").write_text("def duo(problem, client):\n    return ''\n")
    rc = main(["eval", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32",
               "task.kind=workflow", f"task.dataset={data}", f"task.reward={tmp_path / 'rewards.py'}:exact",
               "task.options={}", f"task.workflow={spec.format(file=tmp_path / 'my_team.py')}", f"output_dir={tmp_path}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("marft: error")]
    assert rc == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("source,message", [
    # a module that exits when imported: one line naming the file, status 2 (was: status 3, nothing printed)
    ("import sys\nsys.exit(3)\n", "my_team.py': it called sys.exit(3) while being imported"),
    ("raise BaseException('odd')\n", "my_team.py': BaseException: odd"),
])
def test_a_workflow_module_that_exits_on_import_is_one_line(source, message, tiny_model_dir, tmp_path, capsys):
    rc, err = _eval_workflow(tmp_path, tiny_model_dir, source, "duo", capsys)
    assert rc == 2 and len(err) == 1 and "cannot import module" in err[0] and message in err[0], err


@pytest.mark.parametrize("source,signature", [
    ("def duo(problem):\n    return ''\n", "duo(problem)"),
    ("def duo(problem, client, judge):\n    return ''\n", "duo(problem, client, judge)"),
    ("def duo():\n    return ''\n", "duo()"),
])
def test_a_workflow_with_the_wrong_signature_is_one_line(source, signature, tiny_model_dir, tmp_path, capsys):
    rc, err = _eval_workflow(tmp_path, tiny_model_dir, source, "duo", capsys)
    assert rc == 2 and len(err) == 1, err
    assert "must take two arguments, workflow(problem, client); its signature is " + signature in err[0], err


def test_workflows_that_take_problem_and_client_pass_the_check():
    from marft.envs.workflow import check_workflow

    def default(problem, client, tries=3): ...
    def star(*args): ...
    async def coro(problem, client): ...
    for fn in (default, star, coro, lambda p, c: None, print):
        check_workflow(fn, "x.py:fn")


def _eval_workflow(tmp_path, tiny_model_dir, source, name, capsys):
    """``marft eval`` of a workflow task whose workflow is ``name`` in a file holding ``source``:
    (exit status, the ``marft: error`` lines)."""
    from test_dataset_task import REWARDS, records, write_jsonl
    from marft.cli import main

    data = write_jsonl(tmp_path / "sums.jsonl", records(5))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "my_team.py").write_text(source)
    rc = main(["eval", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32",
               "task.kind=workflow", f"task.dataset={data}", f"task.reward={tmp_path / 'rewards.py'}:exact",
               "task.options={}", f"task.workflow={tmp_path / 'my_team.py'}:{name}", f"output_dir={tmp_path}"])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.startswith("marft: error")]


@pytest.mark.parametrize("config", ["workflow_duo", "workflow_loop", "workflow_tools"])
def test_the_shipped_workflow_examples_train_on_the_tiny_model(config, tiny_overrides, tmp_path, capsys):
    """examples/duo_workflow.py, and examples/loop_workflow.py (two planner calls at once, then the
    solver until its answer is boxed; it imports its neighbour duo_workflow.py); eval.ablate is
    skipped for a workflow, saying so."""
    import json

    from marft.cli import main

    run = tmp_path / "wf"
    assert main(["train", f"configs/{config}.yaml", *tiny_overrides, "train.iterations=1", "train.eval_every=0",
                 "eval.problems=2", "eval.samples=1", "eval.ablate=true", f"output_dir={run}"]) == 0
    assert "eval.ablate: not for a workflow task" in capsys.readouterr().err
    assert not list(run.glob("eval_final_without_*.json"))
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["episodes/failed"] == 0 and {"planner/entropy", "solver/entropy"} <= set(m)
    assert json.loads((run / "eval_final.json").read_text())["problems"] == 2
    if config == "workflow_loop":  # two planner steps at least (the second call starts step 1), then the solver's
        assert json.loads((run / "eval_final.json").read_text())["mean_steps"] >= 2



def test_the_langgraph_example_trains_as_the_plain_openai_example(tiny_overrides, tmp_path):
    """examples/langgraph_duo.py (a LangGraph graph, a node per agent) makes the same calls as
    examples/duo_workflow.py, so marft trains it the same: metrics of every iteration and weights."""
    pytest.importorskip("langgraph", reason="LangGraph is not installed (pip install 'marft[langgraph]')")
    from test_api import comparable
    from marft.run.checkpoints import latest_checkpoint
    from marft.cli import main

    runs = {}
    for name in ("workflow_duo", "workflow_langgraph"):
        runs[name] = tmp_path / name
        assert main(["train", f"configs/{name}.yaml", *tiny_overrides, "train.iterations=2", "train.eval_every=0",
                     "rollout.episodes=4", "train.minibatch_size=4", "eval.problems=2", "eval.samples=1",
                     f"output_dir={runs[name]}"]) == 0
    plain, graph = runs["workflow_duo"], runs["workflow_langgraph"]
    assert comparable(graph) == comparable(plain) and comparable(graph)[0]["episodes/failed"] == 0
    wa, wb = latest_checkpoint(graph), latest_checkpoint(plain)
    files = sorted(wb.rglob("*.safetensors"))
    assert files and all(f.read_bytes() == (wa / f.relative_to(wb)).read_bytes() for f in files)

LOOP = '''
from concurrent.futures import ThreadPoolExecutor


def run(problem, client):
    """Two planner views at once, then the solver until its answer holds a digit, at most three tries."""
    ask = lambda agent, text: client.chat.completions.create(
        model=agent, messages=[{"role": "user", "content": text}]).choices[0].message.content
    with ThreadPoolExecutor(2) as pool:
        views = list(pool.map(lambda k: ask("planner", problem["prompt"] + f" View {k}."), range(2)))
    answer = ""
    for _ in range(3):
        answer = ask("solver", problem["prompt"] + " " + " ".join(views) + " " + answer)
        if any(ch.isdigit() for ch in answer):
            break
    return answer
'''


@pytest.mark.parametrize("algorithm,shared", [("marft", False), ("marft", True), ("marft-token", False),
                                              ("ippo", False), ("grpo", False), ("dr-mas", False), ("at-grpo", False)])
def test_a_workflow_the_config_cannot_express_trains_with_every_algorithm(algorithm, shared, tiny_model_dir, tmp_path):
    import json
    import math

    from test_dataset_task import REWARDS, records, write_jsonl
    from marft.run.checkpoints import latest_checkpoint
    from marft.cli import main

    data = write_jsonl(tmp_path / "sums.jsonl", records(20))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "loop.py").write_text(LOOP)
    run = tmp_path / "run"
    assert main(["train", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32",
                 "model.device=cpu", "rollout.max_new_tokens=4", "rollout.episodes=4", "team.max_new_tokens={}",
                 "rollout.temperature=1.0", "train.iterations=1", "train.minibatch_size=4", "train.group_size=2",
                 "eval.problems=2", "eval.ablate=false", "eval.before=false", "task.kind=workflow",
                 f"task.workflow={tmp_path / 'loop.py'}:run", f"task.dataset={data}",
                 f"task.reward={tmp_path / 'rewards.py'}:flag", "task.options={}", f"train.algorithm={algorithm}",
                 f"team.share_adapter={str(shared).lower()}", f"output_dir={run}"]) == 0
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["episodes/failed"] == 0
    assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float))
    assert latest_checkpoint(run) is not None


@pytest.mark.ray
def test_a_workflow_on_a_ray_rollout_worker_repeats_the_in_process_run(tiny_overrides, tmp_path):
    """The workflow task on a Ray rollout worker (the worker serves the team on its own engine and
    runs the program there) gives the in-process run's metrics, two iterations."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'marft[ray]')")
    from test_mixture import comparable_metrics, ray_metrics
    from marft.api import prepare
    from marft.run.config import load_config
    from marft.assemble import build_trainer

    over = [*tiny_overrides, "rollout.episodes=4", "train.minibatch_size=4", "train.micro_batch_size=2", "threads=1"]
    cfg = load_config("configs/workflow_duo.yaml", over)
    local = build_trainer(cfg, *prepare(cfg), log=lambda m: None)
    expected = [comparable_metrics(local.iteration_step()) for _ in range(2)]
    got = ray_metrics("configs/workflow_duo.yaml", [*over, "cluster.rollout_workers=1", f"output_dir={tmp_path / 'd'}"])
    assert got == expected and got[0]["episodes/failed"] == 0


def test_marft_eval_scores_a_workflow_and_load_team_serves_the_trained_adapters(tiny_overrides, tmp_path):
    """After training a workflow: `marft eval --adapters` plays the workflow with the trained
    adapters, and `marft.load_team(run).serve()` puts them behind the same kind of endpoint."""
    import json

    import openai

    import marft
    from marft.cli import main
    from marft.team import agent_messages

    run = tmp_path / "wf"
    common = [*tiny_overrides, "eval.problems=3", "eval.samples=1"]
    assert main(["train", "configs/workflow_duo.yaml", *common, "train.iterations=2", "train.eval_every=0",
                 "eval.before=false", f"output_dir={run}"]) == 0
    assert main(["eval", "configs/workflow_duo.yaml", *common, "--adapters", str(run), f"output_dir={tmp_path / 'ev'}"]) == 0
    again = json.loads((tmp_path / "ev" / "eval.json").read_text())
    final = json.loads((run / "eval_final.json").read_text())
    assert again["problems"] == 3 and again["per_problem_success"] == final["per_problem_success"]
    turn = again["transcripts"][0]["turns"][0]  # what the program sent the planner, in the transcript
    assert turn["agent"] == "planner" and [m["role"] for m in turn["messages"]] == ["system", "user"]
    assert turn["messages"][1]["content"] == again["transcripts"][0]["observation"].removeprefix("Problem: ")
    team = marft.load_team(run)
    chat = agent_messages(team.team["solver"], "Calculate 2 + 3.", {})
    with team.serve() as server:
        client = openai.OpenAI(base_url=server.url, api_key=server.api_key)
        assert [m.id for m in client.models.list().data] == ["planner", "solver"]
        served = client.chat.completions.create(model="solver", messages=chat, temperature=0, max_tokens=6)
    assert served.choices[0].message.content == team.reply("solver", "Calculate 2 + 3.", max_new_tokens=6)
    assert _closed(server.port)


def test_a_workflow_reward_may_give_each_agent_its_own(tiny_overrides, tmp_path):
    """task.reward returning {agent: number}: each agent's reward at the episode's last step (the
    team reward their mean); a mapping naming an agent the team lacks fails that episode alone."""
    from marft.api import prepare
    from marft.run.config import load_config
    from marft.assemble import build_trainer

    (tmp_path / "per_agent.py").write_text(
        "def split(answer, record):\n"
        "    return {'solver': 1.0} if record['answer'] != '2' else {'critic': 1.0}\n")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(f'{{"question": "Calculate {i} + 1.", "answer": "{i + 1}"}}\n' for i in range(20)))
    cfg = load_config("configs/workflow_duo.yaml", [*tiny_overrides, f"task.dataset={data}",
                                                    f"task.reward={tmp_path / 'per_agent.py'}:split"])
    tr = build_trainer(cfg, *prepare(cfg), log=lambda m: None)
    resets = [(0, {"split": "train", "index": i}) for i in range(4)]
    out = __import__("marft.run.rollout", fromlist=["play"]).play(cfg, tr.team, tr.engine, tr.episodes.make_env, resets, 0)
    assert out.failed.tolist() == [False, True, False, False]  # record 1's answer is "2": it names a "critic"
    assert "rewards for ['critic']" in out.infos[1]["error"]
    kept = ~out.failed
    assert out.agent_rewards[kept, 0].tolist() == [[0.0, 1.0]] * 3 and out.rewards[kept, 0].tolist() == [0.5] * 3


def test_a_workflows_return_value_is_the_graded_text():
    from marft.envs.workflow import answer_text
    assert answer_text("The answer is 7") == "The answer is 7"
    assert answer_text(42) == "42"
    assert answer_text(None) == ""  # nothing returned: no answer (it was graded as the text "None")


@pytest.mark.parametrize("algorithm", ["marft", "ippo", "marft-token", "dr-mas"])
def test_a_workflow_that_never_calls_an_agent_trains_the_others(algorithm, tiny_model_dir, tmp_path):
    # the solver alone: the planner has no call in the batch (its metrics said nothing; reply_tokens raised)
    import json

    from test_dataset_task import REWARDS, records, write_jsonl
    from marft.cli import main

    data = write_jsonl(tmp_path / "sums.jsonl", records(20))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "solo.py").write_text(
        "def run(problem, client):\n"
        "    return client.chat.completions.create(model='solver', messages=[{'role': 'user', 'content': "
        "problem['prompt']}]).choices[0].message.content\n")
    run = tmp_path / "run"
    assert main(["train", "configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32",
                 "model.device=cpu", "rollout.max_new_tokens=4", "rollout.episodes=4", "team.max_new_tokens={}",
                 "train.iterations=1", "train.minibatch_size=4", "eval.problems=2", "eval.ablate=false",
                 "eval.before=false", "task.kind=workflow", f"task.workflow={tmp_path / 'solo.py'}:run",
                 f"task.dataset={data}", f"task.reward={tmp_path / 'rewards.py'}:flag", "task.options={}",
                 f"train.algorithm={algorithm}", f"output_dir={run}"]) == 0
    m = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert m["planner/calls"] == 0 and m["solver/calls"] == 1 and "planner/reply_tokens" not in m


class _ToolUser:
    """The real engine, but the solver calls the example's calculator first (a random tiny model
    writes no tool call) and answers from its result once it has one."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, agent, chats, sampling, generator=None):
        import json
        import re

        out = self.engine.generate(agent, chats, sampling, generator)
        if agent == "solver":
            texts = []
            for chat in chats:
                result = re.search(r"<tool_response>\n(.*)\n</tool_response>", chat[-1]["content"])
                a, b = re.search(r"Calculate (\d+) \+ (\d+)", chat[1]["content"]).groups()
                call = {"name": "add", "arguments": {"a": int(a), "b": int(b)}}
                texts.append(f"\\boxed{{{result.group(1)}}}" if result else f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
            out.texts = texts
        return out

    def flops(self, agent, out):
        return 0.0


def test_the_tool_example_runs_its_tool_and_the_solver_answers_from_the_result(duo):
    """examples/tool_workflow.py through the endpoint: the solver's <tool_call> comes back to the
    program as tool_calls, the program's tool result (role tool) reaches the solver's next prompt,
    and the rollout is planner, solver, solver with the reward at the last step."""
    from marft.envs.check import import_user_module

    team, models, engine = duo
    solve = import_user_module("examples/tool_workflow.py", "marft_test_").solve
    problems = [{"prompt": f"Calculate {a} + {b}.", "answer": str(a + b)} for a, b in [(2, 3), (4, 8)]]
    with serve_team(models, team, _ToolUser(engine), SAMPLING) as server:
        out = play_workflows(team, server, solve, problems, lambda answer, p: float(answer == f"\\boxed{{{p['answer']}}}"))
    assert not out.failed.any() and out.success.tolist() == [True, True]
    assert [(t.step, t.agent) for t in out.turns] == [(0, "planner"), (0, "solver"), (1, "solver")]
    again = out.turns[2]
    for e, messages in zip(again.episodes.tolist(), again.messages):  # what the program sent the second time
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
        assert messages[2]["tool_calls"][0]["function"]["name"] == "add"
        assert messages[3]["content"] == problems[e]["answer"]
    assert out.rewards[:, 1].tolist() == [1.0, 1.0] and out.rewards[:, 0].tolist() == [0.0, 0.0]
