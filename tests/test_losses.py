"""Losses against hand-computed numbers (arithmetic in the comments)."""
import math

import pytest
import torch

from marft.maths import losses
from marft.maths.losses import (action_logprobs, entropy_from_logits, kl_penalty, masked_mean, ppo_policy_loss,
                               value_loss)

T, F = True, False


def t(x, **kw):
    return torch.tensor(x, dtype=kw.pop("dtype", torch.float64), **kw)


def test_masked_mean():
    x = t([[1.0, 2.0, float("nan")], [3.0, float("inf"), 5.0]])
    mask = torch.tensor([[T, T, F], [T, F, T]])
    assert masked_mean(x, mask).item() == pytest.approx(11 / 4)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 4.0])
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_action_logprobs_modes():
    lp = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, 9.0]])
    mask = torch.tensor([[T, T, T], [T, T, F]])
    assert action_logprobs(lp, mask, "sum").tolist() == [-6.0, -1.0]
    assert action_logprobs(lp, mask, "mean").tolist() == [-2.0, -0.5]
    # words: 4 and 0 (min 1) -> -6/4, -1/1
    assert action_logprobs(lp, mask, "word", torch.tensor([4, 0])).tolist() == [-1.5, -1.0]
    with pytest.raises(ValueError):
        action_logprobs(lp, mask, "word")


# Five valid entries and one masked, clip 0.2; loss term = max(-A r, -A clamp(r, .8, 1.2)):
#   A=+1 r=1.1 (inside)        -1.1 vs -1.1 -> -1.1  unclipped, d/dlp = -A r = -1.1
#   A=+1 r=1.5 (above)         -1.5 vs -1.2 -> -1.2  CLIPPED,   d/dlp = 0
#   A=-1 r=0.5 (below)          0.5 vs  0.8 ->  0.8  CLIPPED,   d/dlp = 0
#   A=-2 r=1.5 (above)          3.0 vs  2.4 ->  3.0  unclipped, d/dlp = -A r = 3.0
#   A=+1 r=0.5 (below)         -0.5 vs -0.8 -> -0.5  unclipped, d/dlp = -0.5
#   masked: r = e^50, A = 100
# loss = (-1.1 - 1.2 + 0.8 + 3.0 - 0.5) / 5 = 0.2; grad = [-1.1, 0, 0, 3.0, -0.5, 0] / 5
RATIOS = [1.1, 1.5, 0.5, 1.5, 0.5, math.exp(50)]
ADV = [1.0, 1.0, -1.0, -2.0, 1.0, 100.0]
MASK = [T, T, T, T, T, F]


def ppo_inputs(shape):
    old = t([-1.0] * 6)
    lp = (old + torch.log(t(RATIOS))).reshape(shape).requires_grad_()
    return lp, old.reshape(shape), t(ADV).reshape(shape), torch.tensor(MASK).reshape(shape)


@pytest.mark.parametrize("shape", [(6,), (2, 3)])  # action level [B], token level [B, T]
def test_ppo_policy_loss_by_hand(shape):
    lp, old, adv, mask = ppo_inputs(shape)
    loss, stats = ppo_policy_loss(lp, old, adv, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.2)
    loss.backward()
    assert lp.grad.reshape(-1).tolist() == pytest.approx([-0.22, 0.0, 0.0, 0.6, -0.1, 0.0])
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 1.5 + 0.5) / 5)  # 1.02
    # k3: (r - 1) - ln r = .1 - ln 1.1, .5 - ln 1.5 (twice), -.5 - ln .5 (twice)
    kl = (0.1 - math.log(1.1) + 2 * (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5))) / 5
    assert stats["approx_kl"] == pytest.approx(kl)  # ~0.11601
    assert all(isinstance(v, float) for v in stats.values())


def test_ppo_masked_positions_do_not_matter():
    lp, old, adv, mask = ppo_inputs((2, 3))
    loss, _ = ppo_policy_loss(lp, old, adv, mask)
    lp2 = lp.detach().clone()
    lp2[1, 2] = float("nan")
    adv2 = adv.clone()
    adv2[1, 2] = -1e6
    loss2, _ = ppo_policy_loss(lp2, old, adv2, mask)
    assert loss2.item() == pytest.approx(loss.item())
    # all-valid action level with mask None equals an all-true mask
    lp, old, adv, _ = ppo_inputs((6,))
    a, _ = ppo_policy_loss(lp[:5], old[:5], adv[:5], None)
    assert a.item() == pytest.approx(0.2)


def test_ppo_equal_policies():
    # ratio 1 everywhere: loss = -mean(A), nothing clipped, approx_kl 0
    lp = t([-1.0, -2.0, -3.0])
    loss, stats = ppo_policy_loss(lp, lp.clone(), t([1.0, 2.0, -6.0]), torch.tensor([T, T, T]))
    assert loss.item() == pytest.approx(1.0)
    assert stats == {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0}


def test_value_loss_by_hand():
    values, old, returns = t([1.0, 2.0, 0.9]), t([0.8, 1.0, 0.0]), t([1.5, 1.2, 1.0])
    # e0: V-old = .2 -> Vc = 1.0;  (1-1.5)^2 = .25,  (1-1.5)^2 = .25  -> .25
    # e1: V-old = 1 -> Vc = 1.2;   (2-1.2)^2 = .64,  (1.2-1.2)^2 = 0  -> .64
    # e2: V-old = .9 -> Vc = .2;   (.9-1)^2 = .01,   (.2-1)^2 = .64   -> .64 (the clipped term wins)
    assert value_loss(values, old, returns, None, clip=0.2).item() == pytest.approx(0.5 * 1.53 / 3)  # .255
    assert value_loss(values, old, returns, None, clip=None).item() == pytest.approx(0.5 * 0.9 / 3)  # .15
    mask = torch.tensor([T, T, F])
    assert value_loss(values, old, returns, mask, clip=0.2).item() == pytest.approx(0.5 * 0.89 / 2)  # .2225


def test_kl_penalty_k3():
    lp = t([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[T, T, F]])
    assert kl_penalty(lp, lp.clone(), mask).item() == 0.0
    # d = ref - lp = [0, .5]: e^0 - 0 - 1 = 0; e^.5 - .5 - 1 = .1487213; mean over 2 = .0743606
    ref = t([[-1.0, -1.5, 40.0]])  # the masked entry would be e^43
    assert kl_penalty(lp, ref, mask).item() == pytest.approx((math.exp(0.5) - 1.5) / 2)
    assert kl_penalty(lp, t([[-3.0, 0.0, -3.0]]), None).item() > 0  # non-negative either sign


def test_entropy_from_logits():
    # uniform over V = 7 -> log 7, whatever the constant
    logits = torch.full((2, 3, 7), 3.0, dtype=torch.bfloat16)
    mask = torch.tensor([[T, T, F], [T, F, F]])
    h = entropy_from_logits(logits, mask)
    assert h.dtype == torch.float32 and h.item() == pytest.approx(math.log(7), rel=1e-6)
    # p = [.25, .75] from logits [0, ln 3]: H = -(.25 ln .25 + .75 ln .75) = .5623351;
    # a peaked distribution at a masked position does not count
    logits = t([[[0.0, math.log(3)], [100.0, -100.0]]])
    assert entropy_from_logits(logits, torch.tensor([[T, F]])).item() == pytest.approx(0.5623351, rel=1e-6)
    assert entropy_from_logits(logits, None).item() == pytest.approx(0.5623351 / 2, rel=1e-5)


def test_decoupled_ppo_by_hand():
    """ratio pi/pi_prox = (1.1, 1.5, 0.5), weight pi_prox/mu = (2, 1, 10) capped at 5, A = (1, 1, -1),
    clip 0.2: the terms are 2 * -1.1, 1 * -1.2 (clipped) and 5 * 0.8 (clipped): loss = 0.6 / 3."""
    lp = torch.log(torch.tensor([1.1, 1.5, 0.5])).requires_grad_()
    prox = torch.zeros(3)
    behaviour = torch.log(torch.tensor([0.5, 1.0, 0.1]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, st = losses.decoupled_ppo_policy_loss(lp, prox, behaviour, adv, None, clip=0.2, max_weight=5.0)
    assert loss.item() == pytest.approx(0.2, abs=1e-6)
    assert st["clip_fraction"] == pytest.approx(2 / 3)
    assert st["importance_weight_mean"] == pytest.approx(13 / 3, rel=1e-6)
    assert st["capped_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    # only the unclipped first entry moves pi: d/dlp0 of (1/3) * 2 * (-1) * exp(lp0) = -(2/3) * 1.1
    assert lp.grad.tolist() == pytest.approx([-(2 / 3) * 1.1, 0.0, 0.0], abs=1e-6)


def test_decoupled_ppo_with_fresh_data_is_ppo_exactly():
    """mu = pi_prox (no staleness): weight 1, the loss, its gradient and stats are PPO's, bit for bit."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=g).requires_grad_()
    old = torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    a, st_a = losses.ppo_policy_loss(lp, old, adv, mask, 0.2)
    (ga,) = torch.autograd.grad(a, lp)
    b, st_b = losses.decoupled_ppo_policy_loss(lp, old, old, adv, mask, 0.2, max_weight=5.0)
    (gb,) = torch.autograd.grad(b, lp)
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert {k: st_b[k] for k in st_a} == st_a and st_b["importance_weight_mean"] == 1.0 and st_b["capped_fraction"] == 0.0


def test_decoupled_ppo_ignores_padding_and_stale_gradients():
    lp = torch.tensor([[0.1, 5.0]], requires_grad=True)
    prox = torch.tensor([[0.0, float("inf")]])
    behaviour = torch.tensor([[-0.2, float("-inf")]], requires_grad=True)
    mask = torch.tensor([[True, False]])
    loss, st = losses.decoupled_ppo_policy_loss(lp, prox, behaviour, torch.ones(1, 2), mask, 0.2, 5.0)
    assert torch.isfinite(loss) and st["importance_weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.2))))
    loss.backward()
    assert behaviour.grad is None or not behaviour.grad.any()  # the weight is a constant
    assert lp.grad[0, 1] == 0
