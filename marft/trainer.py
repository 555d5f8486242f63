"""The MARFT trainer. One iteration, in numbered steps:

1. rollout: the team plays ``rollout.episodes`` training episodes with the current adapters;
2. rewards: the environment's team rewards per step, credited to micro-steps;
3. values: the critic's features and values for every micro-step (or token, or own observation);
4. advantages: action-level GAE (marft), token-level GAE (marft-token), per-agent GAE (ippo) or
   group-relative baselines (grpo);
5. critic update: the value head on the cached features;
6. policy update: each trained agent's adapter with its own AdamW, clipped PPO surrogate, in
   minibatches with gradient accumulation.

Numerical trouble never reaches the weights: a micro-batch with non-finite log-probabilities (from
the rollout or recomputed) or a non-finite loss is skipped, and so is an update with a non-finite
gradient (or with nothing left to learn from), each with a warning; ``train.max_bad_updates``
skipped updates in a row stop the run with a :class:`UserError`, its last checkpoint untouched.
The metrics count skipped updates and degenerate batches (every episode rewarded the same, empty
or truncated replies). Episodes whose environment raised or timed out are left out of the update
and counted (``episodes/failed``); a batch in which every episode failed stops the run.

Checkpoints (adapters in PEFT format, critic, optimisers, iteration, config) are written atomically
to ``<output_dir>/checkpoints/iter_NNNNNN`` and ``latest`` names the newest complete one. Every
random choice of iteration i is seeded from (seed, i), so a resumed run repeats an uninterrupted one.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import advantages as adv_fns
from . import flops, losses, packing
from .checkpoints import latest_checkpoint, read_state, write_checkpoint
from .config import RunConfig, save_config
from .critic import ValueHead, prompt_features, state_features, token_features
from .engines import Engine, make_engine
from .errors import UserError
from .generation import Sampling, _positions
from .rollout import Rollout, Turn, rollout


@dataclass
class TurnTargets:
    """What the update needs for one :class:`Turn`, row-aligned with it."""

    features: torch.Tensor  # [b, H] or [b, R, H] (token level)
    values: torch.Tensor  # [b] or [b, R]: critic values at rollout time
    advantages: torch.Tensor  # [b] or [b, R]
    returns: torch.Tensor  # [b] or [b, R]


def _seed(cfg: RunConfig, iteration: int, salt: int = 0) -> int:
    return (cfg.seed * 1_000_003 + iteration * 7_919 + salt) % 2**63


class Trainer:
    def __init__(self, cfg: RunConfig, team, models, make_env, log=print, engine: Engine | None = None):
        """``engine`` plays the rollouts (:mod:`marft.engines`); None: the one ``rollout.engine`` names."""
        self.cfg, self.team, self.models, self.make_env, self.log = cfg, team, models, make_env, log
        self.engine = engine if engine is not None else make_engine(cfg, models)
        tr = cfg.train
        self.algorithm = tr.algorithm
        self.token_level = tr.algorithm == "marft-token"
        self.run_dir = Path(cfg.output_dir)
        first = next(iter(models.bases.values()))
        hidden = first.config.hidden_size
        torch.manual_seed(cfg.seed)
        if tr.algorithm == "ippo":
            self.heads = {a: ValueHead(hidden) for a in team.names}
        elif tr.algorithm == "grpo":
            self.heads = {}
        else:
            self.heads = {"team": ValueHead(hidden)}
        self.critic_opt = {k: torch.optim.AdamW(h.parameters(), lr=tr.critic_lr) for k, h in self.heads.items()}
        self.policy_opt = {a: torch.optim.AdamW(models.adapter_parameters(a), lr=tr.lr) for a in team.adapters}
        self.iteration = 0
        self.bad_in_a_row = 0  # skipped policy updates since the last good one (train.max_bad_updates)
        self.skipped = {"updates": 0, "micro_batches": 0, "critic_updates": 0}  # in the current iteration
        self._pending_old: set = set()  # (turn, row) whose behaviour log-probs come from the first pass
        self._rows = None  # packing.Row per turn and row of the batch being learned from
        self._flops = dict.fromkeys(("behaviour", "learner"), 0.0)  # needed FLOPs in this iteration
        self._behaviour_s = 0.0
        self._critic_work = packing.Work()
        self._dp_group = None  # a torch.distributed group of data-parallel learners (marft.distributed)

    # ------------------------------------------------------------------ one iteration
    def iteration_step(self) -> dict:
        cfg, tr, it = self.cfg, self.cfg.train, self.iteration
        times = {}
        self.skipped = dict.fromkeys(self.skipped, 0)
        self._flops = dict.fromkeys(("behaviour", "learner"), 0.0)
        self._behaviour_s = 0.0
        self._critic_work = packing.Work()
        t0 = time.perf_counter()
        # 1. rollout
        out, failed = self._without_failed(self._rollout(it))
        times["rollout_s"] = time.perf_counter() - t0
        times["generation_s"] = out.gen_seconds  # the rest of rollout_s is prompts and scoring
        # 2-4. rewards, values, advantages
        t1 = time.perf_counter()
        targets = self._targets(out)
        times["critic_features_s"] = time.perf_counter() - t1
        # 5. critic update
        t2 = time.perf_counter()
        critic_stats = self._update_critic(out, targets) if self.heads else {}
        times["critic_update_s"] = time.perf_counter() - t2
        # 6. policy update
        t3 = time.perf_counter()
        trained = self._trained_agents(it)
        self.engine.before_update()
        policy_stats = self._update_policy(out, targets, trained) if trained else {}
        self.engine.update()  # an engine with its own weights (vllm) gets the new adapters
        times["policy_update_s"] = time.perf_counter() - t3
        times["behaviour_logprobs_s"] = self._behaviour_s
        times["learner_s"] = times["policy_update_s"] - self._behaviour_s
        self.iteration += 1
        total = time.perf_counter() - t0
        tokens = out.generated_tokens
        shape = self._shape()
        work = {"rollout": (out.gen_flops, times["generation_s"]),
                "behaviour_logprobs": (self._flops["behaviour"], times["behaviour_logprobs_s"]),
                "learner": (self._flops["learner"], times["learner_s"]),
                "critic_features": (self._critic_work.flops(shape), times["critic_features_s"])}
        rate = flops.machine_rate(self._base())
        mfu = {f"mfu/{k}": flops.mfu(f, s, rate) for k, (f, s) in work.items()}
        mfu["mfu/iteration"] = flops.mfu(sum(f for f, _ in work.values()), total, rate)
        mfu["machine/matmul_gflops"] = rate / 1e9
        metrics = {
            "iteration": self.iteration,
            "reward": float(out.rewards.sum(1).mean()),
            "accuracy": float(out.success.float().mean()),
            "extracted": float(out.extracted.float().mean()),
            "tokens": tokens,
            "tokens_per_s": tokens / total,
            "seconds": total,
            "trained": trained,
            "episodes/failed": failed,
            **times, **mfu, **critic_stats, **policy_stats,
            **{f"skipped/{k}": v for k, v in self.skipped.items()},
            "skipped/updates_in_a_row": self.bad_in_a_row,
            **self._degenerate_stats(out),
        }
        for agent in self.team.names:
            rows = [t for t in out.turns if t.agent == agent]
            lens = torch.cat([t.response_mask.sum(1).float() for t in rows])
            metrics[f"{agent}/reply_tokens"] = float(lens.mean())
            metrics[f"{agent}/truncated"] = float(torch.cat([t.truncated.float() for t in rows]).mean())
        return metrics

    def _without_failed(self, out: Rollout) -> tuple[Rollout, int]:
        """Leave out the episodes whose environment raised or timed out (for grpo, their whole
        group), with a warning; if nothing is left the environment is broken: stop."""
        failed = int(out.failed.sum())
        if not failed:
            return out, 0
        errors = [i.get("error", "") for i, f in zip(out.infos, out.failed.tolist()) if f]
        keep = ~out.failed
        if self.algorithm == "grpo":
            keep = keep.view(-1, self.cfg.train.group_size).all(1, keepdim=True).expand(-1, self.cfg.train.group_size).flatten()
        if not keep.any():
            raise UserError(f"every episode of iteration {self.iteration + 1} failed in the environment (first: {errors[0]}); "
                            "fix the environment or its reward (check it with marft env-check), then marft train --resume")
        self.log(f"warning: {failed} of {len(keep)} episodes failed in the environment at iteration {self.iteration + 1} "
                 f"and are left out of the update (first: {errors[0]})")
        return out.select(keep), failed

    def _degenerate_stats(self, out: Rollout) -> dict:
        """How much of the batch carries no learning signal: ``degenerate/same_reward`` is the share
        of groups (grpo; otherwise the whole batch is one group) whose episodes all got the same
        return; ``responses/empty`` and ``responses/truncated`` the share of replies with no text and
        of replies cut at ``rollout.max_new_tokens``."""
        returns = out.rewards.sum(1)
        size = self.cfg.train.group_size if self.algorithm == "grpo" else len(returns)
        groups = returns.view(-1, size)
        same = (groups == groups[:, :1]).all(1).float().mean()
        texts = [x for t in out.turns for x in t.texts]
        return {"degenerate/same_reward": float(same),
                "responses/empty": sum(not x.strip() for x in texts) / max(len(texts), 1),
                "responses/truncated": float(torch.cat([t.truncated.float() for t in out.turns]).mean())}

    def _resets(self, it: int) -> list[tuple[int, dict]]:
        """The (seed, options) of each training episode of iteration ``it`` (grpo: groups of one problem)."""
        cfg, tr = self.cfg, self.cfg.train
        rng = random.Random(_seed(cfg, it))
        E = cfg.rollout.episodes
        if self.algorithm == "grpo":
            problems = [rng.randrange(2**62) for _ in range(E // tr.group_size)]
            return [(p, {"split": "train"}) for p in problems for _ in range(tr.group_size)]
        return [(rng.randrange(2**62), {"split": "train"}) for _ in range(E)]

    def _rollout(self, it: int) -> Rollout:
        return play(self.cfg, self.team, self.engine, self.make_env, self._resets(it), _seed(self.cfg, it, 1))

    def _trained_agents(self, it: int) -> list[str]:
        tr = self.cfg.train
        if it < tr.critic_warmup and self.heads:
            return []
        if tr.agent_by_agent > 0:
            return [self.team.names[(it // tr.agent_by_agent) % len(self.team.names)]]
        return list(self.team.names)

    # ------------------------------------------------------------------ steps 2-4
    def _micro_index(self, turn: Turn) -> int:
        return turn.step * len(self.team.names) + self.team.names.index(turn.agent)

    def _targets(self, out: Rollout) -> list[TurnTargets]:
        tr = self.cfg.train
        E, H = out.rewards.shape
        N = len(self.team.names)
        rewards, discounts, dones, mask = adv_fns.micro_layout(out.rewards, out.dones, N, tr.gamma, tr.agent_gamma, tr.credit)
        if self.algorithm == "grpo":
            group = torch.arange(E) // tr.group_size
            a = adv_fns.group_advantages(out.rewards.sum(1), group, tr.group_baseline)
            zero = torch.zeros(0)
            return [TurnTargets(zero, torch.zeros(len(t.episodes)), a[t.episodes], torch.zeros(len(t.episodes)))
                    for t in out.turns]
        if self.algorithm == "ippo":
            feats = [prompt_features(self.models, t.agent, t.prompt_ids, t.prompt_mask, work=self._critic_work) for t in out.turns]
            values = torch.zeros(E, H, N)
            for t, f in zip(out.turns, feats):
                with torch.no_grad():
                    values[t.episodes, t.step, self.team.names.index(t.agent)] = self.heads[t.agent](f)
            a, ret = adv_fns.ippo_gae(out.rewards, values, adv_fns.valid_steps(out.dones), tr.gamma, tr.lam)
            i = self.team.names.index
            return [TurnTargets(f, values[t.episodes, t.step, i(t.agent)], a[t.episodes, t.step, i(t.agent)],
                                ret[t.episodes, t.step, i(t.agent)]) for t, f in zip(out.turns, feats)]
        head = self.heads["team"]
        K = H * N
        if not self.token_level:
            feats = [state_features(self.models, t.agent, t.states, work=self._critic_work) for t in out.turns]
            values = torch.zeros(E, K)
            for t, f in zip(out.turns, feats):
                with torch.no_grad():
                    values[t.episodes, self._micro_index(t)] = head(f)
            a, ret = adv_fns.gae(rewards, values, discounts, dones, mask, tr.lam)
            return [TurnTargets(f, values[t.episodes, self._micro_index(t)], a[t.episodes, self._micro_index(t)],
                                ret[t.episodes, self._micro_index(t)]) for t, f in zip(out.turns, feats)]
        # token level
        T = max(t.response_ids.shape[1] for t in out.turns)
        lengths = torch.zeros(E, K, dtype=torch.long)
        tok_values = torch.zeros(E, K, T)
        feats = []
        for t in out.turns:
            f = token_features(self.models, t.agent, t.states, t.response_ids, t.response_mask, work=self._critic_work)
            feats.append(f)
            k = self._micro_index(t)
            lengths[t.episodes, k] = t.response_mask.sum(1)
            with torch.no_grad():
                v = head(f) * t.response_mask
            tok_values[t.episodes, k, : v.shape[1]] = v
        t_rew, t_disc, t_done, t_mask, first = adv_fns.token_layout(lengths, rewards * mask, discounts, dones & mask, tr.gamma_token)
        L = t_rew.shape[1]
        v_layout = adv_fns.to_token_layout(tok_values, lengths, first, L)
        a, ret = adv_fns.gae(t_rew, v_layout, t_disc, t_done, t_mask, tr.lam)
        a_tok = adv_fns.from_token_layout(a, lengths, first, T)
        r_tok = adv_fns.from_token_layout(ret, lengths, first, T)
        targets = []
        for t, f in zip(out.turns, feats):
            k, R = self._micro_index(t), t.response_ids.shape[1]
            targets.append(TurnTargets(f, tok_values[t.episodes, k, :R], a_tok[t.episodes, k, :R], r_tok[t.episodes, k, :R]))
        return targets

    # ------------------------------------------------------------------ step 5
    def _update_critic(self, out: Rollout, targets: list[TurnTargets]) -> dict:
        tr = self.cfg.train
        stats = {}
        for key, head in self.heads.items():
            idx = [i for i, t in enumerate(out.turns) if key in ("team", t.agent)]
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
            g = torch.Generator().manual_seed(_seed(self.cfg, self.iteration, 2))
            total, count = 0.0, 0
            bs = max(tr.minibatch_size, len(feats) // 4 or 1)  # about four minibatches per pass
            for _ in range(tr.critic_epochs):
                for mb in torch.randperm(len(feats), generator=g).split(bs):
                    loss = losses.value_loss(head(feats[mb]), old[mb], ret[mb], None, tr.value_clip or None)
                    self.critic_opt[key].zero_grad()
                    loss.backward()
                    gn = torch.nn.utils.clip_grad_norm_(head.parameters(), tr.max_grad_norm)
                    if not (torch.isfinite(loss) and torch.isfinite(gn)):
                        self.log(f"warning: non-finite value loss or gradient for critic {key} at iteration {self.iteration}; update skipped")
                        self.critic_opt[key].zero_grad()
                        self.skipped["critic_updates"] += 1
                        continue
                    self.critic_opt[key].step()
                    total, count = total + float(loss.detach()), count + 1
            stats[f"value_loss/{key}" if key != "team" else "value_loss"] = total / max(count, 1)
        return stats

    # ------------------------------------------------------------------ step 6
    def _update_policy(self, out: Rollout, targets: list[TurnTargets], trained: list[str]) -> dict:
        stats: dict = {}
        plan = self._plan_policy(out, targets, trained)
        gap: list[tuple[float, int]] = []
        self._rows = [packing.unpad(t.prompt_ids, t.prompt_mask, t.response_ids, t.response_mask) for t in out.turns]
        for adapter, (rows, orders) in plan["adapters"].items():
            stats.update(self._update_adapter(out, plan["advantages"], adapter, rows, orders, gap, len(plan["adapters"])))
        stats.update(_gap_stat(gap))
        return stats

    def _plan_policy(self, out: Rollout, targets: list[TurnTargets], trained: list[str]) -> dict:
        """What the policy update of each trained adapter learns from, decided before any update:
        ``adapters``: adapter -> (its rows (turn, row), one shuffled order of them per epoch);
        ``advantages``: the normalised advantages per turn (normalised over the whole batch). Every
        random choice is made here, so adapters can then be updated in any order, or at once."""
        tr = self.cfg.train
        rows_by_adapter: dict[str, list[tuple[int, int]]] = {}
        for i, t in enumerate(out.turns):
            if t.agent in trained:
                adapter = self.team[t.agent].adapter
                rows_by_adapter.setdefault(adapter, []).extend((i, r) for r in range(len(t.episodes)))
        g = torch.Generator().manual_seed(_seed(self.cfg, self.iteration, 3))
        adapters = {a: (rows, [[rows[j] for j in torch.randperm(len(rows), generator=g).tolist()] for _ in range(tr.epochs)])
                    for a, rows in rows_by_adapter.items()}
        return {"adapters": adapters, "advantages": self._normalised_advantages(out, targets)}

    def _update_adapter(self, out: Rollout, norm_adv: list, adapter: str, rows: list[tuple[int, int]],
                        orders: list[list[tuple[int, int]]], gap: list, n_adapters: int) -> dict:
        """PPO epochs over one adapter's ``rows`` in the given ``orders``; its stats. Needs
        ``self._rows`` (packing rows of ``out``'s turns)."""
        tr = self.cfg.train
        stats: dict = {}
        params = self.models.adapter_parameters(adapter)
        opt = self.policy_opt[adapter]
        # behaviour log-probabilities; the fast path takes the first minibatch's from its own pass
        # (no weight has moved yet when it runs)
        self._pending_old = set(orders[0][:tr.minibatch_size]) if tr.fast and packing.REUSE_FIRST and not self._dp_group else set()
        t0 = time.perf_counter()
        recompute = [x for x in rows if x not in self._pending_old]
        old = self._old_logprobs(out, recompute)
        self._logprob_gap(out, old, recompute, gap)
        self._behaviour_s += time.perf_counter() - t0
        self._flops["behaviour"] += self._needed(adapter, recompute, backward=False)
        agg = {"policy_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0, "kl_ref": 0.0, "grad_norm": 0.0}
        n_mb, stopped = 0, False
        for order in orders:
            for lo in range(0, len(order), tr.minibatch_size):
                mb = order[lo:lo + tr.minibatch_size]
                opt.zero_grad()
                mb_stats = self._accumulate(out, mb, old, norm_adv, len(mb))
                if self._dp_group:
                    mb_stats = self._all_reduce(params, mb_stats)
                self._flops["learner"] += self._needed(adapter, mb, backward=True)
                if tr.kl_coef > 0:  # the reference policy's forward
                    self._flops["learner"] += self._needed(adapter, mb, backward=False)
                gn = torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm)
                if not mb_stats.pop("used") or not torch.isfinite(gn):
                    if torch.isfinite(gn):
                        self.log(f"warning: every micro-batch of an update of adapter {adapter} was skipped at iteration {self.iteration}; update skipped")
                    else:
                        self.log(f"warning: non-finite gradient for adapter {adapter} at iteration {self.iteration}; update skipped")
                    opt.zero_grad()
                    self._skip_update()
                    continue
                opt.step()
                self._good_update()
                for k in agg:
                    agg[k] += mb_stats.get(k, 0.0) if k != "grad_norm" else float(gn)
                n_mb += 1
                if tr.target_kl and mb_stats["approx_kl"] > tr.target_kl:
                    stopped = True
                    break
            if stopped:
                break
        prefix = "" if n_adapters == 1 and adapter == "team" else f"{adapter}/"
        for k, v in agg.items():
            stats[prefix + k] = v / max(n_mb, 1)
        stats[prefix + "early_stop"] = stopped
        return stats

    def _good_update(self) -> None:
        self.bad_in_a_row = 0

    def _all_reduce(self, params: list, stats: dict) -> dict:
        """Data-parallel learners (:mod:`marft.distributed`): sum the gradients and the statistics
        of every learner's share of the minibatch's micro-batches."""
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.flatten().float() for g in grads])
        dist.all_reduce(flat, group=self._dp_group)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g).to(g.dtype)
            offset += n
        keys = sorted(stats)
        vec = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(vec, group=self._dp_group)
        return {k: (int(v) if k == "used" else float(v)) for k, v in zip(keys, vec.tolist())}

    @staticmethod
    def _logprob_gap(out: Rollout, old: dict, rows: list[tuple[int, int]], gap: list) -> None:
        """Append to ``gap`` (sum, tokens) of |rollout - learner| behaviour log-probabilities of each
        recomputed row (``rollout/logprob_gap``: how far the engine's numerics are from the learner's)."""
        for i, r in rows:
            m = out.turns[i].response_mask[r]
            gap.append((float((out.turns[i].logprobs[r][m] - old[i][r][m]).abs().sum()), int(m.sum())))

    def _base(self, adapter: str | None = None):
        return self.models.bases[self.models.base_of[adapter or self.team.adapters[0]]]

    def _shape(self, adapter: str | None = None) -> flops.ModelShape:
        return flops.model_shape(self._base(adapter))

    def _needed(self, adapter: str, rows: list[tuple[int, int]], backward: bool) -> float:
        """FLOPs a pass over ``rows`` needs (:func:`marft.packing.needed_work`), forward or forward
        + backward, whichever path computes it."""
        if not rows:
            return 0.0
        tr = self.cfg.train
        w = packing.needed_work([self._rows[i][r] for i, r in rows], tr.micro_batch_tokens, tr.micro_batch_size)
        return w.flops(self._shape(adapter), backward)

    def _skip_update(self) -> None:
        """Count a skipped policy update; ``train.max_bad_updates`` in a row stop the run."""
        self.skipped["updates"] += 1
        self.bad_in_a_row += 1
        limit = self.cfg.train.max_bad_updates
        if limit and self.bad_in_a_row >= limit:
            last = latest_checkpoint(self.run_dir)
            kept = f"the last checkpoint, {last}, is kept as it was" if last else "no checkpoint had been written"
            raise UserError(f"training stopped at iteration {self.iteration + 1}: {self.bad_in_a_row} policy updates in a row were "
                            f"skipped for non-finite log-probabilities, losses or gradients ({kept}); lower train.lr, try "
                            "model.dtype=float32, or raise train.max_bad_updates, then marft train --resume")

    def _normalised_advantages(self, out: Rollout, targets: list[TurnTargets]) -> list[torch.Tensor]:
        advs = [tg.advantages for tg in targets]
        if not self.cfg.train.normalize_advantages:
            return advs
        if self.token_level:
            flat = torch.cat([a.flatten() for a in advs])
            m = torch.cat([t.response_mask.flatten() for t in out.turns])
            normed = adv_fns.normalize(flat, m)
            return list(normed.split([a.numel() for a in advs]))  # reshaped in _accumulate
        flat = torch.cat(advs)
        return list(adv_fns.normalize(flat, torch.ones_like(flat, dtype=torch.bool)).split([len(a) for a in advs]))

    def _micro_batches(self, out: Rollout, rows: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Split rows (turn, row) into forward/backward passes: ``fast``: rows of similar length
        together, by tokens (``micro_batch_tokens``) and rows (``micro_batch_size``); plain: by turn,
        ``micro_batch_size`` rows at a time."""
        tr = self.cfg.train
        if tr.fast:
            lengths = [self._rows[i][r].length for i, r in rows]
            return [[rows[j] for j in g] for g in packing.micro_batches(lengths, tr.micro_batch_tokens, tr.micro_batch_size)]
        by_turn: dict[int, list[int]] = {}
        for i, r in rows:
            by_turn.setdefault(i, []).append(r)
        return [[(i, r) for r in rs[lo:lo + tr.micro_batch_size]] for i, rs in by_turn.items()
                for lo in range(0, len(rs), tr.micro_batch_size)]

    def _logprobs(self, model, out: Rollout, mb: list[tuple[int, int]], with_entropy: bool):
        """Teacher-forced token log-probabilities [b, R] of the replies of ``mb`` (pairs (turn, row);
        R = the longest of their turns' reply widths, 0 beyond a reply) and the masked mean entropy
        (a scalar tensor, or None), under log softmax(logits / rollout.temperature)."""
        temp = self.cfg.rollout.temperature
        R = max(out.turns[i].response_ids.shape[1] for i, _ in mb)
        if self.cfg.train.fast:
            lp, ent, _ = packing.response_logprobs(model, [self._rows[i][r] for i, r in mb], temp, with_entropy)
            rmask = self._gather(out, mb, "response_mask", R).to(lp.device)
            lp = torch.nn.functional.pad(lp, (0, R - lp.shape[1]))
            if ent is not None:
                ent = losses.masked_mean(torch.nn.functional.pad(ent, (0, R - ent.shape[1])), rmask)
            return lp, ent
        t = out.turns[mb[0][0]]
        rows = [r for _, r in mb]
        ids = torch.cat([t.prompt_ids[rows], t.response_ids[rows]], 1)
        mask = torch.cat([t.prompt_mask[rows], t.response_mask[rows]], 1)
        device = next(model.parameters()).device
        ids, mask_l = ids.to(device), mask.long().to(device)
        logits = model(input_ids=ids, attention_mask=mask_l, position_ids=_positions(mask_l),
                       logits_to_keep=t.response_ids.shape[1] + 1).logits[:, :-1]
        logits = logits.float() / temp
        resp = t.response_ids[rows].to(device)
        rmask = t.response_mask[rows].to(device)
        lp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1) * rmask
        ent = losses.entropy_from_logits(logits, rmask) if with_entropy else None
        return torch.nn.functional.pad(lp, (0, R - lp.shape[1])), ent

    @staticmethod
    def _gather(out: Rollout, mb: list[tuple[int, int]], name: str, R: int) -> torch.Tensor:
        """``turn.<name>`` [b_i, R_i] of each row of ``mb``, right-padded (zeros) to [b, R]."""
        return torch.stack([torch.nn.functional.pad(getattr(out.turns[i], name)[r], (0, R - out.turns[i].response_ids.shape[1]))
                            for i, r in mb])

    @torch.no_grad()
    def _old_logprobs(self, out: Rollout, rows: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Behaviour log-probabilities [b, R] per turn, recomputed by the learner (so the first
        ratio is exactly 1: rollout and learner numerics differ, in bf16 especially). Rows not in
        ``rows`` are zeros here; those in ``self._pending_old`` are filled by :meth:`_accumulate`
        from its own pass."""
        old = {i: torch.zeros_like(t.logprobs) for i, t in enumerate(out.turns)}
        agent_of = {i: t.agent for i, t in enumerate(out.turns)}
        for mb in self._my_share(self._micro_batches(out, rows)):
            with self.models.acting(agent_of[mb[0][0]]) as (model, _):
                lp, _ = self._logprobs(model, out, mb, False)
            for (i, r), row in zip(mb, lp.cpu()):
                old[i][r] = row[: old[i].shape[1]]
        if self._dp_group:  # every learner computed its share; the others' rows are zeros
            import torch.distributed as dist

            for i in sorted(old):
                dist.all_reduce(old[i], group=self._dp_group)
        return old

    def _my_share(self, chunks: list) -> list:
        """This learner's share of the micro-batches: all of them, or every world-th for data-parallel learners."""
        if not self._dp_group:
            return chunks
        import torch.distributed as dist

        return chunks[dist.get_rank(self._dp_group)::dist.get_world_size(self._dp_group)]

    def _accumulate(self, out: Rollout, mb: list[tuple[int, int]], old: dict, norm_adv: list, mb_size: int) -> dict:
        """Forward and backward of one minibatch in micro-batches. Action level: each row's loss
        weighs rows / ``mb_size``; token-level losses, entropy and KL weigh the micro-batch's reply
        tokens / the minibatch's, so the gradient does not depend on how the minibatch is split."""
        tr = self.cfg.train
        stats = {"policy_loss": 0.0, "entropy": 0.0, "approx_kl": 0.0, "clip_fraction": 0.0, "kl_ref": 0.0, "used": 0}
        mb_tokens = sum(int(out.turns[i].response_mask[r].sum()) for i, r in mb)
        for chunk in self._my_share(self._micro_batches(out, mb)):
            agent = out.turns[chunk[0][0]].agent
            R = max(out.turns[i].response_ids.shape[1] for i, _ in chunk)
            rmask = self._gather(out, chunk, "response_mask", R)
            w_rows, w_tok = len(chunk) / mb_size, float(rmask.sum()) / max(mb_tokens, 1)
            ref_lp = None
            if tr.kl_coef > 0:
                with torch.no_grad(), self.models.reference(agent) as (model, _):
                    ref_lp = self._logprobs(model, out, chunk, False)[0]
            with self.models.acting(agent) as (model, _):
                lp, ent = self._logprobs(model, out, chunk, tr.entropy_coef > 0)
            rmask = rmask.to(lp.device)
            old_lp = self._gather_old(old, chunk, R, lp)
            bad = [name for name, x in (("rollout", self._gather(out, chunk, "logprobs", R)), ("recomputed", old_lp),
                                        ("current", lp), ("reference", ref_lp)) if x is not None and not _finite(x, rmask)]
            if bad:
                self.log(f"warning: non-finite {', '.join(bad)} log-probabilities for agent {agent} at iteration "
                         f"{self.iteration}; micro-batch skipped")
                self.skipped["micro_batches"] += 1
                continue
            if self.token_level:
                a = torch.stack([torch.nn.functional.pad(norm_adv[i].view(len(out.turns[i].episodes), -1)[r],
                                                         (0, R - out.turns[i].response_ids.shape[1])) for i, r in chunk]).to(lp.device)
                pl, st = losses.ppo_policy_loss(lp, old_lp, a, rmask, tr.clip)
                w = w_tok
            else:
                words = torch.tensor([len(out.turns[i].texts[r].split()) for i, r in chunk]) if tr.logprob == "word" else None
                new_a = losses.action_logprobs(lp, rmask, tr.logprob, words)
                old_a = losses.action_logprobs(old_lp, rmask, tr.logprob, words)
                a = torch.stack([norm_adv[i][r] for i, r in chunk]).to(lp.device)
                pl, st = losses.ppo_policy_loss(new_a, old_a, a, None, tr.clip)
                w = w_rows
            loss = w * pl
            if ent is not None:
                loss = loss - tr.entropy_coef * w_tok * ent
                stats["entropy"] += w_tok * float(ent.detach())
            if ref_lp is not None:
                kl = losses.kl_penalty(lp, ref_lp, rmask)
                loss = loss + tr.kl_coef * w_tok * kl
                stats["kl_ref"] += w_tok * float(kl.detach())
            if not torch.isfinite(loss):
                self.log(f"warning: non-finite loss for agent {agent} at iteration {self.iteration}; micro-batch skipped")
                self.skipped["micro_batches"] += 1
                continue
            loss.backward()
            stats["used"] += 1
            stats["policy_loss"] += w * float(pl.detach())
            stats["approx_kl"] += w * st["approx_kl"]
            stats["clip_fraction"] += w * st["clip_fraction"]
        return stats

    def _gather_old(self, old: dict, chunk: list[tuple[int, int]], R: int, lp: torch.Tensor) -> torch.Tensor:
        """Behaviour log-probabilities [b, R] of ``chunk``; rows of the fast path's first minibatch
        (``self._pending_old``: no weight has moved yet) take the current pass's values, stored for
        later epochs."""
        rows = []
        for (i, r), cur in zip(chunk, lp.detach()):
            if (i, r) in self._pending_old:
                self._pending_old.discard((i, r))
                old[i][r] = cur[: old[i].shape[1]].cpu()
            stored = old[i][r]
            rows.append(torch.nn.functional.pad(stored, (0, R - stored.shape[0])))
        return torch.stack(rows).to(lp.device)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Write ``checkpoints/iter_NNNNNN`` atomically and point ``checkpoints/latest`` at it
        (:mod:`marft.checkpoints`): the adapters (PEFT format), the critic, the optimisers, the RNG
        state and the config."""
        def fill(folder: Path) -> None:
            self.models.save_adapters(folder / "adapters")
            torch.save({
                "iteration": self.iteration,
                "heads": {k: h.state_dict() for k, h in self.heads.items()},
                "critic_opt": {k: o.state_dict() for k, o in self.critic_opt.items()},
                "policy_opt": {k: o.state_dict() for k, o in self.policy_opt.items()},
                "torch_rng": torch.get_rng_state(),
                "team": self.team.names,
                "adapters": self.team.adapters,
                "algorithm": self.algorithm,
                "bad_in_a_row": self.bad_in_a_row,
            }, folder / "trainer.pt")
            save_config(self.cfg, folder / "config.yaml")

        return write_checkpoint(self.run_dir, self.iteration, fill, self.cfg.train.keep_checkpoints)

    def close(self) -> None:
        """Free the engine (and, for a distributed run, the actors)."""
        self.engine.close()

    def load(self, checkpoint: Path) -> None:
        state = read_state(checkpoint)
        mine = (self.team.names, self.team.adapters, self.algorithm)
        if (state["team"], state["adapters"], state["algorithm"]) != mine:
            raise UserError(f"checkpoint {checkpoint} was written for team {state['team']} with adapters {state['adapters']} "
                            f"({state['algorithm']}), not {mine[0]} with adapters {mine[1]} ({mine[2]}); resume with the run's own config")
        self.models.load_adapters(checkpoint / "adapters")
        self.engine.update()
        for k, h in self.heads.items():
            h.load_state_dict(state["heads"][k])
            self.critic_opt[k].load_state_dict(state["critic_opt"][k])
        for k, o in self.policy_opt.items():
            o.load_state_dict(state["policy_opt"][k])
        for opts, lr in ((self.policy_opt, self.cfg.train.lr), (self.critic_opt, self.cfg.train.critic_lr)):
            for o in opts.values():  # the config's learning rates, not the saved ones: an override on resume counts
                for group in o.param_groups:
                    group["lr"] = lr
        torch.set_rng_state(state["torch_rng"])
        self.iteration = state["iteration"]
        self.bad_in_a_row = state.get("bad_in_a_row", 0)


def _gap_stat(gap: list[tuple[float, int]]) -> dict:
    total, tokens = 0.0, 0
    for s, n in gap:
        total, tokens = total + s, tokens + n
    return {"rollout/logprob_gap": total / tokens} if tokens else {}


def play(cfg: RunConfig, team, engine: Engine, make_env, resets: list[tuple[int, dict]], seed: int) -> Rollout:
    """Play the episodes ``resets`` with ``engine`` under ``cfg.rollout``'s sampling, the sampler
    seeded with ``seed`` (what a rollout worker of :mod:`marft.distributed` runs too)."""
    r = cfg.rollout
    sampling = Sampling(r.temperature, r.top_p, r.top_k, r.max_new_tokens, tuple(r.stop))
    generator = torch.Generator().manual_seed(seed)
    return rollout(team, engine, make_env, resets, sampling, cfg.task.horizon, generator,
                   env_timeout_s=r.env_timeout_s, schedule=r.schedule)


def _finite(x: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether ``x`` [b, R] is finite wherever ``mask`` [b, R] is True (padding may hold anything)."""
    return bool(torch.isfinite(x[mask.to(x.device)]).all())
