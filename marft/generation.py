"""Batched sampling with the log-probability of every generated token, and the teacher-forced
recomputation of those log-probabilities.

Log-probabilities are those of the temperature-scaled policy, log softmax(logits / T), before any
top-k / top-p truncation: the quantity a learner recomputes from the same tokens. At T = 0
(greedy) they are taken at T = 1.

Shapes: B prompts, P prompt length (left-padded), R response length (right-padded), V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

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
class Generated:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] bool
    response_ids: torch.Tensor  # [B, R] long, right-padded; includes the end-of-turn token
    response_mask: torch.Tensor  # [B, R] bool
    logprobs: torch.Tensor  # [B, R] float32, 0 where response_mask is False
    truncated: torch.Tensor  # [B] bool: hit max_new_tokens without ending
    texts: list[str]  # decoded replies without special tokens


def encode_chats(tok, chats: list[list[dict]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Render chats with the tokenizer's chat template, ending with the assistant's turn opener;
    returns left-padded ids [B, P] and mask [B, P]."""
    texts = [_render(tok, c) for c in chats]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()


def _render(tok, chat: list[dict]) -> str:
    try:
        return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    except Exception:  # templates that reject a system role: fold it into the first user turn
        if chat and chat[0]["role"] == "system" and len(chat) > 1:
            merged = [{"role": "user", "content": chat[0]["content"] + "\n\n" + chat[1]["content"]}] + chat[2:]
            return tok.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
        raise


def _sample(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] by inverse-CDF sampling: one uniform number per row
    (``torch.multinomial`` draws one per vocabulary entry, about 30 ms per step on 2 CPU cores)."""
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def _positions(mask: torch.Tensor) -> torch.Tensor:
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


@torch.no_grad()
def generate(model, tok, chats: list[list[dict]], sampling: Sampling, stop_ids: list[int],
             generator: torch.Generator | None = None) -> Generated:
    """Sample one reply per chat, all chats in one batch, with a KV cache."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_chats(tok, chats, device)
    B = prompt_ids.shape[0]
    pad = tok.pad_token_id
    stops = torch.tensor(stop_ids, device=device)
    temp = sampling.temperature if sampling.temperature > 0 else 1.0
    mask = prompt_mask.long()
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=_positions(mask),
                use_cache=True, logits_to_keep=1)
    past, logits = getattr(out, _CACHE), out.logits[:, -1]
    tokens, logps, valid = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=device)  # the reply has ended before this token
    ended = torch.zeros(B, dtype=torch.bool, device=device)  # ended by an end-of-turn token or stop string
    texts_so_far = [""] * B if sampling.stop else None
    for _ in range(sampling.max_new_tokens):
        logp = F.log_softmax(logits.float() / temp, dim=-1)
        if sampling.temperature > 0:
            nxt = _sample(_filter(logp, sampling.top_k, sampling.top_p), generator)
        else:
            nxt = logp.argmax(-1)
        live = ~done
        nxt = torch.where(live, nxt, torch.full_like(nxt, pad))
        tokens.append(nxt)
        valid.append(live)
        logps.append(logp.gather(-1, nxt[:, None]).squeeze(-1) * live)
        hit = live & torch.isin(nxt, stops)
        if texts_so_far is not None:
            hit |= _stop_string_hit(tok, nxt, done, texts_so_far, sampling.stop)
        ended |= hit
        done = done | hit
        if bool(done.all()):
            break
        mask = torch.cat([mask, live.long()[:, None]], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=_positions(mask)[:, -1:],
                    use_cache=True, **{_CACHE: past})
        past, logits = getattr(out, _CACHE), out.logits[:, -1]
    response_ids = torch.stack(tokens, 1)
    response_mask = torch.stack(valid, 1)
    logprobs = torch.stack(logps, 1)
    texts = tok.batch_decode(response_ids, skip_special_tokens=True)
    return Generated(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ~ended, texts)


def _stop_string_hit(tok, nxt, done, texts, stop_strings) -> torch.Tensor:
    """Per-sequence check of user stop strings on the decoded reply so far (only when configured)."""
    hit = torch.zeros_like(done)
    for b in range(len(texts)):
        if done[b]:
            continue
        texts[b] += tok.decode([int(nxt[b])], skip_special_tokens=False)
        if any(s in texts[b] for s in stop_strings):
            hit[b] = True
    return hit


def sequence_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask,
                      temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log-probabilities [B, R] of ``response_ids`` after ``prompt_ids``, under
    log softmax(logits / T); 0 where ``response_mask`` is False."""
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask, response_mask], 1).long()
    P, R = prompt_ids.shape[1], response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask),
                   logits_to_keep=R + 1).logits[:, :-1]
    temp = temperature if temperature > 0 else 1.0
    logp = F.log_softmax(logits.float() / temp, dim=-1).gather(-1, response_ids[..., None]).squeeze(-1)
    return logp * response_mask
