"""How the policy and the critic are updated: the second part of a trainer (:mod:`marft.run.trainer`).

A policy update gets one :class:`marft.run.learner.PolicyBatch` per trained adapter (every random
choice already made by the trainer) and returns each adapter's :class:`marft.run.learner.UpdateStats`,
in adapter order, with the new weights in the team's models. :class:`LocalPolicy` runs one
:class:`marft.run.learner.AdapterLearner` per adapter in this process, one after another; the Ray
learner actors are the other policy update (:class:`marft.distributed.RayPolicy`).

:class:`CriticLearner` is the critic's learner beside it: the value heads (:mod:`marft.maths.critic`)
and their AdamW optimisers, fitted on the cached features, or with ``train.critic: lora`` together
with the critic's adapter on features recomputed each minibatch (step 5 of an iteration).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import torch

from ..engines.packing import PassWork
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
        self.work = PassWork()  # the last update's passes through the model (a learning critic's; MFU)

    def update(self, out: Rollout, targets: list[TurnTargets], iteration: int) -> tuple[dict, int]:
        """``train.critic_epochs`` passes over each head's rows (its agent's turns, or all for the
        team's head) in minibatches of about a quarter; returns the metrics (``value_loss``, or
        ``value_loss/<agent>``) and the number of updates skipped for a non-finite loss or gradient."""
        tr = self.cfg.train
        stats, skipped = {}, 0
        self.work = PassWork()
        for key, head in self.heads.items():
            idx = [i for i, t in enumerate(out.turns) if key in ("team", t.agent)]
            if not idx:  # an agent an agent program did not call in this batch: nothing to fit
                continue
            steps = [(self.optimizers[key], list(head.parameters()))]
            if self.adapter is not None:  # a learning critic: its features recomputed per minibatch, its adapter stepped too
                rows = [(i, r) for i in idx for r in range(len(out.turns[i].episodes))]
                steps.append((self.adapter_optimizer, self.models.adapter_parameters(self.adapter)))
                clip = tr.critic_lora_value_clip or None

                def loss_of(mb, head=head, rows=rows):
                    return self._minibatch_loss(out, targets, head, [rows[j] for j in mb.tolist()], clip)
                n = len(rows)
            else:  # the frozen critic: the cached features
                feats, old, ret = self._cached(out, targets, idx)

                def loss_of(mb, head=head, feats=feats, old=old, ret=ret):
                    return losses.value_loss(head(feats[mb]), old[mb], ret[mb], None, tr.value_clip or None)
                n = len(feats)
            mean, bad = self._fit(key, n, loss_of, steps, iteration)
            skipped += bad
            stats[f"value_loss/{key}" if key != "team" else "value_loss"] = mean
        return stats, skipped

    def _cached(self, out: Rollout, targets: list[TurnTargets], idx: list[int]):
        """The frozen critic's cached features, values before the update and returns of turns ``idx``:
        per row, or at token level per valid reply token."""
        if self.token_level:
            feats = torch.cat([targets[i].features.flatten(0, 1) for i in idx])
            old = torch.cat([targets[i].values.flatten() for i in idx])
            ret = torch.cat([targets[i].returns.flatten() for i in idx])
            valid = torch.cat([out.turns[i].response_mask.flatten() for i in idx])
            return feats[valid], old[valid], ret[valid]
        return (torch.cat([targets[i].features for i in idx]), torch.cat([targets[i].values for i in idx]),
                torch.cat([targets[i].returns for i in idx]))

    def _fit(self, key: str, n: int, loss_of, steps: list, iteration: int) -> tuple[float, int]:
        """``train.critic_epochs`` passes over ``n`` entries in shuffled minibatches of about a quarter
        (at least ``train.minibatch_size``): per minibatch ``loss_of(indices)``, backward, each
        (optimiser, parameters) of ``steps`` clipped to ``max_grad_norm`` on its own and stepped, or
        the update skipped when the loss or a gradient is not finite. (mean loss, updates skipped)."""
        tr = self.cfg.train
        g = torch.Generator().manual_seed(iteration_seed(self.cfg, iteration, 2))
        total, count, skipped = 0.0, 0, 0
        bs = max(tr.minibatch_size, n // 4 or 1)  # about four minibatches per pass
        for _ in range(tr.critic_epochs):
            for mb in torch.randperm(n, generator=g).split(bs):
                loss = loss_of(mb)
                for opt, _ in steps:
                    opt.zero_grad()
                loss.backward()
                norms = [torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm) for _, params in steps]
                if not (torch.isfinite(loss) and all(torch.isfinite(gn) for gn in norms)):
                    self.log(f"warning: non-finite value loss or gradient for critic {key} at iteration {iteration}; update skipped")
                    for opt, _ in steps:
                        opt.zero_grad()
                    skipped += 1
                    continue
                for opt, _ in steps:
                    opt.step()
                total, count = total + float(loss.detach()), count + 1
        return total / max(count, 1), skipped

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
            v = head(self.algorithm.critic_features(self.models, turn, rs, adapter=self.adapter, grad=True, work=self.work))
            for k, r in enumerate(rs):
                if self.token_level:  # the reply's tokens
                    m = turn.response_mask[r]
                    got[(i, r)] = (v[k][m], targets[i].values[r][m], targets[i].returns[r][m])
                else:
                    got[(i, r)] = (v[k:k + 1], targets[i].values[r:r + 1], targets[i].returns[r:r + 1])
        values, old, ret = (torch.cat([got[x][j].reshape(-1) for x in chosen]) for j in range(3))  # in the minibatch's order
        return losses.value_loss(values, old, ret, None, clip)

    def state(self) -> dict:
        """The optimisers' states (for a checkpoint's ``trainer.pt``; the heads go to its ``critic/``
        folder, :meth:`about` says what they are, and a learning critic's adapter weights are saved
        with the agents' adapters)."""
        out = {"critic_opt": {k: o.state_dict() for k, o in self.optimizers.items()}}
        if self.adapter_optimizer is not None:
            out["critic_adapter_opt"] = self.adapter_optimizer.state_dict()
        return out

    def about(self) -> dict:
        """What the heads are (a checkpoint's ``critic/critic.json``): the critic's kind
        (``train.critic``), the algorithm whose heads they are, and the critic's adapter (or None)."""
        return {"kind": self.cfg.train.critic, "algorithm": self.cfg.train.algorithm, "adapter": self.adapter}

    def start_from(self, source: str | Path, team: list[str]) -> None:
        """``model.init_critic``: the heads, and a learning critic's adapter, of the critic saved in
        ``source`` (a checkpoint, its ``adapters/``, or a run folder: its latest) for the same team
        (``team``) and algorithm, or a one-line error saying why they cannot start this run's critic."""
        from ..errors import UserError
        from .checkpoints import critic_checkpoint, load_heads, read_critic

        try:
            ckpt = critic_checkpoint(source)
        except UserError as e:  # a run folder without a checkpoint, a file: adapters_folder's words
            raise UserError(f"model.init_critic: {e}") from None
        found = read_critic(ckpt) if ckpt is not None else None
        if found is None:
            raise UserError(f"model.init_critic: {source} holds no saved critic (give a checkpoint, or a run folder with one, "
                            "of a run of marft, marft-token or ippo)")
        about, heads = found
        algorithm, names = self.cfg.train.algorithm, about.get("team") or team
        if about["algorithm"] != algorithm or names != team or set(heads) != set(self.heads):
            raise UserError(f"model.init_critic: the critic in {ckpt} is {about['algorithm']}'s for team {', '.join(names)}; "
                            f"this run is {algorithm}'s for team {', '.join(team)}: start from a critic of the same "
                            "algorithm and team")
        if about["kind"] == "lora" and self.adapter is None:
            raise UserError(f"model.init_critic: the critic in {ckpt} is a learning one (its heads read features through "
                            "its adapter); start it with train.critic=lora")
        load_heads(self.heads, heads, f"model.init_critic: the critic in {ckpt} does not fit this run's model",
                   "start from a critic of the same base model")
        if about["kind"] == "lora":
            self.models.load_adapter(self.adapter, ckpt / "adapters" / about["adapter"])

    def load(self, state: dict, heads: dict, checkpoint: Path | None = None) -> None:
        """A checkpoint's heads (``{head: state_dict}``) and optimisers (``state``), with the config's
        learning rates (not the saved ones)."""
        missing = [k for k in self.heads if k not in heads]
        if missing:
            from ..errors import UserError

            raise UserError(f"checkpoint {checkpoint} has no value head {missing[0]!r} (its critic/ folder is missing or "
                            "incomplete); resume from an earlier checkpoint, or start a new run")
        for k, h in self.heads.items():
            h.load_state_dict(heads[k])
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
