"""Chunked log-probabilities and entropies against the plain full-softmax path."""
import pytest
import torch
import torch.nn.functional as F

from marft.engines.logits import token_logprobs_and_entropy


def make(n=11, H=8, V=37, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, H, generator=g) * 2).to(dtype)  # * 2: peaked enough that lp varies a lot
    W = torch.randn(V, H, generator=g).to(dtype)
    t = torch.randint(0, V, (n,), generator=g)
    return h, W, t


def plain(h, W, t, T):
    """The reference: full [n, V] float32 log-softmax and softmax."""
    logp = F.log_softmax((h @ W.T).float() / T, -1)
    return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def loss_of(lp, ent, a, b):
    return (a * lp).sum() - 0.01 * (b * ent).sum()


@pytest.mark.parametrize("chunk", [1, 4, 11, 1024])  # 4 leaves a ragged last chunk of 3
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_values_match_plain(chunk, T):
    h, W, t = make()
    lp, ent = token_logprobs_and_entropy(h, W, t, temperature=T, chunk=chunk)
    lp_ref, ent_ref = plain(h, W, t, T)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (11,)
    assert ent_ref.std() > 0.1 and lp_ref.std() > 0.5  # the check is not trivially satisfied
    torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk", [3, 1024])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_hidden_grad_matches_plain(chunk, T):
    h, W, t = make()
    a, b = torch.randn(11), torch.randn(11)
    h1 = h.clone().requires_grad_(True)
    loss_of(*token_logprobs_and_entropy(h1, W, t, temperature=T, chunk=chunk), a, b).backward()
    h2 = h.clone().requires_grad_(True)
    loss_of(*plain(h2, W, t, T), a, b).backward()
    assert h2.grad.abs().max() > 0.1
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_gradcheck_float64(with_entropy):
    h, W, t = make(n=5, H=4, V=7, dtype=torch.float64)
    h.requires_grad_(True)

    def f(x):
        lp, ent = token_logprobs_and_entropy(x, W, t, temperature=0.7, chunk=2, with_entropy=with_entropy)
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(f, (h,))


def test_each_output_alone_gets_its_own_gradient():
    """Only one output used: the other's gradient arrives as None and must count as zero."""
    h, W, t = make()
    for pick in (0, 1):
        h1 = h.clone().requires_grad_(True)
        token_logprobs_and_entropy(h1, W, t, chunk=4)[pick].sum().backward()
        h2 = h.clone().requires_grad_(True)
        plain(h2, W, t, 1.0)[pick].sum().backward()
        torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)


def test_bf16_inputs_give_float32_close_to_fp32():
    h, W, t = make(dtype=torch.bfloat16)
    h.requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(h, W, t, temperature=0.7, chunk=4)
    assert lp.dtype == ent.dtype == torch.float32
    lp_ref, ent_ref = plain(h.detach().float(), W.float(), t, 0.7)
    torch.testing.assert_close(lp, lp_ref, atol=0.05, rtol=0.01)  # bf16 logits: ~3 significant digits
    torch.testing.assert_close(ent, ent_ref, atol=0.05, rtol=0)
    (lp.sum() + ent.sum()).backward()
    assert h.grad.dtype == torch.bfloat16 and h.grad.abs().max() > 0


def test_empty():
    h, W, _ = make(n=0)
    h.requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(h, W, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,) and lp.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert h.grad.shape == (0, 8)


def test_without_entropy():
    h, W, t = make()
    a = torch.randn(11)
    h1 = h.clone().requires_grad_(True)
    lp, ent = token_logprobs_and_entropy(h1, W, t, temperature=0.7, chunk=4, with_entropy=False)
    assert ent is None
    (a * lp).sum().backward()
    h2 = h.clone().requires_grad_(True)
    lp_ref, _ = plain(h2, W, t, 0.7)
    (a * lp_ref).sum().backward()
    torch.testing.assert_close(lp, lp_ref.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=0)


def test_no_grad_and_trainable_weight():
    h, W, t = make()
    with torch.no_grad():  # e.g. the old log-probabilities: no graph, no saved state needed
        lp, _ = token_logprobs_and_entropy(h, W, t)
    assert not lp.requires_grad
    with pytest.raises(ValueError, match="no gradient"):
        token_logprobs_and_entropy(h, W.clone().requires_grad_(True), t)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(h, W, t, temperature=0.0)
