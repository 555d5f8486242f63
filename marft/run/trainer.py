"""The MARFT trainer: the numbered steps of one iteration, from two parts the assembly chooses
(:func:`marft.assemble.build_trainer`): where the episodes come from (``episodes``, a
:class:`marft.run.episodes.EpisodeSource`: this process's team loop or agent program, or Ray rollout
workers) and how the policy is updated (``policy``, a :class:`marft.run.updates.PolicyUpdate`: one
learner per adapter here, or Ray learners), with the critic's learner beside it (``critic``, a
:class:`marft.run.updates.CriticLearner`). Ray, or later an asynchronous source, is a choice of
parts, not another trainer.

1. rollout: the parts' ``episodes`` play ``rollout.episodes`` training episodes (:meth:`Trainer.resets`:
   their seeds, and a mixture's tasks) with the current adapters;
2-4. rewards, values, advantages: what the algorithm (``train.algorithm``, one
   :class:`marft.maths.algorithms.Algorithm` in :data:`marft.maths.algorithms.ALGORITHMS`) computes for every
   turn: the rewards credited, the critic's features and values, the advantages and returns
   (action-level GAE, token-level GAE, per-agent GAE, or a critic-free group baseline);
5. critic update: the value heads on the cached features, or with ``train.critic: lora`` the critic's
   adapter and heads on features recomputed each minibatch (none for a critic-free algorithm);
6. policy update: every random choice of the update is made first (:meth:`Trainer.plan_policy`:
   the rows of each trained adapter, one shuffled order per epoch, the advantages normalised over
   the whole batch or per agent, as the algorithm says); then the ``policy`` part updates each
   adapter from its :class:`marft.run.learner.PolicyBatch` (the clipped PPO surrogate the algorithm
   carries, in minibatches with gradient accumulation) and the ``episodes`` part plays with the new
   adapters from then on.

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
random choice of iteration i is seeded from (seed, i) (:func:`marft.run.episodes.iteration_seed`),
so a resumed run repeats an uninterrupted one.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..engines import flops, packing
from ..engines.machine import memory_stats
from ..errors import UserError
from ..maths.algorithms import ALGORITHMS, TargetInputs, TurnTargets
from ..maths.stats import explained_variance
from ..turns import Rollout
from .checkpoints import latest_checkpoint, read_critic, read_state, write_checkpoint, write_critic
from .config import RunConfig, is_workflow, save_config, task_label
from .episodes import EpisodeSource, episode_resets, iteration_seed
from .learner import PolicyBatch, metric_prefix
from .updates import CriticLearner, PolicyUpdate


class Trainer:
    """The steps of one iteration (the module docstring) over its parts: ``episodes`` (where
    episodes come from), ``policy`` (how the adapters are updated) and ``critic`` (the value heads'
    learner), for the team ``team`` on ``models``. Build one with :func:`marft.assemble.build_trainer`."""

    def __init__(self, cfg: RunConfig, team, models, episodes: EpisodeSource, policy: PolicyUpdate,
                 critic: CriticLearner, log=print):
        self.cfg, self.team, self.models, self.log = cfg, team, models, log
        self.episodes, self.policy, self.critic = episodes, policy, critic
        self.algorithm = cfg.train.algorithm
        self.algo = ALGORITHMS[self.algorithm]
        self.run_dir = Path(cfg.output_dir)
        self.iteration = 0
        self.bad_in_a_row = 0  # skipped policy updates since the last good one (train.max_bad_updates)
        self.skipped = {"updates": 0, "micro_batches": 0, "critic_updates": 0}  # in the current iteration
        self._flops = dict.fromkeys(("behaviour", "learner"), 0.0)  # needed FLOPs in this iteration
        self._behaviour_s = 0.0  # seconds of the behaviour log-probabilities in this iteration
        self._critic_work = packing.PassWork()
        self._rate_logged = False  # the MFU's rate is named in the log once per run

    @property
    def engine(self):
        """The engine that evaluates the team (in one process, also the one that plays its episodes)."""
        return self.episodes.engine

    @property
    def heads(self) -> dict:
        """The critic's value heads (none for a critic-free algorithm)."""
        return self.critic.heads

    # ------------------------------------------------------------------ one iteration
    def iteration_step(self) -> dict:
        it = self.iteration
        times = {}
        self.skipped = dict.fromkeys(self.skipped, 0)
        self._flops = dict.fromkeys(("behaviour", "learner"), 0.0)
        self._behaviour_s = 0.0
        self._critic_work = packing.PassWork()
        t0 = time.perf_counter()
        # 1. rollout
        out, failed = self._without_failed(self.play(it))
        times["rollout_s"] = time.perf_counter() - t0
        times["generation_s"] = out.gen_seconds  # the rest of rollout_s is prompts and scoring
        # 2-4. rewards, values, advantages
        t1 = time.perf_counter()
        targets = self.targets(out)
        times["critic_features_s"] = time.perf_counter() - t1
        # 5. critic update
        t2 = time.perf_counter()
        critic_stats = {}
        if self.heads:
            critic_stats, skipped = self.critic.update(out, targets, self.iteration)
            self.skipped["critic_updates"] += skipped
        times["critic_update_s"] = time.perf_counter() - t2
        # 6. policy update, then the episodes are played with the new adapters
        t3 = time.perf_counter()
        trained = self.trained_agents(it)
        self.episodes.before_update()
        policy_stats, updated = self.update_policy(out, targets, trained) if trained else ({}, [])
        self.episodes.publish(updated, self.iteration + 1)
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
        if self.critic.adapter is not None:  # a learning critic's passes, forward and backward (a frozen head's MLP is not model work)
            work["critic_update"] = (self.critic.work.flops(shape, backward=True), times["critic_update_s"])
        rate = flops.machine_rate(self._base())
        device = next(self._base().parameters()).device
        mfu = {f"mfu/{k}": flops.mfu(f, s, rate) for k, (f, s) in work.items()}
        mfu["mfu/iteration"] = flops.mfu(sum(f for f, _ in work.values()), total, rate)
        mfu["machine/matmul_gflops"] = rate / 1e9
        mfu["machine/matmul_n"] = flops.rate_size(device)
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
            **degenerate_stats(self.cfg, out),
            **critic_quality(self.team.names, list(self.heads), self.algo.token_level, out, targets),
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
        metrics.update(self.episodes.metrics(metrics, time.perf_counter() - t0))
        metrics.update(memory_stats(device))
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

    def resets(self, it: int) -> list[tuple[int, dict]]:
        """The (seed, options) of each training episode of iteration ``it``
        (:func:`marft.run.episodes.episode_resets`)."""
        return episode_resets(self.cfg, it)

    def play(self, it: int) -> Rollout:
        """Step 1: the training episodes of iteration ``it``, played by the ``episodes`` part."""
        return self.episodes.play(it, self.resets(it))

    def trained_agents(self, it: int) -> list[str]:
        """The agents whose adapters iteration ``it`` updates (none during ``train.critic_warmup``;
        one at a time with ``train.agent_by_agent``)."""
        tr = self.cfg.train
        if it < tr.critic_warmup and self.heads:
            return []
        if tr.agent_by_agent > 0:
            return [self.team.names[(it // tr.agent_by_agent) % len(self.team.names)]]
        return list(self.team.names)

    # ------------------------------------------------------------------ steps 2-4
    def targets(self, out: Rollout) -> list[TurnTargets]:
        """Rewards, values, advantages and returns of every turn, as the algorithm computes them."""
        return self.algo.targets(TargetInputs(self.cfg.train, self.team.names, self.models, self.heads, self._critic_work,
                                              self.critic.adapter), out)

    # ------------------------------------------------------------------ step 6
    def update_policy(self, out: Rollout, targets: list[TurnTargets], trained: list[str]) -> tuple[dict, list[str]]:
        """The ``policy`` part's update of each trained adapter, from the plan of :meth:`plan_policy`:
        the iteration's policy metrics, and the adapters updated."""
        plan = self.plan_policy(out, targets, trained)
        # replies of older adapter versions (asynchronous training) are trained as stale data
        version = self.iteration if any(t.versions is not None for t in out.turns) else None
        batches = {adapter: PolicyBatch.of(out.turns, plan["advantages"], rows, orders, version)
                   for adapter, (rows, orders) in plan["adapters"].items()}
        results = self.policy.update(batches, self.iteration, self._count_update)
        stats: dict = {}
        gap: list[tuple[float, int]] = []
        seconds = []
        for adapter, st in results:  # in adapter order
            stats.update(st.metrics(metric_prefix(adapter, len(batches))))
            gap += st.logprob_gap
            self.skipped["micro_batches"] += st.micro_batches_skipped
            self._flops["behaviour"] += st.behaviour_flops  # each data-parallel rank counts the whole minibatch's work
            self._flops["learner"] += st.learner_flops
            seconds.append(st.behaviour_s)
        # the adapters' behaviour passes, one after another or at once
        self._behaviour_s += (max(seconds, default=0.0) if self.policy.parallel else sum(seconds))
        stats.update(logprob_gap(gap))
        return stats, list(batches)

    def plan_policy(self, out: Rollout, targets: list[TurnTargets], trained: list[str]) -> dict:
        """What the policy update of each trained adapter learns from, decided before any update:
        ``adapters``: adapter -> (its rows (turn, row), one shuffled order of them per epoch);
        ``advantages``: the normalised advantages per turn (:meth:`normalised_advantages`). Every
        random choice is made here, so adapters can then be updated in any order, or at once."""
        tr = self.cfg.train
        rows_by_adapter: dict[str, list[tuple[int, int]]] = {}
        for i, t in enumerate(out.turns):
            if t.agent in trained:
                adapter = self.team[t.agent].adapter
                rows_by_adapter.setdefault(adapter, []).extend((i, r) for r in range(len(t.episodes)))
        g = torch.Generator().manual_seed(iteration_seed(self.cfg, self.iteration, 3))
        adapters = {a: (rows, [[rows[j] for j in torch.randperm(len(rows), generator=g).tolist()] for _ in range(tr.epochs)])
                    for a, rows in rows_by_adapter.items()}
        return {"adapters": adapters, "advantages": self.normalised_advantages(out, targets)}

    def normalised_advantages(self, out: Rollout, targets: list[TurnTargets]) -> list[torch.Tensor]:
        """Each turn's advantages normalised (``train.normalize_advantages``) over the whole batch or
        per agent (:meth:`marft.maths.algorithms.Algorithm.normalise`): [b] at action level; at token level
        flattened [b * R] over the reply tokens (the learner reshapes them), or the targets' own
        [b, R] when not normalised."""
        advs = [tg.advantages for tg in targets]
        if not self.cfg.train.normalize_advantages:
            return advs
        return self.algo.normalise(out, advs)

    def _count_update(self, good: bool) -> None:
        """Count a policy update's outcome: a good one resets the count of skipped updates in a row;
        ``train.max_bad_updates`` skipped in a row stop the run."""
        if good:
            self.bad_in_a_row = 0
            return
        self.skipped["updates"] += 1
        self.bad_in_a_row += 1
        limit = self.cfg.train.max_bad_updates
        if limit and self.bad_in_a_row >= limit:
            last = latest_checkpoint(self.run_dir)
            kept = f"the last checkpoint, {last}, is kept as it was" if last else "no checkpoint had been written"
            raise UserError(f"training stopped at iteration {self.iteration + 1}: {self.bad_in_a_row} policy updates in a row were "
                            f"skipped for non-finite log-probabilities, losses or gradients ({kept}); lower train.lr, try "
                            "model.dtype=float32, or raise train.max_bad_updates, then marft train --resume")

    def _base(self, adapter: str | None = None):
        return self.models.bases[self.models.base_of[adapter or self.team.adapters[0]]]

    def _shape(self, adapter: str | None = None) -> flops.ModelShape:
        return flops.model_shape(self._base(adapter))

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Write ``checkpoints/iter_NNNNNN`` atomically and point ``checkpoints/latest`` at it
        (:mod:`marft.run.checkpoints`): the adapters (PEFT format), the critic, the optimisers, the RNG
        state and the config."""
        policy_opt = self.policy.optimizer_states()
        episodes = self.episodes.state()  # an asynchronous source: the older adapter versions it plays with

        def fill(folder: Path) -> None:
            self.models.save_adapters(folder / "adapters")
            write_critic(folder, self.heads, {**self.critic.about(), "team": self.team.names})
            torch.save({
                "iteration": self.iteration,
                **self.critic.state(),
                "policy_opt": policy_opt,
                "torch_rng": torch.get_rng_state(),
                "team": self.team.names,
                "adapters": self.team.adapters,
                "algorithm": self.algorithm,
                "bad_in_a_row": self.bad_in_a_row,
                **({"episodes": episodes} if episodes else {}),
            }, folder / "trainer.pt")
            save_config(self.cfg, folder / "config.yaml")

        return write_checkpoint(self.run_dir, self.iteration, fill, self.cfg.train.keep_checkpoints)

    def close(self) -> None:
        """Free the parts: the engine, and for a distributed run the actors."""
        try:
            self.policy.close()
        finally:
            self.episodes.close()

    def load(self, checkpoint: Path) -> None:
        """Continue from ``checkpoint``: its adapters, critic, optimisers, RNG state and counters."""
        state = read_state(checkpoint)
        mine = (self.team.names, self.team.adapters, self.algorithm)
        if (state["team"], state["adapters"], state["algorithm"]) != mine:
            raise UserError(f"checkpoint {checkpoint} was written for team {state['team']} with adapters {state['adapters']} "
                            f"({state['algorithm']}), not {mine[0]} with adapters {mine[1]} ({mine[2]}); resume with the run's own config")
        self.models.load_adapters(checkpoint / "adapters")
        critic = read_critic(checkpoint, state)  # its critic/ folder (or, written before it had one, trainer.pt's heads)
        self.critic.load(state, critic[1] if critic else {}, checkpoint)
        self.policy.load(state["policy_opt"])  # the config's learning rates, not the saved ones: an override on resume counts
        self.iteration = state["iteration"]
        self.episodes.load(state.get("episodes", {}))
        self.episodes.publish(list(self.team.adapters), self.iteration)
        torch.set_rng_state(state["torch_rng"])
        self.bad_in_a_row = state.get("bad_in_a_row", 0)


def logprob_gap(gap: list[tuple[float, int]]) -> dict:
    """``rollout/logprob_gap``: the mean |rollout - learner| log-probability per reply token, over
    the (sum, tokens) of every recomputed row."""
    total, tokens = 0.0, 0
    for s, n in gap:
        total, tokens = total + s, tokens + n
    return {"rollout/logprob_gap": total / tokens} if tokens else {}


def critic_quality(agents: list[str], heads: list[str], token_level: bool, out: Rollout, targets: list) -> dict:
    """Whether a critic is learning (for every critic kind): ``<agent>/abs_advantage``, the mean
    absolute advantage of the agent's turns (before normalisation; for a critic-free algorithm too),
    and per value head (``"team"``, or an agent's) ``critic/explained_variance`` (or
    ``critic/explained_variance/<agent>``), :func:`marft.maths.stats.explained_variance` of its
    entries (the returns and the values the advantages were computed with; at token level the reply
    tokens); omitted when every reward of the batch's steps is the same, or the returns vary by no
    more than float rounding."""
    stats = {}
    for agent in agents:
        mine = [_entries(out, i, targets[i].advantages.view(len(t.episodes), -1) if token_level else targets[i].advantages,
                         token_level) for i, t in enumerate(out.turns) if t.agent == agent]
        if mine:
            stats[f"{agent}/abs_advantage"] = float(torch.cat(mine).abs().mean())
    from ..maths.advantages import valid_steps

    rewards = out.rewards[valid_steps(out.dones)]  # the steps that happened (0 is padding after an episode ended)
    if not len(rewards) or not bool((rewards != rewards[0]).any()):
        return stats
    for key in heads:
        ret, val = head_entries(out, targets, key, token_level)
        ev = explained_variance(ret, val) if len(ret) else None
        if ev is not None:
            stats["critic/explained_variance" if key == "team" else f"critic/explained_variance/{key}"] = ev
    return stats


def head_entries(out: Rollout, targets: list, key: str, token_level: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The (returns, values) of value head ``key`` (``"team"``: every turn; else the agent's turns),
    one entry per row, or at token level per reply token; empty where the head has no turn."""
    idx = [i for i, t in enumerate(out.turns) if key in ("team", t.agent)]
    if not idx:
        return torch.zeros(0), torch.zeros(0)
    return (torch.cat([_entries(out, i, targets[i].returns, token_level) for i in idx]),
            torch.cat([_entries(out, i, targets[i].values, token_level) for i in idx]))


def _entries(out: Rollout, i: int, x: torch.Tensor, token_level: bool) -> torch.Tensor:
    """Turn ``i``'s entries of ``x``: at token level ([rows, tokens]) its reply tokens, else its rows."""
    return x[out.turns[i].response_mask[:, : x.shape[1]]] if token_level and x.dim() == 2 else x.flatten()


def degenerate_stats(cfg: RunConfig, out: Rollout) -> dict:
    """How much of the batch carries no learning signal: ``degenerate/same_reward`` is the share
    of groups (grouped algorithms; otherwise the whole batch is one group) whose episodes all
    got the same return; ``responses/empty`` and ``responses/truncated`` the share of replies
    with no text and of replies cut at ``rollout.max_new_tokens``."""
    returns = out.rewards.sum(1)
    size = cfg.train.group_size if ALGORITHMS[cfg.train.algorithm].grouped else len(returns)
    groups = returns.view(-1, size)
    same = (groups == groups[:, :1]).all(1).float().mean()
    texts = [x for t in out.turns for x in t.texts]
    return {"degenerate/same_reward": float(same),
            "responses/empty": sum(not x.strip() for x in texts) / max(len(texts), 1),
            "responses/truncated": float(torch.cat([t.truncated.float() for t in out.turns]).mean())}
