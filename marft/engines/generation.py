"""Batched sampling with the log-probability of every generated token, and the teacher-forced
recomputation of those log-probabilities.

Log-probabilities are those of the temperature-scaled policy, log softmax(logits / T), before any
top-k / top-p truncation: the quantity a learner recomputes from the same tokens. At T = 0
(greedy) they are taken at T = 1.

Work saved (:func:`generate`; each can be switched off, none changes the replies): the token prefix
that every prompt of a batch shares (system prompt, chat template, task preamble) is prefilled once;
rows whose reply has ended leave the decode batch; the KV cache reserves room for the replies
instead of growing by concatenation. :class:`DecodeWork` counts what the replies need and what was
computed, for FLOP and MFU figures (:mod:`marft.engines.flops`).

On a GPU the decode loop is static instead (:class:`_StaticDecoder`): fixed shapes, no host
synchronisation per token, the step replayed as a CUDA graph, marft's grouped-query attention for
the one-token steps (docs/gpu.md has what each buys). The sampler's uniform numbers come from the
caller's generator, on its own device, whatever device the model is on (:class:`_Uniforms`).

Shapes: B prompts, b rows still in the decode batch, P prompt length (left-padded), R response
length (right-padded), V vocabulary.
"""
from __future__ import annotations

import contextlib
from dataclasses import astuple, dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import attention as grouped_attention
from . import compiling
from ..errors import warn_once
from .flops import causal_context

# transformers >= 5.2x names the KV cache `cache`; earlier releases `past_key_values`
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@dataclass
class Sampling:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 96
    stop: tuple[str, ...] = ()


@dataclass
class DecodeWork:
    """Model work of a :func:`generate` call, in the terms of :meth:`marft.engines.flops.ModelShape.forward`.

    Prefill is the forward pass over the prompts, decode the forward passes over the generated
    tokens fed back one at a time. A token's context is the number of positions it attends to,
    itself included; the contexts are summed over the tokens."""

    prefill_tokens: float = 0.0
    prefill_context: float = 0.0
    decode_tokens: float = 0.0
    decode_context: float = 0.0
    logits: float = 0.0  # positions whose output projection was computed

    def flops(self, shape) -> float:
        """FLOPs of this work for a model of ``shape`` (a :class:`marft.engines.flops.ModelShape`)."""
        return shape.forward(self.prefill_tokens + self.decode_tokens,
                             self.prefill_context + self.decode_context, self.logits)

    def __add__(self, other: "DecodeWork") -> "DecodeWork":
        return DecodeWork(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass
class Generated:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] bool
    response_ids: torch.Tensor  # [B, R] long, right-padded; includes the end-of-turn token
    response_mask: torch.Tensor  # [B, R] bool
    logprobs: torch.Tensor  # [B, R] float32, 0 where response_mask is False
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without ending
    texts: list[str]  # decoded replies without special tokens
    # what the replies need (the FLOPs of MFU): prompt and reply tokens only, without padding or
    # finished rows, a prefix common to every prompt once
    work: DecodeWork | None = None
    spent: DecodeWork | None = None  # what this call computed: padding, finished rows kept in the batch, ...


def encode_chats(tok, chats: list[list[dict]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Render chats with the tokenizer's chat template, ending with the assistant's turn opener;
    returns left-padded ids [B, P] and mask [B, P]."""
    texts = [render_chat(tok, c) for c in chats]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


def render_chat(tok, chat: list[dict]) -> str:
    """A chat (a list of messages) as the prompt text the tokenizer's chat template makes of it,
    ready for the assistant's reply."""
    # model.chat_template_kwargs (load_base), and a served request's tools, for a template that shows
    # them itself (marft.serving.tool_calls.Chat)
    tools = dict(getattr(tok, "marft_template_kwargs", None) or {})
    if getattr(chat, "tools", None):
        tools["tools"] = chat.tools
    try:
        return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **tools)
    except Exception:  # templates that reject a system role: fold it into the first user turn
        if chat and chat[0]["role"] == "system" and len(chat) > 1:
            merged = [{"role": "user", "content": chat[0]["content"] + "\n\n" + chat[1]["content"]}] + chat[2:]
            return tok.apply_chat_template(merged, tokenize=False, add_generation_prompt=True, **tools)
        raise


def _sample(logits: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [b, V] by inverse-CDF sampling: one uniform number per row
    (``torch.multinomial`` draws one per vocabulary entry, about 30 ms per step on 2 CPU cores).
    ``u`` [b, 1] holds those numbers, in [0, 1); drawn from ``generator`` when not given."""
    cdf = logits.softmax(-1).cumsum(-1)
    if u is None:
        u = _uniform((cdf.shape[0], 1), generator).to(cdf.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """Uniform numbers in [0, 1) drawn on ``generator``'s own device (the global CPU generator when
    None), whatever device they are used on: a CPU generator drives a model on a GPU (and the
    same seed gives the same numbers there as on a CPU)."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=device)


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] position ids of a left-padded batch: 0 at each row's first real token (and on its padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [B, V] outside the top-k / nucleus top-p set with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


MIN_SHARED_PREFIX = 8  # a common prompt prefix shorter than this is prefilled with the rest of each prompt
COMPACT_AT = 0.75  # finished rows leave the batch once the live ones are at most this share of it
SYNC_EVERY = 16  # static decoding: steps between checks (a host synchronisation) of whether every reply has ended


@torch.no_grad()
def generate(model, tok, chats: list[list[dict]], sampling: Sampling, stop_ids: list[int],
             generator: torch.Generator | None = None, *, compact: bool = True,
             share_prefix: bool = True, preallocate: bool = True, static: bool | None = None,
             graphs: bool | None = None, compile: bool = False) -> Generated:
    """Sample one reply per chat, all chats in one batch, with a KV cache.

    ``share_prefix``: the longest token prefix common to every prompt (system prompt, chat
    template, task preamble) is prefilled once and its cache shared by all rows. ``compact``: rows
    whose reply has ended leave the batch (when at most ``COMPACT_AT`` of its rows are live).
    ``preallocate``: the KV cache reserves room for the replies instead of growing by
    concatenation at every token.

    ``static`` (default: on a GPU): the decode loop keeps every shape fixed, so that the host never
    waits for the device inside it: the batch keeps its rows (no compaction), the KV cache and the
    attention mask have room for the longest reply from the start (:class:`_StaticDecoder`), the
    uniform numbers of every step are drawn before the loop, and whether every reply has ended is
    read only every ``SYNC_EVERY`` steps. ``graphs`` (default: with ``static`` on a CUDA device):
    the decode step's model call is captured once as a CUDA graph and replayed, instead of
    launching its few thousand kernels one by one from Python. ``compile`` (``rollout.compile``):
    the static loop's step is compiled with ``torch.compile`` (:func:`_compiled_step`: norms, rotary
    embeddings, activations and the adapters' small products fused into fewer kernels), inside the
    CUDA graph on a GPU; it turns the static loop on unless ``static`` is False.

    None of them changes the replies: the sampler draws a uniform number for each of the B rows
    at every step whichever rows are still in the batch, and the generator ends in the same state
    (numbers drawn for steps after every reply ended are given back), so a seeded ``generator``
    gives the same tokens and log-probabilities up to float rounding, which other batch shapes and
    kernels change (within 1e-5 in fp32; in bf16 a sampled token can then differ, and the reply
    goes on differently from there). The generator may live on another device than the model (a
    CPU generator drives a GPU model; its numbers are moved there once per call).
    Stop strings work as without them (checked on every row's reply so far, at every step)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_chats(tok, chats, device)
    lengths = prompt_mask.sum(1)
    shared = _common_prefix(prompt_ids, lengths)
    R = sampling.max_new_tokens
    static = (compile or device.type == "cuda") if static is None else static
    room = R if preallocate or static else None
    state = None
    if share_prefix and shared >= MIN_SHARED_PREFIX:
        state = _prefill_shared(model, prompt_ids, prompt_mask, shared, room)
    past, logits, mask, spent = state or _prefill(model, prompt_ids, prompt_mask, room)
    with _decode_attention(model, static and GROUPED_DECODE):
        decoder = _StaticDecoder.make(model, past, mask, lengths, R, graphs, compile) if static else None
        return _decode(model, tok, sampling, stop_ids, generator, prompt_ids, prompt_mask, lengths, past, logits, mask,
                       spent, decoder, compact)


def _decode(model, tok, sampling, stop_ids, generator, prompt_ids, prompt_mask, lengths, past, logits, mask, spent,
            decoder, compact) -> Generated:
    """:func:`generate`'s decode loop, after the prefill: the static one when ``decoder`` is given."""
    device = prompt_ids.device
    B, P = prompt_ids.shape
    pad, stops, R = tok.pad_token_id, torch.tensor(stop_ids, device=device), sampling.max_new_tokens
    uniforms = _Uniforms(generator, R, B, device) if sampling.temperature > 0 else None
    rows = torch.arange(B, device=device)  # [b] the prompt of each row of the batch
    attn = torch.cat([mask, mask.new_zeros(B, R)], 1)  # [b, P + R] attention mask; the first K columns in use
    K = P
    pos = lengths.clone()  # [b] position of the token each row is fed next
    tokens, logps, valid = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=device)  # the reply has ended before this token
    ended = torch.zeros(B, dtype=torch.bool, device=device)  # ended by an end-of-turn token or stop string
    reply_ids = [[] for _ in range(B)] if sampling.stop else None  # each reply's token ids, for stop strings
    check = SYNC_EVERY if decoder is not None and reply_ids is None else 1
    for step in range(R):
        live = ~done[rows]
        u = uniforms.step(step, rows) if uniforms is not None else None
        nxt, logp = _next_tokens(logits, sampling, u)
        nxt = torch.where(live, nxt, torch.full_like(nxt, pad))
        tokens.append(_scatter(nxt, rows, B, pad))
        valid.append(_scatter(live, rows, B, False))
        logps.append(_scatter(logp * live, rows, B, 0.0))
        hit = valid[-1] & torch.isin(tokens[-1], stops)
        if reply_ids is not None:
            hit |= _stop_string_hit(tok, tokens[-1], done, reply_ids, sampling.stop)
        ended |= hit
        done = done | hit
        if step == R - 1 or ((step + 1) % check == 0 and bool(done.all())):  # the last token is not fed back
            break
        if decoder is not None:
            spent += DecodeWork(decode_tokens=B, decode_context=B * (P + step + 1), logits=B)
            logits = decoder.step(nxt, step)
            continue
        attn[:, K] = live
        K += 1
        if compact:
            keep = _rows_to_keep(done[rows])
            if keep is not None:
                past.batch_select_indices(keep)
                rows, attn, pos, nxt = rows[keep], attn[keep], pos[keep], nxt[keep]
        spent += DecodeWork(decode_tokens=len(rows), decode_context=len(rows) * K, logits=len(rows))
        out = model(input_ids=nxt[:, None], attention_mask=attn[:, :K], position_ids=pos[:, None],
                    use_cache=True, **{_CACHE: past})
        past, logits = getattr(out, _CACHE), out.logits[:, -1]
        pos = pos + 1
    response_mask = torch.stack(valid, 1)
    width = int(response_mask.any(0).nonzero().max()) + 1  # steps run after every reply ended are dropped
    response_ids, response_mask = torch.stack(tokens, 1)[:, :width], response_mask[:, :width]
    logprobs = torch.stack(logps, 1)[:, :width]
    if uniforms is not None:
        uniforms.used(width)
    texts = tok.batch_decode(response_ids, skip_special_tokens=True)
    work = needed_work(prompt_ids, prompt_mask, response_mask)
    return Generated(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ~ended, texts, work, spent)


# the static loop's decode steps attend with marft's grouped-query attention (marft.engines.attention):
# transformers' sdpa, given a mask, repeats every key and value head for each query head that reads
# it (6x the KV cache of Qwen2.5-1.5B, written and read again at every step) and PyTorch's kernels
# then take the mask on the repeated heads; grouped attention reads each cached head once
GROUPED_DECODE = True


@contextlib.contextmanager
def _decode_attention(model, on: bool):
    """Switch ``model`` to marft's grouped attention for the block (decode steps of one query
    token), when ``on`` and the model can switch; its own attention afterwards."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    before = _attention_name(model)
    switch = on and before in ("sdpa", "eager") and hasattr(base, "set_attn_implementation") and grouped_attention.replaces(model)
    if switch:
        grouped_attention.register()
        base.set_attn_implementation(grouped_attention.NAME)
    try:
        yield
    finally:
        if switch:
            base.set_attn_implementation(before)


class _Uniforms:
    """The uniform numbers of every decode step, [R, B], drawn in one call (on the generator's
    device, moved to the model's once) in the order step-by-step draws of B numbers would take them;
    :meth:`used` leaves the generator as if only the steps run had drawn theirs."""

    def __init__(self, generator: torch.Generator | None, R: int, B: int, device):
        self.generator = generator if generator is not None else torch.default_generator
        self.state = self.generator.get_state()
        self.B = B
        self.u = _uniform((R, B), self.generator).to(device)

    def step(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        """The numbers [b, 1] of the rows ``rows`` [b] at ``step``."""
        u = self.u[step]
        return (u if len(rows) == self.B else u[rows])[:, None]

    def used(self, steps: int) -> None:
        self.generator.set_state(self.state)
        _uniform((steps, self.B), self.generator)


class _StaticDecoder:
    """The decode step with fixed shapes: the KV cache of every layer is one [B, kv_heads, P + R, d]
    buffer (:class:`_StaticLayer`) written at column P + step, and the attention mask a
    [B, 1, 1, P + R] buffer whose column P + step is switched on before the token generated at
    that step is fed. Masked columns (padding, replies' future) weigh exactly 0 in the softmax, so
    every row attends to what the growing cache of :func:`generate`'s plain loop holds.

    On a CUDA device the model call is captured once as a CUDA graph (``graphs``) over these
    buffers and replayed at every step; the first step runs it eagerly first (a warm-up that
    writes the same cache column as the replay after it). With ``compile`` the model call is
    :func:`_compiled_step`'s (captured in the graph where there is one). Built by :meth:`make`, which
    returns None where the cache or the attention is not of a kind it handles (the plain loop runs
    then)."""

    def __init__(self, model, past, mask: torch.Tensor, lengths: torch.Tensor, R: int, graphs: bool,
                 compile: bool = False):
        B, P = mask.shape
        device = mask.device
        self.model, self.past, self.P, self.graphs = model, past, P, graphs
        self.compile = compile and id(model) not in _gave_up
        self.at = torch.tensor([P], device=device)  # [1] the cache column written by the step
        past.layers = [_StaticLayer(layer, self.at) for layer in past.layers]
        keep = torch.zeros(B, 1, 1, P + R, dtype=torch.bool, device=device)
        keep[:, 0, 0, :P] = mask.bool()
        impl = _attention_name(model)
        if impl == "sdpa":
            self.mask, self.on = keep, True
        else:  # eager and marft's grouped attention add the mask to the scores
            dtype = next(model.parameters()).dtype
            self.mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, torch.finfo(dtype).min)
            self.on = 0.0
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.pos = lengths[:, None].clone()  # [B, 1] position of the token fed at the next step
        self.graph = self.logits = None

    @classmethod
    def make(cls, model, past, mask, lengths, R: int, graphs: bool | None, compile: bool = False):
        layers = getattr(past, "layers", None)
        if not layers or not all(type(layer) is _ReservedLayer for layer in layers):
            return None
        if any(layer._k.shape[-2] != mask.shape[1] + R for layer in layers):
            return None
        if _attention_name(model) not in ("sdpa", "eager", grouped_attention.NAME):
            return None
        device = mask.device
        graphs = device.type == "cuda" if graphs is None else graphs and device.type == "cuda"
        return cls(model, past, mask, lengths, R, graphs, compile)

    def _forward(self) -> torch.Tensor:
        if self.compile:
            try:
                return _compiled_step()(self.model, self.ids, self.mask, self.pos, self.past)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 -- no compiler for this device or model: run the step as it is
                compiling.warn_failed("the decode step", "rollout.compile", e)
                self.compile = False
                _gave_up.add(id(self.model))  # not tried again for this model
        return _step(self.model, self.ids, self.mask, self.pos, self.past)

    def step(self, nxt: torch.Tensor, step: int) -> torch.Tensor:
        """Feed the tokens ``nxt`` [B] generated at ``step``; the logits [B, V] after them."""
        column = self.P + step
        self.ids.copy_(nxt[:, None])
        self.mask[:, 0, 0, column] = self.on
        self.at.fill_(column)
        if step:
            self.pos += 1
        if not self.graphs:
            return self._forward()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        # on the model's GPU (streams are made on the current device, cuda:0 unless told: a model on
        # cuda:1 would run outside the capture and leave the graph empty); thread_local: asynchronous
        # training's learner thread works on the GPU during the capture, which the default "global"
        # mode would forbid it
        with torch.cuda.device(self.mask.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward()  # warm-up: lazily built state is made outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self._record(side)

    def _record(self, side) -> None:
        graph = torch.cuda.CUDAGraph()
        try:  # on our stream: torch's default capture stream is made once, on the first GPU it ran on
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                self.logits = self._forward()
        except RuntimeError as e:  # a model whose step cannot be captured: run it eagerly
            warn_once(f"marft: the decode step could not be captured as a CUDA graph ({str(e).splitlines()[0][:160]}); "
                       "it runs without one (slower)")
            self.graphs = False
            self.logits = self._forward()
            return
        self.graph = graph


def _step(model, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past) -> torch.Tensor:
    """One decode step of the static loop: the logits [B, V] after the tokens ``ids`` [B, 1]."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{_CACHE: past})
    return out.logits[:, -1]


_COMPILED = None
_gave_up: set[int] = set()  # models whose decode step failed to compile: run as they are from then on


def _compiled_step():
    """:func:`_step` under ``torch.compile`` (``rollout.compile``; :mod:`marft.engines.compiling`), made
    once per process and shared by every model: dynamic shapes, so the batch and the cache length
    may change from call to call without compiling again; compiled again for each model and acting
    adapter. The first call of each compiles (about ten seconds for the tiny test model on 2 CPU
    cores; longer for a real model); later calls run the compiled step."""
    global _COMPILED
    if _COMPILED is None:
        compiling.configure()
        _COMPILED = torch.compile(_step, dynamic=True)
    return _COMPILED


def _attention_name(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base.config, "_attn_implementation", None) or "eager"


def _common_prefix(ids: torch.Tensor, lengths: torch.Tensor) -> int:
    """How many tokens at the start of every prompt are the same in all of them (left-padded
    ``ids`` [B, P], ``lengths`` [B]); at most the shortest prompt less one, so that every row keeps a
    token of its own; 0 for a single prompt."""
    B, P = ids.shape
    n = int(lengths.min()) - 1
    if B < 2 or n <= 0:
        return 0
    head = ids.gather(1, (P - lengths)[:, None] + torch.arange(n, device=ids.device))  # [B, n]
    return int((head == head[:1]).all(0).long().cumprod(0).sum())


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor, room: int | None):
    """All prompts ``ids`` [B, P] (left-padded, ``mask`` [B, P]) in one forward pass. Returns the
    cache (with ``room`` positions reserved, see :func:`_reserve`, unless None), the logits [B, V]
    after each prompt, the attention mask [B, P] long and the work done."""
    mask = mask.long()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask), use_cache=True, logits_to_keep=1)
    past = getattr(out, _CACHE)
    if room is not None:
        _reserve(past, room)
    B, P = ids.shape
    work = DecodeWork(prefill_tokens=B * P, prefill_context=causal_context(torch.full((B,), P)), logits=B)
    return past, out.logits[:, -1], mask, work


def _prefill_shared(model, ids: torch.Tensor, mask: torch.Tensor, shared: int, room: int | None):
    """The first ``shared`` tokens of every prompt (the same in all) once at batch 1, then every
    prompt's rest after them: since the prompts are left-padded, ``ids[:, shared:]`` holds each rest
    right-aligned, and ``mask[:, :P - shared]`` marks it; the gap between the prefix and a shorter
    rest is masked out and skipped by the positions. Returns as :func:`_prefill` (the attention
    mask [B, P] is 1 on the prefix and on each rest), or None when the cache cannot be shared."""
    B, P = ids.shape
    start = P - int(mask[0].sum())
    prefix = ids[:1, start:start + shared]
    out = model(input_ids=prefix, position_ids=torch.arange(shared, device=ids.device)[None],
                use_cache=True, logits_to_keep=1)
    past = getattr(out, _CACHE)
    if not _broadcast_cache(past, B):
        return None
    if room is not None:
        _reserve(past, P - shared + room)
    full = torch.cat([mask.new_ones(B, shared), mask[:, :P - shared]], 1).long()
    out = model(input_ids=ids[:, shared:], attention_mask=full, position_ids=positions_of(full)[:, shared:],
                use_cache=True, logits_to_keep=1, **{_CACHE: past})
    rest = torch.full((B,), P - shared)
    work = DecodeWork(prefill_tokens=shared + B * (P - shared), logits=1 + B,
                prefill_context=causal_context(torch.tensor([shared])) + causal_context(rest, shared))
    return getattr(out, _CACHE), out.logits[:, -1], full, work


def _broadcast_cache(past, B: int) -> bool:
    """Make a batch-1 KV cache one of ``B`` rows in place, as an expanded view (the next update
    concatenates it into a new tensor anyway). False, with the cache untouched, for caches other
    than plain full-attention ``DynamicLayer`` ones."""
    if not _plain(past):
        return False
    for layer in past.layers:
        layer.keys = layer.keys.expand(B, -1, -1, -1)
        layer.values = layer.values.expand(B, -1, -1, -1)
    return True


def _plain(past) -> bool:
    """Whether ``past`` is a cache of full-attention ``DynamicLayer`` layers only."""
    layers = getattr(past, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _reserve(past, room: int) -> None:
    """Give every layer of a plain cache (see :func:`_plain`; others are left as they are) room for
    ``room`` more positions, written in place instead of concatenated."""
    if _plain(past):
        past.layers = [_ReservedLayer(layer.keys, layer.values, room) for layer in past.layers]


class _ReservedLayer(DynamicLayer):
    """A full-attention cache layer with room reserved up front: ``update`` writes the new keys and
    values [b, h, s, d] after the ``n`` cached ones and returns views of the first ``n + s``
    positions, instead of concatenating (which copies the whole cache at every token). Past its
    room it falls back to concatenation."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        b, h, n, d = keys.shape
        self._k = keys.new_empty(b, h, n + room, d)
        self._v = values.new_empty(b, h, n + room, values.shape[-1])
        self._k[:, :, :n], self._v[:, :, :n] = keys, values
        self.n, self.is_initialized, self.device = n, True, keys.device
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        s = key_states.shape[-2]
        if self.n + s > self._k.shape[-2]:  # out of room: grow as DynamicLayer does
            self._k, self._v = torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)
        else:
            self._k[:, :, self.n:self.n + s], self._v[:, :, self.n:self.n + s] = key_states, value_states
        self.n += s
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._view()


class _StaticLayer(DynamicLayer):
    """A :class:`_ReservedLayer`'s buffers [b, h, P + R, d] used whole: ``update`` writes the new keys
    and values (one position) at the column held by the device tensor ``at`` [1] and returns the
    whole buffers, so every step has the same shapes and reads the column from the device (what a
    captured CUDA graph needs). The attention mask hides the columns not yet written."""

    def __init__(self, reserved: _ReservedLayer, at: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.at = reserved._k, reserved._v, at
        self.is_initialized, self.device = True, reserved.device
        # the columns not yet written are masked out, but attention still multiplies them by a zero
        # weight: uninitialised memory could hold a NaN, and 0 * NaN is NaN
        self.keys[:, :, reserved.n:].zero_()
        self.values[:, :, reserved.n:].zero_()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.at, key_states)
        self.values.index_copy_(2, self.at, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


def _next_tokens(logits: torch.Tensor, sampling: Sampling, u: torch.Tensor | None):
    """The next token [b] of each batch row from its ``logits`` [b, V], and its log-probability
    [b] under log softmax(logits / T). Sampling uses the uniform numbers ``u`` [b, 1] (one per row;
    see :class:`_Uniforms`); greedy decoding (T = 0) takes the argmax."""
    temp = sampling.temperature if sampling.temperature > 0 else 1.0
    logp = F.log_softmax(logits.float() / temp, dim=-1)
    if sampling.temperature > 0:
        nxt = _sample(_filter(logp, sampling.top_k, sampling.top_p), None, u)
    else:
        nxt = logp.argmax(-1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


def _scatter(x: torch.Tensor, rows: torch.Tensor, B: int, fill) -> torch.Tensor:
    """Values ``x`` [b] of the batch rows as a [B] tensor over all prompts, ``fill`` elsewhere."""
    if len(rows) == B:
        return x
    return x.new_full((B,), fill).index_copy_(0, rows, x)


def _rows_to_keep(done: torch.Tensor) -> torch.Tensor | None:
    """Indices of the batch rows still live (``done`` [b]) when few enough are to be worth the copy
    of the cache, else None."""
    keep = (~done).nonzero().squeeze(1)
    return keep if len(keep) <= COMPACT_AT * len(done) else None


def needed_work(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> DecodeWork:
    """What replies need, whichever implementation produced them (left-padded prompts [B, P],
    right-padded replies [B, R]): every prompt token, with the prefix common to all prompts once
    (see :func:`_common_prefix`); every generated token fed back but each reply's last; the logits
    after each prompt and each fed-back token. No padding, no finished rows."""
    lengths, replies = prompt_mask.sum(1).cpu(), response_mask.sum(1).cpu()
    shared = _common_prefix(prompt_ids.cpu(), lengths)
    rest = lengths - shared
    fed = (replies - 1).clamp(min=0)
    return DecodeWork(prefill_tokens=shared + float(rest.sum()),
                prefill_context=causal_context(torch.tensor([shared])) + causal_context(rest, shared),
                decode_tokens=float(fed.sum()), decode_context=causal_context(fed, lengths),
                logits=float(replies.sum()))


def _stop_string_hit(tok, nxt, done, replies, stop_strings) -> torch.Tensor:
    """Which replies a stop string ends at this token (only when configured): ``replies`` [B] the token
    ids so far, ``nxt`` appended. The reply's tail is decoded as a whole, as its text is (a character
    split across byte-level tokens is found at the token that completes it); a string that first
    appears now ends in that token, so a tail of 4 tokens a character of the longest string (and a
    few more) covers it."""
    tail = 4 * max(map(len, stop_strings)) + 4
    hit = []
    for b, (token, finished) in enumerate(zip(nxt.tolist(), done.tolist())):  # one device read a step, not one a row
        if finished:
            hit.append(False)
            continue
        replies[b].append(token)
        text = tok.decode(replies[b][-tail:], skip_special_tokens=True)
        hit.append(any(s in text for s in stop_strings))
    return torch.tensor(hit, dtype=torch.bool, device=done.device)


def sequence_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log-probabilities [B, R] of ``response_ids`` after ``prompt_ids``, under
    log softmax(logits / T); 0 where ``response_mask`` is False."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1).long()
    R = response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask),
                   logits_to_keep=R + 1).logits[:, :-1]
    temp = temperature if temperature > 0 else 1.0
    logp = F.log_softmax(logits.float() / temp, dim=-1).gather(-1, response_ids[..., None]).squeeze(-1)
    return logp * response_mask
