"""The HF engine: marft's own batched sampling loop (:func:`marft.engines.generation.generate`) on the
learner's PEFT model, with the acting agent's adapter switched on. It shares the learner's weights,
so an update needs no hand-over. Barrier schedule only: one batched call per agent turn."""
from __future__ import annotations

import torch

from .flops import model_shape
from .generation import Generated, Sampling, generate
from .models import TeamModel, stop_token_ids
from .base import Engine


class HFEngine(Engine):
    name = "hf"

    def __init__(self, models: TeamModel, fast: bool = True, merge: bool = False, compile: bool = False):
        self.models = models
        # fast False: the plain loop (no shared-prefix prefill, finished rows kept in the batch,
        # the KV cache grown by concatenation), kept to measure against
        self.flags = {} if fast else {"compact": False, "share_prefix": False, "preallocate": False, "static": False}
        if compile:  # rollout.compile: the static loop's step under torch.compile
            self.flags["compile"] = True
        # merge (rollout.fold_adapters): act with the adapter folded into the base weights
        # (TeamModel.acting_merged) instead of through the adapter layers
        self.merge = merge

    def _acting(self, agent: str):
        return self.models.acting_merged(agent) if self.merge else self.models.acting(agent)

    def generate(self, agent: str, chats: list[list[dict]], sampling: Sampling,
                 generator: torch.Generator | None = None) -> Generated:
        with self._acting(agent) as (model, tok):
            return generate(model, tok, chats, sampling, stop_token_ids(model, tok), generator, **self.flags)

    def flops(self, agent: str, out: Generated) -> float:
        model, _, _ = self.models.for_agent(agent)
        return out.work.flops(model_shape(model)) if out.work is not None else 0.0
