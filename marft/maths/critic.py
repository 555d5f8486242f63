"""Critics: a value head (MLP on the last hidden layer) over the shared base model.

The centralised critic V(k) reads the global state, the whole transcript before micro-step k
(``Turn.states``), and estimates the team's return from that moment. IPPO's per-agent critics read
the agent's own observation (its prompt) instead, one head per agent. Two kinds
(``train.critic``):

* ``head`` (the original MARFT code's): the base model runs with every adapter disabled and without
  gradients, so its features are computed once per iteration and the heads train on them for
  several passes at almost no cost;
* ``lora`` (the paper's newest experiments, on AReaL): the critic has its own LoRA adapter on the
  same base model (one more adapter, never a model copy), so its features move with training: they
  are recomputed, with gradients through the adapter, for every minibatch of the critic's update
  (``adapter`` and ``grad`` below).

Feature shapes: H hidden size; action level [b, H] (the state's last token); token level
[b, R, H] (the position before each generated token: state tokens, then the reply so far).
"""
from __future__ import annotations

import torch
from torch import nn

from ..engines.models import hidden_size


class ValueHead(nn.Module):
    """hidden -> 1024 -> 512 -> 1 with ReLU (the reference critic head), in float32."""

    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).squeeze(-1)


def _last_hidden(model, ids: torch.Tensor, mask: torch.Tensor, work=None) -> torch.Tensor:
    """Last hidden states [b, L, H]; adds the needed work (unpadded tokens) to ``work``
    (a :class:`marft.engines.packing.PassWork`) when given."""
    from ..engines.flops import causal_context
    from ..engines.generation import positions_of

    if work is not None:
        n = mask.sum(1)
        work.tokens += float(n.sum())
        work.context += causal_context(n)

    # the decoder alone: no output head, and not transformers' output_hidden_states, whose capturing
    # hooks would stay on every layer (and break a compiled layer's graph, marft/engines/compiling.py)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder()(input_ids=ids, attention_mask=mask.long(), position_ids=positions_of(mask.long())).last_hidden_state


def _batch(batch: int | None, device, cpu: int) -> int:
    """Rows per forward pass: ``batch`` if given, else ``cpu`` on a CPU and 4x that on a GPU."""
    return batch if batch else cpu if device.type == "cpu" else 4 * cpu


def _view(models, agent: str, adapter: str | None):
    """Where features come from: the agent's base model with every adapter disabled (``adapter``
    None: the frozen critic), or with the critic's own adapter acting (a learning critic)."""
    return models.reference(agent) if adapter is None else models.acting_adapter(adapter)


def _out(h: torch.Tensor) -> torch.Tensor:
    """Features in float32 on the CPU, where the value heads are: cached for the iteration, or with
    their graph for a learning critic's update (the copy to the CPU passes the gradient back to the
    critic's adapter on the model's device)."""
    return h.float().cpu()


def opening(tok) -> str:
    """The text a tokenizer puts before plain text, its BOS token (Llama 3's ``<|begin_of_text|>``,
    Gemma's ``<bos>``), which every input of such a model began with in its training; "" where
    the tokenizer adds none (SmolLM2, Qwen). The critic reads a transcript, not a chat template's
    rendering, so it adds the opening itself."""
    found = getattr(tok, "marft_opening", None)
    if found is None:
        ids = tok("a", add_special_tokens=True)["input_ids"] if tok.bos_token_id is not None else []
        found = tok.bos_token if ids and ids[0] == tok.bos_token_id else ""
        tok.marft_opening = found
    return found


def encode_state(tok, texts: list[str], max_tokens: int) -> dict:
    """Texts as left-padded ``input_ids`` and ``attention_mask`` tensors, left-truncated to
    ``max_tokens``, each after the tokenizer's :func:`opening` (kept when the text is truncated)."""
    start = opening(tok)
    if not start:
        return tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_tokens,
                   add_special_tokens=False)
    texts = [t[len(start):] if t.startswith(start) else t for t in texts]
    ids = tok(texts, truncation=True, max_length=max(1, max_tokens - 1), add_special_tokens=False)["input_ids"]
    return tok.pad({"input_ids": [[tok.bos_token_id, *row] for row in ids]}, return_tensors="pt")


def state_features(models, agent: str, texts: list[str], batch: int | None = None, max_tokens: int = 2048, work=None,
                   adapter: str | None = None, grad: bool = False) -> torch.Tensor:
    """[b, H] features of global-state texts: the base model's last hidden state at the last token
    (adapters disabled, or the critic's ``adapter`` acting; with gradients when ``grad``), ``batch``
    texts a pass (default 16 on a CPU, 64 on a GPU), after the tokenizer's :func:`opening`. Texts are
    left-truncated to ``max_tokens``."""
    with torch.set_grad_enabled(grad), _view(models, agent, adapter) as (model, tok):
        device = next(model.parameters()).device
        batch = _batch(batch, device, 16)
        feats = []
        for i in range(0, len(texts), batch):
            enc = encode_state(tok, texts[i:i + batch], max_tokens)
            h = _last_hidden(model, enc["input_ids"].to(device), enc["attention_mask"].to(device).bool(), work)
            feats.append(_out(h[:, -1]))  # left padding: the last position is the last token
        return torch.cat(feats) if feats else torch.zeros(0, hidden_size(model))


def prompt_features(models, agent: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    batch: int | None = None, work=None, adapter: str | None = None, grad: bool = False) -> torch.Tensor:
    """[b, H] features of an agent's own observation (its left-padded prompt), for IPPO."""
    with torch.set_grad_enabled(grad), _view(models, agent, adapter) as (model, _):
        device = next(model.parameters()).device
        batch = _batch(batch, device, 16)
        feats = [_out(_last_hidden(model, prompt_ids[i:i + batch].to(device), prompt_mask[i:i + batch].to(device), work)[:, -1])
                 for i in range(0, len(prompt_ids), batch)]
        return torch.cat(feats)


def token_features(models, agent: str, texts: list[str], response_ids: torch.Tensor, response_mask: torch.Tensor,
                   batch: int | None = None, max_tokens: int = 2048, work=None, adapter: str | None = None,
                   grad: bool = False) -> torch.Tensor:
    """[b, R, H] features before each generated token: the state text followed by the reply so
    far (after the tokenizer's :func:`opening`). Position j is the hidden state after the state and
    reply tokens < j."""
    with torch.set_grad_enabled(grad), _view(models, agent, adapter) as (model, tok):
        device = next(model.parameters()).device
        batch = _batch(batch, device, 8)
        R = response_ids.shape[1]
        feats = []
        for i in range(0, len(texts), batch):
            enc = encode_state(tok, texts[i:i + batch], max_tokens)
            ids = torch.cat([enc["input_ids"], response_ids[i:i + batch]], 1).to(device)
            mask = torch.cat([enc["attention_mask"].bool(), response_mask[i:i + batch]], 1).to(device)
            h = _last_hidden(model, ids, mask, work)
            P = enc["input_ids"].shape[1]
            feats.append(_out(h[:, P - 1:P - 1 + R]))
        return torch.cat(feats)
