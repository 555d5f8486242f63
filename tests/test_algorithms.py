"""The algorithm objects (marft.algorithms): what each one says it is, and the per-agent whitening of
dr-mas against hand-computed numbers."""
from types import SimpleNamespace

import torch

from marft.algorithms import ALGORITHMS


def test_each_algorithm_says_what_it_is():
    kinds = {name: (a.critic, a.token_level, a.grouped, a.whiten) for name, a in ALGORITHMS.items()}
    assert kinds == {"marft": ("team", False, False, "batch"), "marft-token": ("team", True, False, "batch"),
                     "ippo": ("agent", False, False, "batch"), "grpo": (None, False, True, "batch"),
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
    batch = ALGORITHMS["grpo"].normalise(out, advs)
    expected = [[-0.74721, -0.57739], [0.01698, 1.71519], [-0.40757]]
    assert all(torch.allclose(a, torch.tensor(e), atol=1e-5) for a, e in zip(batch, expected))
