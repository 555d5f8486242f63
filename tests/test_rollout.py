"""Models, adapters and rollout on a tiny random chat model: one base copy per team, adapter
isolation, the reference policy, recorded log-probabilities, and what each prompt contains."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import marft.engines.hf as hf_engine
from marft.engines.hf import HFEngine
from marft.run.config import load_config
from marft.envs.base import Grade, Problem, TurnBasedEnv
from marft.engines.generation import Sampling, sequence_logprobs
from marft.engines.models import TeamModel
from marft.run.rollout import rollout
from marft.team import build_team


class EchoEnv(TurnBasedEnv):
    """Problem i is "Compute i + 1."; a reply is right when it contains the answer."""

    def new_problem(self, rng, split, index):
        i = index if index is not None else rng.randint(0, 99)
        return Problem(f"Compute {i} + 1.", str(i + 1))

    def grade(self, problem, reply):
        return Grade(problem.answer in reply, True, feedback="wrong")


def make(overrides, tiny_model_dir):
    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu", *overrides])
    team = build_team(cfg.team)
    return cfg, team, TeamModel(team, cfg.model)


def play(team, models, n=4, sampling=Sampling(max_new_tokens=10), horizon=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return rollout(team, models, lambda: EchoEnv(team.names, team.answering, horizon),
                   [(i, {"split": "test", "index": i}) for i in range(n)], sampling, horizon, g)


def perturb(models, adapter, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = models.adapter_state(adapter)
    models.load_adapter_state(adapter, {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in state.items()})


def test_one_base_copy_for_the_whole_team(tiny_model_dir, tiny_model_dir_b):
    _, team, models = make(["team.preset=quartet"], tiny_model_dir)
    assert len(models.bases) == 1
    peft = next(iter(models.bases.values()))
    assert set(peft.peft_config) == {"planner", "solver", "reflector", "verifier"}
    # base weights exist once: count parameters that are not LoRA
    base_params = [n for n, _ in peft.named_parameters() if "lora_" not in n]
    assert len(base_params) == len(list(AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters()))
    # an agent with its own base model adds exactly one more copy
    _, _, models2 = make(["team.preset=trio", f"team.agents.2.model={tiny_model_dir_b}"], tiny_model_dir)
    assert len(models2.bases) == 2
    _, _, shared = make(["team.preset=quartet", "team.share_adapter=true"], tiny_model_dir)
    assert set(next(iter(shared.bases.values())).peft_config) == {"team"}


def test_rollout_batch_shapes_masks_and_rewards(tiny_model_dir):
    _, team, models = make([], tiny_model_dir)
    out = play(team, models, n=5)
    assert [(t.step, t.agent) for t in out.turns] == [(0, "planner"), (0, "solver")]
    for t in out.turns:
        b, R = t.response_ids.shape
        assert b == 5 and R <= 10
        assert t.logprobs.shape == t.response_mask.shape == (b, R)
        assert (t.logprobs[~t.response_mask] == 0).all() and (t.logprobs[t.response_mask] <= 0).all()
        # a reply is a prefix of the row: no gaps in the mask
        assert (t.response_mask[:, 1:] <= t.response_mask[:, :-1]).all()
        # truncated exactly when the reply used every token without an end-of-turn token
        lengths = t.response_mask.sum(1)
        last = t.response_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        eos = next(iter(models.tokenizers.values())).eos_token_id
        assert torch.equal(t.truncated, (lengths == 10) & (last != eos))
        assert ((last == eos) | t.truncated).all()
    assert out.rewards.shape == (5, 1) and out.dones.all()


def test_an_agent_can_have_its_own_reply_limit(tiny_model_dir):
    # the tiny random model rarely ends a reply by itself: the planner is cut at 3, the solver at 10
    _, team, models = make(["team.max_new_tokens={planner: 3}"], tiny_model_dir)
    out = play(team, models, n=6)
    planner, solver = out.turns
    assert planner.response_mask.sum(1).max() <= 3 and solver.response_mask.sum(1).max() <= 10
    assert solver.response_mask.sum(1).max() > 3  # the solver is not held to the planner's limit
    assert torch.equal(planner.truncated, planner.response_mask.sum(1) == 3) or planner.truncated.any()


def test_recorded_logprobs_equal_teacher_forced_recomputation(tiny_model_dir):
    _, team, models = make(["team.preset=trio"], tiny_model_dir)
    for adapter in team.adapters:
        perturb(models, adapter, seed=len(adapter))
    sampling = Sampling(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)
    out = play(team, models, n=6, sampling=sampling)
    assert out.generated_tokens > 0
    for t in out.turns:
        with models.acting(t.agent) as (model, _):
            lp = sequence_logprobs(model, t.prompt_ids, t.prompt_mask, t.response_ids, t.response_mask, 0.7)
        assert torch.allclose(lp, t.logprobs, atol=1e-4), (t.agent, (lp - t.logprobs).abs().max())


def test_changing_one_adapter_changes_that_agent_only(tiny_model_dir):
    _, team, models = make([], tiny_model_dir)
    greedy = Sampling(temperature=0.0, max_new_tokens=10)
    before = play(team, models, sampling=greedy)
    perturb(models, "solver")
    after = play(team, models, sampling=greedy)
    b_plan, b_solve = before.turns
    a_plan, a_solve = after.turns
    assert a_plan.texts == b_plan.texts and torch.equal(a_plan.logprobs, b_plan.logprobs)
    # the solver's policy changed: same prompts and tokens, other log-probabilities
    with models.acting("solver") as (model, _):
        lp = sequence_logprobs(model, b_solve.prompt_ids, b_solve.prompt_mask, b_solve.response_ids, b_solve.response_mask)
    assert not torch.allclose(lp, b_solve.logprobs, atol=1e-3)
    # and the planner's policy on the planner's own tokens did not
    with models.acting("planner") as (model, _):
        lp = sequence_logprobs(model, b_plan.prompt_ids, b_plan.prompt_mask, b_plan.response_ids, b_plan.response_mask)
    assert torch.allclose(lp, b_plan.logprobs, atol=1e-5)


def test_shared_adapter_changes_every_agent(tiny_model_dir):
    _, team, models = make(["team.share_adapter=true"], tiny_model_dir)
    before = play(team, models, sampling=Sampling(temperature=0.0, max_new_tokens=10))
    perturb(models, "team")
    for t in before.turns:
        with models.acting(t.agent) as (model, _):
            lp = sequence_logprobs(model, t.prompt_ids, t.prompt_mask, t.response_ids, t.response_mask)
        assert not torch.allclose(lp, t.logprobs, atol=1e-3), t.agent


def test_reference_policy_is_the_base_model(tiny_model_dir):
    _, team, models = make([], tiny_model_dir)
    perturb(models, "planner")
    perturb(models, "solver", seed=1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        for agent in team.names:
            with models.reference(agent) as (model, _):
                got = model(input_ids=ids).logits
            assert torch.allclose(got, want, atol=1e-5)
            with models.acting(agent) as (model, _):
                assert not torch.allclose(model(input_ids=ids).logits, want, atol=1e-3)


@pytest.mark.parametrize("graph,expected", [
    ("chain", {"x": set(), "y": {"x"}, "z": {"x", "y"}}),
    ("parallel", {"x": set(), "y": set(), "z": set()}),
    ("{z: [x], y: [z]}", {"x": set(), "z": {"x"}, "y": {"z"}}),
])
def test_each_prompt_holds_exactly_its_predecessors_replies(tiny_model_dir, monkeypatch, graph, expected):
    """Through the whole path (rollout -> messages -> chat template -> token ids)."""
    agents = [{"name": n, "prompt": f"You are agent {n}."} for n in "xyz"]
    _, team, models = make([f"team.agents={agents}", f"team.graph={graph}"], tiny_model_dir)
    real = hf_engine.generate

    def marked(model, tok, chats, sampling, stop_ids, generator, **kw):
        out = real(model, tok, chats, sampling, stop_ids, generator)
        name = chats[0][0]["content"].split()[-1].rstrip(".")
        out.texts = [f"MARK_{name}_{i}" for i in range(len(chats))]
        return out

    monkeypatch.setattr(hf_engine, "generate", marked)
    out = play(team, models, n=3, sampling=Sampling(max_new_tokens=3))
    tok = next(iter(models.tokenizers.values()))
    for t in out.turns:
        for row, prompt in enumerate(tok.batch_decode(t.prompt_ids, skip_special_tokens=True)):
            seen = {n for n in "xyz" if f"MARK_{n}_{row}" in prompt}
            assert seen == expected[t.agent], (t.agent, prompt)
            assert not any(f"MARK_{n}_{other}" in prompt for n in "xyz" for other in range(3) if other != row)


def test_multi_turn_feedback_reaches_the_team(tiny_model_dir):
    _, team, models = make([], tiny_model_dir)
    out = play(team, models, n=3, horizon=2, sampling=Sampling(max_new_tokens=4))
    assert out.rewards.shape == (3, 2)
    second = [t for t in out.turns if t.step == 1]
    failed = (~out.success).sum()
    if failed:  # a random tiny model fails; those episodes get a second step with feedback
        assert {t.agent for t in second} == {"planner", "solver"}
        tok = next(iter(models.tokenizers.values()))
        assert "Feedback: wrong" in tok.decode(second[0].prompt_ids[0], skip_special_tokens=True)
        assert (out.steps[~out.success] == 2).all()


def test_generate_fast_paths_play_the_same_rollout_as_the_plain_loop(tiny_model_dir):
    """Prefix sharing, compaction and the reserved cache (generate's defaults) change no episode."""
    _, team, models = make(["team.preset=trio"], tiny_model_dir)
    for adapter in team.adapters:
        perturb(models, adapter, seed=len(adapter))
    sampling = Sampling(temperature=1.0, max_new_tokens=12)
    fast = play(team, models, n=6, sampling=sampling)
    plain = play(team, HFEngine(models, fast=False), n=6, sampling=sampling)
    assert [(t.step, t.agent) for t in fast.turns] == [(t.step, t.agent) for t in plain.turns]
    for f, p in zip(fast.turns, plain.turns):
        assert torch.equal(f.prompt_ids, p.prompt_ids) and torch.equal(f.response_ids, p.response_ids)
        assert torch.equal(f.response_mask, p.response_mask) and f.texts == p.texts
        assert torch.allclose(f.logprobs, p.logprobs, atol=1e-5)
    assert torch.equal(fast.rewards, plain.rewards)
