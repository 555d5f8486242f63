"""A Ray run's parts: where its episodes come from (:class:`RayEpisodes`: rollout workers) and how
its policy is updated (:class:`RayPolicy`: learner actors), the trainer's two parts
(:mod:`marft.run.trainer`) for ``cluster.rollout_workers`` > 0; :class:`RayCluster` starts Ray and the
actors and frees them. The trainer's steps are those of one process; the driver keeps the critic, the
checkpoints and an HF engine for evaluation.

1. rollout (:class:`RayEpisodes`): the iteration's episodes (their reset seeds) are split into
   consecutive shards, one per rollout worker; each worker plays its shard and sends back the turns'
   tensors; the driver merges them (:func:`marft.turns.merge_rollouts`). A worker that dies is
   replaced, handed the current adapters, and its shard replayed with the same seeds
   (``cluster.max_worker_restarts`` per run). New adapters go to every worker as one object in
   Ray's store, read by all.
6. policy update (:class:`RayPolicy`): each trained adapter's learner(s) get only that adapter's
   turns and advantages (a :class:`marft.run.learner.PolicyBatch`), all adapters at once; each runs
   the update of :class:`marft.run.learner.AdapterLearner` and sends back its
   :class:`marft.run.learner.UpdateStats` and its new weights, which go into the driver's models.
   The updates' outcomes are counted in adapter order, as one process counts them
   (``train.max_bad_updates``).

With one rollout worker and one learner per adapter the run repeats the in-process run exactly
(same seeds, same batches, same order of floating-point operations); with more workers each shard
samples with its own seed, so the episodes differ (as they would with another batch size).
Checkpoints are the in-process ones: when the driver saves, it fetches the learners' optimiser
states, so ``marft train --resume`` works for both kinds of run.
"""
from __future__ import annotations

import os
import pickle
import time

from ..errors import UserError
from ..run.checkpoints import latest_checkpoint
from ..run.asynchronous import adapter_snapshot, keep_version, playable, staleness_metrics, stamp, versions_state
from ..run.episodes import episode_resets, iteration_seed
from ..run.learner import PolicyBatch, UpdateStats
from ..turns import Rollout, merge_rollouts
from .actors import Learner, RolloutWorker, on_cpu


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
    return iteration_seed(cfg, it, 1 if k == 0 else 1000 + k)


class RayCluster:
    """Ray for one run: started here (``cluster.address: local``) or joined, its resources checked
    against the ``cluster`` section, the actor classes, and what the actors' traffic costs
    (:attr:`bytes`). :attr:`iteration` is the iteration under way (0-based), for messages."""

    def __init__(self, cfg, team, log=print):
        ray = _ray()
        self.cfg, self.team, self.log = cfg, team, log
        self.run_dir = cfg.output_dir
        self.started_ray = False
        if not ray.is_initialized():
            self._init_ray(ray)
        self._check_resources(ray)
        self.remote_worker = ray.remote(RolloutWorker)
        self.remote_learner = ray.remote(Learner)
        self.iteration = 0
        self.bytes = dict.fromkeys(("rollout", "learner_in", "learner_out", "weights"), 0)

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
        self.started_ray = True

    def _check_resources(self, ray) -> None:
        c = self.cfg.cluster
        n_learners = len(self.team.adapters) * c.learners_per_adapter
        want = {kind: sum(count * ask[kind] for _, ask, _, count in self.asks()) for kind in ("CPU", "GPU")}
        have = ray.cluster_resources()
        for kind, n in want.items():
            if n > have.get(kind, 0) + 1e-9:
                raise UserError(f"config: the cluster section asks for {n:g} {kind}s ({c.rollout_workers} rollout workers x "
                                f"{getattr(c, 'worker_' + kind.lower() + 's'):g}, {n_learners} learners x "
                                f"{getattr(c, 'learner_' + kind.lower() + 's'):g}) but the Ray cluster has {have.get(kind, 0):g}; "
                                f"lower cluster.worker_{kind.lower()}s / cluster.learner_{kind.lower()}s (fractions share a device) "
                                "or cluster.rollout_workers")
        self._check_nodes([n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)])

    def asks(self) -> list[tuple[str, dict, str, int]]:
        """What the actors ask Ray for: ``(who, {"CPU": n, "GPU": n}, its config key, how many)`` for a
        rollout worker, and per device group (:meth:`groups`) for a learner, or a colocated group's
        learners together (one bundle a rank)."""
        c = self.cfg.cluster
        asks = [("a rollout worker", {"CPU": c.worker_cpus, "GPU": c.worker_gpus}, "worker", c.rollout_workers)]
        for group in self.groups():
            who = f"the learner of {group[0]}" if len(group) == 1 else f"the colocated learners of {', '.join(group)}"
            asks.append((who, {"CPU": c.learner_cpus * len(group), "GPU": c.learner_gpus}, "learner", c.learners_per_adapter))
        return asks

    def _check_nodes(self, nodes: list[dict]) -> None:
        """Each actor must fit on one node (``nodes``: each live node's resources): totals that fit can
        still leave Ray waiting for ever for a machine that holds one actor's ask (two GPUs a learner
        on nodes of one GPU each)."""
        if not nodes:
            return
        for who, ask, key, count in self.asks():
            if count and not any(all(n <= node.get(kind, 0) + 1e-9 for kind, n in ask.items()) for node in nodes):
                most = ", ".join(f"{max(node.get(kind, 0) for node in nodes):g} {kind}s" for kind in ask)
                raise UserError(f"config: {who} asks for {ask['CPU']:g} CPUs and {ask['GPU']:g} GPUs on one machine, but no node "
                                f"of the Ray cluster has that much (the most any node has: {most}); lower "
                                f"cluster.{key}_cpus / cluster.{key}_gpus, or join a larger node")

    def groups(self) -> list[list[str]]:
        """Adapters whose learners share a device (``cluster.colocate``), the rest one each."""
        named = [list(g) for g in self.cfg.cluster.colocate]
        seen = {a for g in named for a in g}
        return named + [[a] for a in self.team.adapters if a not in seen]

    def learner_gpus(self) -> float:
        c = self.cfg.cluster
        # a colocated group shares one learner's worth of GPUs per data-parallel rank
        return sum(c.learner_gpus * c.learners_per_adapter for _ in self.groups())

    def get(self, refs, what: str):
        """ray.get, with a learner's death or error (a CUDA out-of-memory inside it) turned into the
        run's end in one line (its last checkpoint intact)."""
        ray = _ray()
        try:
            return ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:  # died, or raised (CUDA out of memory)
            last = latest_checkpoint(self.run_dir)
            kept = f"the last checkpoint, {last}, is intact: marft train --resume {self.run_dir}" if last else "no checkpoint had been written yet"
            how = "died" if isinstance(e, ray.exceptions.RayActorError) else "failed"
            raise UserError(f"{what} {how} at iteration {self.iteration + 1} ({_cause(e)}); the run stops, {kept}") \
                from (None if how == "died" else e)  # an error's traceback, with --debug

    @staticmethod
    def kill(actors: list) -> None:
        ray = _ray()
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        """Stop Ray, if this run started it."""
        try:
            import ray
        except ImportError:
            return
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        self.started_ray = False


class RayEpisodes:
    """Episodes played by ``cluster.rollout_workers`` Ray actors (:class:`marft.distributed.actors.RolloutWorker`),
    each holding the base model with every adapter; ``engine`` (the driver's) evaluates."""

    def __init__(self, cluster: RayCluster, models, engine):
        self.cluster, self.cfg, self.models, self.engine = cluster, cluster.cfg, models, engine
        self.workers = [self._new_worker() for _ in range(self.cfg.cluster.rollout_workers)]
        self.restarts = 0
        self.version = 0
        self._before = (dict(cluster.bytes), 0)
        # asynchronous training (train.max_staleness k >= 1, pipelined): batch t is queued on the workers
        # behind the adapters of version max(0, t - k), while the learners train the batches before it
        self.k = self.cfg.train.max_staleness
        self.versions: dict[int, dict] = {0: adapter_snapshot(models, cluster.team.adapters)} if self.k else {}
        self.latest = 0
        self.queued: dict[int, tuple[int, list, dict]] = {}  # iteration -> (its version, its shards, shard -> ref)
        self.next_batch: int | None = None  # the next iteration to queue
        self.holding: int | None = None  # the version the workers hold once their queued calls have run (None: not sent yet)
        self.loads: dict[int, list] = {}  # worker -> its queued adapter loads (checked before its batches count)
        self.discarded = 0
        self._async: dict = {}

    def _new_worker(self):
        c = self.cfg.cluster
        return self.cluster.remote_worker.options(num_cpus=c.worker_cpus, num_gpus=c.worker_gpus).remote(
            self.cfg, max(1, int(c.worker_cpus)), os.getcwd())

    def play(self, iteration: int, resets: list) -> Rollout:
        self.cluster.iteration = iteration
        self._before = (dict(self.cluster.bytes), self.restarts)
        if self.k:
            return self._play_ahead(iteration)
        shards = shard(resets, len(self.workers))
        pending = {k: self.workers[k].play.remote(s, shard_seed(self.cfg, iteration, k)) for k, s in enumerate(shards)}
        parts = self._collect(iteration, None, shards, pending)
        return merge_rollouts([parts[k] for k in range(len(shards))], self.cluster.team.names)

    def before_update(self) -> None:
        self.engine.before_update()

    def publish(self, adapters: list[str], version: int) -> None:
        """Every rollout worker acts with the driver's weights of ``adapters`` from now on (one
        object in Ray's store, read by all); the driver's engine too. Asynchronous: the weights are
        kept as ``version``, and the batch that plays with them is queued behind them."""
        if self.k:
            self.latest = keep_version(self.versions, version, adapter_snapshot(self.models, self.cluster.team.adapters),
                                       self.k, self.latest)
            self.engine.update()
            if self.next_batch is not None:
                self._queue_ready()
            return
        if adapters:
            self._broadcast({a: self.models.adapter_state(a) for a in adapters})
        self.engine.update()

    def state(self) -> dict:
        if not self.k:
            return {}
        return {"versions": versions_state(self.versions, self.latest), "ahead": self._ahead()}

    def load(self, state: dict) -> None:
        if self.k:
            self.versions = dict(state.get("versions", {}))  # the checkpoint's, not those this run started with
        self.discarded = state.get("ahead", 0)
        if self.discarded:
            self.cluster.log(f"asynchronous training: {self.discarded} episodes in flight when the checkpoint was written are discarded")

    # ------------------------------------------------------------------ asynchronous (pipelined)
    def _play_ahead(self, iteration: int) -> Rollout:
        """Batch ``iteration``, queued on the workers ahead of time (with version max(0, t - k)); the
        batches the versions allow from here on are queued too."""
        if self.next_batch is None:  # the first batch of this process: queue what the versions allow
            self.next_batch = iteration
            self._queue_ready()
        t0 = time.perf_counter()
        version, shards, pending = self.queued[iteration]
        parts = self._collect(iteration, version, shards, pending)
        del self.queued[iteration]
        out = stamp(merge_rollouts([parts[k] for k in range(len(shards))], self.cluster.team.names), version)
        self._async = {**staleness_metrics(out, iteration), "async/dropped": 0,
                       "async/learner_wait_s": time.perf_counter() - t0,
                       "async/ahead": self._ahead()}
        if self.discarded:
            self._async["async/discarded"], self.discarded = self.discarded, 0
        return out

    def _ahead(self) -> int:
        """Episodes of the batches queued on the workers and not yet handed over."""
        return len(self.queued) * self.cfg.rollout.episodes

    def _queue_ready(self) -> None:
        """Queue every batch whose version exists (t - k <= the newest), up to the last iteration."""
        while self.next_batch < self.cfg.train.iterations and self.next_batch - self.k <= self.latest:
            self._queue(self.next_batch)
            self.next_batch += 1

    def _queue(self, t: int) -> None:
        """Batch t on the workers, behind the adapters of its version (not waited for)."""
        version = playable(self.versions, max(0, t - self.k), self.cluster.log)
        if version != self.holding:
            self._send_version(version, range(len(self.workers)))
        shards = shard(episode_resets(self.cfg, t), len(self.workers))
        self.queued[t] = (version, shards, {k: self.workers[k].play.remote(s, shard_seed(self.cfg, t, k))
                                            for k, s in enumerate(shards)})

    def _send_version(self, version: int, workers) -> None:
        """Queue ``version``'s adapters on ``workers`` (one object in Ray's store)."""
        ray = _ray()
        states = on_cpu(self.versions[version])
        self.cluster.bytes["weights"] += len(pickle.dumps(states)) * len(workers)
        ref = ray.put(states)
        for k in workers:
            self.loads.setdefault(k, []).append(self.workers[k].set_adapters.remote(version, ref))
        self.holding = version

    def _check_loads(self, k: int) -> None:
        """Worker ``k``'s queued adapter loads, which ran before the batch it just returned: one that
        failed (the worker alive) would have played that batch with other adapters than its version
        says, so the run stops with one line."""
        ray = _ray()
        for ref in self.loads.pop(k, []):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # the worker died: its batch is replayed on a new one (_collect)
            except ray.exceptions.RayError as e:
                raise UserError(f"rollout worker {k} could not load the adapters it was sent ({_cause(e)}); "
                                "the run stops (its checkpoint is intact)") from None

    def _collect(self, t: int, version: int | None, shards: list, pending: dict) -> dict[int, Rollout]:
        """The shards of batch t (``pending``: shard -> its reference); a worker that died is replaced
        with batch t's ``version`` (None: the current adapters) and plays its shard again, and the
        batches queued behind it (asynchronous training) are queued again on the new one."""
        ray = _ray()
        parts: dict[int, Rollout] = {}
        pending = dict(pending)
        while pending:
            k, ref = next(iter(pending.items()))
            try:
                parts[k], nbytes = ray.get(ref)
                self.cluster.bytes["rollout"] += nbytes
                del pending[k]
                self._check_loads(k)
            except ray.exceptions.RayActorError as e:
                self._replace_worker(k, f"while playing ({_cause(e)})", None if version is None else self.versions[version])
                pending[k] = self.workers[k].play.remote(shards[k], shard_seed(self.cfg, t, k))
                holding, last = self.holding, version  # the new worker holds batch t's version
                for later in sorted(x for x in self.queued if x > t):
                    v, later_shards, refs = self.queued[later]
                    if v != last:
                        self._send_version(v, [k])
                        last = v
                    refs[k] = self.workers[k].play.remote(later_shards[k], shard_seed(self.cfg, later, k))
                if last != holding:  # then the version the others will hold
                    self._send_version(holding, [k])
                self.holding = holding
        return parts

    def _broadcast(self, states: dict) -> None:
        ray = _ray()
        states = on_cpu(states)
        self.version += 1
        self.cluster.bytes["weights"] += len(pickle.dumps(states)) * len(self.workers)
        ref = ray.put(states)
        for k in range(len(self.workers)):
            while True:
                try:
                    ray.get(self.workers[k].set_adapters.remote(self.version, ref))
                    break
                except ray.exceptions.RayActorError as e:
                    self._replace_worker(k, f"while loading new adapters ({_cause(e)})")

    def _replace_worker(self, k: int, when: str, states: dict | None = None) -> None:
        """Worker k died ``when``: a new one with the current adapters (a replacement that dies while
        starting is replaced too; each counts against ``cluster.max_worker_restarts``)."""
        ray = _ray()
        it = self.cluster.iteration + 1
        while True:
            self.restarts += 1
            if self.restarts > self.cfg.cluster.max_worker_restarts:
                raise UserError(f"rollout workers died {self.restarts} times (more than cluster.max_worker_restarts="
                                f"{self.cfg.cluster.max_worker_restarts}); the last one {when} at iteration {it}. "
                                f"Look at the Ray logs (/tmp/ray/session_latest/logs); marft train --resume {self.cluster.run_dir} continues")
            self.cluster.log(f"warning: rollout worker {k} died {when} at iteration {it}; replaced, its episodes replayed")
            ray.kill(self.workers[k], no_restart=True)
            self.workers[k] = self._new_worker()
            weights = on_cpu(states if states is not None else {a: self.models.adapter_state(a) for a in self.cluster.team.adapters})
            try:
                ray.get(self.workers[k].set_adapters.remote(self.version, weights))
                return
            except ray.exceptions.RayActorError as e:
                when = f"while starting ({_cause(e)})"

    def digests(self) -> list[dict]:
        """The adapter digests every rollout worker holds (for checks)."""
        return _ray().get([w.digests.remote() for w in self.workers])

    def metrics(self, m: dict, seconds: float) -> dict:
        """What the cluster moved and did in the iteration; throughput per GPU where the run asked for GPUs."""
        before, restarts = self._before
        out = {f"distributed/bytes_{k}": v - before[k] for k, v in self.cluster.bytes.items()}
        out["distributed/worker_restarts"] = self.restarts - restarts
        out["distributed/rollout_workers"] = len(self.workers)
        out["distributed/episodes_per_s"] = self.cfg.rollout.episodes / seconds
        out.update(self._async)
        gpus = self.cfg.cluster.worker_gpus * len(self.workers) + self.cluster.learner_gpus()
        out["distributed/gpus"] = gpus
        if gpus > 0:  # the trainer's throughput is of the whole cluster
            for k in ("generated", "processed"):
                out[f"throughput/{k}_tokens_per_s_per_gpu"] = m[f"throughput/{k}_tokens_per_s"] / gpus
        return out

    def close(self) -> None:
        """Stop the workers, the driver's engine, and Ray if this run started it."""
        try:
            import ray
        except ImportError:
            ray = None
        if ray is not None and ray.is_initialized():
            self.cluster.kill(self.workers)
        self.workers = []
        self.cluster.close()
        self.engine.close()


class RayPolicy:
    """One Ray learner actor per adapter (:class:`marft.distributed.actors.Learner`), or
    ``cluster.learners_per_adapter`` data-parallel ones, each with its own copy of the model; all
    adapters update at once, their new weights loaded into the driver's ``models``."""

    parallel = True

    def __init__(self, cluster: RayCluster, models):
        self.cluster, self.cfg, self.models = cluster, cluster.cfg, models
        self._pgs: list = []  # placement groups of colocated learners
        self.learners = self._new_learners()
        self._push(None)  # every learner starts from the driver's adapters (not its own random initialisation)

    def _new_learners(self) -> dict[str, list]:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, c = _ray(), self.cfg.cluster
        learners: dict[str, list] = {}
        for group in self.cluster.groups():
            for rank in range(c.learners_per_adapter):
                options = {"num_cpus": c.learner_cpus, "num_gpus": c.learner_gpus / len(group)}
                if len(group) > 1:  # one bundle per rank, holding the whole group
                    pg = placement_group([{"CPU": c.learner_cpus * len(group), **({"GPU": c.learner_gpus} if c.learner_gpus else {})}],
                                         strategy="STRICT_PACK")
                    ray.get(pg.ready())
                    self._pgs.append(pg)
                    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
                for adapter in group:
                    learners.setdefault(adapter, []).append(self.cluster.remote_learner.options(**options).remote(
                        self.cfg, adapter, max(1, int(c.learner_cpus)), rank, c.learners_per_adapter, os.getcwd()))
        if c.learners_per_adapter > 1:
            for adapter, ranks in learners.items():
                host, port = self.cluster.get(ranks[0].address.remote(), f"the first learner of adapter {adapter}")
                self.cluster.get([r.join.remote(host, port) for r in ranks], f"the learners of adapter {adapter}")
        return learners

    def _push(self, optimizer_states: dict | None) -> None:
        """The driver's adapters (and ``optimizer_states``) into every learner."""
        ray = _ray()
        refs = []
        for adapter, ranks in self.learners.items():
            state = ray.put(on_cpu(self.models.adapter_state(adapter)))
            opt_state = ray.put(on_cpu(optimizer_states[adapter])) if optimizer_states is not None else None
            refs += [r.load.remote(state, opt_state) for r in ranks]
        self.cluster.get(refs, "a learner")

    def update(self, batches: dict[str, PolicyBatch], iteration: int, on_update) -> list[tuple[str, UpdateStats]]:
        ray = _ray()
        refs = {}
        for adapter, batch in batches.items():
            job = {"iteration": iteration, "batch": batch, "n_adapters": len(batches)}
            self.cluster.bytes["learner_in"] += len(pickle.dumps(job))
            ref = ray.put(job)
            refs[adapter] = [r.update.remote(ref) for r in self.learners[adapter]]
        results, states = [], {}
        for adapter in batches:  # in adapter order, as one process would
            res = self.cluster.get(refs[adapter], f"the learner of adapter {adapter}")[0]
            st = res["stats"]
            for message in res["messages"]:
                self.cluster.log(message)
            for good in st.outcomes:
                on_update(good)
            results.append((adapter, st))
            states[adapter] = res["state"]
            self.cluster.bytes["learner_out"] += len(pickle.dumps(res))
        for adapter, state in states.items():
            self.models.load_adapter_state(adapter, state)
        return results

    def optimizer_states(self) -> dict[str, dict]:
        return {a: self.cluster.get(ranks[0].optimizer_state.remote(), f"the learner of adapter {a}")
                for a, ranks in self.learners.items()}

    def load(self, optimizer_states: dict[str, dict]) -> None:
        self._push(optimizer_states)

    def digests(self) -> dict[str, list[str]]:
        """The adapter digest every learner holds (for checks)."""
        ray = _ray()
        return {a: ray.get([r.digest.remote() for r in ranks]) for a, ranks in self.learners.items()}

    def close(self) -> None:
        """Stop the learners and free their placement groups."""
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        self.cluster.kill([r for ranks in self.learners.values() for r in ranks])
        from ray.util.placement_group import remove_placement_group

        for pg in self._pgs:
            remove_placement_group(pg)
        self.learners, self._pgs = {}, []


def ray_parts(cfg, team, models, engine, log=print):
    """The two parts of a Ray run (:class:`RayEpisodes`, :class:`RayPolicy`), Ray started or joined
    and every actor holding the driver's adapters; ``engine`` (the driver's) evaluates."""
    cluster = RayCluster(cfg, team, log)
    episodes = policy = None
    try:
        episodes = RayEpisodes(cluster, models, engine)
        policy = RayPolicy(cluster, models)
        episodes.publish(list(team.adapters), 0)
    except BaseException:  # the actors made so far go, and Ray if this run started it (the caller closes the engine)
        if policy is not None:
            policy.close()
        if episodes is not None:
            cluster.kill(episodes.workers)
        cluster.close()
        raise
    return episodes, policy


def _cause(e: BaseException) -> str:
    """The exception an actor died of, when Ray's message carries it (an error in its constructor:
    ``ImportError: ...``), else the kind of death (``ActorDiedError``: killed, out of memory)."""
    import re

    found = re.findall(r"^\s*(?:[\w]+\.)*(\w+(?:Error|Exception): .+)$", str(e), re.M)  # torch.OutOfMemoryError: ...
    return found[-1].strip()[:200] if found else type(e).__name__
