"""The learner's fast path (marft/engines/packing.py) against the plain padded pass: same log-probabilities,
entropies, losses and gradients on a tiny float32 model; and the grouping helpers by hand."""
import pytest
import torch

from marft.engines import packing
from marft.api import prepare
from marft.run.config import load_config
from marft.engines.generation import sequence_logprobs
from marft.run.learner import PolicyBatch
from marft.assemble import build_trainer


def test_micro_batches_group_similar_lengths_within_the_token_budget():
    lengths = [10, 50, 12, 48, 30, 200]
    groups = packing.micro_batches(lengths, max_tokens=100)
    # longest first; 200 alone (over budget), then 50+48 (2 x 50 = 100), then 30+12+10 (3 x 30 = 90)
    assert groups == [[5], [1, 3], [4, 2, 0]]
    assert packing.micro_batches(lengths, max_tokens=1000, max_rows=4) == [[5, 1, 3, 4], [2, 0]]
    assert sorted(i for g in groups for i in g) == list(range(6))


def test_shared_prefix_stops_before_the_shortest_prompt_ends():
    row = lambda ids, n_prompt: packing.Row(torch.tensor(ids), n_prompt, len(ids) - n_prompt)  # noqa: E731
    a, b = row([1, 2, 3, 4, 5, 9, 9], 5), row([1, 2, 3, 4, 6, 9], 5)
    assert packing.shared_prefix([a, b], min_len=1) == 4
    # identical prompts (a grpo group): the last prompt token stays in each row's own part
    c, d = row([1, 2, 3, 4, 5, 7], 5), row([1, 2, 3, 4, 5, 8, 8], 5)
    assert packing.shared_prefix([c, d], min_len=1) == 4
    assert packing.shared_prefix([c, d], min_len=5) == 0  # too short to bother
    assert packing.shared_prefix([c], min_len=1) == 0


def _trainer(tiny_overrides, extra=()):
    cfg = load_config("configs/duo_arithmetic.yaml", tiny_overrides + ["rollout.episodes=6", "rollout.max_new_tokens=10",
                                                                      "rollout.temperature=0.8", *extra])
    team, models, make_env = prepare(cfg)
    torch.manual_seed(0)
    for adapter in team.adapters:  # LoRA B starts at zero; give the adapters weight so they matter
        for name, p in models.bases[next(iter(models.bases))].named_parameters():
            if "lora_B" in name and f".{adapter}." in name:
                p.data.normal_(0, 0.3)
    return build_trainer(cfg, team, models, make_env, log=lambda m: None)


def test_fast_logprobs_and_entropy_equal_the_padded_pass(tiny_overrides):
    tr = _trainer(tiny_overrides)
    out = tr.play(0)
    for t in out.turns:
        rows = packing.unpad(t.prompt_ids, t.prompt_mask, t.response_ids, t.response_mask)
        with torch.no_grad(), tr.models.acting(t.agent) as (model, _):
            plain = sequence_logprobs(model, t.prompt_ids, t.prompt_mask, t.response_ids, t.response_mask, 0.8)
            ids = torch.cat([t.prompt_ids, t.response_ids], 1)
            mask = torch.cat([t.prompt_mask, t.response_mask], 1).long()
            from marft.engines.generation import positions_of
            z = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask),
                      logits_to_keep=t.response_ids.shape[1] + 1).logits[:, :-1].float() / 0.8
            plain_ent = -(z.log_softmax(-1).exp() * z.log_softmax(-1)).sum(-1) * t.response_mask
            for share in (True, False):
                lp, ent, work = packing.response_logprobs(model, rows, 0.8, True, share_prefix=share, min_prefix=2)
                R = lp.shape[1]
                assert torch.allclose(lp, plain[:, :R], atol=1e-5), (share, (lp - plain[:, :R]).abs().max())
                assert torch.allclose(ent, plain_ent[:, :R], atol=1e-5)
                assert work.logits == int(t.response_mask.sum())
            assert packing.shared_prefix(rows, 2) > 5  # the duo's prompts share their system prompt


def _grads(tr, adapter):
    return torch.cat([p.grad.flatten() for p in tr.models.adapter_parameters(adapter)])


@pytest.mark.parametrize("algorithm,kl", [("marft", 0.0), ("marft-token", 0.1)])
def test_fast_update_gives_the_plain_loss_and_gradients(tiny_overrides, algorithm, kl):
    tr = _trainer(tiny_overrides, [f"train.algorithm={algorithm}", f"train.kl_coef={kl}", "train.micro_batch_size=2",
                                   "train.micro_batch_tokens=64"])
    out = tr.play(0)
    targets = tr.targets(out)
    adv = tr.normalised_advantages(out, targets)
    rows = [(i, r) for i, t in enumerate(out.turns) if t.agent == "solver" for r in range(len(t.episodes))]
    batch = PolicyBatch.of(out.turns, adv, rows, [rows])
    learner = tr.policy.learners["solver"]
    params = tr.models.adapter_parameters("solver")
    for p in params:
        p.requires_grad_(True)
    results = {}
    for fast in (False, True):
        tr.cfg.train.fast = fast
        old = learner.behaviour_logprobs(batch, batch.rows)
        for p in params:
            p.grad = None
        stats = learner.accumulate(batch, batch.rows, old)
        results[fast] = (old, stats, _grads(tr, "solver"))
    (old0, s0, g0), (old1, s1, g1) = results[False], results[True]
    for i in old0:
        assert torch.allclose(old0[i], old1[i], atol=1e-5)
    assert s0["used"] > 1 and s1["used"] > 1  # several micro-batches, differently split in each path
    for k in ("policy_loss", "entropy", "approx_kl", "kl_ref"):
        assert s0[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), k
    assert g0.abs().max() > 0
    # float32 rounding in a different summation order: within 1e-5 of the largest gradient entry
    assert (g0 - g1).abs().max() <= 1e-5 * g0.abs().max(), (g0 - g1).abs().max()
