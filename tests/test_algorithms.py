"""The algorithm objects (marft.maths.algorithms): what each one says it is, and the per-agent whitening of
dr-mas against hand-computed numbers."""
from types import SimpleNamespace

import torch

from marft.maths.algorithms import ALGORITHMS


def test_each_algorithm_says_what_it_is():
    kinds = {name: (a.critic, a.token_level, a.grouped, a.whiten) for name, a in ALGORITHMS.items()}
    assert kinds == {"marft": ("team", False, False, "batch"), "marft-token": ("team", True, False, "batch"),
                     "ippo": ("agent", False, False, "batch"), "grpo": (None, False, True, "episode"),
                     "dr-mas": (None, False, True, "agent"), "at-grpo": (None, False, True, "batch")}
    assert list(ALGORITHMS["ippo"].make_heads(["planner", "solver"], 8)) == ["planner", "solver"]
    assert list(ALGORITHMS["marft"].make_heads(["planner", "solver"], 8)) == ["team"]
    assert ALGORITHMS["at-grpo"].make_heads(["planner", "solver"], 8) == {}


def turns(*agents):
    return SimpleNamespace(turns=[SimpleNamespace(agent=a) for a in agents])


def test_whitening_per_agent_or_over_the_batch():
    out = turns("planner", "solver", "planner")  # steps 0 and 1 of a duo, the solver ended at step 0
    advs = [torch.tensor([1.0, 3.0]), torch.tensor([10.0, 30.0]), torch.tensor([5.0])]
    # per agent: planner [1, 3, 5]: mean 3, sample std 2 -> -1, 0, 1;
    #            solver [10, 30]: mean 20, sample std sqrt(200) -> -0.70711, 0.70711
    per_agent = ALGORITHMS["dr-mas"].normalise(out, advs)
    expected = [[-1.0, 0.0], [-0.70711, 0.70711], [1.0]]
    assert all(torch.allclose(a, torch.tensor(e), atol=1e-5) for a, e in zip(per_agent, expected))
    # over the batch: [1, 3, 10, 30, 5]: mean 9.8, deviations -8.8, -6.8, 0.2, 20.2, -4.8,
    # sample std sqrt((77.44 + 46.24 + 0.04 + 408.04 + 23.04) / 4) = sqrt(138.7) = 11.77710
    batch = ALGORITHMS["at-grpo"].normalise(out, advs)
    expected = [[-0.74721, -0.57739], [0.01698, 1.71519], [-0.40757]]
    assert all(torch.allclose(a, torch.tensor(e), atol=1e-5) for a, e in zip(batch, expected))


def test_grpo_whitens_with_one_turn_per_episode():
    """grpo's advantage is its episode's for every turn; whitened with statistics over turns, an
    episode that ended early would weigh less and the mean would move every advantage. Groups of
    2, one agent: group 0 solved in one step (+1/sqrt2) and failed in two (-1/sqrt2); group 1 failed
    twice (0, 0). Over turns [.707, -.707, 0, 0, -.707, 0, 0] the mean is -0.101: group 1's failures
    would get +0.207. Over episodes [.707, -.707, 0, 0]: mean 0, sample std sqrt(1/3)."""
    a = 2 ** -0.5
    out = SimpleNamespace(turns=[SimpleNamespace(agent="solver", step=0, episodes=torch.tensor([0, 1, 2, 3])),
                                 SimpleNamespace(agent="solver", step=1, episodes=torch.tensor([1, 2, 3]))])
    advs = [torch.tensor([a, -a, 0.0, 0.0]), torch.tensor([-a, 0.0, 0.0])]
    got = ALGORITHMS["grpo"].normalise(out, advs)
    r = a / (1 / 3) ** 0.5  # 1.22474
    assert torch.allclose(got[0], torch.tensor([r, -r, 0.0, 0.0]), atol=1e-5)
    assert torch.allclose(got[1], torch.tensor([-r, 0.0, 0.0]), atol=1e-5)
    shifted = ALGORITHMS["at-grpo"].normalise(out, advs)  # what statistics over turns would give
    assert shifted[1][1] > 0.2
    # two agents, one turn each per episode (a horizon of one): the same numbers as over the batch
    duo = SimpleNamespace(turns=[SimpleNamespace(agent=x, step=0, episodes=torch.tensor([0, 1, 2])) for x in ("p", "s")])
    advs = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([1.0, -2.0, 0.5])]
    assert all(torch.equal(x, y) for x, y in zip(ALGORITHMS["grpo"].normalise(duo, advs), ALGORITHMS["at-grpo"].normalise(duo, advs)))


def test_targets_of_an_agent_program_that_skips_an_agent(monkeypatch):
    # planner at step 0, then planner and solver at step 1 (an agent program's call order; the solver did
    # not act at step 0): marft's and ippo's targets treat the empty micro-step as not there
    import marft.maths.algorithms as alg
    values = {(0, "planner"): 0.5, (1, "planner"): 0.7, (1, "solver"): 0.8}
    feature = lambda models, agent, rows, work=None: rows  # noqa: E731  (a row's value is its feature)
    monkeypatch.setattr(alg, "state_features", feature)
    monkeypatch.setattr(alg, "prompt_features", lambda models, agent, ids, mask, work=None: ids)
    turn = lambda step, agent: SimpleNamespace(step=step, agent=agent, episodes=torch.tensor([0]),  # noqa: E731
                                               states=torch.tensor([values[(step, agent)]]),
                                               prompt_ids=torch.tensor([values[(step, agent)]]), prompt_mask=None)
    out = SimpleNamespace(turns=[turn(0, "planner"), turn(1, "planner"), turn(1, "solver")],
                          rewards=torch.tensor([[0.0, 1.0]]), dones=torch.tensor([[False, True]]))
    train = SimpleNamespace(gamma=1.0, agent_gamma=1.0, credit="last", lam=0.5)
    head = lambda f: f  # noqa: E731
    inp = alg.TargetInputs(train, ["planner", "solver"], None, {"team": head, "planner": head, "solver": head}, None)
    # micro-steps 0, 2, 3 (1 empty): A3 = 1 - .8 = .2; A2 = .8 - .7 + .5*.2 = .2; A0 = .7 - .5 + .5*.2 = .3
    got = [round(x.advantages.item(), 6) for x in alg.action_gae(inp, out)]
    assert got == [0.3, 0.2, 0.2]
    # ippo: the planner's steps 0 and 1: A1 = 1 - .7 = .3, A0 = .7 - .5 + .5*.3 = .35; the solver's step 1: .2
    got = [round(x.advantages.item(), 6) for x in alg.ippo_targets(inp, out)]
    assert got == [0.35, 0.3, 0.2]
    # planner, solver, solver: the planner's only step reaches the episode's end (reward 1): A = 1 - .5 = .5
    # (not 0 - .5 + .5 * (1 - 0) = 0 from a step it did not take); the solver: A1 = .2, A0 = .8 - .6 + .5*.2 = .3
    values.update({(0, "solver"): 0.6})
    out.turns = [turn(0, "planner"), turn(0, "solver"), turn(1, "solver")]
    got = [round(x.advantages.item(), 6) for x in alg.ippo_targets(inp, out)]
    assert got == [0.5, 0.3, 0.2]
