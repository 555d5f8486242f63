"""Acting with the adapter folded into the base weights (TeamModel.acting_merged; the HF engine with
rollout.fold_adapters): the same replies as the adapter layers give, every base weight restored bit for
bit afterwards (also when the block fails), the other agents and the reference policy untouched, and
the cases where folding would be wrong left unfolded."""
from __future__ import annotations

import pytest
import torch

from test_generation import CHATS
from test_rollout import make, perturb
from marft.engines.hf import HFEngine
from marft.engines.generation import Sampling, generate
from marft.engines.models import _foldable_layers, stop_token_ids

SAMPLING = Sampling(temperature=1.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def duo(tiny_model_dir):
    cfg, team, models = make(["model.lora.target_modules=[q_proj,v_proj,o_proj,up_proj]"], tiny_model_dir)
    for k, adapter in enumerate(team.adapters):
        perturb(models, adapter, seed=k)  # adapters that change the replies (PEFT starts B at zero)
    return team, models


def base_weights(models):
    return {n: p.detach().clone() for model in models.bases.values() for n, p in model.named_parameters()
            if "lora_" not in n}


def sample(ctx):
    with ctx as (model, tok):
        return generate(model, tok, CHATS, SAMPLING, stop_token_ids(model, tok), torch.Generator().manual_seed(0))


def test_folded_adapter_gives_the_adapter_layers_replies(duo):
    team, models = duo
    for agent in team.names:
        plain, merged = sample(models.acting(agent)), sample(models.acting_merged(agent))
        assert torch.equal(plain.response_ids, merged.response_ids), agent
        assert torch.allclose(plain.logprobs, merged.logprobs, atol=1e-4, rtol=0), agent  # fp32 rounding
    # the adapters matter here (else the test could not fail): the reference policy replies otherwise
    assert not torch.equal(sample(models.reference(team.names[0])).response_ids, plain.response_ids)


def test_base_weights_are_restored_bit_for_bit(duo):
    team, models = duo
    before = base_weights(models)
    model, _, adapter = models.for_agent(team.names[0])
    with models.acting_merged(team.names[0]):
        during = base_weights(models)
        assert any(not torch.equal(before[n], during[n]) for n in before)  # folded while acting
    after = base_weights(models)
    assert all(torch.equal(before[n], after[n]) for n in before)
    with pytest.raises(RuntimeError, match="boom"):
        with models.acting_merged(team.names[1]):
            raise RuntimeError("boom")
    after = base_weights(models)
    assert all(torch.equal(before[n], after[n]) for n in before)
    # and acting, the reference and training see the unfolded weights with the adapters on again
    from peft.tuners.lora import LoraLayer
    assert not any(m.disable_adapters for m in model.modules() if isinstance(m, LoraLayer))
    assert torch.equal(sample(models.acting(team.names[0])).response_ids,
                       sample(models.acting_merged(team.names[0])).response_ids)


def test_the_engine_folds_when_the_config_asks(duo, tiny_overrides):
    from marft.run.config import load_config
    from marft.engines import make_engine

    team, models = duo
    assert make_engine(load_config(None, tiny_overrides), models).merge is False  # off by default
    engine = make_engine(load_config(None, [*tiny_overrides, "rollout.fold_adapters=true"]), models)
    assert engine.merge is True
    calls = []
    orig = models.acting_merged
    models.acting_merged = lambda name: (calls.append(name), orig(name))[1]
    try:
        HFEngine(models).generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
        assert calls == []
        folded = engine.generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
        assert calls == [team.names[0]]
    finally:
        del models.acting_merged
    plain = HFEngine(models).generate(team.names[0], CHATS, SAMPLING, torch.Generator().manual_seed(0))
    assert torch.equal(plain.response_ids, folded.response_ids)


def test_no_memory_for_the_copy_means_acting_through_the_layers(tiny_model_dir, monkeypatch):
    _, team, models = make(["model.lora.target_modules=[q_proj,v_proj]"], tiny_model_dir)
    perturb(models, team.adapters[0])
    before = base_weights(models)
    plain = sample(models.acting(team.names[0]))

    clone, calls = torch.Tensor.clone, []

    def no_memory(self, *a, **k):  # the copies run out of memory part-way (at the second)
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return clone(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "clone", no_memory)
    merged = sample(models.acting_merged(team.names[0]))
    monkeypatch.undo()
    assert torch.equal(plain.response_ids, merged.response_ids)
    assert all(torch.equal(v, base_weights(models)[n]) for n, v in before.items())
    assert models._pristine[models.base_of[team.adapters[0]]] == {}


def test_tied_or_embedding_adapters_are_not_folded(tiny_model_dir):
    _, team, models = make(["model.lora.target_modules=[q_proj,lm_head]"], tiny_model_dir)
    model, _, adapter = models.for_agent(team.names[0])
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # the tiny model ties them
    assert _foldable_layers(model, adapter) is None
    _, team, models = make(["model.lora.target_modules=[q_proj,embed_tokens]"], tiny_model_dir)
    model, _, adapter = models.for_agent(team.names[0])
    assert _foldable_layers(model, adapter) is None
    perturb(models, adapter)
    # unfoldable: acting_merged is plain acting, same replies, weights untouched
    before = base_weights(models)
    assert torch.equal(sample(models.acting(team.names[0])).response_ids,
                       sample(models.acting_merged(team.names[0])).response_ids)
    assert all(torch.equal(v, base_weights(models)[n]) for n, v in before.items())
