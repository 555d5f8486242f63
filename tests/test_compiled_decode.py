"""rollout.compile: the HF engine's decode step under torch.compile acts with each agent's own
adapter (a compiled step made for one adapter is never reused for another), folded or through the
adapter layers, and the reference policy without them: the replies of the uncompiled loop."""
from __future__ import annotations

import torch

from test_generation import CHATS
from test_merged import duo  # noqa: F401 -- the fixture: two agents whose adapters change the replies
from marft.config import load_config
from marft.engines import make_engine
from marft.engines.hf import HFEngine
from marft.generation import Sampling, generate
from marft.models import stop_token_ids

SAMPLING = Sampling(temperature=1.0, max_new_tokens=10)


def sample(ctx, compile: bool):
    with ctx as (model, tok):
        return generate(model, tok, CHATS, SAMPLING, stop_token_ids(model, tok), torch.Generator().manual_seed(0),
                        static=True, compile=compile)


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


def test_the_engine_compiles_when_the_config_asks(duo, tiny_overrides):
    team, models = duo
    assert "compile" not in make_engine(load_config(None, tiny_overrides), models).flags  # off by default
    engine = make_engine(load_config(None, [*tiny_overrides, "rollout.compile=true"]), models)
    assert engine.flags == {"compile": True}
    got = engine.generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
    plain = HFEngine(models).generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
    assert torch.equal(plain.response_ids, got.response_ids)


def test_a_step_that_cannot_be_compiled_runs_as_it_is(duo, monkeypatch, capsys):
    import marft.generation as gen

    team, models = duo

    def no_compiler():
        def fails(*a, **k):
            raise RuntimeError("no C++ compiler found (a stand-in)")
        return fails

    monkeypatch.setattr(gen, "_compiled_step", no_compiler)
    got = sample(models.acting(team.names[0]), True)
    assert "the decode step could not be compiled (RuntimeError: no C++ compiler found" in capsys.readouterr().err
    assert torch.equal(got.response_ids, sample(models.acting(team.names[0]), False).response_ids)
