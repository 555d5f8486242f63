"""One adapter's policy update, step 6 of an iteration (:mod:`marft.run.trainer`), on its own.

An :class:`AdapterLearner` holds one adapter's AdamW. Given a :class:`PolicyBatch` (the turns it
learns from, their normalised advantages, its rows and one shuffled order of them per epoch:
every random choice already made by the trainer), :meth:`AdapterLearner.update` runs the PPO
epochs and returns :class:`UpdateStats`:

1. behaviour log-probabilities: each row's reply under the weights before any step, recomputed by
   the learner (so the first ratio is exactly 1: rollout and learner numerics differ, in bf16
   especially); on the fast path the first minibatch's come from its own forward pass, since no
   weight has moved when it runs (``packing.REUSE_FIRST``);
2. each minibatch of each epoch's order: forward and backward in micro-batches, the gradients
   accumulated with weights that do not depend on how the minibatch is split; the clipped PPO
   surrogate at action or token level, the entropy bonus and the KL penalty to the reference
   policy; gradient clipping, then one optimiser step; ``train.target_kl`` stops the epochs early;
3. the statistics: means over the steps taken, each update's outcome, the skipped micro-batches,
   the gap between rollout and learner log-probabilities, and the FLOPs (:mod:`marft.engines.flops`) and
   seconds of the behaviour pass and of the learner.

Numerical trouble never reaches the weights: a micro-batch with non-finite log-probabilities
(rollout, recomputed, current or reference) or a non-finite loss is skipped, and so is an update
with a non-finite gradient or with no micro-batch left, each with a warning. The learner reports
each update's outcome (``on_update``, as it happens, and :attr:`UpdateStats.outcomes`); counting
them against ``train.max_bad_updates`` across iterations is its caller's business.

Data-parallel learners of one adapter (``group``: a torch.distributed process group, which
:mod:`marft.distributed` sets up for ``cluster.learners_per_adapter`` > 1) each run every
world-th micro-batch and sum gradients, statistics and behaviour log-probabilities by all-reduce.

Both the in-process :class:`marft.run.trainer.Trainer` (one learner per adapter) and the Ray learner
actor (:class:`marft.distributed.actors.Learner`) update through this class.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..engines import flops, packing
from ..maths import losses
from ..maths.algorithms import ALGORITHMS
from ..engines.generation import positions_of

if TYPE_CHECKING:
    from .config import RunConfig
    from ..engines.models import TeamModel
    from ..turns import Turn

Pair = tuple[int, int]  # (turn index into PolicyBatch.turns, row of that turn)


@dataclass
class PolicyBatch:
    """What one adapter's update learns from, every random choice already made.

    ``turns``: the turns holding the adapter's rows, in rollout order; ``advantages``: per turn,
    normalised over the whole batch: [b] (action level) or [b * R] / [b, R] (token level,
    flattened when normalised); ``rows``: the adapter's rows (turn, row); ``orders``: one shuffled
    order of ``rows`` per epoch. Build one with :meth:`of`, which keeps only the turns the rows use.
    """

    turns: list[Turn]
    advantages: list[torch.Tensor]
    rows: list[Pair]
    orders: list[list[Pair]]
    version: int | None = None
    """The version of the adapter being updated (policy updates so far), where the turns record the
    versions that generated them (asynchronous training): rows of an older version are stale and
    trained with the decoupled objective (:meth:`stale`). None: every row is fresh."""
    packed: list | None = field(default=None, repr=False, compare=False)  # see packed_rows

    @classmethod
    def of(cls, turns: list[Turn], advantages: list[torch.Tensor], rows: list[Pair], orders: list[list[Pair]],
           version: int | None = None) -> PolicyBatch:
        """The batch of ``rows`` and ``orders`` (pairs indexing ``turns`` and ``advantages``, all of a
        rollout's): only the turns they use, renumbered in order (what a Ray learner is sent)."""
        used = sorted({i for i, _ in rows})
        new = {i: j for j, i in enumerate(used)}

        def remap(pairs: list[Pair]) -> list[Pair]:
            return [(new[i], r) for i, r in pairs]

        return cls([turns[i] for i in used], [advantages[i] for i in used], remap(rows), [remap(o) for o in orders], version)

    def stale(self, mb: list[Pair]) -> torch.Tensor | None:
        """[b] bool: which rows of ``mb`` an older adapter version generated; None when none did."""
        if self.version is None:
            return None
        flags = torch.tensor([self.turns[i].versions is not None and int(self.turns[i].versions[r]) < self.version
                              for i, r in mb], dtype=torch.bool)
        return flags if bool(flags.any()) else None

    def packed_rows(self) -> list[list[packing.Row]]:
        """Every turn's rows without padding (:func:`marft.engines.packing.unpad`), made on first use."""
        if self.packed is None:
            self.packed = [packing.unpad(t.prompt_ids, t.prompt_mask, t.response_ids, t.response_mask) for t in self.turns]
        return self.packed

    def __getstate__(self) -> dict:
        return {**self.__dict__, "packed": None}  # the receiver unpads (a Ray learner is sent the padded turns)


@dataclass
class UpdateStats:
    """What one :meth:`AdapterLearner.update` did. The six statistics are means over the optimiser
    steps taken (each step's entropy and KL to the reference weigh tokens; its loss, ratio KL and
    clip fraction weigh rows, or tokens at token level); 0 when none was."""

    policy_loss: float = 0.0
    entropy: float = 0.0
    approx_kl: float = 0.0
    clip_fraction: float = 0.0
    kl_ref: float = 0.0
    grad_norm: float = 0.0  # before clipping to train.max_grad_norm
    early_stop: bool = False  # train.target_kl ended the epochs early
    outcomes: list[bool] = field(default_factory=list)  # each update in order: True stepped, False skipped
    micro_batches_skipped: int = 0
    logprob_gap: list[tuple[float, int]] = field(default_factory=list)  # (sum |rollout - learner|, tokens) per recomputed row
    behaviour_flops: float = 0.0  # needed FLOPs (marft.engines.packing.needed_work) of the behaviour pass
    learner_flops: float = 0.0  # of the updates' forward + backward passes (and reference forwards)
    behaviour_s: float = 0.0  # seconds of the behaviour pass (the rest of the update is the learner's)
    stale: dict = field(default_factory=dict)  # asynchronous training: importance_weight, capped_fraction over the micro-batches holding stale rows (their fresh rows, weight 1, included), means over steps

    STATS = ("policy_loss", "entropy", "approx_kl", "clip_fraction", "kl_ref", "grad_norm")

    @property
    def steps(self) -> int:
        """Optimiser steps taken."""
        return self.outcomes.count(True)

    @property
    def updates_skipped(self) -> int:
        return self.outcomes.count(False)

    def metrics(self, prefix: str = "") -> dict:
        """The statistics as metrics, names prefixed with ``prefix`` (see :func:`metric_prefix`)."""
        return {**{prefix + k: getattr(self, k) for k in self.STATS}, prefix + "early_stop": self.early_stop,
                **{prefix + k: v for k, v in self.stale.items()}}


def metric_prefix(adapter: str, n_adapters: int) -> str:
    """The prefix of an adapter's policy metrics: none for a team that shares one adapter
    (``team``, alone in the update), otherwise ``<adapter>/``."""
    return "" if n_adapters == 1 and adapter == "team" else f"{adapter}/"


class AdapterLearner:
    """One adapter's policy update (see the module docstring), with its own AdamW
    (:attr:`optimizer`, over :meth:`marft.engines.models.TeamModel.adapter_parameters`).

    ``cfg``: the run's config, read when used (``train`` and ``rollout.temperature``); ``models``:
    the team's models holding ``adapter``; ``log``: where warnings go; ``group``: the
    torch.distributed group of this adapter's data-parallel learners, or None."""

    def __init__(self, cfg: RunConfig, models: TeamModel, adapter: str, log: Callable[[str], None] = print, group=None):
        self.cfg, self.models, self.adapter, self.log, self.group = cfg, models, adapter, log, group
        self.algorithm = ALGORITHMS[cfg.train.algorithm]  # it carries its loss
        self.optimizer = torch.optim.AdamW(models.adapter_parameters(adapter), lr=cfg.train.lr)
        base = models.bases[models.base_of[adapter]]
        # train.micro_batch_tokens, or (0) by the device: 2,048 on a CPU, by its memory on a GPU
        self.micro_tokens = packing.token_budget(base, cfg.train.micro_batch_tokens)
        self.device = next(base.parameters()).device

    def load_optimizer(self, state: dict) -> None:
        """The optimiser's state from a checkpoint, with the config's learning rate (not the saved one)."""
        self.optimizer.load_state_dict(state)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.train.lr

    # ------------------------------------------------------------------ the update
    def update(self, batch: PolicyBatch, iteration: int, on_update: Callable[[bool], None] | None = None) -> UpdateStats:
        """PPO epochs over ``batch.rows`` in ``batch.orders``, one optimiser step per minibatch of
        ``train.minibatch_size`` rows. ``iteration`` (0-based) names the iteration in warnings;
        ``on_update`` is called after each update, with True when it stepped and False when it
        was skipped (what a caller counts against ``train.max_bad_updates``; it may raise)."""
        tr = self.cfg.train
        st = UpdateStats()
        params = self.models.adapter_parameters(self.adapter)
        opt = self.optimizer
        packed = batch.packed_rows()
        # the fast path takes the first minibatch's behaviour log-probs from its own pass (no
        # weight has moved yet when it runs); data-parallel learners recompute them all
        pending = set(batch.orders[0][:tr.minibatch_size]) if tr.fast and packing.REUSE_FIRST and not self.group else set()
        t0 = time.perf_counter()
        recompute = [x for x in batch.rows if x not in pending]
        old = self.behaviour_logprobs(batch, recompute)
        st.logprob_gap = _logprob_gap(batch, old, recompute)
        st.behaviour_s = time.perf_counter() - t0
        st.behaviour_flops = self._needed(packed, recompute, backward=False)
        agg = dict.fromkeys(UpdateStats.STATS, 0.0)
        n_mb, stopped = 0, False
        stale, stale_n = {}, {}
        for order in batch.orders:
            for lo in range(0, len(order), tr.minibatch_size):
                mb = order[lo:lo + tr.minibatch_size]
                opt.zero_grad()
                mb_stats = self.accumulate(batch, mb, old, iteration, pending)
                if self.group:  # every learner's share: the skipped micro-batches of all of them, as one learner counts
                    mb_stats = self._all_reduce(params, mb_stats)
                st.micro_batches_skipped += int(mb_stats.pop("skipped"))
                st.learner_flops += self._needed(packed, mb, backward=True)
                if tr.kl_coef > 0:  # the reference policy's forward
                    st.learner_flops += self._needed(packed, mb, backward=False)
                gn = torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm)
                if not mb_stats.pop("used") or not torch.isfinite(gn):
                    if torch.isfinite(gn):
                        self.log(f"warning: every micro-batch of an update of adapter {self.adapter} was skipped at iteration {iteration}; update skipped")
                    else:
                        self.log(f"warning: non-finite gradient for adapter {self.adapter} at iteration {iteration}; update skipped")
                    opt.zero_grad()
                    st.outcomes.append(False)
                    if on_update:
                        on_update(False)
                    continue
                opt.step()
                st.outcomes.append(True)
                if on_update:
                    on_update(True)
                for k in agg:
                    agg[k] += mb_stats.get(k, 0.0) if k != "grad_norm" else float(gn)
                if mb_stats.get("stale_weight", 0.0) > 0:  # the minibatch held stale rows: their weights' means
                    for k in ("importance_weight", "capped_fraction"):
                        stale[k] = stale.get(k, 0.0) + mb_stats[k] / mb_stats["stale_weight"]
                        stale_n[k] = stale_n.get(k, 0) + 1
                n_mb += 1
                if tr.target_kl and mb_stats["approx_kl"] > tr.target_kl:
                    stopped = True
                    break
            if stopped:
                break
        for k, v in agg.items():
            setattr(st, k, v / max(n_mb, 1))
        st.stale = {k: v / stale_n[k] for k, v in stale.items()}
        st.early_stop = stopped
        return st

    def first_gradients(self, batch: PolicyBatch, iteration: int = 0) -> list[torch.Tensor]:
        """The gradient (summed over data-parallel learners) of the first minibatch of the first
        epoch's order, no step taken and the adapter's gradients left empty: for the check that
        ``world`` learners compute what one does."""
        old = self.behaviour_logprobs(batch, batch.rows)
        params = self.models.adapter_parameters(self.adapter)
        for p in params:
            p.grad = None
        mb = batch.orders[0][:self.cfg.train.minibatch_size]
        st = self.accumulate(batch, mb, old, iteration)
        st.pop("skipped")
        if self.group:
            self._all_reduce(params, st)
        grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        for p in params:
            p.grad = None
        return grads

    # ------------------------------------------------------------------ its steps
    @torch.no_grad()
    def behaviour_logprobs(self, batch: PolicyBatch, rows: list[Pair]) -> dict[int, torch.Tensor]:
        """Behaviour log-probabilities [b, R] per turn (turn index -> tensor shaped like its
        ``logprobs``) of ``rows`` under the current weights; the other rows are zeros (those
        :meth:`update` leaves pending are filled by :meth:`accumulate` from its own pass)."""
        old = {i: torch.zeros_like(t.logprobs) for i, t in enumerate(batch.turns)}
        for mb in self._my_share(self._micro_batches(batch, rows)):
            with self.models.acting(batch.turns[mb[0][0]].agent) as (model, _):
                lp, _ = self._logprobs(model, batch, mb, False)
            for (i, r), row in zip(mb, lp.cpu()):
                old[i][r] = row[: old[i].shape[1]]
        if self.group:  # every learner computed its share; the others' rows are zeros
            for i in sorted(old):
                old[i] = self._reduced(old[i])
        return old

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the data-parallel learners, where it came from: NCCL reduces CUDA
        tensors only, so a CPU tensor goes to this learner's GPU and back."""
        import torch.distributed as dist

        there = x.to(self.device) if dist.get_backend(self.group) == "nccl" else x
        dist.all_reduce(there, group=self.group)
        return there.to(x.device)

    def accumulate(self, batch: PolicyBatch, mb: list[Pair], old: dict[int, torch.Tensor], iteration: int = 0,
                   pending: set | None = None) -> dict:
        """Forward and backward of one minibatch ``mb`` in micro-batches (this learner's share of
        them), gradients added to the adapter's. Action level: each row's loss weighs 1 / rows of
        ``mb``; token-level losses, entropy and KL weigh the micro-batch's reply tokens / the
        minibatch's, so the gradient does not depend on how the minibatch is split. ``old``: the
        behaviour log-probabilities; rows in ``pending`` take theirs from this pass (and are
        stored in ``old`` for later epochs). Returns the weighted sums of the statistics, ``used``
        (micro-batches back-propagated) and ``skipped`` (micro-batches left out)."""
        tr = self.cfg.train
        pending = set() if pending is None else pending
        turns, norm_adv = batch.turns, batch.advantages
        stats = {"policy_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0, "kl_ref": 0.0, "used": 0}
        if batch.version is not None:  # asynchronous: the same keys on every data-parallel learner, summed, divided after
            stats.update(importance_weight=0.0, capped_fraction=0.0, stale_weight=0.0)
        skipped = 0
        mb_tokens = sum(int(turns[i].response_mask[r].sum()) for i, r in mb)
        for chunk in self._my_share(self._micro_batches(batch, mb)):
            agent = turns[chunk[0][0]].agent
            R = max(turns[i].response_ids.shape[1] for i, _ in chunk)
            rmask = _gather(turns, chunk, "response_mask", R)
            w_rows, w_tok = len(chunk) / len(mb), float(rmask.sum()) / max(mb_tokens, 1)
            ref_lp = None
            if tr.kl_coef > 0:
                with torch.no_grad(), self.models.reference(agent) as (model, _):
                    ref_lp = self._logprobs(model, batch, chunk, False)[0]
            with self.models.acting(agent) as (model, _):
                lp, ent = self._logprobs(model, batch, chunk, tr.entropy_coef > 0)
            rmask = rmask.to(lp.device)
            old_lp = _gather_old(old, pending, chunk, R, lp)
            bad = [name for name, x in (("rollout", _gather(turns, chunk, "logprobs", R)), ("recomputed", old_lp),
                                        ("current", lp), ("reference", ref_lp)) if x is not None and not _finite(x, rmask)]
            if bad:
                self.log(f"warning: non-finite {', '.join(bad)} log-probabilities for agent {agent} at iteration "
                         f"{iteration}; micro-batch skipped")
                skipped += 1
                continue
            a = self.algorithm.row_advantages(norm_adv, turns, chunk, R).to(lp.device)
            # stale rows (an older adapter's replies): the rollout's log-probs are the behaviour policy's,
            # ``old_lp`` the proximal one's; fresh rows have behaviour = proximal (importance weight 1)
            stale = batch.stale(chunk)
            behaviour = None if stale is None else torch.where(stale[:, None].to(lp.device),
                                                               _gather(turns, chunk, "logprobs", R).to(lp.device), old_lp)
            pl, st = self.algorithm.policy_loss(lp, old_lp, a, rmask, tr, [turns[i].texts[r] for i, r in chunk], behaviour)
            w = w_tok if self.algorithm.token_level else w_rows
            loss = w * pl
            if ent is not None:
                loss = loss - tr.entropy_coef * w_tok * ent
                stats["entropy"] += w_tok * float(ent.detach())
            if ref_lp is not None:
                kl = losses.kl_penalty(lp, ref_lp, rmask)
                loss = loss + tr.kl_coef * w_tok * kl
                stats["kl_ref"] += w_tok * float(kl.detach())
            if not torch.isfinite(loss):
                self.log(f"warning: non-finite loss for agent {agent} at iteration {iteration}; micro-batch skipped")
                skipped += 1
                continue
            loss.backward()
            stats["used"] += 1
            stats["policy_loss"] += w * float(pl.detach())
            stats["approx_kl"] += w * st["approx_kl"]
            stats["clip_fraction"] += w * st["clip_fraction"]
            if "importance_weight_mean" in st:  # stale rows: the decoupled objective's weights (weighted sums)
                stats["stale_weight"] += w
                stats["importance_weight"] += w * st["importance_weight_mean"]
                stats["capped_fraction"] += w * st["capped_fraction"]
        return {**stats, "skipped": skipped}

    def _micro_batches(self, batch: PolicyBatch, rows: list[Pair]) -> list[list[Pair]]:
        """Split ``rows`` into forward/backward passes: ``fast``: rows of similar length together,
        by tokens (``micro_batch_tokens``) and rows (``micro_batch_size``); plain: by turn,
        ``micro_batch_size`` rows at a time."""
        tr = self.cfg.train
        if tr.fast:
            packed = batch.packed_rows()
            lengths = [packed[i][r].length for i, r in rows]
            return [[rows[j] for j in g] for g in packing.micro_batches(lengths, self.micro_tokens, tr.micro_batch_size)]
        by_turn: dict[int, list[int]] = {}
        for i, r in rows:
            by_turn.setdefault(i, []).append(r)
        return [[(i, r) for r in rs[lo:lo + tr.micro_batch_size]] for i, rs in by_turn.items()
                for lo in range(0, len(rs), tr.micro_batch_size)]

    def _logprobs(self, model, batch: PolicyBatch, mb: list[Pair], with_entropy: bool):
        """Teacher-forced token log-probabilities [b, R] of the replies of ``mb`` (R = the longest
        of their turns' reply widths, 0 beyond a reply) and the masked mean entropy (a scalar
        tensor, or None), under log softmax(logits / rollout.temperature)."""
        temp = self.cfg.rollout.temperature
        turns = batch.turns
        R = max(turns[i].response_ids.shape[1] for i, _ in mb)
        if self.cfg.train.fast:
            packed = batch.packed_rows()
            lp, ent, _ = packing.response_logprobs(model, [packed[i][r] for i, r in mb], temp, with_entropy,
                                                  compile=self.cfg.train.compile)
            rmask = _gather(turns, mb, "response_mask", R).to(lp.device)
            lp = torch.nn.functional.pad(lp, (0, R - lp.shape[1]))
            if ent is not None:
                ent = losses.masked_mean(torch.nn.functional.pad(ent, (0, R - ent.shape[1])), rmask)
            return lp, ent
        t = turns[mb[0][0]]
        rows = [r for _, r in mb]
        ids = torch.cat([t.prompt_ids[rows], t.response_ids[rows]], 1)
        mask = torch.cat([t.prompt_mask[rows], t.response_mask[rows]], 1)
        device = next(model.parameters()).device
        ids, mask_l = ids.to(device), mask.long().to(device)
        logits = model(input_ids=ids, attention_mask=mask_l, position_ids=positions_of(mask_l),
                       logits_to_keep=t.response_ids.shape[1] + 1).logits[:, :-1]
        logits = logits.float() / temp
        resp = t.response_ids[rows].to(device)
        rmask = t.response_mask[rows].to(device)
        lp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1) * rmask
        ent = losses.entropy_from_logits(logits, rmask) if with_entropy else None
        return torch.nn.functional.pad(lp, (0, R - lp.shape[1])), ent

    def _my_share(self, chunks: list) -> list:
        """This learner's share of the micro-batches: all of them, or every world-th for data-parallel learners."""
        if not self.group:
            return chunks
        import torch.distributed as dist

        return chunks[dist.get_rank(self.group)::dist.get_world_size(self.group)]

    def _all_reduce(self, params: list, stats: dict) -> dict:
        """Data-parallel learners: sum the gradients and the statistics of every learner's share of
        the minibatch's micro-batches."""
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.flatten().float() for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
            offset += n
        keys = sorted(stats)
        vec = self._reduced(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
        return {k: (int(v) if k == "used" else float(v)) for k, v in zip(keys, vec.tolist())}

    def _needed(self, packed: list[list[packing.Row]], rows: list[Pair], backward: bool) -> float:
        """FLOPs a pass over ``rows`` needs (:func:`marft.engines.packing.needed_work`), forward or forward
        + backward, whichever path computes it."""
        if not rows:
            return 0.0
        tr = self.cfg.train
        w = packing.needed_work([packed[i][r] for i, r in rows], self.micro_tokens, tr.micro_batch_size)
        return w.flops(flops.model_shape(self.models.bases[self.models.base_of[self.adapter]]), backward)


def _gather(turns: list[Turn], mb: list[Pair], name: str, R: int) -> torch.Tensor:
    """``turn.<name>`` [b_i, R_i] of each row of ``mb``, right-padded (zeros) to [b, R]."""
    return torch.stack([torch.nn.functional.pad(getattr(turns[i], name)[r], (0, R - turns[i].response_ids.shape[1]))
                        for i, r in mb])


def _gather_old(old: dict, pending: set, chunk: list[Pair], R: int, lp: torch.Tensor) -> torch.Tensor:
    """Behaviour log-probabilities [b, R] of ``chunk``; rows still ``pending`` (the fast path's
    first minibatch: no weight has moved yet) take the current pass's values ``lp`` [b, R],
    stored in ``old`` for later epochs."""
    rows = []
    for (i, r), cur in zip(chunk, lp.detach()):
        if (i, r) in pending:
            pending.discard((i, r))
            old[i][r] = cur[: old[i].shape[1]].cpu()
        stored = old[i][r]
        rows.append(torch.nn.functional.pad(stored, (0, R - stored.shape[0])))
    return torch.stack(rows).to(lp.device)


def _logprob_gap(batch: PolicyBatch, old: dict, rows: list[Pair]) -> list[tuple[float, int]]:
    """(sum, tokens) of |rollout - learner| behaviour log-probabilities of each of ``rows``
    (``rollout/logprob_gap``: how far the engine's numerics are from the learner's)."""
    gap = []
    for i, r in rows:
        m = batch.turns[i].response_mask[r]
        gap.append((float((batch.turns[i].logprobs[r][m] - old[i][r][m]).abs().sum()), int(m.sum())))
    return gap


def _finite(x: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``x`` [b, R] is finite wherever ``mask`` [b, R] is True (padding may hold anything)."""
    return bool(torch.isfinite(x[mask.to(x.device)]).all())
