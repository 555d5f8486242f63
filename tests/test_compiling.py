"""torch.compile in marft (marft/engines/compiling.py). rollout.compile: the HF engine's decode step
compiled acts with each agent's own adapter (a compiled step made for one adapter is never reused
for another), folded or through the adapter layers, and the reference policy without them: the
replies of the uncompiled loop. train.compile: the learner's passes with compiled decoder layers
give the log-probabilities, entropies and adapter gradients of the uncompiled ones (fp32), without
compiling again for other micro-batch shapes, and leave the layers uncompiled afterwards."""
from __future__ import annotations

import pytest
import torch

from test_generation import CHATS
from test_merged import duo  # noqa: F401 -- the fixture: two agents whose adapters change the replies
from marft.engines import compiling, packing
from marft.run.config import load_config
from marft.engines import make_engine
from marft.engines.hf import HFEngine
from marft.engines.generation import Sampling, generate
from marft.engines.models import stop_token_ids

SAMPLING = Sampling(temperature=1.0, max_new_tokens=10)


def sample(ctx, compile: bool):
    with ctx as (model, tok):
        return generate(model, tok, CHATS, SAMPLING, stop_token_ids(model, tok), torch.Generator().manual_seed(0),
                        static=True, compile=compile)


@pytest.mark.slow  # compiles five decode steps: 30 s on 2 cores
def test_each_agent_acts_with_its_own_adapter_when_compiled(duo):
    team, models = duo
    a, b = team.names
    # interleaved as a rollout calls them: agent a, agent b, the reference, a folded, a again
    calls = [models.acting(a), models.acting(b), models.reference(a), models.acting_merged(a), models.acting(a)]
    labels = ["a", "b", "reference", "a folded", "a again"]
    want = [sample(ctx, False).response_ids for ctx in
            [models.acting(a), models.acting(b), models.reference(a), models.acting_merged(a), models.acting(a)]]
    assert not torch.equal(want[0], want[1]) and not torch.equal(want[0], want[2])  # the adapters matter
    got = [sample(ctx, True).response_ids for ctx in calls]
    for label, w, g in zip(labels, want, got):
        assert torch.equal(w, g), label


@pytest.mark.slow  # compiles each agent's step and the learner's layers: 40 s on 2 cores
def test_agents_taking_turns_compile_once_each(duo):
    """Each agent's compiled step is made once: acting again (after the other agent, the learner or
    the critic) finds it, because nothing it is guarded on changes between turns (peft's
    set_adapter leaves only the acting adapter trainable; marft keeps every adapter trainable)."""
    import torch._dynamo

    from marft.maths.critic import state_features

    team, models = duo
    a, b = team.names
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    sample(models.acting(a), True), sample(models.acting(b), True)
    graphs = counters["stats"]["unique_graphs"]
    with models.acting(a) as (model, tok):
        learner_pass(model, rows_of(tok, 2, 3), True)  # the learner's compiled layers, between turns
    state_features(models, a, ["a global state", "another one"])  # the critic's features
    before = counters["stats"]["unique_graphs"]
    sample(models.acting(a), True), sample(models.acting(b), True)
    assert counters["stats"]["unique_graphs"] == before and before > graphs, dict(counters["stats"])
    lora = [p for model in models.bases.values() for n, p in model.named_parameters() if "lora_" in n]
    base = [p for model in models.bases.values() for n, p in model.named_parameters() if "lora_" not in n]
    assert all(p.requires_grad for p in lora) and not any(p.requires_grad for p in base)


def test_the_engine_compiles_when_the_config_asks(duo, tiny_overrides):
    team, models = duo
    assert "compile" not in make_engine(load_config(None, tiny_overrides), models).flags  # off by default
    engine = make_engine(load_config(None, [*tiny_overrides, "rollout.compile=true"]), models)
    assert engine.flags == {"compile": True}
    got = engine.generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
    plain = HFEngine(models).generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
    assert torch.equal(plain.response_ids, got.response_ids)


def test_a_step_that_cannot_be_compiled_runs_as_it_is(duo, monkeypatch, capsys):
    import marft.engines.generation as gen

    team, models = duo
    tries = []

    def no_compiler():
        def fails(*a, **k):
            tries.append(1)
            raise RuntimeError("no C++ compiler found (a stand-in)")
        return fails

    monkeypatch.setattr(gen, "_compiled_step", no_compiler)
    monkeypatch.setattr(gen, "_gave_up", set())
    got = sample(models.acting(team.names[0]), True)
    assert "the decode step could not be compiled (RuntimeError: no C++ compiler found" in capsys.readouterr().err
    assert torch.equal(got.response_ids, sample(models.acting(team.names[0]), False).response_ids)
    sample(models.acting(team.names[1]), True)
    assert len(tries) == 1  # not tried again at the next call (each try would trace the model anew)


def test_a_batch_as_large_as_a_head_is_not_tied_to_it(duo):
    """Dimensions of equal size get symbols of their own: a batch of 16 prompts on a model whose
    heads have 16 dimensions, then a batch of 6, run the same compiled step (with duck sizing the
    first would tie batch and head size, and the second compile again)."""
    import torch._dynamo

    team, models = duo
    model, tok, _ = models.for_agent(team.names[0])
    head = model.config.hidden_size // model.config.num_attention_heads
    chats = [[{"role": "user", "content": f"Count to {i}."}] for i in range(head)]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with models.acting(team.names[0]) as (model, tok):
        stops = stop_token_ids(model, tok)
        generate(model, tok, chats, SAMPLING, stops, torch.Generator().manual_seed(0), compile=True)
        graphs = counters["stats"]["unique_graphs"]
        generate(model, tok, chats[:6], SAMPLING, stops, torch.Generator().manual_seed(0), compile=True)
    assert counters["stats"]["unique_graphs"] == graphs


def rows_of(tok, n: int, seed: int) -> list[packing.Row]:
    g = torch.Generator().manual_seed(seed)
    return [packing.Row(torch.randint(0, len(tok), (24 + 5 * i,), generator=g), 12 + i, 12 + 4 * i) for i in range(n)]


def learner_pass(model, rows, compile: bool):
    """One micro-batch's log-probabilities and entropies and the adapter gradients of their sum."""
    lp, ent, _ = packing.response_logprobs(model, rows, 0.7, True, share_prefix=False, compile=compile)
    (lp.sum() + 0.1 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent.detach(), grads


def test_the_compiled_learner_pass_gives_the_uncompiled_values_and_gradients(duo):
    import torch._dynamo

    team, models = duo
    counters = torch._dynamo.utils.counters
    with models.acting(team.names[0]) as (model, tok):
        model.train()
        rows = rows_of(tok, 4, 0)
        want = learner_pass(model, rows, False)
        torch._dynamo.reset()
        counters.clear()
        got = learner_pass(model, rows, True)
        assert all(layer._compiled_call_impl is None for layer in compiling.decoder_layers(model))  # only inside
        graphs = counters["stats"]["unique_graphs"]
        assert graphs >= 1 and not counters["graph_break"], dict(counters["graph_break"])
        # fp32, summed in another order by the fused kernels: |log p| up to about 12 here
        assert torch.allclose(want[0], got[0], atol=1e-4, rtol=0) and torch.allclose(want[1], got[1], atol=1e-4, rtol=0)
        assert want[2].keys() == got[2].keys() and any("lora_" in n for n in want[2])
        for name, g in want[2].items():
            assert float((g - got[2][name]).norm() / g.norm()) < 1e-4, name  # fp32 sums of thousands of terms
        # another micro-batch: other rows, other lengths; the same compiled layers
        other = rows_of(tok, 3, 1)
        want_other, got_other = learner_pass(model, other, False), learner_pass(model, other, True)
        assert counters["stats"]["unique_graphs"] == graphs
        assert torch.allclose(want_other[0], got_other[0], atol=1e-4, rtol=0)
        # the behaviour log-probabilities (no gradient): a variant of its own, the same values
        with torch.no_grad():
            lp, _, _ = packing.response_logprobs(model, rows, 0.7, False, share_prefix=False, compile=True)
        assert torch.allclose(lp, want[0], atol=1e-4, rtol=0)


def test_layers_that_cannot_be_compiled_run_as_they_are(duo, monkeypatch, capsys):
    team, models = duo

    def fails(*a, **k):
        raise RuntimeError("no C++ compiler found (a stand-in)")

    with models.acting(team.names[1]) as (model, tok):
        rows = rows_of(tok, 3, 2)
        want = learner_pass(model, rows, False)
        for layer in compiling.decoder_layers(model):
            monkeypatch.setattr(layer, "_marft_compiled", fails, raising=False)
        got = learner_pass(model, rows, True)
        assert "train.compile: the learner's decoder layers could not be compiled (RuntimeError" in capsys.readouterr().err
        assert torch.equal(want[0], got[0])
        assert all(layer._marft_compiled is False and layer._compiled_call_impl is None
                   for layer in compiling.decoder_layers(model))  # not tried again
        monkeypatch.undo()
        for layer in compiling.decoder_layers(model):
            layer._marft_compiled = None  # the other tests compile again
