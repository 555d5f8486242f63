"""The driver of a Ray run: the trainer's numbered steps with rollout and policy update on actors.

1. rollout: the iteration's episodes (their reset seeds) are split into consecutive shards, one per
   rollout worker; each worker plays its shard and sends back the turns' tensors; the driver merges
   them (:func:`marft.run.rollout.merge_rollouts`). A worker that dies is replaced, handed the current
   adapters, and its shard replayed with the same seeds (``cluster.max_worker_restarts`` per run).
2-5. rewards, values, advantages, critic update: in the driver, as in one process.
6. policy update: every random choice of the update is made here (:meth:`Trainer._plan_policy`);
   each trained adapter's learner(s) get only that adapter's turns and advantages (a
   :class:`marft.run.learner.PolicyBatch`), all adapters at once; each runs the update of
   :class:`marft.run.learner.AdapterLearner` and sends back its :class:`marft.run.learner.UpdateStats`
   and its new weights, which go to every rollout worker (one object in Ray's store, read by all)
   and into the driver's copy (checkpoints, evaluation). The updates' outcomes are counted in
   adapter order, as one process counts them (``train.max_bad_updates``).

With one rollout worker and one learner per adapter the run repeats the in-process run exactly
(same seeds, same batches, same order of floating-point operations); with more workers each shard
samples with its own seed, so the episodes differ (as they would with another batch size).
Checkpoints are the in-process ones: the driver holds the adapters and, when it saves, fetches
the learners' optimiser states, so ``marft train --resume`` works for both kinds of run.
"""
from __future__ import annotations

import os
import pickle
import time

from ..errors import UserError
from ..run.learner import PolicyBatch
from ..turns import Rollout, merge_rollouts
from ..run.checkpoints import latest_checkpoint
from ..run.trainer import Trainer, _gap_stat, _seed
from .actors import Learner, RolloutWorker


def _ray():
    try:
        import ray
    except ImportError:
        raise UserError("cluster.rollout_workers > 0 needs Ray: pip install 'marft[ray]' (or set cluster.rollout_workers=0 "
                        "to train in one process)") from None
    return ray


def shard(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive shards whose sizes differ by at most one (none empty)."""
    n = max(1, min(n, len(items)))
    q, r = divmod(len(items), n)
    out, lo = [], 0
    for k in range(n):
        hi = lo + q + (k < r)
        out.append(items[lo:hi])
        lo = hi
    return out


def shard_seed(cfg, it: int, k: int) -> int:
    """The sampler seed of shard ``k`` of iteration ``it``; shard 0's is the in-process run's."""
    return _seed(cfg, it, 1 if k == 0 else 1000 + k)


class DistributedTrainer(Trainer):
    """A :class:`Trainer` whose rollouts run on Ray rollout workers and whose per-adapter policy
    updates run on Ray learner actors. The driver keeps the critic, the checkpoints and an HF
    engine for evaluation; its own :attr:`policy_learners` never update, their optimisers only
    hold the learners' states for checkpoints."""

    def __init__(self, cfg, team, models, make_env, log=print, engine=None):
        from ..engines import HFEngine

        super().__init__(cfg, team, models, make_env, log, engine or HFEngine(models, fast=cfg.train.fast, merge=cfg.rollout.fold_adapters,
                                                                               compile=cfg.rollout.compile))
        ray = _ray()
        c = cfg.cluster
        self._started_ray = False
        if not ray.is_initialized():
            self._init_ray(ray)
        self._check_resources(ray)
        self._remote_worker = ray.remote(RolloutWorker)
        self._remote_learner = ray.remote(Learner)
        self._pgs: list = []  # placement groups of colocated learners
        self.workers = [self._new_worker() for _ in range(c.rollout_workers)]
        self.learners = self._new_learners()
        self.restarts = 0
        self.version = 0
        self.bytes = dict.fromkeys(("rollout", "learner_in", "learner_out", "weights"), 0)
        # every actor starts from the driver's adapters (not from its own random initialisation)
        self._push_learner_state(opt=False)
        self._broadcast({a: self.models.adapter_state(a) for a in team.adapters})

    # ------------------------------------------------------------------ set-up
    def _init_ray(self, ray) -> None:
        c = self.cfg.cluster
        try:
            if c.address == "local":
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR", configure_logging=True)
            else:  # the workers read the local data copies the driver reads (the same folder on every node)
                data = {k: os.environ[k] for k in ("MARFT_DATA_DIR",) if os.environ.get(k)}
                ray.init(address=c.address, log_to_driver=False, logging_level="ERROR",
                         **({"runtime_env": {"env_vars": data}} if data else {}))
        except ConnectionError as e:
            raise UserError(f"cannot reach the Ray cluster at cluster.address={c.address} ({e}); start it "
                            "(ray start --head) or use cluster.address=local") from None
        self._started_ray = True

    def _check_resources(self, ray) -> None:
        c = self.cfg.cluster
        n_learners = len(self.team.adapters) * c.learners_per_adapter
        want = {"CPU": c.rollout_workers * c.worker_cpus + n_learners * c.learner_cpus,
                "GPU": c.rollout_workers * c.worker_gpus + self._learner_gpus_total()}
        have = ray.cluster_resources()
        for kind, n in want.items():
            if n > have.get(kind, 0) + 1e-9:
                raise UserError(f"config: the cluster section asks for {n:g} {kind}s ({c.rollout_workers} rollout workers x "
                                f"{getattr(c, 'worker_' + kind.lower() + 's'):g}, {n_learners} learners x "
                                f"{getattr(c, 'learner_' + kind.lower() + 's'):g}) but the Ray cluster has {have.get(kind, 0):g}; "
                                f"lower cluster.worker_{kind.lower()}s / cluster.learner_{kind.lower()}s (fractions share a device) "
                                "or cluster.rollout_workers")

    def _groups(self) -> list[list[str]]:
        """Adapters whose learners share a device (``cluster.colocate``), the rest one each."""
        named = [list(g) for g in self.cfg.cluster.colocate]
        seen = {a for g in named for a in g}
        return named + [[a] for a in self.team.adapters if a not in seen]

    def _learner_gpus_total(self) -> float:
        c = self.cfg.cluster
        # a colocated group shares one learner's worth of GPUs per data-parallel rank
        return sum(c.learner_gpus * c.learners_per_adapter for _ in self._groups())

    def _new_worker(self):
        c = self.cfg.cluster
        return self._remote_worker.options(num_cpus=c.worker_cpus, num_gpus=c.worker_gpus).remote(
            self.cfg, max(1, int(c.worker_cpus)), os.getcwd())

    def _new_learners(self) -> dict[str, list]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, c = _ray(), self.cfg.cluster
        learners: dict[str, list] = {}
        for group in self._groups():
            for rank in range(c.learners_per_adapter):
                options = {"num_cpus": c.learner_cpus, "num_gpus": c.learner_gpus / len(group)}
                if len(group) > 1:  # one bundle per rank, holding the whole group
                    pg = placement_group([{"CPU": c.learner_cpus * len(group), **({"GPU": c.learner_gpus} if c.learner_gpus else {})}],
                                         strategy="STRICT_PACK")
                    ray.get(pg.ready())
                    self._pgs.append(pg)
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
                for adapter in group:
                    learners.setdefault(adapter, []).append(self._remote_learner.options(**options).remote(
                        self.cfg, adapter, max(1, int(c.learner_cpus)), rank, c.learners_per_adapter, os.getcwd()))
        if c.learners_per_adapter > 1:
            for adapter, ranks in learners.items():
                host, port = ray.get(ranks[0].address.remote())
                self._get([r.join.remote(host, port) for r in ranks], f"the learners of adapter {adapter}")
        return learners

    def _get(self, refs, what: str):
        """ray.get, with a learner's death turned into the run's end (its last checkpoint intact)."""
        ray = _ray()
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            last = latest_checkpoint(self.run_dir)
            kept = f"the last checkpoint, {last}, is intact: marft train --resume {self.run_dir}" if last else "no checkpoint had been written yet"
            raise UserError(f"{what} died at iteration {self.iteration + 1} ({_cause(e)}); the run stops, {kept}") from None

    # ------------------------------------------------------------------ weights
    def _push_learner_state(self, opt: bool) -> None:
        ray = _ray()
        refs = []
        for adapter, ranks in self.learners.items():
            state = ray.put(self.models.adapter_state(adapter))
            opt_state = ray.put(self.policy_opt[adapter].state_dict()) if opt else None
            refs += [r.load.remote(state, opt_state) for r in ranks]
        self._get(refs, "a learner")

    def _broadcast(self, states: dict) -> None:
        """Every rollout worker acts with ``states`` (adapter -> weights) from now on."""
        ray = _ray()
        self.version += 1
        self.bytes["weights"] += len(pickle.dumps(states)) * len(self.workers)
        ref = ray.put(states)
        for k in range(len(self.workers)):
            while True:
                try:
                    ray.get(self.workers[k].set_adapters.remote(self.version, ref))
                    break
                except ray.exceptions.RayActorError as e:
                    self._replace_worker(k, f"while loading new adapters ({_cause(e)})")

    def _replace_worker(self, k: int, when: str) -> None:
        """Worker k died ``when``: a new one with the current adapters (a replacement that dies while
        starting is replaced too; each counts against ``cluster.max_worker_restarts``)."""
        ray = _ray()
        while True:
            self.restarts += 1
            if self.restarts > self.cfg.cluster.max_worker_restarts:
                raise UserError(f"rollout workers died {self.restarts} times (more than cluster.max_worker_restarts="
                                f"{self.cfg.cluster.max_worker_restarts}); the last one {when} at iteration {self.iteration + 1}. "
                                f"Look at the Ray logs (/tmp/ray/session_latest/logs); marft train --resume {self.run_dir} continues")
            self.log(f"warning: rollout worker {k} died {when} at iteration {self.iteration + 1}; replaced, its episodes replayed")
            ray.kill(self.workers[k], no_restart=True)
            self.workers[k] = self._new_worker()
            states = {a: self.models.adapter_state(a) for a in self.team.adapters}
            try:
                ray.get(self.workers[k].set_adapters.remote(self.version, states))
                return
            except ray.exceptions.RayActorError as e:
                when = f"while starting ({_cause(e)})"

    def digests(self) -> dict:
        """The adapter digests every rollout worker and learner holds (for checks)."""
        ray = _ray()
        return {"workers": ray.get([w.digests.remote() for w in self.workers]),
                "learners": {a: ray.get([r.digest.remote() for r in ranks]) for a, ranks in self.learners.items()}}

    # ------------------------------------------------------------------ step 1
    def _rollout(self, it: int) -> Rollout:
        ray = _ray()
        shards = shard(self._resets(it), len(self.workers))
        pending = {k: self.workers[k].play.remote(s, shard_seed(self.cfg, it, k)) for k, s in enumerate(shards)}
        parts: dict[int, Rollout] = {}
        while pending:
            k, ref = next(iter(pending.items()))
            try:
                parts[k], nbytes = ray.get(ref)
                self.bytes["rollout"] += nbytes
                del pending[k]
            except ray.exceptions.RayActorError as e:
                self._replace_worker(k, f"while playing ({_cause(e)})")
                pending[k] = self.workers[k].play.remote(shards[k], shard_seed(self.cfg, it, k))
        return merge_rollouts([parts[k] for k in range(len(shards))], self.team.names)

    # ------------------------------------------------------------------ step 6
    def _update_policy(self, out: Rollout, targets, trained: list[str]) -> dict:
        ray = _ray()
        plan = self._plan_policy(out, targets, trained)
        adv = plan["advantages"]
        n = len(plan["adapters"])
        refs = {}
        for adapter, (rows, orders) in plan["adapters"].items():
            job = _job(out, adv, rows, orders, self.iteration, n)
            self.bytes["learner_in"] += len(pickle.dumps(job))
            ref = ray.put(job)
            refs[adapter] = [r.update.remote(ref) for r in self.learners[adapter]]
        stats, gap, states, slowest = {}, [], {}, 0.0
        for adapter in plan["adapters"]:  # in adapter order, as one process would
            results = self._get(refs[adapter], f"the learner of adapter {adapter}")
            res = results[0]
            st = res["stats"]
            for m in res["messages"]:
                self.log(m)
            for good in st.outcomes:
                self._count_update(good)
            stats.update(res["metrics"])
            gap += st.logprob_gap
            self.skipped["micro_batches"] += st.micro_batches_skipped
            for k in self._flops:  # each data-parallel rank counts the whole minibatch's work, not its share
                self._flops[k] += getattr(st, f"{k}_flops")
            slowest = max(slowest, st.behaviour_s)
            states[adapter] = res["state"]
            self.bytes["learner_out"] += len(pickle.dumps(res))
        self._behaviour_s += slowest  # the learners ran at once
        for adapter, state in states.items():
            self.models.load_adapter_state(adapter, state)
        if states:
            self._broadcast(states)
        stats.update(_gap_stat(gap))
        return stats

    # ------------------------------------------------------------------ one iteration, checkpoints
    def iteration_step(self) -> dict:
        before = dict(self.bytes)
        restarts = self.restarts
        t0 = time.perf_counter()
        m = super().iteration_step()
        m.update({f"distributed/bytes_{k}": v - before[k] for k, v in self.bytes.items()})
        m["distributed/worker_restarts"] = self.restarts - restarts
        m["distributed/rollout_workers"] = len(self.workers)
        m["distributed/episodes_per_s"] = self.cfg.rollout.episodes / (time.perf_counter() - t0)
        # the trainer's throughput is of the whole cluster; per GPU where the run asked for GPUs
        gpus = self.cfg.cluster.worker_gpus * len(self.workers) + self._learner_gpus_total()
        m["distributed/gpus"] = gpus
        if gpus > 0:
            for k in ("generated", "processed"):
                m[f"throughput/{k}_tokens_per_s_per_gpu"] = m[f"throughput/{k}_tokens_per_s"] / gpus
        return m

    def save(self):
        for adapter, ranks in self.learners.items():
            self.policy_opt[adapter].load_state_dict(self._get(ranks[0].optimizer_state.remote(), f"the learner of adapter {adapter}"))
        return super().save()

    def load(self, checkpoint) -> None:
        super().load(checkpoint)
        self._push_learner_state(opt=True)
        self._broadcast({a: self.models.adapter_state(a) for a in self.team.adapters})

    def close(self) -> None:
        """Stop the actors (and Ray, if this run started it)."""
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        for actor in [*self.workers, *(r for ranks in self.learners.values() for r in ranks)]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs:
            remove_placement_group(pg)
        self.workers, self.learners, self._pgs = [], {}, []
        if self._started_ray:
            ray.shutdown()
        self.engine.close()


def _job(out: Rollout, adv: list, rows: list, orders: list, iteration: int, n_adapters: int) -> dict:
    """What one adapter's learner needs: the :class:`PolicyBatch` of its rows (that adapter's turns
    only, indices renumbered), the iteration, and how many adapters the update has (for the
    metrics' names, :func:`marft.run.learner.metric_prefix`)."""
    return {"iteration": iteration, "batch": PolicyBatch.of(out.turns, adv, rows, orders), "n_adapters": n_adapters}


def _cause(e: BaseException) -> str:
    """The exception an actor died of, when Ray's message carries it (an error in its constructor:
    ``ImportError: ...``), else the kind of death (``ActorDiedError``: killed, out of memory)."""
    import re

    found = re.findall(r"^\s*(\w+(?:Error|Exception): .+)$", str(e), re.M)
    return found[-1].strip()[:200] if found else type(e).__name__
