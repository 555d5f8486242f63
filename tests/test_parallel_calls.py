"""Agent programs that call agents in parallel (marft/serving/workflow.py, marft/serving/serve.py): calls made before
an earlier call's reply came back are one Flex-MG step, ordered by the team's agent order whatever
their arrival order; batches form the same way from run to run, so one seed gives one rollout for
async programs (``asyncio.gather``) and threaded ones (a thread pool) alike; evaluation counts
distinct problems from the problem; a failed episode keeps the calls it made."""
from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("openai")

from test_rollout import make, perturb  # noqa: E402
from marft.engines.hf import HFEngine  # noqa: E402
from marft.engines.generation import Sampling  # noqa: E402
from marft.serving.serve import serve_team  # noqa: E402
from marft.serving.workflow import play_workflows  # noqa: E402

SAMPLING = Sampling(temperature=1.0, max_new_tokens=6)
AGENTS = "team.agents=[{name: drafter_a}, {name: drafter_b}, {name: judge}]"


@pytest.fixture(scope="module")
def trio(tiny_model_dir):
    cfg, team, models = make([AGENTS], tiny_model_dir)
    for k, adapter in enumerate(team.adapters):
        perturb(models, adapter, seed=k)
    return team, models, HFEngine(models)


def problems(n: int) -> list[dict]:
    return [{"prompt": f"Compute {i} + 1.", "answer": str(i + 1), "index": i} for i in range(n)]


def judged(problem, a: str, b: str) -> list[dict]:
    return [{"role": "user", "content": f"{problem['prompt']} Draft A: {a} Draft B: {b} Which is right?"}]


def ask_async(client, agent, text):
    async def go():
        reply = await client.chat.completions.create(model=agent, messages=[{"role": "user", "content": text}])
        return reply.choices[0].message.content
    return go()


async def gathered(problem, client):
    a, b = await asyncio.gather(ask_async(client, "drafter_a", problem["prompt"] + " Draft it."),
                                ask_async(client, "drafter_b", problem["prompt"] + " Check it."))
    reply = await client.chat.completions.create(model="judge", messages=judged(problem, a, b))
    return reply.choices[0].message.content


async def gathered_b_first(problem, client):  # the other order in the gather, and drafter_a's call held back
    async def late_a():
        for _ in range(random.randint(0, 6)):  # a few turns of the event loop: b's request often goes first
            await asyncio.sleep(0)
        return await ask_async(client, "drafter_a", problem["prompt"] + " Draft it.")

    b, a = await asyncio.gather(ask_async(client, "drafter_b", problem["prompt"] + " Check it."), late_a())
    reply = await client.chat.completions.create(model="judge", messages=judged(problem, a, b))
    return reply.choices[0].message.content


async def gathered_after_a_thread(problem, client):  # drafter_a's call waits for work in a thread first
    async def late_a():
        await asyncio.to_thread(time.sleep, 0.02)  # a tool, a name lookup, the openai client's platform check
        return await ask_async(client, "drafter_a", problem["prompt"] + " Draft it.")

    a, b = await asyncio.gather(late_a(), ask_async(client, "drafter_b", problem["prompt"] + " Check it."))
    reply = await client.chat.completions.create(model="judge", messages=judged(problem, a, b))
    return reply.choices[0].message.content


def pooled(problem, client):  # the same program with a thread pool
    def ask(agent, text):
        return client.chat.completions.create(model=agent, messages=[{"role": "user", "content": text}]
                                              ).choices[0].message.content
    with ThreadPoolExecutor(2) as pool:
        b = pool.submit(ask, "drafter_b", problem["prompt"] + " Check it.")
        a = pool.submit(ask, "drafter_a", problem["prompt"] + " Draft it.")
        a, b = a.result(), b.result()
    return ask("judge", judged(problem, a, b)[0]["content"])


def play(trio, workflow, n=4, seed=3):
    team, models, engine = trio
    with serve_team(models, team, engine, SAMPLING) as server:
        server.generator = torch.Generator().manual_seed(seed)
        out = play_workflows(team, server, workflow, problems(n), lambda a, p: float(p["answer"] in a), timeout_s=60)
        assert server.impatient == 0  # every batch started because every episode waited for it
        return out, list(server.batches)


def snapshot(out) -> list:
    """Everything of a rollout the learner reads, as plain values."""
    turns = [(t.step, t.agent, t.episodes.tolist(), t.texts, t.states, [m for m in t.messages],
              [t.response_ids[r][t.response_mask[r]].tolist() for r in range(len(t.episodes))],
              [t.logprobs[r][t.response_mask[r]].tolist() for r in range(len(t.episodes))]) for t in out.turns]
    return [turns, out.rewards.tolist(), out.steps.tolist(), out.dones.tolist(), out.success.tolist(),
            out.failed.tolist()]


def test_gathered_calls_are_one_step_in_team_order_whatever_their_arrival(trio):
    n = 4
    first, batches = play(trio, gathered, n)
    assert not first.failed.any()
    # drafter_a, drafter_b, then the judge: one step (agents acting in parallel, then the one who reads both)
    assert [(t.step, t.agent, t.episodes.tolist()) for t in first.turns] == [
        (0, "drafter_a", list(range(n))), (0, "drafter_b", list(range(n))), (0, "judge", list(range(n)))]
    assert batches == [("drafter_a", n), ("drafter_b", n), ("judge", n)]  # every episode's calls in one batch
    # the critic's state before the judge holds both drafts, drafter_a's first
    for s in first.turns[2].states:
        assert s.count("[step 0] drafter_a:") == 1 and s.index("drafter_a:") < s.index("drafter_b:")
    # the same seed: the same rollout, with the gather's order reversed and drafter_a's request often last
    for _ in range(3):
        again, batches_again = play(trio, gathered_b_first, n)
        assert snapshot(again) == snapshot(first) and batches_again == batches


def test_a_call_made_after_work_in_a_thread_joins_its_batch(trio):
    """An async program's loop that waits for a thread (``asyncio.to_thread``; the ``openai`` client
    looks up the platform so at its first request) waits for more than its calls: the batch does not
    start without the call that follows (it started with drafter_b's calls alone, under load often)."""
    first, batches = play(trio, gathered)
    for _ in range(2):
        again, batches_again = play(trio, gathered_after_a_thread)
        assert batches_again == batches == [("drafter_a", 4), ("drafter_b", 4), ("judge", 4)]
        assert snapshot(again) == snapshot(first)


def test_a_thread_pool_gives_the_async_programs_rollout(trio):
    a, _ = play(trio, gathered)
    for _ in range(2):
        b, batches = play(trio, pooled)
        assert snapshot(b) == snapshot(a)
        assert batches == [("drafter_a", 4), ("drafter_b", 4), ("judge", 4)]


def test_two_parallel_calls_to_one_agent_are_two_steps_ordered_by_what_they_ask(trio):
    async def twice(problem, client, reverse=False):
        views = [f"{problem['prompt']} View {k}." for k in (1, 0)]
        views = views[::-1] if reverse else views
        got = await asyncio.gather(*(ask_async(client, "drafter_a", v) for v in views))
        reply = await client.chat.completions.create(model="judge", messages=judged(problem, *got))
        return reply.choices[0].message.content

    async def twice_reversed(problem, client):
        return await twice(problem, client, reverse=True)

    out, _ = play(trio, twice)
    assert [(t.step, t.agent) for t in out.turns] == [(0, "drafter_a"), (1, "drafter_a"), (1, "judge")]
    assert all(m[0]["content"].endswith("View 0.") for m in out.turns[0].messages)
    again, _ = play(trio, twice_reversed)
    assert [t.texts for t in again.turns[:2]] == [t.texts for t in out.turns[:2]]
    assert [t.states for t in again.turns] == [t.states for t in out.turns]


def test_distinct_problems_count_when_the_first_call_is_not_the_first_agents(trio):
    from marft.run.evaluation import _Record

    async def no_a(problem, client):  # drafter_a never acts: drafter_b opens every episode
        draft = await ask_async(client, "drafter_b", problem["prompt"])
        reply = await client.chat.completions.create(model="judge", messages=judged(problem, "", draft))
        return reply.choices[0].message.content

    n = 5
    out, _ = play(trio, no_a, n)
    assert out.turns[0].agent == "drafter_b" and out.turns[0].step == 0
    rec = _Record(n)
    rec.add(0, out, {0: 0})
    result = rec.summary(range(n), n, 1, 1, ["drafter_a", "drafter_b", "judge"])
    assert result["distinct_problems"] == n
    assert [t["agent"] for t in result["transcripts"][0]["turns"]] == ["drafter_b", "judge"]


def test_a_failed_episode_keeps_the_calls_it_made_and_is_left_out_of_training(trio):
    from marft.run.evaluation import _Record

    async def breaks(problem, client):
        a, b = await asyncio.gather(ask_async(client, "drafter_a", problem["prompt"]),
                                    ask_async(client, "drafter_b", problem["prompt"]))
        if problem["index"] == 1:
            raise RuntimeError("the judge's tool is down")
        reply = await client.chat.completions.create(model="judge", messages=judged(problem, a, b))
        return reply.choices[0].message.content

    out, _ = play(trio, breaks, 3)
    assert out.failed.tolist() == [False, True, False] and "the judge's tool is down" in out.infos[1]["error"]
    assert [(t.agent, t.episodes.tolist()) for t in out.turns] == [
        ("drafter_a", [0, 1, 2]), ("drafter_b", [0, 1, 2]), ("judge", [0, 2])]
    rec = _Record(3)
    rec.add(0, out, {1: 1})  # the failed episode's transcript shows the calls it made before failing
    transcript = rec.summary(range(3), 3, 1, 1, ["drafter_a", "drafter_b", "judge"])["transcripts"][0]
    assert [t["agent"] for t in transcript["turns"]] == ["drafter_a", "drafter_b"] and "tool is down" in transcript["error"]
    kept = out.select(~out.failed)
    assert [t.episodes.tolist() for t in kept.turns] == [[0, 1], [0, 1], [0, 1]]


GATHERED = '''
import asyncio
from concurrent.futures import ThreadPoolExecutor

STATE = {"episodes": 0}  # module-level state: one module per run, shared by every episode


def _judged(problem, a, b):
    return f"{problem['prompt']} Draft A: {a} Draft B: {b} Which is right?"


async def gathered(problem, client):
    async def ask(agent, text):
        r = await client.chat.completions.create(model=agent, messages=[{"role": "user", "content": text}])
        return r.choices[0].message.content
    b, a = await asyncio.gather(ask("drafter_b", problem["prompt"] + " Check it."),
                                ask("drafter_a", problem["prompt"] + " Draft it."))
    return await ask("judge", _judged(problem, a, b))


def pooled(problem, client):
    def ask(agent, text):
        return client.chat.completions.create(model=agent, messages=[{"role": "user", "content": text}]
                                              ).choices[0].message.content
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(ask, "drafter_a", problem["prompt"] + " Draft it.")
        b = pool.submit(ask, "drafter_b", problem["prompt"] + " Check it.")
        a, b = a.result(), b.result()
    return ask("judge", _judged(problem, a, b))
'''


def test_one_seed_one_run_with_parallel_calls_async_and_threaded(tiny_model_dir, tmp_path):
    """`marft train` on a three-agent program with gathered calls: two runs with one seed give the same
    metrics, evaluations (transcripts included) and adapter bytes, and the thread-pool version of the
    program gives the same run as the async one."""
    from test_api import comparable
    from test_dataset_task import REWARDS, records, write_jsonl
    from marft.run.checkpoints import latest_checkpoint
    from marft.cli import main

    data = write_jsonl(tmp_path / "sums.jsonl", records(20))
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "team3.py").write_text(GATHERED)
    common = ["configs/duo_arithmetic.yaml", f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu",
              AGENTS, "rollout.max_new_tokens=5", "rollout.episodes=4", "team.max_new_tokens={}",
              "rollout.temperature=1.0", "train.iterations=2", "train.minibatch_size=4", "eval.problems=3",
              "eval.ablate=false", "eval.transcripts=3", "task.kind=workflow", f"task.dataset={data}",
              f"task.reward={tmp_path / 'rewards.py'}:flag", "task.options={}"]
    runs = {}
    for name, fn in (("async_1", "gathered"), ("async_2", "gathered"), ("threaded", "pooled")):
        runs[name] = tmp_path / name
        assert main(["train", *common, f"task.workflow={tmp_path / 'team3.py'}:{fn}", f"output_dir={runs[name]}"]) == 0

    def evals(run):
        out = {}
        for tag in ("untrained", "final"):
            r = json.loads((run / f"eval_{tag}.json").read_text())
            assert r["distinct_problems"] == r["problems"] >= 2
            out[tag] = (r["per_problem_success"], r["mean_reward"], r["transcripts"])
        return out

    def weights(run):
        ck = latest_checkpoint(run)
        return {str(f.relative_to(ck)): f.read_bytes() for f in sorted(ck.rglob("*.safetensors"))}

    base = runs["async_1"]
    assert comparable(base)[0]["episodes/failed"] == 0
    assert [t["agent"] for t in evals(base)["final"][2][0]["turns"]] == ["drafter_a", "drafter_b", "judge"]
    assert len(weights(base)) >= 3
    for other in ("async_2", "threaded"):
        assert comparable(runs[other]) == comparable(base), other
        assert evals(runs[other]) == evals(base), other
        assert weights(runs[other]) == weights(base), other


def test_a_workflow_file_is_imported_once_while_it_is_unchanged(tmp_path):
    """Module-level state of a workflow file lives across the run's rollouts (it was imported anew for
    every environment, so a counter or a cache reset at every rollout); a changed file is read again."""
    import os

    from marft.envs.workflow import load_workflow

    path = tmp_path / "counting.py"
    path.write_text("CALLS = []\n\ndef run(problem, client):\n    CALLS.append(problem)\n    return ''\n")
    first = load_workflow(f"{path}:run")
    first({"prompt": "x"}, None)
    assert load_workflow(f"{path}:run") is first and first.__globals__["CALLS"] == [{"prompt": "x"}]
    path.write_text("CALLS = ['new']\n\ndef run(problem, client):\n    return 'changed'\n")
    os.utime(path, ns=(1, 1))
    changed = load_workflow(f"{path}:run")
    assert changed is not first and changed({}, None) == "changed"
