"""The sampler and the top-k / top-p filter, against hand values."""
import math

import torch

from marft.generation import _filter, _sample


def test_sampler_follows_the_distribution_and_never_picks_masked_tokens():
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7])
    logits = probs.log().expand(20000, 4).clone()  # log 0 = -inf
    draws = _sample(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[2] == 0
    # binomial standard error at n=20000 is <= 0.0035; allow 4 of them
    assert torch.allclose(freq, probs, atol=0.014), freq


def test_sampler_is_reproducible_with_a_seeded_generator():
    logits = torch.randn(8, 50)
    a = _sample(logits, torch.Generator().manual_seed(3))
    b = _sample(logits, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    k2 = _filter(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(k2[0, :2]).all() and torch.isinf(k2[0, 2:]).all()
    # softmax([2,1,0,-1]) = .644, .237, .087, .032: the nucleus reaching 0.8 is the first two tokens,
    # reaching 0.9 the first three
    p = logits.softmax(-1)[0]
    assert math.isclose(float(p[0] + p[1]), 0.881, abs_tol=1e-3)
    assert torch.isfinite(_filter(logits, 0, 0.8)[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter(logits, 0, 0.9)[0]).tolist() == [True, True, True, False]
    assert torch.isfinite(_filter(logits, 0, 0.5)[0]).tolist() == [True, False, False, False]
