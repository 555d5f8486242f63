"""The learner's teacher-forced passes over packed rows: what the PPO update and the behaviour and
reference log-probabilities are computed with (``train.fast``, the default).

Rollout batches are left-padded prompts followed by right-padded replies, one tensor per agent
turn. A teacher-forced pass over that layout computes padding, the prompt prefix that every row
shares (system prompt, chat template, task preamble) once per row, and the output projection with
a float32 log-softmax over the whole vocabulary at every reply position. Here instead:

- each row is unpadded into one sequence, prompt then reply (:func:`unpad`);
- rows are sorted by length and grouped into micro-batches of at most ``max_tokens`` padded tokens
  (rows x longest row) and ``max_rows`` rows (:func:`micro_batches`), so padding is what remains
  between rows of nearly equal length, at the right end, where causal attention never reads it;
- the longest token prefix common to a micro-batch's rows (capped one token before the shortest
  prompt ends) runs once with batch 1; its keys and values are expanded to every row and the rows'
  remainders run on top of them (:func:`final_hidden`); gradients flow through the expansion back
  into the shared prefix, summed over rows, exactly as if each row had computed it;
- on a CPU the passes use :mod:`marft.engines.attention` (PyTorch's CPU flash-attention backward is slow
  in bf16; transformers' eager attention keeps every layer's probabilities);
- the output projection runs only at the positions that predict a reply token, and the
  log-probabilities of the taken tokens and the entropies come from one chunked pass in the model's
  dtype with float32 accumulation (:mod:`marft.engines.logits`), never a [b, R, V] float32 tensor.

The result is the same log-probabilities and gradients as the padded pass up to floating-point
rounding (``tests/test_packing.py`` checks losses and gradients against the plain path).

Work counters (:class:`PassWork`) record the tokens and attention context actually computed, with the shared
prefix once per micro-batch, for :mod:`marft.engines.flops`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import attention as cpu_attention
from . import compiling
from .flops import causal_context
from .logits import token_logprobs_and_entropy
from .models import text_config

# switches for benchmarks/train.py's ablation rows (each one of the fast path's changes)
SHARE_PREFIX = True  # run the rows' common prefix once
FUSED = True  # chunked log-prob/entropy pass (marft.engines.logits) instead of a float32 log-softmax
REUSE_FIRST = True  # the first minibatch's behaviour log-probs from its own pass (marft.run.learner)
CPU_ATTENTION = "marft_cpu"  # the learner's attention on a CPU: marft_cpu, eager, or None (the model's: sdpa)


@dataclass
class Row:
    """One reply with its prompt, unpadded: ``ids`` [n_prompt + n_resp] long."""

    ids: torch.Tensor
    n_prompt: int
    n_resp: int

    @property
    def length(self) -> int:
        """Tokens the pass needs: the last reply token predicts nothing that is scored."""
        return self.n_prompt + self.n_resp - 1


@dataclass
class PassWork:
    """What a pass computed: ``tokens`` positions run through the model (shared prefixes once),
    ``context`` the sum of their attention contexts, ``logits`` positions with an output projection."""

    tokens: float = 0.0
    context: float = 0.0
    logits: float = 0.0
    padded: float = 0.0  # padding positions computed (not part of the needed work)

    def add(self, other: "PassWork") -> None:
        for k in ("tokens", "context", "logits", "padded"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def flops(self, shape, backward: bool = False) -> float:
        """FLOPs of this work for a :class:`marft.engines.flops.ModelShape`: forward, or forward + backward."""
        return (shape.forward_backward if backward else shape.forward)(self.tokens, self.context, self.logits)


def unpad(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
          response_mask: torch.Tensor) -> list[Row]:
    """Rows of a turn's tensors (prompt [b, P] left-padded, response [b, R] right-padded)."""
    rows = []
    for b in range(prompt_ids.shape[0]):
        p = prompt_ids[b][prompt_mask[b]]
        r = response_ids[b][response_mask[b]]
        rows.append(Row(torch.cat([p, r]), len(p), len(r)))
    return rows


def micro_batches(lengths: list[int], max_tokens: int, max_rows: int = 0) -> list[list[int]]:
    """Indices into ``lengths`` grouped into micro-batches, longest rows first: each group holds at
    most ``max_rows`` rows (0: no limit) and rows x its longest length <= ``max_tokens`` (a row
    longer than that is a group of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if g and (not max_rows or len(g) < max_rows) and lengths[g[0]] * (len(g) + 1) <= max_tokens:
            g.append(i)
        else:
            groups.append([i])
    return groups


def shared_prefix(rows: list[Row], min_len: int = 8) -> int:
    """Length of the token prefix common to every row, at most one short of the shortest prompt
    (the last prompt token predicts the first reply token, so it belongs to every row's own part);
    0 if shorter than ``min_len`` or for a single row."""
    if len(rows) < 2:
        return 0
    limit = min(r.n_prompt for r in rows) - 1
    first = rows[0].ids[:limit]
    n = limit
    for r in rows[1:]:
        diff = (r.ids[:n] != first[:n]).nonzero()
        if len(diff):
            n = int(diff[0])
    return n if n >= min_len else 0


def _cache_kw() -> str:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


@contextlib.contextmanager
def _attention_for_learning(model, device):
    """On a CPU, the learner's passes use :mod:`marft.engines.attention` (matrix products, float32 softmax,
    probabilities recomputed in the backward): faster than PyTorch's CPU flash-attention kernel in
    bf16 and lighter than transformers' eager attention. Elsewhere the model's own choice."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    before = base.config._attn_implementation
    want = CPU_ATTENTION if device.type == "cpu" and cpu_attention.replaces(model) else None
    switch = bool(want) and before != want and hasattr(base, "set_attn_implementation")
    if switch:
        if want == cpu_attention.NAME:
            cpu_attention.register()
        base.set_attn_implementation(want)
    try:
        yield
    finally:
        if switch:
            base.set_attn_implementation(before)


def final_hidden(model, rows: list[Row], prefix: int, device, compile: bool = False) -> torch.Tensor:
    """Last-layer (normed) hidden states [b, S, H] of the rows' positions ``prefix`` ..
    ``prefix + S - 1`` (S = longest ``length - prefix``), right-padded; the first ``prefix`` tokens
    (shared by every row) run once and their keys and values are expanded over the rows.
    ``compile`` (``train.compile``, with ``prefix`` 0): the decoder layers run compiled
    (:func:`marft.engines.compiling.compiled_layers`), or as they are, with one warning, where they cannot."""
    decoder = model.get_base_model().get_decoder() if hasattr(model, "get_base_model") else model.get_decoder()
    pad = int(rows[0].ids[0])  # any id: right padding is never attended to by a real position
    S = max(r.length for r in rows) - prefix
    ids = torch.full((len(rows), S), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : r.length - prefix] = r.ids[prefix: r.length]
    ids = ids.to(device)
    with _attention_for_learning(model, device):
        if compile and not prefix:
            try:
                with compiling.compiled_layers(model):
                    return _run(decoder, rows, prefix, ids, device)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 -- no compiler for this device or model: run the layers as they are
                compiling.warn_failed("the learner's decoder layers", "train.compile", e)
                compiling.give_up(model)
        return _run(decoder, rows, prefix, ids, device)


def _run(decoder, rows: list[Row], prefix: int, ids: torch.Tensor, device) -> torch.Tensor:
    if not prefix:
        return decoder(input_ids=ids, use_cache=False).last_hidden_state
    kw = _cache_kw()
    head = decoder(input_ids=rows[0].ids[None, :prefix].to(device), use_cache=True)
    cache = getattr(head, kw)
    for layer in cache.layers:
        layer.keys = layer.keys.expand(len(rows), -1, -1, -1)
        layer.values = layer.values.expand(len(rows), -1, -1, -1)
    return decoder(input_ids=ids, use_cache=True, **{kw: cache}).last_hidden_state


def _plain_head(model) -> bool:
    """Whether the output projection is a bias-free linear map with no logit scaling, so the fused
    log-probability pass (:mod:`marft.engines.logits`) computes exactly what the model's head does."""
    head = model.get_output_embeddings()
    return isinstance(head, torch.nn.Linear) and head.bias is None and not any(_logit_scaling(model))


def _logit_scaling(model) -> tuple:
    """(scale, divisor, cap) of the model's logits, each None where it changes nothing."""
    cfg = text_config(model)
    scale, div, cap = (getattr(cfg, k, None) for k in ("logit_scale", "logits_scaling", "final_logit_softcapping"))
    return (None if scale in (None, 1.0, 0.0) else scale, None if div in (None, 1.0, 0.0) else div,
            None if cap in (None, 0.0) else cap)


def scaled_logits(model, z: torch.Tensor) -> torch.Tensor:
    """The output head's ``z`` as the model's forward returns its logits: times Cohere's
    ``logit_scale``, divided by Granite's ``logits_scaling`` (HyperCLOVA X multiplies by its own),
    soft-capped by Gemma 2's ``final_logit_softcapping`` (``cap * tanh(z / cap)``), as their
    forwards apply them."""
    scale, div, cap = _logit_scaling(model)
    if scale is not None:
        z = z * scale
    if div is not None:
        z = z * div if getattr(text_config(model), "model_type", "") == "hyperclovax" else z / div
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z


def response_logprobs(model, rows: list[Row], temperature: float, with_entropy: bool, share_prefix: bool = True,
                      min_prefix: int = 8, compile: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, PassWork]:
    """Log-probabilities [b, R] of each row's reply tokens under log softmax(logits / T), the
    entropies [b, R] of those distributions (or None) and the work done; R = longest reply; column j
    of row b is reply token j (0 beyond the reply). One micro-batch: all ``rows`` in one pass.
    ``compile`` (``train.compile``): the decoder layers compiled; the shared prefix is then not
    split off (its cache would make each layer a compilation of its own)."""
    device = next(model.parameters()).device
    T = temperature if temperature > 0 else 1.0
    prefix = shared_prefix(rows, min_prefix) if share_prefix and SHARE_PREFIX and not compile else 0
    prefix = max(0, min(prefix, max(r.length for r in rows) - 1))  # every reply empty: keep a position
    hidden = final_hidden(model, rows, prefix, device, compile)  # [b, S, H]
    # the position predicting reply token j of row b: n_prompt - 1 + j, shifted by the prefix
    resp = torch.tensor([r.n_resp for r in rows])
    R = int(resp.max()) if len(rows) else 0
    b_idx = torch.repeat_interleave(torch.arange(len(rows)), resp)
    j_idx = torch.cat([torch.arange(n) for n in resp.tolist()]) if len(rows) else torch.zeros(0, dtype=torch.long)
    starts = torch.tensor([r.n_prompt - 1 - prefix for r in rows])
    pos = starts[b_idx] + j_idx
    targets = torch.cat([r.ids[r.n_prompt:] for r in rows]).to(device)
    h = hidden[b_idx.to(device), pos.to(device)]  # [n, H]
    if FUSED and _plain_head(model):
        lp, ent = token_logprobs_and_entropy(h, model.get_output_embeddings().weight, targets, T, chunk=_logit_chunk(device),
                                              with_entropy=with_entropy)
    else:  # a head with bias or logit scaling: the model's own head, on the needed positions only
        z = scaled_logits(model, model.get_output_embeddings()(h).float()) / T
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, targets[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    lp_out = torch.zeros(len(rows), R, dtype=torch.float32, device=device).index_put((b_idx.to(device), j_idx.to(device)), lp)
    ent_out = None
    if ent is not None:
        ent_out = torch.zeros(len(rows), R, dtype=torch.float32, device=device).index_put((b_idx.to(device), j_idx.to(device)), ent)
    return lp_out, ent_out, work_of(rows, prefix, hidden.shape[1])


CPU_TOKENS = 2048  # micro-batch tokens on a CPU (train.micro_batch_tokens: 0)
BYTES_PER_TOKEN_WIDTH = 18  # activation bytes kept for the backward, per token, layer and unit of (hidden + MLP) width
GPU_SHARE = 0.6  # of the GPU's memory, for one micro-batch's activations


def token_budget(model, requested: int = 0) -> int:
    """Tokens per learner micro-batch: ``requested`` if positive; else 2,048 on a CPU and, on a GPU,
    what ``GPU_SHARE`` of its memory holds at ``BYTES_PER_TOKEN_WIDTH`` x layers x (hidden +
    intermediate) bytes per token, in multiples of 1,024. The constant is measured: Qwen2.5-1.5B's
    shapes (28 layers, 1,536 + 8,960 wide) in bf16 with LoRA on q and v peaked at 77-88 GiB on an
    H200 with 16,384-token micro-batches (``scripts/gpu_check.py``), about 17 bytes per unit; the
    budget there comes to 16,384 tokens, and to 7,168 for Qwen2.5-7B's shapes."""
    if requested > 0:
        return requested
    p = next(model.parameters())
    if p.device.type != "cuda":
        return CPU_TOKENS
    import torch

    cfg = text_config(model)
    width = cfg.num_hidden_layers * (cfg.hidden_size + getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    per_token = BYTES_PER_TOKEN_WIDTH * width * max(p.element_size(), 2) / 2
    total = torch.cuda.get_device_properties(p.device).total_memory
    return max(1024, int(GPU_SHARE * total / per_token) // 1024 * 1024)


def _logit_chunk(device) -> int:
    """Rows per chunk of the fused log-probability pass: 256 on a CPU (cache-sized); 4096 on a GPU,
    where a [4096, V] float32 buffer (0.8 GB at V = 49,152) is small and fewer, larger products
    keep it busy."""
    return 256 if device.type == "cpu" else 4096


def work_of(rows: list[Row], prefix: int, width: int | None = None) -> PassWork:
    """The work of one pass over ``rows`` with a shared ``prefix`` (run once) and the remainders
    right-padded to ``width`` positions (default: the longest)."""
    lengths = torch.tensor([r.length - prefix for r in rows])
    width = int(lengths.max()) if width is None else width
    return PassWork(tokens=prefix + float(lengths.sum()),
                context=causal_context(torch.tensor([prefix])) + causal_context(lengths, prefix),
                logits=float(sum(r.n_resp for r in rows)),
                padded=float(len(rows) * width - lengths.sum()))


def needed_work(rows: list[Row], max_tokens: int, max_rows: int = 0, min_prefix: int = 8) -> PassWork:
    """The work a pass over ``rows`` needs (no padding, each micro-batch's shared prefix once), as
    grouped by :func:`micro_batches`: the numerator of the learner's MFU, whichever path ran."""
    total = PassWork()
    for g in micro_batches([r.length for r in rows], max_tokens, max_rows):
        group = [rows[i] for i in g]
        w = work_of(group, shared_prefix(group, min_prefix))
        w.padded = 0.0
        total.add(w)
    return total
