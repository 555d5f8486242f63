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
    fitted to the returns with the clipped value loss (:func:`marft.maths.losses.value_loss`).

    ``train.critic: lora`` (``adapter``: the critic's LoRA adapter in ``models``): the features are
    recomputed through the adapter, with gradients, for every minibatch (``algorithm``'s
    :meth:`marft.maths.algorithms.Algorithm.critic_features`), and the adapter is trained with the
    heads by its own AdamW (``train.critic_lora_lr``), its gradient clipped on its own; the loss's
    clip is ``train.critic_lora_value_clip``."""

    def __init__(self, cfg: RunConfig, heads: dict[str, torch.nn.Module], token_level: bool,
                 log: Callable[[str], None] = print, models=None, adapter: str | None = None, algorithm=None):
        self.cfg, self.heads, self.token_level, self.log = cfg, heads, token_level, log
        self.optimizers = {k: torch.optim.AdamW(h.parameters(), lr=cfg.train.critic_lr) for k, h in heads.items()}
        self.models, self.adapter, self.algorithm = models, adapter, algorithm
        self.adapter_optimizer = (torch.optim.AdamW(models.adapter_parameters(adapter), lr=cfg.train.critic_lora_lr)
                                  if adapter is not None else None)

    def update(self, out: Rollout, targets: list[TurnTargets], iteration: int) -> tuple[dict, int]:
        """``train.critic_epochs`` passes over each head's rows (its agent's turns, or all for the
        team's head) in minibatches of about a quarter; returns the metrics (``value_loss``, or
        ``value_loss/<agent>``) and the number of updates skipped for a non-finite loss or gradient."""
        if self.adapter is not None:
            return self._update_with_adapter(out, targets, iteration)
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

    def _update_with_adapter(self, out: Rollout, targets: list[TurnTargets], iteration: int) -> tuple[dict, int]:
        """The learning critic's update: each head's rows (turn, row) in the frozen critic's
        minibatches (at token level: of replies, each reply's tokens together); per minibatch the
        features through the adapter with gradients, the clipped value loss on the valid entries,
        one step of the head and one of the adapter, each gradient clipped to ``max_grad_norm``."""
        tr = self.cfg.train
        stats, skipped = {}, 0
        adapter_params = self.models.adapter_parameters(self.adapter)
        clip = tr.critic_lora_value_clip or None
        for key, head in self.heads.items():
            rows = [(i, r) for i, t in enumerate(out.turns) if key in ("team", t.agent) for r in range(len(t.episodes))]
            if not rows:
                continue
            g = torch.Generator().manual_seed(iteration_seed(self.cfg, iteration, 2))
            total, count = 0.0, 0
            bs = max(tr.minibatch_size, len(rows) // 4 or 1)
            for _ in range(tr.critic_epochs):
                for mb in torch.randperm(len(rows), generator=g).split(bs):
                    chosen = [rows[j] for j in mb.tolist()]
                    loss = self._minibatch_loss(out, targets, head, chosen, clip)
                    self.optimizers[key].zero_grad()
                    self.adapter_optimizer.zero_grad()
                    loss.backward()
                    gn = torch.nn.utils.clip_grad_norm_(head.parameters(), tr.max_grad_norm)
                    gn_adapter = torch.nn.utils.clip_grad_norm_(adapter_params, tr.max_grad_norm)
                    if not (torch.isfinite(loss) and torch.isfinite(gn) and torch.isfinite(gn_adapter)):
                        self.log(f"warning: non-finite value loss or gradient for critic {key} at iteration {iteration}; update skipped")
                        self.optimizers[key].zero_grad()
                        self.adapter_optimizer.zero_grad()
                        skipped += 1
                        continue
                    self.optimizers[key].step()
                    self.adapter_optimizer.step()
                    total, count = total + float(loss.detach()), count + 1
            stats[f"value_loss/{key}" if key != "team" else "value_loss"] = total / max(count, 1)
        return stats, skipped

    def _minibatch_loss(self, out: Rollout, targets: list[TurnTargets], head, chosen: list[tuple[int, int]], clip):
        """The clipped value loss of rows ``chosen`` (turn, row), their features recomputed through
        the critic's adapter with gradients: a mean over the rows, or at token level over the valid
        reply tokens."""
        by_turn: dict[int, list[int]] = {}
        for i, r in chosen:
            by_turn.setdefault(i, []).append(r)
        got: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # (turn, row) -> value, old, return
        for i, rs in by_turn.items():
            turn = out.turns[i]
            v = head(self.algorithm.critic_features(self.models, turn, rs, adapter=self.adapter, grad=True)).cpu()
            for k, r in enumerate(rs):
                if self.token_level:  # the reply's tokens
                    m = turn.response_mask[r]
                    got[(i, r)] = (v[k][m], targets[i].values[r][m], targets[i].returns[r][m])
                else:
                    got[(i, r)] = (v[k:k + 1], targets[i].values[r:r + 1], targets[i].returns[r:r + 1])
        values, old, ret = (torch.cat([got[x][j].reshape(-1) for x in chosen]) for j in range(3))  # in the minibatch's order
        return losses.value_loss(values, old, ret, None, clip)

    def state(self) -> dict:
        """The heads' and optimisers' states (for a checkpoint; a learning critic's adapter weights
        are saved with the agents' adapters)."""
        out = {"heads": {k: h.state_dict() for k, h in self.heads.items()},
               "critic_opt": {k: o.state_dict() for k, o in self.optimizers.items()}}
        if self.adapter_optimizer is not None:
            out["critic_adapter_opt"] = self.adapter_optimizer.state_dict()
        return out

    def load(self, state: dict) -> None:
        """A checkpoint's heads and optimisers, with the config's learning rates (not the saved ones)."""
        for k, h in self.heads.items():
            h.load_state_dict(state["heads"][k])
            self.optimizers[k].load_state_dict(state["critic_opt"][k])
            for group in self.optimizers[k].param_groups:
                group["lr"] = self.cfg.train.critic_lr
        if self.adapter_optimizer is not None:
            if "critic_adapter_opt" not in state:
                from ..errors import UserError

                raise UserError("the checkpoint was written with train.critic=head; resume it with train.critic=head")
            self.adapter_optimizer.load_state_dict(state["critic_adapter_opt"])
            for group in self.adapter_optimizer.param_groups:
                group["lr"] = self.cfg.train.critic_lora_lr
