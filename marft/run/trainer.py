"""The MARFT trainer. One iteration, in numbered steps:

1. rollout: the team plays ``rollout.episodes`` training episodes with the current adapters;
2-4. rewards, values, advantages: what the algorithm (``train.algorithm``, one
   :class:`marft.maths.algorithms.Algorithm` in :data:`marft.maths.algorithms.ALGORITHMS`) computes for every
   turn: the rewards credited, the critic's features and values, the advantages and returns
   (action-level GAE, token-level GAE, per-agent GAE, or a critic-free group baseline);
5. critic update: the value heads on the cached features (none for a critic-free algorithm);
6. policy update: every random choice of the update is made first (:meth:`Trainer._plan_policy`:
   the rows of each trained adapter, one shuffled order per epoch, the advantages normalised over
   the whole batch or per agent, as the algorithm says); then each adapter's
   :class:`marft.run.learner.AdapterLearner`, with its own AdamW, runs the clipped PPO surrogate in
   minibatches with gradient accumulation.

Numerical trouble never reaches the weights: a micro-batch with non-finite log-probabilities (from
the rollout or recomputed) or a non-finite loss is skipped, and so is an update with a non-finite
gradient (or with nothing left to learn from), each with a warning (:mod:`marft.run.learner`); the
trainer counts the skipped updates, and ``train.max_bad_updates`` of them in a row (across
iterations, saved in checkpoints) stop the run with a :class:`UserError`, its last checkpoint untouched.
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
from pathlib import Path

import torch

from ..engines import flops, packing
from ..maths import losses
from ..maths.algorithms import ALGORITHMS, TargetInputs, TurnTargets
from .checkpoints import latest_checkpoint, read_state, write_checkpoint
from .config import RunConfig, horizon, is_workflow, save_config, task_label
from ..engines import Engine, make_engine
from ..envs.mixture import draw_tasks, weight_at
from ..errors import UserError
from ..engines.generation import Sampling
from .learner import AdapterLearner, PolicyBatch, UpdateStats, metric_prefix
from .rollout import Rollout, rollout


def _seed(cfg: RunConfig, iteration: int, salt: int = 0) -> int:
    return (cfg.seed * 1_000_003 + iteration * 7_919 + salt) % 2**63


class Trainer:
    def __init__(self, cfg: RunConfig, team, models, make_env, log=print, engine: Engine | None = None):
        """``engine`` plays the rollouts (:mod:`marft.engines`); None: the one ``rollout.engine`` names."""
        self.cfg, self.team, self.models, self.make_env, self.log = cfg, team, models, make_env, log
        self.engine = engine if engine is not None else make_engine(cfg, models)
        tr = cfg.train
        self.algorithm = tr.algorithm
        self.algo = ALGORITHMS[tr.algorithm]
        self.token_level = self.algo.token_level
        self.run_dir = Path(cfg.output_dir)
        first = next(iter(models.bases.values()))
        torch.manual_seed(cfg.seed)
        self.heads = self.algo.make_heads(team.names, first.config.hidden_size)
        self.critic_opt = {k: torch.optim.AdamW(h.parameters(), lr=tr.critic_lr) for k, h in self.heads.items()}
        # one learner per adapter, each with its AdamW (policy_opt: the same optimisers, for checkpoints)
        self.policy_learners = {a: AdapterLearner(cfg, models, a, log=lambda m: self.log(m)) for a in team.adapters}
        self.policy_opt = {a: learner.optimizer for a, learner in self.policy_learners.items()}
        self.iteration = 0
        self.bad_in_a_row = 0  # skipped policy updates since the last good one (train.max_bad_updates)
        self.skipped = {"updates": 0, "micro_batches": 0, "critic_updates": 0}  # in the current iteration
        self._flops = dict.fromkeys(("behaviour", "learner"), 0.0)  # needed FLOPs in this iteration
        self._behaviour_s = 0.0  # seconds of the behaviour log-probabilities in this iteration
        self._critic_work = packing.Work()
        self._rate_logged = False  # the MFU's rate is named in the log once per run

    # ------------------------------------------------------------------ one iteration
    def iteration_step(self) -> dict:
        it = self.iteration
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
        mfu["machine/matmul_n"] = flops.rate_size(next(self._base().parameters()).device)
        if not self._rate_logged:
            self.log(f"MFU against {flops.rate_label(self._base())}")
            self._rate_logged = True
        # per device (one here), as verl and NeMo RL report them: generated tokens, and prompt + reply
        # tokens processed (each turn's prompt and reply, the work of rollout and learner alike)
        processed = sum(int(t.prompt_mask.sum() + t.response_mask.sum()) for t in out.turns)
        mfu["throughput/generated_tokens_per_s"] = tokens / total
        mfu["throughput/processed_tokens_per_s"] = processed / total
        mfu["throughput/rollout_tokens_per_s"] = tokens / times["generation_s"] if times["generation_s"] > 0 else 0.0
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
            **self._task_stats(out),
        }
        episodes = max(len(out.steps), 1)
        for agent in self.team.names:
            rows = [t for t in out.turns if t.agent == agent]
            calls = sum(len(t.episodes) for t in rows)
            metrics[f"{agent}/calls"] = calls / episodes  # per episode (an agent program decides how many)
            if calls:  # an agent program may call an agent in no episode of a batch
                metrics[f"{agent}/reply_tokens"] = float(torch.cat([t.response_mask.sum(1).float() for t in rows]).mean())
                metrics[f"{agent}/truncated"] = float(torch.cat([t.truncated.float() for t in rows]).mean())
        return metrics

    def _without_failed(self, out: Rollout) -> tuple[Rollout, int]:
        """Leave out the episodes whose environment raised or timed out (for a grouped algorithm,
        their whole group), with a warning; if nothing is left the environment is broken: stop."""
        failed = int(out.failed.sum())
        if not failed:
            return out, 0
        errors = [i.get("error", "") for i, f in zip(out.infos, out.failed.tolist()) if f]
        keep = ~out.failed
        if self.algo.grouped:
            keep = keep.view(-1, self.cfg.train.group_size).all(1, keepdim=True).expand(-1, self.cfg.train.group_size).flatten()
        if not keep.any():
            fix = ("fix the workflow or its reward" if is_workflow(self.cfg) else
                   "fix the environment or its reward (check it with marft env-check)")
            again = ("then marft train --resume" if latest_checkpoint(self.run_dir) is not None else
                     "then start the run again with another output_dir= (no checkpoint to resume from yet)")
            raise UserError(f"every episode of iteration {self.iteration + 1} failed in the environment (first: {errors[0]}); "
                            f"{fix}, {again}")
        self.log(f"warning: {failed} of {len(keep)} episodes failed in the environment at iteration {self.iteration + 1} "
                 f"and are left out of the update (first: {errors[0]})")
        return out.select(keep), failed

    def _task_stats(self, out: Rollout) -> dict:
        """A mixture: per task, its share of the batch's episodes (``tasks/<task>/episodes``), its
        training accuracy and mean episode reward (``tasks/<task>/accuracy``, ``.../reward``)."""
        if not self.cfg.tasks:
            return {}
        stats, returns = {}, out.rewards.sum(1)
        for t in self.cfg.tasks:
            label = task_label(t)
            mine = torch.tensor([x == label for x in out.tasks], dtype=torch.bool)
            n = int(mine.sum())
            stats[f"tasks/{label}/episodes"] = n
            if n:
                stats[f"tasks/{label}/accuracy"] = float(out.success[mine].float().mean())
                stats[f"tasks/{label}/reward"] = float(returns[mine].mean())
        return stats

    def _degenerate_stats(self, out: Rollout) -> dict:
        """How much of the batch carries no learning signal: ``degenerate/same_reward`` is the share
        of groups (grouped algorithms; otherwise the whole batch is one group) whose episodes all
        got the same return; ``responses/empty`` and ``responses/truncated`` the share of replies
        with no text and of replies cut at ``rollout.max_new_tokens``."""
        returns = out.rewards.sum(1)
        size = self.cfg.train.group_size if self.algo.grouped else len(returns)
        groups = returns.view(-1, size)
        same = (groups == groups[:, :1]).all(1).float().mean()
        texts = [x for t in out.turns for x in t.texts]
        return {"degenerate/same_reward": float(same),
                "responses/empty": sum(not x.strip() for x in texts) / max(len(texts), 1),
                "responses/truncated": float(torch.cat([t.truncated.float() for t in out.turns]).mean())}

    def _resets(self, it: int) -> list[tuple[int, dict]]:
        """The (seed, options) of each training episode of iteration ``it`` (grouped algorithms:
        ``train.group_size`` episodes of each problem, one after another)."""
        cfg, tr = self.cfg, self.cfg.train
        rng = random.Random(_seed(cfg, it))
        E = cfg.rollout.episodes
        size = tr.group_size if self.algo.grouped else 1
        seeds = [rng.randrange(2**62) for _ in range(E // size)]
        if not cfg.tasks:
            return [(p, {"split": "train"}) for p in seeds for _ in range(size)]
        # a mixture: each problem's task drawn by the tasks' weights at this iteration, from its own stream
        labels = [task_label(t) for t in cfg.tasks]
        drawn = draw_tasks(labels, [weight_at(t.weight, it) for t in cfg.tasks], len(seeds), random.Random(_seed(cfg, it, 4)))
        return [(p, {"split": "train", "task": task}) for p, task in zip(seeds, drawn) for _ in range(size)]

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
    def _targets(self, out: Rollout) -> list[TurnTargets]:
        """Rewards, values, advantages and returns of every turn, as the algorithm computes them."""
        return self.algo.targets(TargetInputs(self.cfg.train, self.team.names, self.models, self.heads, self._critic_work), out)

    # ------------------------------------------------------------------ step 5
    def _update_critic(self, out: Rollout, targets: list[TurnTargets]) -> dict:
        tr = self.cfg.train
        stats = {}
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
        """Each trained adapter's update (:class:`marft.run.learner.AdapterLearner`), in adapter order,
        from the plan of :meth:`_plan_policy`; their metrics."""
        plan = self._plan_policy(out, targets, trained)
        stats: dict = {}
        gap: list[tuple[float, int]] = []
        n = len(plan["adapters"])
        for adapter, (rows, orders) in plan["adapters"].items():
            batch = PolicyBatch.of(out.turns, plan["advantages"], rows, orders)
            st = self.policy_learners[adapter].update(batch, self.iteration, on_update=self._count_update)
            self._add_update(adapter, n, st, stats, gap)
        stats.update(_gap_stat(gap))
        return stats

    def _add_update(self, adapter: str, n_adapters: int, st: UpdateStats, stats: dict, gap: list) -> None:
        """Add one adapter's update to the iteration's metrics ``stats``, ``gap`` and counters
        (its outcomes are counted as they happen, by :meth:`_count_update`)."""
        stats.update(st.metrics(metric_prefix(adapter, n_adapters)))
        gap += st.logprob_gap
        self.skipped["micro_batches"] += st.micro_batches_skipped
        self._flops["behaviour"] += st.behaviour_flops
        self._flops["learner"] += st.learner_flops
        self._behaviour_s += st.behaviour_s

    def _plan_policy(self, out: Rollout, targets: list[TurnTargets], trained: list[str]) -> dict:
        """What the policy update of each trained adapter learns from, decided before any update:
        ``adapters``: adapter -> (its rows (turn, row), one shuffled order of them per epoch);
        ``advantages``: the normalised advantages per turn (:meth:`_normalised_advantages`). Every
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

    def _count_update(self, good: bool) -> None:
        """Count a policy update's outcome: a good one resets the count of skipped updates in a row."""
        if good:
            self.bad_in_a_row = 0
        else:
            self._skip_update()

    def _base(self, adapter: str | None = None):
        return self.models.bases[self.models.base_of[adapter or self.team.adapters[0]]]

    def _shape(self, adapter: str | None = None) -> flops.ModelShape:
        return flops.model_shape(self._base(adapter))

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
        """Each turn's advantages normalised (``train.normalize_advantages``) over the whole batch or
        per agent (:meth:`marft.maths.algorithms.Algorithm.normalise`): [b] at action level; at token level
        flattened [b * R] over the reply tokens (the learner reshapes them), or the targets' own
        [b, R] when not normalised."""
        advs = [tg.advantages for tg in targets]
        if not self.cfg.train.normalize_advantages:
            return advs
        return self.algo.normalise(out, advs)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Write ``checkpoints/iter_NNNNNN`` atomically and point ``checkpoints/latest`` at it
        (:mod:`marft.run.checkpoints`): the adapters (PEFT format), the critic, the optimisers, the RNG
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
    return rollout(team, engine, make_env, resets, sampling, horizon(cfg), generator,
                   env_timeout_s=r.env_timeout_s, schedule=r.schedule)

