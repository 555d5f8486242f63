"""How the policy and the critic are updated: the second part of a trainer (:mod:`marft.run.trainer`).

A policy update gets one :class:`marft.run.learner.PolicyBatch` per trained adapter (every random
choice already made by the trainer) and returns each adapter's :class:`marft.run.learner.UpdateStats`,
in adapter order, with the new weights in the team's models. :class:`LocalPolicy` runs one
:class:`marft.run.learner.AdapterLearner` per adapter in this process, one after another; the Ray
learner actors are the other policy update (:class:`marft.distributed.RayPolicy`).

:class:`CriticLearner` is the critic's learner beside it: the value heads (:mod:`marft.maths.critic`)
and their AdamW optimisers, fitted on the cached features (step 5 of an iteration).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..maths import losses
from ..maths.algorithms import TurnTargets
from ..turns import Rollout
from .config import RunConfig
from .episodes import iteration_seed
from .learner import AdapterLearner, PolicyBatch, UpdateStats


class PolicyUpdate(Protocol):
    """What a trainer needs from how its policy is updated."""

    parallel: bool
    """The adapters are updated at once (their behaviour passes overlap) rather than one after another."""

    def update(self, batches: dict[str, PolicyBatch], iteration: int,
               on_update: Callable[[bool], None]) -> list[tuple[str, UpdateStats]]:
        """Each adapter's update from its batch; ``on_update(good)`` for every optimiser update's
        outcome, in adapter order; returns (adapter, stats) in adapter order, the new weights in
        the team's models."""

    def optimizer_states(self) -> dict[str, dict]:
        """Each adapter's optimiser state (for a checkpoint)."""

    def load(self, optimizer_states: dict[str, dict]) -> None:
        """A checkpoint's optimiser states, and the team's models' adapters, into the learners."""

    def close(self) -> None:
        """Free the learners."""


class LocalPolicy:
    """One :class:`AdapterLearner` per adapter, in this process, updating the team's models in place."""

    parallel = False

    def __init__(self, cfg: RunConfig, models, adapters: list[str], log: Callable[[str], None] = print):
        self.learners = {a: AdapterLearner(cfg, models, a, log=log) for a in adapters}

    def update(self, batches: dict[str, PolicyBatch], iteration: int,
               on_update: Callable[[bool], None]) -> list[tuple[str, UpdateStats]]:
        return [(adapter, self.learners[adapter].update(batch, iteration, on_update=on_update))
                for adapter, batch in batches.items()]

    def optimizer_states(self) -> dict[str, dict]:
        return {a: learner.optimizer.state_dict() for a, learner in self.learners.items()}

    def load(self, optimizer_states: dict[str, dict]) -> None:
        for a, learner in self.learners.items():
            learner.load_optimizer(optimizer_states[a])

    def close(self) -> None:
        pass


class CriticLearner:
    """The value heads of ``train.algorithm`` (``"team"``, one per agent, or none) and an AdamW each,
    fitted to the returns with the clipped value loss (:func:`marft.maths.losses.value_loss`)."""

    def __init__(self, cfg: RunConfig, heads: dict[str, torch.nn.Module], token_level: bool,
                 log: Callable[[str], None] = print):
        self.cfg, self.heads, self.token_level, self.log = cfg, heads, token_level, log
        self.optimizers = {k: torch.optim.AdamW(h.parameters(), lr=cfg.train.critic_lr) for k, h in heads.items()}

    def update(self, out: Rollout, targets: list[TurnTargets], iteration: int) -> tuple[dict, int]:
        """``train.critic_epochs`` passes over each head's rows (its agent's turns, or all for the
        team's head) in minibatches of about a quarter; returns the metrics (``value_loss``, or
        ``value_loss/<agent>``) and the number of updates skipped for a non-finite loss or gradient."""
        tr = self.cfg.train
        stats, skipped = {}, 0
        for key, head in self.heads.items():
            idx = [i for i, t in enumerate(out.turns) if key in ("team", t.agent)]
            if not idx:  # an agent an agent program did not call in this batch: nothing to fit
                continue
            if self.token_level:
                feats = torch.cat([targets[i].features.flatten(0, 1) for i in idx])
                old = torch.cat([targets[i].values.flatten() for i in idx])
                ret = torch.cat([targets[i].returns.flatten() for i in idx])
                valid = torch.cat([out.turns[i].response_mask.flatten() for i in idx])
                feats, old, ret = feats[valid], old[valid], ret[valid]
            else:
                feats = torch.cat([targets[i].features for i in idx])
                old = torch.cat([targets[i].values for i in idx])
                ret = torch.cat([targets[i].returns for i in idx])
            g = torch.Generator().manual_seed(iteration_seed(self.cfg, iteration, 2))
            total, count = 0.0, 0
            bs = max(tr.minibatch_size, len(feats) // 4 or 1)  # about four minibatches per pass
            for _ in range(tr.critic_epochs):
                for mb in torch.randperm(len(feats), generator=g).split(bs):
                    loss = losses.value_loss(head(feats[mb]), old[mb], ret[mb], None, tr.value_clip or None)
                    self.optimizers[key].zero_grad()
                    loss.backward()
                    gn = torch.nn.utils.clip_grad_norm_(head.parameters(), tr.max_grad_norm)
                    if not (torch.isfinite(loss) and torch.isfinite(gn)):
                        self.log(f"warning: non-finite value loss or gradient for critic {key} at iteration {iteration}; update skipped")
                        self.optimizers[key].zero_grad()
                        skipped += 1
                        continue
                    self.optimizers[key].step()
                    total, count = total + float(loss.detach()), count + 1
            stats[f"value_loss/{key}" if key != "team" else "value_loss"] = total / max(count, 1)
        return stats, skipped

    def state(self) -> dict:
        """The heads' and optimisers' states (for a checkpoint)."""
        return {"heads": {k: h.state_dict() for k, h in self.heads.items()},
                "critic_opt": {k: o.state_dict() for k, o in self.optimizers.items()}}

    def load(self, state: dict) -> None:
        """A checkpoint's heads and optimisers, with the config's learning rate (not the saved one)."""
        for k, h in self.heads.items():
            h.load_state_dict(state["heads"][k])
            self.optimizers[k].load_state_dict(state["critic_opt"][k])
            for group in self.optimizers[k].param_groups:
                group["lr"] = self.cfg.train.critic_lr
