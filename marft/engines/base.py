"""The rollout engine interface: chat prompts in, replies with their log-probabilities out.

A rollout asks an engine for one agent's replies to a batch of chats (:meth:`Engine.generate`,
the barrier schedule: every episode waits for the batch) or, where the engine supports it,
submits requests one episode at a time and collects each reply as soon as it is done
(:meth:`Engine.submit` / :meth:`Engine.collect`, the asynchronous schedule of
``rollout.schedule: async``). Either way a reply carries the prompt's token ids as the learner's
tokenizer renders them, the reply's ids (with its end-of-turn token), the log-probability of each
reply token under the temperature-scaled policy, and whether it was cut at its token limit.

Engines act with the team's current adapters. The HF engine (:mod:`marft.engines.hf`) runs on
the learner's own weights, so there is nothing to hand over; an engine that holds its own copy of
the weights (:mod:`marft.engines.vllm`) is given the trained adapters after every policy update
(:meth:`Engine.update`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .generation import Generated, Sampling, needed_work


@dataclass
class Reply:
    """One agent's reply to one chat."""

    prompt_ids: list[int]
    response_ids: list[int]  # with the end-of-turn token when the reply ended on one
    logprobs: list[float]  # one per response token
    truncated: bool  # cut at the token limit without ending
    text: str  # decoded without special tokens


class Engine:
    """What a rollout needs from an engine. ``generate`` is required; the asynchronous pair
    ``submit``/``collect`` is optional (``asynchronous`` says whether it is there)."""

    name = "engine"
    asynchronous = False

    def generate(self, agent: str, chats: list[list[dict]], sampling: Sampling,
                 generator: torch.Generator | None = None) -> Generated:
        """One reply per chat with ``agent``'s adapter, as one batch."""
        raise NotImplementedError

    def submit(self, key, agent: str, chat: list[dict], sampling: Sampling, seed: int) -> None:
        """Queue one request; its reply comes back from :meth:`collect` under ``key``."""
        raise NotImplementedError(f"the {self.name} engine has no asynchronous schedule")

    def collect(self) -> list[tuple[object, Reply]]:
        """Block until at least one submitted request is done; return every finished (key, reply)."""
        raise NotImplementedError(f"the {self.name} engine has no asynchronous schedule")

    def flops(self, agent: str, out: Generated) -> float:
        """FLOPs the replies needed (:mod:`marft.engines.flops`), for MFU; 0 when unknown."""
        return 0.0

    def before_update(self) -> None:
        """The learner is about to update the adapters (an engine may free memory for it)."""

    def update(self) -> None:
        """The team's adapters changed (a policy update, a loaded checkpoint): act with the new ones."""

    def close(self) -> None:
        """Free the engine's resources."""


def pack(replies: list[Reply], pad_id: int) -> Generated:
    """Replies as one batch: prompts left-padded, responses right-padded (the shapes of
    :class:`marft.engines.generation.Generated`, which :class:`marft.run.rollout.Turn` is built from)."""
    B = len(replies)
    P = max((len(r.prompt_ids) for r in replies), default=0)
    R = max((len(r.response_ids) for r in replies), default=0)
    prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.full((B, R), pad_id, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.bool)
    logprobs = torch.zeros(B, R, dtype=torch.float32)
    for i, r in enumerate(replies):
        p, n = len(r.prompt_ids), len(r.response_ids)
        if p:
            prompt_ids[i, P - p:] = torch.tensor(r.prompt_ids)
            prompt_mask[i, P - p:] = True
        if n:
            response_ids[i, :n] = torch.tensor(r.response_ids)
            response_mask[i, :n] = True
            logprobs[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
    truncated = torch.tensor([r.truncated for r in replies], dtype=torch.bool)
    work = needed_work(prompt_ids, prompt_mask, response_mask)
    return Generated(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, truncated,
                     [r.text for r in replies], work)

