"""Rollout engines (``rollout.engine``): ``hf``, marft's own loop on the learner's weights, and
``vllm``, one vLLM instance per base model serving every agent's adapter. :mod:`.base` holds the
interface a rollout uses; only :mod:`.vllm` imports vLLM, and only when it is asked for."""
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
