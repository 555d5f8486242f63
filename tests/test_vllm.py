"""The vLLM engine against the HF engine, on vLLM's CPU build with a tiny model saved as a Hugging
Face folder (one engine start-up for the module, about a minute on 2 cores).

Run where vLLM is installed (``bash scripts/setup.sh --vllm``); skipped otherwise. Everything is
float32 and greedy, where vLLM's kernels and the learner's agree to ~1e-5 per logit, so the same
weights give the same tokens."""
from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from conftest import build_tiny_model
from test_rollout import EchoEnv as Echo  # Problem i is "Compute i + 1."
from marft.run.config import load_config
from marft.engines.hf import HFEngine
from marft.engines.generation import Sampling
from marft.engines.models import TeamModel
from marft.run.rollout import rollout
from marft.team import build_team

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (bash scripts/setup.sh --vllm installs its CPU build)"),
]

GREEDY = Sampling(temperature=0.0, max_new_tokens=12)
CHATS = [[{"role": "system", "content": "You are the planner."}, {"role": "user", "content": f"Calculate {a} + {b}."}]
         for a, b in [(1, 2), (12, 7), (3, 9), (0, 0), (5, 5), (8, 1)]]


def perturb(models, adapter, seed):
    g = torch.Generator().manual_seed(seed)
    state = models.adapter_state(adapter)
    models.load_adapter_state(adapter, {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in state.items()})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from marft.engines.vllm import VLLMEngine

    # head_dim 64: a size vLLM's CPU attention kernels support
    folder = build_tiny_model(tmp_path_factory.mktemp("vllm-model"), hidden=128, layers=2)
    cfg = load_config(None, [f"model.name={folder}", "model.dtype=float32", "model.device=cpu",
                             "rollout.engine=vllm", "rollout.vllm.kv_cache_gb=1", "rollout.vllm.max_model_len=512"])
    team = build_team(cfg.team)
    models = TeamModel(team, cfg.model)
    for k, adapter in enumerate(team.adapters):
        perturb(models, adapter, seed=k)
    engine = VLLMEngine(models, cfg.model, cfg.rollout.vllm)
    yield team, models, engine
    engine.close()


def replies(engine, agent):
    return engine.generate(agent, CHATS, GREEDY, torch.Generator().manual_seed(0))


def test_greedy_replies_equal_the_hf_engines(setup):
    team, models, engine = setup
    hf = HFEngine(models)
    for agent in team.names:
        v, h = replies(engine, agent), replies(hf, agent)
        assert v.texts == h.texts, agent
        assert torch.equal(v.response_ids, h.response_ids) and torch.equal(v.response_mask, h.response_mask)
        assert torch.equal(v.prompt_ids, h.prompt_ids) and torch.equal(v.truncated, h.truncated)
        # greedy log-probabilities are those of the unscaled policy in both
        assert torch.allclose(v.logprobs, h.logprobs, atol=1e-3)


def test_a_batch_refused_halfway_leaves_nothing_for_the_next_one(setup):
    """A prompt over max_model_len in the middle of a batch raises; the requests already submitted
    are aborted, so the next batch gets its own replies (it used to collect the stale ones)."""
    from marft.errors import UserError

    team, models, engine = setup
    agent = team.names[-1]
    too_long = [{"role": "user", "content": "many words " * 400}]
    with pytest.raises(UserError, match="max_model_len"):
        engine.generate(agent, [CHATS[0], too_long, CHATS[1]], GREEDY, torch.Generator().manual_seed(0))
    assert not engine._pending
    got = engine.generate(agent, [CHATS[1], CHATS[2]], GREEDY, torch.Generator().manual_seed(0))
    assert got.texts == HFEngine(models).generate(agent, [CHATS[1], CHATS[2]], GREEDY, torch.Generator().manual_seed(0)).texts


def test_each_agent_follows_its_own_adapter_and_updates_reach_the_engine(setup):
    team, models, engine = setup
    planner, solver = team.names
    before = {a: replies(engine, a).texts for a in team.names}
    assert before[planner] != before[solver]  # different adapters, different replies
    state = {k: v.clone() for k, v in models.adapter_state(planner).items()}
    version = engine.version
    perturb(models, planner, seed=99)
    engine.update()
    assert engine.version == version + 1
    after = {a: replies(engine, a) for a in team.names}
    assert after[planner].texts != before[planner]  # the new version is served ...
    assert after[solver].texts == before[solver]  # ... and the other agent's adapter is untouched
    hf = HFEngine(models)
    assert after[planner].texts == replies(hf, planner).texts  # the engine acts with the learner's weights
    models.load_adapter_state(planner, state)
    engine.update()
    assert replies(engine, planner).texts == before[planner]


def test_asynchronous_rollout_plays_the_barrier_rollouts_episodes(setup):
    team, models, engine = setup
    resets = [(i, {"split": "test", "index": i}) for i in range(6)]
    runs = {}
    for schedule in ("barrier", "async"):
        runs[schedule] = rollout(team, engine, lambda: Echo(team.names, team.answering, 2), resets, GREEDY, 2,
                                 torch.Generator().manual_seed(0), schedule=schedule)
    hf = rollout(team, HFEngine(models), lambda: Echo(team.names, team.answering, 2), resets, GREEDY, 2,
                 torch.Generator().manual_seed(0))
    b, a = runs["barrier"], runs["async"]
    for other in (a, hf):
        assert [(t.step, t.agent) for t in other.turns] == [(t.step, t.agent) for t in b.turns]
        for x, y in zip(b.turns, other.turns):
            assert torch.equal(x.episodes, y.episodes) and x.texts == y.texts
            assert torch.equal(x.prompt_ids, y.prompt_ids) and torch.equal(x.response_ids, y.response_ids)
            assert x.states == y.states
        assert torch.equal(other.rewards, b.rewards) and torch.equal(other.steps, b.steps)


def test_training_with_the_vllm_engine_serves_every_update(setup, tmp_path):
    """Two iterations of MARFT with the engine: each policy update reaches the engine as a new
    adapter version, and the learner's recomputed behaviour log-probabilities match the engine's."""
    from marft.assemble import build_trainer

    team, models, engine = setup
    cfg = load_config(None, ["model.dtype=float32", "model.device=cpu", "rollout.episodes=4", "rollout.max_new_tokens=8",
                             "rollout.temperature=1.0", "rollout.engine=vllm", "rollout.schedule=async", "train.minibatch_size=2",
                             "train.lr=1e-2", f"output_dir={tmp_path}"])
    trainer = build_trainer(cfg, team, models, lambda: Echo(team.names, team.answering, 1), log=lambda m: None, engine=engine)
    version = engine.version
    for _ in range(2):
        m = trainer.iteration_step()
        assert m["rollout/logprob_gap"] < 1e-3  # fp32: the same policy on both sides
    assert engine.version == version + 2
    hf = HFEngine(models)
    for agent in team.names:  # the engine now acts with the trained adapters
        assert replies(engine, agent).texts == replies(hf, agent).texts


def test_marft_eval_on_the_vllm_engine_scores_as_the_hf_engine(setup, tmp_path, capsys):
    """``marft eval ... rollout.engine=vllm`` end to end (its own engine, closed after), greedy:
    the same transcripts and per-problem results as the HF engine's evaluation."""
    from marft.cli import main

    _, models, _ = setup
    folder = next(iter(models.bases.values())).base_model.model.name_or_path
    common = ["configs/duo_arithmetic.yaml", f"model.name={folder}", "model.dtype=float32", "model.device=cpu",
              "rollout.max_new_tokens=8", "team.max_new_tokens={}", "rollout.episodes=4", "eval.problems=6",
              "eval.temperature=0", "rollout.vllm.kv_cache_gb=1", "rollout.vllm.max_model_len=512"]
    results = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        assert main(["eval", *common, f"rollout.engine={engine}", f"eval.output={out}"]) == 0
        results[engine] = __import__("json").loads(out.read_text())
    hf, vl = results["hf"], results["vllm"]
    assert hf["per_problem_success"] == vl["per_problem_success"]
    assert [[x["reply"] for x in t["turns"]] for t in hf["transcripts"]] == \
           [[x["reply"] for x in t["turns"]] for t in vl["transcripts"]]
    assert hf["generated_tokens"] == vl["generated_tokens"] > 0


def test_the_endpoint_serves_the_team_through_the_vllm_engine(setup):
    """marft/serving/serve.py on the vLLM engine: each agent answers with its own adapter, as the engine
    itself replies (greedy), and the call is recorded with its token ids and log-probabilities."""
    openai = pytest.importorskip("openai")
    from marft.serving.serve import serve_team

    team, models, engine = setup
    with serve_team(models, team, engine, GREEDY) as server:
        client = openai.OpenAI(base_url=server.base_url("e"), api_key=server.api_key)
        for agent in team.names:
            r = client.chat.completions.create(model=agent, messages=CHATS[1], temperature=0.0)
            direct = engine.generate(agent, [CHATS[1]], GREEDY, torch.Generator().manual_seed(0))
            assert r.choices[0].message.content == direct.texts[0]
        calls = server.calls("e")
        assert [c.agent for c in calls] == team.names
        assert all(len(c.logprobs) == len(c.response_ids) > 0 for c in calls)
        # a stop string: vLLM ends the reply at the token completing it, as the HF engine does; the
        # content returned ends before it
        whole = calls[-1]
        stop = whole.text[len(whole.text) // 2:len(whole.text) // 2 + 2]
        r = client.chat.completions.create(model=team.names[-1], messages=CHATS[1], temperature=0.0, stop=stop)
        cut = server.calls("e")[-1]
        assert r.choices[0].message.content == whole.text[:whole.text.index(stop)] and r.choices[0].finish_reason == "stop"
        k = len(cut.response_ids)
        assert 0 < k < len(whole.response_ids) and cut.response_ids == whole.response_ids[:k]
    hf = HFEngine(models).generate(team.names[-1], [CHATS[1]], replace(GREEDY, stop=(stop,)), torch.Generator().manual_seed(0))
    assert hf.response_ids[0][hf.response_mask[0]].tolist() == cut.response_ids


def test_a_workflow_plays_on_the_vllm_engine_as_on_the_hf_engine(setup):
    """A workflow's rollout (marft/serving/workflow.py: the endpoint's batches generated in the calling
    thread) on the vLLM engine gives the HF engine's replies and rewards, greedy."""
    pytest.importorskip("openai")
    from marft.serving.serve import serve_team
    from marft.serving.workflow import play_workflows

    team, models, engine = setup

    def duo(problem, client):
        plan = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": problem["prompt"]}])
        return client.chat.completions.create(model="solver", messages=[
            {"role": "user", "content": problem["prompt"] + " " + plan.choices[0].message.content}]).choices[0].message.content

    problems = [{"prompt": f"Calculate {a} + {b}."} for a, b in [(1, 2), (12, 7), (3, 9)]]
    got = {}
    for name, eng in (("vllm", engine), ("hf", HFEngine(models))):
        with serve_team(models, team, eng, GREEDY) as server:
            out = play_workflows(team, server, duo, problems, lambda answer, p: float(len(answer) % 2))
        assert not out.failed.any() and server.batches == [("planner", 3), ("solver", 3)]
        got[name] = ([t.texts for t in out.turns], out.rewards.tolist())
    assert got["vllm"] == got["hf"]


def test_a_learning_critics_adapter_is_not_served(setup, tmp_path):
    """train.critic=lora adds the critic's adapter to the team's model; the engine serves the agents'
    adapters only (the critic answers no request), each update too. Last in the module: it leaves
    the critic's adapter in the shared model."""
    from marft.assemble import build_trainer

    team, models, engine = setup
    cfg = load_config(None, ["model.dtype=float32", "model.device=cpu", "rollout.episodes=4", "rollout.max_new_tokens=8",
                             "rollout.temperature=1.0", "rollout.engine=vllm", "train.minibatch_size=2",
                             "train.critic=lora", f"output_dir={tmp_path}"])
    trainer = build_trainer(cfg, team, models, lambda: Echo(team.names, team.answering, 1), log=lambda m: None, engine=engine)
    assert "critic" in models.base_of
    trainer.iteration_step()
    assert sorted(engine._lora) == sorted(team.adapters) and not any("critic" in p.name for p in engine._dir.glob("v*/*"))
