"""The learner's CPU attention (marft/engines/attention.py) against transformers' eager attention: same
outputs and gradients, with grouped-query heads, a causal offset (a cached prefix) and padding."""
import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from marft.engines.attention import attention


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("with_mask", [True, False])
def test_outputs_and_gradients_equal_eager_attention(with_mask):
    torch.manual_seed(0)
    b, h, kvh, Lq, Lk, d = 2, 6, 2, 5, 8, 4
    q = torch.randn(b, h, Lq, d, requires_grad=True)
    k = torch.randn(b, kvh, Lk, d, requires_grad=True)
    v = torch.randn(b, kvh, Lk, d, requires_grad=True)
    mask = None
    if with_mask:  # queries are the last Lq positions (a prefix of Lk - Lq cached); row 1 pads its first key
        allowed = torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk - Lq).expand(b, 1, Lq, Lk).clone()
        allowed[1, :, :, 0] = False
        mask = torch.zeros(b, 1, Lq, Lk).masked_fill(~allowed, torch.finfo(torch.float32).min)
    g_out = torch.randn(b, Lq, h, d)
    results = []
    for fn in (eager_attention_forward, attention):
        for x in (q, k, v):
            x.grad = None
        out, _ = fn(_Module(h // kvh), q, k, v, mask, scaling=d ** -0.5)
        (out * g_out).sum().backward()
        results.append((out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()))
    for a, c in zip(*results):
        assert a.shape == c.shape
        assert torch.allclose(a, c, atol=1e-5), (a - c).abs().max()
    assert results[0][1].abs().max() > 0
