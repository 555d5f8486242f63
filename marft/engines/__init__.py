"""The generation engine: a base model with one LoRA adapter per agent (:mod:`.models`), and what
plays it: marft's own decode loop (:mod:`.generation`, with :mod:`.attention`, :mod:`.compiling`,
:mod:`.packing` for padding-free learner passes, :mod:`.logits` for log-probabilities and entropy),
FLOP counts and the machine's matmul rate (:mod:`.flops`, :mod:`.machine`), and the rollout engines
``rollout.engine`` names: ``hf`` (:mod:`.hf`, the decode loop on the learner's weights) and ``vllm``
(:mod:`.vllm`, one vLLM instance per base model serving every adapter; only it imports vLLM, and
only when asked for). :mod:`.base` holds the interface a rollout uses.

May import: torch, transformers, peft, :mod:`marft.team`, :mod:`marft.errors`. A new engine goes
here: a subclass of :class:`.base.Engine` and a branch in :func:`make_engine`.
"""
from __future__ import annotations

from .base import Engine, Reply, pack
from .hf import HFEngine


def make_engine(cfg, models) -> Engine:
    """The engine ``cfg.rollout.engine`` names, acting with ``models``' adapters."""
    if cfg.rollout.engine == "vllm":
        from .vllm import VLLMEngine

        return VLLMEngine(models, cfg.model, cfg.rollout.vllm, seed=cfg.seed)
    return HFEngine(models, fast=cfg.train.fast, merge=cfg.rollout.fold_adapters, compile=cfg.rollout.compile)


__all__ = ["Engine", "HFEngine", "Reply", "make_engine", "pack"]
