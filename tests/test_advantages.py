"""Credit assignment against hand-computed numbers (arithmetic in the comments)."""
import pytest
import torch

from marft.maths.advantages import (agent_group_advantages, credit_rewards, fold_skipped, from_token_layout, gae,
                              group_advantages, ippo_gae, micro_discounts, micro_layout, normalize, to_token_layout, token_layout,
                              turn_group_advantages, valid_steps)

T, F = True, False


def t(x, **kw):
    return torch.tensor(x, dtype=kw.pop("dtype", torch.float64), **kw)


# ---------------------------------------------------------------- layouts

def test_credit_rewards_last_and_equal():
    r = t([[1.0, 2.0]])  # E=1, H=2, N=2 -> micro-steps (0,0) (0,1) (1,0) (1,1)
    assert credit_rewards(r, 2, "last").tolist() == [[0.0, 1.0, 0.0, 2.0]]
    assert credit_rewards(r, 2, "equal").tolist() == [[0.5, 0.5, 1.0, 1.0]]
    # N=3, one step, r=3: last -> [0, 0, 3]; equal -> [1, 1, 1]
    assert credit_rewards(t([[3.0]]), 3, "last").tolist() == [[0.0, 0.0, 3.0]]
    assert credit_rewards(t([[3.0]]), 3, "equal").tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(ValueError):
        credit_rewards(r, 2, "first")


def test_micro_discounts():
    # H=2, N=3: agent_gamma between agents of a step, gamma after the last agent of each step
    assert micro_discounts(2, 3, 0.9, 0.5).tolist() == pytest.approx([0.5, 0.5, 0.9, 0.5, 0.5, 0.9])
    assert micro_discounts(1, 1, 0.9, 0.5).tolist() == pytest.approx([0.9])


def test_micro_layout_and_valid_steps():
    dones = torch.tensor([[F, T], [T, F]])  # row 1 ended after step 0 of a horizon-2 rollout
    assert valid_steps(dones).tolist() == [[T, T], [T, F]]
    r, g, d, m = micro_layout(t([[1.0, 2.0], [1.0, 0.0]]), dones, 2, 0.9, 1.0, "last")
    assert r.tolist() == [[0, 1, 0, 2], [0, 1, 0, 0]]
    assert torch.allclose(g, t([[1.0, 0.9, 1.0, 0.9]] * 2))
    assert d.tolist() == [[F, F, F, T], [F, T, F, F]]
    assert m.tolist() == [[T, T, T, T], [T, T, F, F]]


# ---------------------------------------------------------------- action-level GAE by hand

def two_agent_episode(agent_gamma, lam):
    """N=2, H=2, gamma=0.9, credit last, team rewards r_0=1, r_1=2, values V_k = [.5, .6, .7, .8]."""
    r, g, d, m = micro_layout(t([[1.0, 2.0]]), torch.tensor([[F, T]]), 2, 0.9, agent_gamma, "last")
    return gae(r, t([[0.5, 0.6, 0.7, 0.8]]), g, d, m, lam)


def test_gae_two_agents_agent_gamma_1():
    # rewards [0, 1, 0, 2], discounts [1, .9, 1, .9], done at k=3
    adv, ret = two_agent_episode(1.0, 0.95)
    # k=3: delta = 2 - .8 = 1.2                      A3 = 1.2
    # k=2: delta = 0 + 1*.8 - .7 = .1                 A2 = .1 + 1*.95*1.2 = 1.24
    # k=1: delta = 1 + .9*.7 - .6 = 1.03 (V of the FIRST agent at step 1)
    #                                                 A1 = 1.03 + .9*.95*1.24 = 2.0902
    # k=0: delta = 0 + 1*.6 - .5 = .1                 A0 = .1 + 1*.95*2.0902 = 2.08569
    assert torch.allclose(adv, t([[2.08569, 2.0902, 1.24, 1.2]]))
    assert torch.allclose(ret, t([[2.58569, 2.6902, 1.94, 2.0]]))  # A + V
    # lam = 1: returns are the discounted team returns: R3 = R2 = 2, R1 = R0 = 1 + .9*2 = 2.8
    adv, ret = two_agent_episode(1.0, 1.0)
    assert torch.allclose(ret, t([[2.8, 2.8, 2.0, 2.0]]))
    assert torch.allclose(adv, t([[2.3, 2.2, 1.3, 1.2]]))
    # lam = 0: A1 is the one-step TD error, bootstrapped from V at k=2 (agent 0, step 1) = .7
    adv, _ = two_agent_episode(1.0, 0.0)
    assert torch.allclose(adv, t([[0.1, 1.03, 0.1, 1.2]]))


def test_gae_two_agents_agent_gamma_half():
    # discounts [.5, .9, .5, .9], lam = 1
    adv, ret = two_agent_episode(0.5, 1.0)
    # k=3: delta = 2 - .8 = 1.2,             A3 = 1.2,               R3 = 2
    # k=2: delta = .5*.8 - .7 = -.3,         A2 = -.3 + .5*1.2 = .3, R2 = 1.0  (= .5*2)
    # k=1: delta = 1 + .9*.7 - .6 = 1.03,    A1 = 1.03 + .9*.3 = 1.3, R1 = 1.9 (= 1 + .9*1)
    # k=0: delta = .5*.6 - .5 = -.2,         A0 = -.2 + .5*1.3 = .45, R0 = .95 (= .5*1.9)
    assert torch.allclose(adv, t([[0.45, 1.3, 0.3, 1.2]]))
    assert torch.allclose(ret, t([[0.95, 1.9, 1.0, 2.0]]))


def test_gae_episode_ending_early_nothing_leaks_from_padding():
    # row 0 the full episode above; row 1 ends after step 0: r_0 = 1, a reward 7 and nan values in padding
    r, g, d, m = micro_layout(t([[1.0, 2.0], [1.0, 7.0]]), torch.tensor([[F, T], [T, F]]), 2, 0.9, 1.0)
    values = t([[0.5, 0.6, 0.7, 0.8], [0.5, 0.6, float("nan"), 100.0]])
    adv, ret = gae(r, values, g, d, m, 0.95)
    # row 1: k=1 done: delta = 1 - .6 = .4 = A1, R1 = 1;  k=0: delta = .6 - .5 = .1, A0 = .1 + .95*.4 = .48
    assert torch.allclose(adv[1], t([0.48, 0.4, 0.0, 0.0]))
    assert torch.allclose(ret[1], t([0.98, 1.0, 0.0, 0.0]))
    assert torch.allclose(adv[0], t([2.08569, 2.0902, 1.24, 1.2]))  # row 0 unaffected by row 1


def test_gae_truncated_bootstraps_from_last_values():
    # one position, not done, discount .9: delta = 1 + .9*2 - .5 = 2.3; without last_values: 1 - .5
    args = t([[1.0]]), t([[0.5]]), t([[0.9]]), torch.tensor([[F]]), torch.tensor([[T]]), 0.95
    assert gae(*args, last_values=t([2.0]))[0].item() == pytest.approx(2.3)
    assert gae(*args)[0].item() == pytest.approx(0.5)
    # padded row, last valid position not done: bootstraps from last_values too
    adv, _ = gae(t([[1.0, 5.0]]), t([[0.5, 9.0]]), t([[0.9, 0.9]]), torch.tensor([[F, F]]),
                 torch.tensor([[T, F]]), 0.95, last_values=t([2.0]))
    assert adv[0].tolist() == pytest.approx([2.3, 0.0])


def test_gae_done_mid_row_cuts_value_and_advantage():
    # two one-position episodes back to back in one row, discount .9, lam .95, V = [.5, .6]
    # k=1: A = 2 - .6 = 1.4;  k=0 is done: A = 1 - .5 = .5 (no .9*.6 bootstrap, no .9*.95*1.4 carry)
    adv, ret = gae(t([[1.0, 2.0]]), t([[0.5, 0.6]]), t([[0.9, 0.9]]), torch.tensor([[T, T]]),
                   torch.tensor([[T, T]]), 0.95)
    assert adv[0].tolist() == pytest.approx([0.5, 1.4])
    assert ret[0].tolist() == pytest.approx([1.0, 2.0])


def test_gae_passes_over_holes_as_if_they_were_not_there():
    # a row with holes (mask False inside it) gives what the row without them gives
    gen = torch.Generator().manual_seed(3)
    B, L = 6, 7
    mask = torch.rand(B, L, generator=gen) < 0.6
    mask[:, 0] = True
    r, v, g = (torch.randn(B, L, generator=gen, dtype=torch.float64) for _ in range(3))
    d = torch.rand(B, L, generator=gen) < 0.2
    adv, ret = gae(r, v, g, d, mask, 0.9)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    for b in range(B):
        keep = mask[b]
        a2, r2 = gae(r[b, keep][None], v[b, keep][None], g[b, keep][None], d[b, keep][None],
                     torch.ones(1, int(keep.sum()), dtype=torch.bool), 0.9)
        assert torch.allclose(adv[b, keep], a2[0]) and torch.allclose(ret[b, keep], r2[0])


def test_fold_skipped_by_hand():
    # positions 0..4; kept 0, 2, 4 (1 and 3 skipped); rewards [1, 2, 3, 4, 5], discounts [.5, .9, .8, .7, .6]
    r, g = t([[1.0, 2.0, 3.0, 4.0, 5.0]]), t([[0.5, 0.9, 0.8, 0.7, 0.6]])
    kept = torch.tensor([[T, F, T, F, T]])
    fr, fg, fd = fold_skipped(r, g, torch.tensor([[F, F, F, F, T]]), kept)
    # 0: 1 + .5*2 = 2, discount .5*.9 = .45;  2: 3 + .8*4 = 6.2, discount .8*.7 = .56;  4 as it was
    assert torch.allclose(fr, t([[2.0, 0.0, 6.2, 0.0, 5.0]]))
    assert torch.allclose(fg, t([[0.45, 0.0, 0.56, 0.0, 0.6]]))
    assert fd.tolist() == [[F, F, F, F, T]]
    # a done on a skipped position lands on the kept one before it, and nothing after the done is added
    fr, fg, fd = fold_skipped(r, g, torch.tensor([[F, F, F, T, F]]), torch.tensor([[T, F, T, F, F]]))
    assert fd.tolist() == [[F, F, T, F, F]]
    assert torch.allclose(fr, t([[2.0, 0.0, 6.2, 0.0, 0.0]]))  # 2: 3 + .8*4, not + .8*.7*5


def test_agent_program_skipping_an_agent():
    # an agent program calls the planner at step 0 only, then planner and solver at step 1 (H=2, N=2):
    # acted [[planner, -], [planner, solver]]; r = (0, 1); values (.5, -, .7, .8) (9 where nobody acted)
    acted = torch.tensor([[[T, F], [T, T]]])
    r, g, d, m = micro_layout(t([[0.0, 1.0]]), torch.tensor([[F, T]]), 2, 1.0, 1.0, "last", acted)
    assert m.tolist() == [[T, F, T, T]]
    adv, ret = gae(r, t([[0.5, 9.0, 0.7, 0.8]]), g, d, m, 0.5)
    # k=3: 1 - .8 = .2;  k=2: .8 - .7 + .5*.2 = .2;  k=0 bootstraps from k=2 (not the empty k=1):
    # .7 - .5 + .5*.2 = .3
    assert torch.allclose(adv, t([[0.3, 0.0, 0.2, 0.2]]))
    # credit equal: step 1's reward split between the two that acted; the solver's return at lam=1 is its .5
    r, g, d, m = micro_layout(t([[0.0, 1.0]]), torch.tensor([[F, T]]), 2, 1.0, 1.0, "equal", acted)
    assert r.tolist() == [[0.0, 0.0, 0.5, 0.5]]
    # the solver alone at step 1 gets the whole reward under "equal" (before: half of it on an empty micro-step)
    alone = torch.tensor([[[T, T], [F, T]]])
    r, g, d, m = micro_layout(t([[0.0, 1.0]]), torch.tensor([[F, T]]), 2, 1.0, 1.0, "equal", alone)
    assert r.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    _, ret = gae(r, t([[0.5, 0.6, 0.0, 0.8]]), g, d, m, 1.0)
    assert ret[0, 3].item() == pytest.approx(1.0)
    # "last" with the last agent skipped at a step: its reward goes to the agent that acted last
    assert credit_rewards(t([[1.0, 2.0]]), 2, "last", torch.tensor([[[T, F], [T, T]]])).tolist() == [[1, 0, 0, 2]]
    # agent_gamma .5, gamma .9: the planner, the last agent that acted at step 0, reaches the first of
    # step 1: gamma .9 (the empty solver micro-step is no transition: not .5 * .9)
    _, g, _, _ = micro_layout(t([[0.0, 1.0]]), torch.tensor([[F, T]]), 2, 0.9, 0.5, "last", acted)
    assert g[0, 0].item() == pytest.approx(0.9)


def test_discounts_between_the_agents_that_acted():
    """Three agents, agent_gamma .5, gamma .9. Step 0: agents 0 and 2 acted (1 skipped); step 1:
    agents 0 and 1 (2 skipped), then the episode ended. Between agents of one step agent_gamma once
    (0 -> 2: .5, not .25); from a step's last acting agent to the next step's first gamma (2 -> 0:
    .9; at step 1 agent 1 is the last and the done lands on it)."""
    acted = torch.tensor([[[T, F, T], [T, T, F]]])
    r, g, d, m = micro_layout(t([[1.0, 2.0]]), torch.tensor([[F, T]]), 3, 0.9, 0.5, "last", acted)
    assert m.tolist() == [[T, F, T, T, T, F]]
    assert torch.allclose(g[0, [0, 2, 3]], t([0.5, 0.9, 0.5]))
    assert d.tolist() == [[F, F, F, F, T, F]] and r.tolist() == [[0.0, 0.0, 1.0, 0.0, 2.0, 0.0]]
    # values (.1, -, .2, .3, .4): lam 1: A4 = 2 - .4 = 1.6; A3 = .5 * .4 - .3 + .5 * 1.6 = .7;
    # A2 = 1 + .9 * .3 - .2 + .9 * .7 = 1.7; A0 = .5 * .2 - .1 + .5 * 1.7 = .85
    adv, _ = gae(r, t([[0.1, 9.0, 0.2, 0.3, 0.4, 9.0]]), g, d, m, 1.0)
    assert torch.allclose(adv, t([[0.85, 0.0, 1.7, 0.7, 1.6, 0.0]]))
    # nobody skipped: the discounts of micro_discounts, unchanged
    every = torch.ones(1, 2, 3, dtype=torch.bool)
    _, g, _, _ = micro_layout(t([[1.0, 2.0]]), torch.tensor([[F, T]]), 3, 0.9, 0.5, "last", every)
    assert torch.equal(g[0], micro_discounts(2, 3, 0.9, 0.5).to(g))


# ---------------------------------------------------------------- token level

def test_token_layout_by_hand():
    lengths = torch.tensor([[2, 1], [1, 0]])  # row 1: its second action did not happen
    rewards = t([[0.0, 1.0], [3.0, 0.0]])
    discounts = t([[0.5, 0.9], [0.9, 0.5]])
    dones = torch.tensor([[F, T], [T, F]])
    r, g, d, m, first = token_layout(lengths, rewards, discounts, dones, gamma_token=0.8)
    # row 0 tokens: a0.0 a0.1 a1.0 -> reward at each action's last token, g_k there, .8 inside
    assert r.tolist() == [[0, 0, 1], [3, 0, 0]]
    assert torch.allclose(g, t([[0.8, 0.5, 0.9], [0.9, 0.0, 0.0]]))
    assert d.tolist() == [[F, F, T], [T, F, F]]
    assert m.tolist() == [[T, T, T], [T, F, F]]
    assert first.tolist() == [[0, 2], [0, 1]]
    # GAE on row 0, V = [1, 2, 3], lam = 1:
    # k=2: delta = 1 - 3 = -2                A = -2,                 R = 1
    # k=1: delta = .5*3 - 2 = -.5            A = -.5 + .5*-2 = -1.5, R = .5
    # k=0: delta = .8*2 - 1 = .6             A = .6 + .8*-1.5 = -.6, R = .4  (= .8*.5*1)
    adv, ret = gae(r, t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]]), g, d, m, 1.0)
    assert torch.allclose(adv[0], t([-0.6, -1.5, -2.0]))
    assert torch.allclose(ret, t([[0.4, 0.5, 1.0], [3.0, 0.0, 0.0]]))
    with pytest.raises(ValueError):  # a reward on an action that did not happen would be lost
        token_layout(lengths, t([[0.0, 1.0], [3.0, 1.0]]), discounts, dones, 0.8)


def test_token_layout_round_trip():
    lengths = torch.tensor([[2, 1], [1, 0]])
    *_, m, first = token_layout(lengths, torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool), 1.0)
    x = t([[[1, 2, 0], [3, 0, 0]], [[4, 0, 0], [0, 0, 0]]])  # [E, K, T] right-padded
    y = to_token_layout(x, lengths, first, m.shape[1])
    assert y.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert from_token_layout(y, lengths, first, 3).tolist() == x.tolist()


def random_batch(gen, E=5, H=3, N=2):
    """Episodes of 1..H steps; each action 1..4 tokens; random rewards, values."""
    steps = torch.randint(1, H + 1, (E,), generator=gen)
    steps[0] = H  # at least one full-length and one short episode
    steps[1] = 1
    dones = torch.zeros(E, H, dtype=torch.bool)
    dones[torch.arange(E), steps - 1] = True
    step_rewards = torch.randn(E, H, generator=gen, dtype=torch.float64) * valid_steps(dones)
    lengths = torch.randint(1, 5, (E, H * N), generator=gen)
    return step_rewards, dones, lengths


@pytest.mark.parametrize("skipping", [False, True])
@pytest.mark.parametrize("gamma,agent_gamma,credit", [(1.0, 1.0, "last"), (0.9, 0.7, "last"), (0.8, 1.0, "equal")])
def test_token_return_at_first_token_equals_action_return(gamma, agent_gamma, credit, skipping):
    gen = torch.Generator().manual_seed(0)
    N = 2
    step_rewards, dones, lengths = random_batch(gen, N=N)
    # skipping: an agent program that calls only some agents at a step (at least one each step)
    acted = None
    if skipping:
        acted = torch.rand(dones.shape + (N,), generator=gen) < 0.6
        acted[..., 1] |= ~acted[..., 0]
        assert not acted.all()
    r, g, d, m = micro_layout(step_rewards, dones, N, gamma, agent_gamma, credit, acted)
    lengths = lengths * m  # actions of steps that did not happen have 0 tokens
    tr, tg, td, tm, first = token_layout(lengths, r, g, d, gamma_token=1.0)
    assert len(set(tm.sum(1).tolist())) > 1  # episodes of different token lengths

    def returns(lam):
        action_values = torch.randn(m.shape, generator=gen, dtype=torch.float64)
        token_values = torch.randn(tm.shape, generator=gen, dtype=torch.float64)
        _, action_ret = gae(r, action_values, g, d, m, lam)
        _, token_ret = gae(tr, token_values, tg, td, tm, lam)
        return action_ret[m], token_ret.gather(1, first)[m]

    a, b = returns(1.0)
    assert torch.allclose(a, b)
    # not vacuous: with lam < 1 the returns depend on the (different) values, and the property fails
    a, b = returns(0.9)
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------- IPPO

def test_ippo_by_hand():
    # team rewards r = [1, 2], gamma .9, lam .95; agent 0 values [.5, .7], agent 1 values [.6, .8]
    values = t([[[0.5, 0.6], [0.7, 0.8]]])  # [E=1, H=2, N=2]
    adv, ret = ippo_gae(t([[1.0, 2.0]]), values, torch.tensor([[T, T]]), 0.9, 0.95)
    # agent 0: t1: 2 - .7 = 1.3;  t0: delta = 1 + .9*.7 - .5 = 1.13, A = 1.13 + .9*.95*1.3 = 2.2415
    # agent 1: t1: 2 - .8 = 1.2;  t0: delta = 1 + .9*.8 - .6 = 1.12, A = 1.12 + .855*1.2 = 2.146
    assert torch.allclose(adv, t([[[2.2415, 2.146], [1.3, 1.2]]]))
    assert torch.allclose(ret, adv + values)
    # the episode ends after step 0: terminal there, agent 0: A = 1 - .5
    adv, _ = ippo_gae(t([[1.0, 2.0]]), values, torch.tensor([[T, F]]), 0.9, 0.95)
    assert torch.allclose(adv, t([[[0.5, 0.4], [0.0, 0.0]]]))


def test_ippo_agent_that_skips_a_step():
    # the planner acts at step 0 only, the solver at steps 0 and 1; team rewards r = (1, 2), gamma .9
    values = t([[[0.5, 0.6], [9.0, 0.8]]])  # [E=1, H=2, N=2]; 9: the planner did not act at step 1
    acted = torch.tensor([[[T, T], [F, T]]])
    adv, ret = ippo_gae(t([[1.0, 2.0]]), values, torch.tensor([[T, T]]), 0.9, 0.95, acted)
    # planner: one transition to the episode's end with reward 1 + .9*2 = 2.8: A = 2.8 - .5 = 2.3
    # solver as without skipping: t1: 2 - .8 = 1.2; t0: 1 + .9*.8 - .6 + .9*.95*1.2 = 2.146
    assert torch.allclose(adv, t([[[2.3, 2.146], [0.0, 1.2]]]))
    assert torch.allclose(ret[0, 0], t([2.8, 2.746]))


def test_ippo_agents_do_not_share_values():
    gen = torch.Generator().manual_seed(1)
    E, H, N = 4, 3, 3
    rewards = torch.randn(E, H, generator=gen)
    values = torch.randn(E, H, N, generator=gen)
    mask = torch.tensor([[T, T, T], [T, T, F], [T, F, F], [T, T, T]])
    adv, _ = ippo_gae(rewards, values, mask, 0.9, 0.95)
    changed = values.clone()
    changed[..., 1] += torch.randn(E, H, generator=gen)
    adv2, _ = ippo_gae(rewards, changed, mask, 0.9, 0.95)
    assert torch.equal(adv[..., 0], adv2[..., 0]) and torch.equal(adv[..., 2], adv2[..., 2])
    assert not torch.allclose(adv[..., 1], adv2[..., 1])


# ---------------------------------------------------------------- group baselines, normalisation

def test_group_advantages_grpo_and_rloo():
    returns = t([1.0, 4.0, 2.0, 5.0, 6.0, 3.0, 8.0])
    groups = torch.tensor([7, 3, 7, 2, 3, 7, 9])  # group 7 = [1, 2, 3]; 3 = [4, 6]; 2 and 9 alone
    # grpo: group 7 mean 2, sample std sqrt((1 + 0 + 1) / 2) = 1 -> -1, 0, 1
    #       group 3 mean 5, sample std sqrt((1 + 1) / 1) = sqrt 2 -> -1/sqrt2, +1/sqrt2; singles 0
    s = 2 ** -0.5
    assert torch.allclose(group_advantages(returns, groups, "grpo"), t([-1, -s, 0, 0, s, 1, 0]), atol=1e-5)
    # rloo: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5; 4 - 6 = -2, 6 - 4 = 2; singles 0
    assert torch.allclose(group_advantages(returns, groups, "rloo"), t([-1.5, -2, 0, 0, 2, 1.5, 0]))
    # grpo agrees with TRL's reshape-and-std on equal groups
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    ref = (x - x.mean(1, keepdim=True)) / (x.std(1, keepdim=True) + 1e-6)
    assert torch.allclose(group_advantages(x.reshape(-1), torch.arange(3).repeat_interleave(4)), ref.reshape(-1))


def test_dr_mas_normalises_per_agent_not_over_the_team():
    # 2 agents (planner, solver), one step; group 0 = episodes 0, 1; group 1 = episodes 2, 3
    returns = t([[1.0, 1.0], [0.0, 0.5],    # group 0: planner [1, 0], solver [1, 0.5]
                 [0.5, 0.5], [0.5, 0.5]])   # group 1: every reward the same
    acted = torch.ones(4, 1, 2, dtype=torch.bool)
    adv = agent_group_advantages(returns, acted, torch.tensor([0, 0, 1, 1]))
    # planner: mean 0.5, sample std sqrt((0.25 + 0.25) / 1) = 0.70711 -> +-0.70711
    # solver:  mean 0.75, sample std sqrt((0.0625 + 0.0625) / 1) = 0.35355 -> +-0.70711
    s = 2 ** -0.5
    assert torch.allclose(adv, t([[s, s], [-s, -s], [0, 0], [0, 0]]), atol=1e-5)
    # normalised over the team instead (all four samples of group 0 pooled, [1, 1, 0, 0.5]):
    # mean 0.625, sample std sqrt((0.140625 * 2 + 0.390625 + 0.015625) / 3) = 0.47871
    pooled = group_advantages(t([1.0, 1.0, 0.0, 0.5]), torch.zeros(4, dtype=torch.long))
    assert torch.allclose(pooled, t([0.78335, 0.78335, -1.30558, -0.26112]), atol=1e-5)
    assert not torch.allclose(adv[:2].flatten(), pooled, atol=0.1)  # the solver's 0.5: -0.707, not -0.261


def test_dr_mas_counts_every_turn_of_the_agent():
    # one group of 2 episodes, horizon 2, team reward: episode 0 solved at step 0 (return 1, one
    # turn per agent), episode 1 failed twice (return 0, two turns per agent); agent 1 did not act
    # in episode 1 at all (say), and a second group holds one episode
    returns = t([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
    acted = torch.tensor([[[T, T], [F, F]], [[T, F], [T, F]], [[T, T], [F, F]]])
    adv = agent_group_advantages(returns, acted, torch.tensor([0, 0, 1]))
    # agent 0's samples in group 0: [1, 0, 0] (episode 1 twice): mean 1/3,
    # sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.57735 -> 1.15470, -0.57735
    # agent 1: one sample in group 0 -> 0, no turn in episode 1 -> 0; group 1: one episode -> 0
    assert torch.allclose(adv, t([[1.15470, 0.0], [-0.57735, 0.0], [0.0, 0.0]]), atol=1e-5)
    # per episode (grpo) the same group gives +-0.70711: Dr. MAS weighs an episode by its turns
    assert torch.allclose(group_advantages(t([1.0, 0.0]), torch.tensor([0, 0])), t([2 ** -0.5, -(2 ** -0.5)]), atol=1e-5)


def test_at_grpo_groups_by_problem_agent_and_turn():
    # group 0: 4 episodes of a duo, horizon 2, the team reward for both agents:
    #   episode 0 right at step 0; 1 wrong then right; 2 wrong twice; 3 wrong then right
    # group 1: 2 episodes, one step, each agent its own reward: planner [1, 0], solver [0, 0]
    r = torch.zeros(6, 2, 2, dtype=torch.float64)
    r[0, 0] = 1.0
    r[1, 1] = 1.0
    r[3, 1] = 1.0
    r[4, 0, 0] = 1.0
    acted = torch.zeros(6, 2, 2, dtype=torch.bool)
    acted[:, 0] = True
    acted[1:4, 1] = True
    adv = turn_group_advantages(r, acted, torch.tensor([0, 0, 0, 0, 1, 1]))
    # step 0 of group 0: [1, 0, 0, 0], mean 0.25, sample std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    #   -> 1.5, -0.5, -0.5, -0.5 (for each agent)
    # step 1 of group 0 (episodes 1-3): [1, 0, 1], mean 2/3, sample std sqrt(1/3) = 0.57735
    #   -> 0.57735, -1.15470, 0.57735; episode 0 has no step 1 -> 0
    # group 1, planner: [1, 0] -> +-0.70711; solver: [0, 0] -> 0, 0
    s = 2 ** -0.5
    expected = t([[[1.5, 1.5], [0.0, 0.0]],
                  [[-0.5, -0.5], [0.57735, 0.57735]],
                  [[-0.5, -0.5], [-1.15470, -1.15470]],
                  [[-0.5, -0.5], [0.57735, 0.57735]],
                  [[s, 0.0], [0.0, 0.0]],
                  [[-s, 0.0], [0.0, 0.0]]])
    assert torch.allclose(adv, expected, atol=1e-5)
    # episode-wise (grpo on the returns [1, 1, 0, 1]: mean 0.75, sample std 0.5) credits episode
    # 1's failed first attempt with +0.5; turn-wise grouping gives it -0.5
    grpo = group_advantages(r[:4, :, 0].sum(1), torch.zeros(4, dtype=torch.long))
    assert torch.allclose(grpo, t([0.5, 0.5, -1.5, 0.5]), atol=1e-5)
    assert grpo[1] > 0 > adv[1, 0, 0]


def test_normalize():
    # valid [1, 2, 3]: mean 2, sample std 1; the masked 100 is ignored and returned as 0
    out = normalize(t([1.0, 2.0, 3.0, 100.0]), torch.tensor([T, T, T, F]))
    assert torch.allclose(out, t([-1.0, 0.0, 1.0, 0.0]))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    mask = torch.rand(4, 6, generator=torch.Generator().manual_seed(4)) > 0.3
    y = normalize(x, mask)[mask]
    assert y.mean().abs() < 1e-6 and (y.std() - 1).abs() < 1e-6


def test_one_step_team_reward_makes_the_group_baselines_coincide():
    """On a one-step task whose reward is the team's (every agent gets it), AT-GRPO's groups
    (problem, agent, step) and Dr. MAS's per-agent statistics both reduce to GRPO's group of one
    problem: the same advantage for every agent. So on such a task they can only differ from
    ``grpo`` by the whitening (per agent for dr-mas), which is why RESULTS.md's cooperative
    comparison does not run them."""
    from marft.maths.advantages import agent_group_advantages, group_advantages, turn_group_advantages

    team = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])  # 8 episodes, groups of 4
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    acted = torch.ones(8, 1, 3, dtype=torch.bool)  # one step, three agents
    grpo = group_advantages(team, groups)
    per_agent = team[:, None].expand(8, 3)
    assert torch.allclose(agent_group_advantages(per_agent, acted, groups), grpo[:, None].expand(8, 3).to(per_agent.dtype))
    at = turn_group_advantages(per_agent[:, None, :], acted, groups)
    assert torch.allclose(at.reshape(8, 3), grpo[:, None].expand(8, 3).to(per_agent.dtype))
