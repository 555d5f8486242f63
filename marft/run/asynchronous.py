"""Asynchronous training (``train.max_staleness`` k >= 1): an episode source
(:class:`marft.run.episodes.EpisodeSource`) that keeps playing episodes while the learner updates.

Generation runs in threads of this process on a replica of the team's models
(:meth:`marft.engines.models.TeamModel.replica`: its own LoRA weights, the frozen base weights
shared), so the learner can change its adapters while episodes are being played. The learner's
adapters after ``v`` policy updates are *version* v; :meth:`AsyncEpisodes.publish` keeps a copy of
each version still allowed to play, and the generation side loads one before it generates. Every
reply records the version that generated it (:attr:`marft.turns.Turn.versions`); the trainer's
batch for iteration t (trained by version t) trains a reply of version v as stale data when v < t,
with the decoupled PPO objective (:func:`marft.maths.losses.decoupled_ppo_policy_loss`: the
rollout's log-probabilities are the behaviour policy's, the learner's recomputed ones the proximal
policy's). The critic's values and the advantages are computed when the batch is trained, by the
critic as it is then (as for fresh data).

Two modes (``train.async_mode``):

* ``pipelined``: iteration t plays the episodes a synchronous run plays at t (its problems and
  sampler seed) with exactly version max(0, t - k), a whole batch at a time in one thread; so
  batch t is generated while the learner trains on batches t - k .. t - 1, every reply is exactly
  min(t, k) versions old, nothing is dropped, and the same seed gives the same run, resumed or not
  (a checkpoint keeps the k older versions the next batches play with). k = 1 is verl's
  one-step-off pipeline.
* ``streaming``: the episodes of iterations t, t + 1, ... (their problems and seeds) are played in
  chunks of ``train.async_chunk`` in threads of their own, as many at once as keep generation at
  most k batches ahead of the learner (a dropped chunk is replaced by a new one). The chunks share one engine (:class:`_Batcher`): calls queue, and whenever the
  engine is free it generates the oldest chunk's call together with every queued call of the same
  agent, with the newest version, so a chunk's later turns may come from newer versions than its
  first, and under load the batches grow as in continuous batching; env steps and tool calls of the
  chunks overlap. A batch takes chunks in the order they complete, so a slow or hung
  episode delays only its chunk (up to ``rollout.env_timeout_s``); a chunk whose oldest reply is
  more than k versions older than the batch's iteration is dropped and counted. For a grouped
  algorithm a chunk holds whole groups, so in the team loop a group's episodes share their versions
  turn by turn (an agent program's calls come when they are ready, each with its own version).
  Which episodes form a batch depends on timing: runs are not reproducible.

Episodes still being played when a run stops or is killed are discarded; a checkpoint records how
many there were, and the resumed run counts them (``async/discarded``). In streaming mode the
checkpoint also records which chunks the batches had taken (the first not taken, and later ones
taken early), so the resumed run plays each chunk the uninterrupted run would still have played,
once: none trained twice, none skipped. While generation runs, the
CPU's threads are split between the learner (this thread) and generation, half each (at least
one); evaluations before the first batch and after the last have them all.

Metrics per iteration: ``async/staleness_mean`` and ``async/staleness_max`` (versions, over the
batch's replies), ``async/dropped`` (episodes), ``async/learner_wait_s`` (the trainer waited for the
batch), ``async/generation_wait_s`` (generation waited for weights, since the last batch),
``async/ahead`` (episodes played or being played beyond the batch when it was handed over).
"""
from __future__ import annotations

import dataclasses
import threading
import time

import torch

from ..engines import Engine, HFEngine
from ..turns import Rollout, merge_rollouts
from .config import RunConfig, async_chunk
from .episodes import episode_resets, iteration_seed


class _Cancelled(BaseException):
    """Raised in a generation thread's next engine call once the source is closing."""


class _Batcher:
    """The one generation engine shared by the playing threads, batching their calls: a call waits in
    a queue; whichever caller finds the engine free generates, in one batch, the oldest queued call
    (smallest ``key``: the chunk of the oldest iteration, the batch the learner needs next) together
    with every queued call for the same agent and sampling, with the newest adapters (``newest``;
    else the version loaded), and hands each call its rows. While one batch generates, the others'
    calls queue up, so under load the batches grow on their own (continuous batching at the call
    level). The rows are stamped with the version (``Generated.version``); once the source is
    closing, a call raises :class:`_Cancelled`, ending the episodes it was for."""

    def __init__(self, inner: Engine, source: "AsyncEpisodes", newest: bool):
        self.inner, self.source, self.newest = inner, source, newest
        self.cv = threading.Condition()
        self.queue: list[dict] = []
        self.busy = False

    def generate(self, key, agent, chats, sampling, generator=None):
        call = {"key": key, "agent": agent, "chats": chats, "sampling": sampling, "generator": generator}
        with self.cv:
            self.queue.append(call)
            while "out" not in call and "error" not in call:
                if self.source.stopping:
                    self.queue = [c for c in self.queue if c is not call]
                    raise _Cancelled()
                if self.busy:
                    self.cv.wait(0.5)
                    continue
                first = min(self.queue, key=lambda c: c["key"])
                batch = [c for c in self.queue if c["agent"] == first["agent"] and c["sampling"] == first["sampling"]]
                batch.sort(key=lambda c: c["key"])
                self.queue = [c for c in self.queue if all(c is not b for b in batch)]
                self.busy = True
                self.cv.release()
                try:
                    self._run(batch)
                finally:
                    self.cv.acquire()
                    self.busy = False
                    self.cv.notify_all()
        if "error" in call:
            raise call["error"]
        return call["out"]

    def _run(self, batch: list[dict]) -> None:
        """Generate ``batch``'s calls as one (the engine free, the condition released)."""
        try:
            version = self.source.load_newest() if self.newest else self.source.loaded
            chats = [chat for c in batch for chat in c["chats"]]
            out = self.inner.generate(batch[0]["agent"], chats, batch[0]["sampling"], batch[0]["generator"])
            lo = 0
            for k, c in enumerate(batch):
                n = len(c["chats"])
                part = _rows(out, lo, lo + n, whole=k == 0)
                part.version = version
                c["out"], lo = part, lo + n
        except BaseException as e:  # noqa: BLE001 - each caller raises it
            for c in batch:
                c["error"] = e


def _rows(out, lo: int, hi: int, whole: bool):
    """Rows lo..hi of a generated batch as a batch of their own (the widths as they are); the work
    it needed (FLOPs) goes with the first part only (``whole``), so that it is counted once."""
    return dataclasses.replace(out, prompt_ids=out.prompt_ids[lo:hi], prompt_mask=out.prompt_mask[lo:hi],
                               response_ids=out.response_ids[lo:hi], response_mask=out.response_mask[lo:hi],
                               logprobs=out.logprobs[lo:hi], truncated=out.truncated[lo:hi], texts=out.texts[lo:hi],
                               work=out.work if whole else None, spent=out.spent if whole else None)


class _Versioned:
    """One chunk's view of the shared engine (:class:`_Batcher`): its calls carry the chunk's
    (iteration, chunk) as their key; everything else is the engine's."""

    def __init__(self, batcher: _Batcher, key: tuple[int, int]):
        self.batcher, self.key = batcher, key

    def generate(self, agent, chats, sampling, generator=None):
        return self.batcher.generate(self.key, agent, chats, sampling, generator)

    def __getattr__(self, name):
        return getattr(self.batcher.inner, name)


class AsyncEpisodes:
    """Episodes played ahead of the learner (the module docstring). ``engine`` evaluates the team on
    the learner's ``models``; generation runs on a replica of them."""

    def __init__(self, cfg: RunConfig, team, engine: Engine, models, make_env, log=print):
        self.cfg, self.team, self.engine, self.models, self.make_env, self.log = cfg, team, engine, models, make_env, log
        self.k = cfg.train.max_staleness
        self.mode = cfg.train.async_mode
        self.E = cfg.rollout.episodes
        r = cfg.rollout
        self.gen_models = models.replica(share_base=not r.fold_adapters)
        self.gen_engine = HFEngine(self.gen_models, fast=cfg.train.fast, merge=r.fold_adapters, compile=r.compile)
        self.batcher = _Batcher(self.gen_engine, self, newest=self.mode == "streaming")
        self._threads_before = torch.get_num_threads()  # this thread's again once generation stops
        self.gen_threads = max(1, self._threads_before // 2)
        self.cv = threading.Condition()
        self.versions: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # version -> adapter -> LoRA weights
        self.latest = -1
        self.loaded = -1  # the version in gen_models
        self._stats = {"generation_wait_s": 0.0}
        self._blocked_since: float | None = None
        self._snapshot(0)
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self.error: BaseException | None = None
        self.results: dict[int, Rollout] = {}  # pipelined: iteration -> its batch
        self.done: list[tuple[tuple[int, int], Rollout]] = []  # streaming: (chunk, its episodes) in the order they completed
        self.next_job = None  # streaming: the next chunk to play, (iteration, chunk)
        self.taken: set[tuple[int, int]] = set()  # streaming: chunks the batches have taken (used or dropped)
        self.resume_at: tuple[int, int] | None = None  # streaming, resumed: the first chunk no batch had taken
        self.first = 0  # the first iteration this process plays
        self.started = self.dropped_chunks = self.lost = 0  # streaming: chunks started, dropped as too stale, lost to an error
        self.running = 0  # episodes being played
        self.discarded = 0  # episodes in flight when the run was checkpointed, counted once on resume

    # ------------------------------------------------------------------ versions
    def _snapshot(self, version: int) -> None:
        """Keep the learner's adapters as ``version`` and forget versions no batch may play any more."""
        state = adapter_snapshot(self.models, self.team.adapters)
        if self.gen_models_on_cuda():  # the copies are made on this thread's stream; generation reads them on its own
            torch.cuda.current_stream().synchronize()
        with self.cv:
            self.latest = keep_version(self.versions, version, state, self.k, self.latest)
            self._unblock()
            self.cv.notify_all()

    def _load(self, version: int) -> None:
        """Generation's adapters become ``version`` (called by the batcher while it holds the engine,
        or by pipelined's only generating thread between its batches)."""
        if version != self.loaded:
            with self.cv:
                state = self.versions[version]
            for a, weights in state.items():
                self.gen_models.load_adapter_state(a, weights)
            self.loaded = version

    def load_newest(self) -> int:
        """Streaming: load the newest version before a generation call (the engine's lock held)."""
        with self.cv:
            newest = self.latest
        self._load(newest)
        return newest

    def _wait_for(self, ready) -> bool:
        """Wait (the condition held) until ``ready()`` or the source stops. The wall time during which
        nothing is being played and the next episodes are held back by the bound counts as generation
        waiting for weights. False when stopping."""
        while not ready() and not self.stopping:
            if self._blocked_since is None and not self.running:
                self._blocked_since = time.perf_counter()
            self.cv.wait(0.5)
        self._unblock()
        return not self.stopping

    def _unblock(self) -> None:
        """The bound no longer holds generation back: its wait ends (the condition held)."""
        if self._blocked_since is not None:
            self._stats["generation_wait_s"] += time.perf_counter() - self._blocked_since
            self._blocked_since = None

    # ------------------------------------------------------------------ generation threads
    def _start(self, it: int) -> None:
        # the cores split between the learner (this thread) and generation while generation runs;
        # evaluations before the first batch and after the last have them all
        torch.set_num_threads(max(1, self._threads_before - self.gen_threads))
        self.first = it
        if self.mode == "pipelined":
            targets = [(self._pipelined, (it,))]
        else:
            self.chunk = async_chunk(self.cfg)
            self.next_job = next_chunk(None, self.resume_at or (it, 0), self.E // self.chunk, self.taken)
            n = min(64, (self.k + 1) * (self.E // self.chunk))
            targets = [(self._streaming, ())] * n
        for k, (fn, args) in enumerate(targets):
            t = threading.Thread(target=self._guard, args=(fn, args), daemon=True, name=f"marft-generation-{k}")
            self.threads.append(t)
            t.start()

    def _guard(self, fn, args) -> None:
        torch.set_num_threads(self.gen_threads)
        stream = torch.cuda.Stream() if self.gen_models_on_cuda() else None
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    fn(*args)
            else:
                fn(*args)
        except _Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's next play()
            with self.cv:
                self.error = self.error or e
                self.cv.notify_all()

    def gen_models_on_cuda(self) -> bool:
        return next(iter(self.gen_models.bases.values())).device.type == "cuda"

    def _play(self, resets, seed: int, key: tuple[int, int]) -> Rollout:
        from .rollout import play

        engine = _Versioned(self.batcher, key)
        return play(self.cfg, self.team, engine, self.make_env, resets, seed)

    def _pipelined(self, t: int) -> None:
        """Iteration t's batch with version max(0, t - k), for t = the first iteration onwards."""
        while t < self.cfg.train.iterations:
            need = max(0, t - self.k)
            with self.cv:
                if not self._wait_for(lambda: need <= self.latest):
                    return
                need = playable(self.versions, need, self.log)
                self.running = self.E
            self._load(need)
            out = self._play(episode_resets(self.cfg, t), iteration_seed(self.cfg, t, 1), (t, 0))
            stamp(out, need)
            with self.cv:
                self.results[t] = out
                self.running = 0
                self.cv.notify_all()
            t += 1
            if self.stopping:
                return

    def _streaming(self) -> None:
        """Chunks of the episode stream, one after another, while the bound allows (:meth:`_may_start`)."""
        per = self.E // self.chunk
        while True:
            with self.cv:
                if not self._wait_for(self._may_start):
                    return
                t, q = self.next_job
                self.next_job = next_chunk((t, q), None, per, self.taken)
                self.started += 1
                self.running += self.chunk
            try:
                resets = episode_resets(self.cfg, t)[q * self.chunk:(q + 1) * self.chunk]
                out = self._play(resets, iteration_seed(self.cfg, t, 1 if q == 0 else 1000 + q), (t, q))
            except BaseException:
                with self.cv:  # lost: it no longer counts against the bound (the error reaches play())
                    self.lost += 1
                raise
            finally:
                with self.cv:
                    self.running -= self.chunk
                    self.cv.notify_all()
            with self.cv:
                self.done.append(((t, q), out))
                self.cv.notify_all()

    def _may_start(self) -> bool:
        """Streaming's bound (the condition held): the chunks started and not dropped or lost stay
        within the batches up to k past the learner's version, so a dropped chunk is replaced by a
        new one and generation is never more than k batches ahead (a hung chunk holds its place
        until it times out; the engine serves the oldest chunk's calls first, so chunks beyond the
        last batch only fill its gaps)."""
        per = self.E // self.chunk
        return self.started - self.dropped_chunks - self.lost < (self.latest - self.first + self.k + 1) * per

    # ------------------------------------------------------------------ the episode source
    def play(self, iteration: int, resets: list[tuple[int, dict]]) -> Rollout:
        if not self.threads:
            self._start(iteration)
        t0 = time.perf_counter()
        dropped = 0
        with self.cv:
            if self.error is not None:  # a generation thread failed: its chunk is lost, say why
                raise self.error
            if self.mode == "pipelined":
                self._wait_batch(lambda: iteration in self.results)
                out = self.results.pop(iteration)
            else:
                parts, count = [], 0
                while count < self.E:
                    self._wait_batch(lambda: bool(self.done))
                    key, part = self.done.pop(0)
                    self.taken.add(key)
                    if iteration - _oldest(part, iteration) > self.k:
                        dropped += len(part.steps)
                        self.dropped_chunks += 1  # a new chunk may start in its place
                        self.cv.notify_all()
                        continue
                    parts.append(part)
                    count += len(part.steps)
                out = merge_rollouts(parts, self.team.names)
            ahead = self._ahead()
            gen_wait, self._stats["generation_wait_s"] = self._stats["generation_wait_s"], 0.0
        if iteration + 1 >= self.cfg.train.iterations:
            self._stop()  # nothing more to play: what is in flight is not needed
        self._metrics = {**staleness_metrics(out, iteration),
                         "async/dropped": dropped, "async/learner_wait_s": time.perf_counter() - t0,
                         "async/generation_wait_s": gen_wait, "async/ahead": ahead}
        if self.discarded:
            self._metrics["async/discarded"], self.discarded = self.discarded, 0
        return out

    def _wait_batch(self, ready) -> None:
        """Wait (the condition held) until ``ready()``; a generation thread's error is raised here."""
        while not ready():
            if self.error is not None:
                raise self.error
            self.cv.wait(0.5)

    def before_update(self) -> None:
        self.engine.before_update()

    def publish(self, adapters: list[str], version: int) -> None:
        self.engine.update()
        self._snapshot(version)

    def metrics(self, iteration: dict, seconds: float) -> dict:
        return getattr(self, "_metrics", {})

    def state(self) -> dict:
        """The versions batches after the checkpoint may still play with, the episodes in flight and,
        streaming, the first chunk no batch has taken and the later ones taken early: a resumed run
        plays the chunks the uninterrupted one would still have played, each once."""
        with self.cv:
            out = {"versions": versions_state(self.versions, self.latest), "ahead": self._ahead()}
            if self.mode == "streaming" and self.next_job is not None:
                first = next_chunk(None, self.resume_at or (self.first, 0), self.E // self.chunk, self.taken)
                out["chunks"] = {"first": first, "taken": sorted(k for k in self.taken if k > first)}
            return out

    def _ahead(self) -> int:
        """Episodes played or being played beyond the batches handed over (the condition held)."""
        return sum(len(r.steps) for r in (*self.results.values(), *(r for _, r in self.done))) + self.running

    def load(self, state: dict) -> None:
        device = next(iter(self.models.bases.values())).device
        with self.cv:
            self.versions.clear()  # not the adapters this process started with: the checkpoint's
            for v, s in state.get("versions", {}).items():
                self.versions[v] = {a: {n: t.to(device) for n, t in w.items()} for a, w in s.items()}
        chunks = state.get("chunks")
        if chunks and self.mode == "streaming":  # the chunks before "first" and those in "taken" are trained on
            self.resume_at = tuple(chunks["first"])
            self.taken = {tuple(k) for k in chunks["taken"]}
        self.discarded = state.get("ahead", 0)
        if self.discarded:
            self.log(f"asynchronous training: {self.discarded} episodes in flight when the checkpoint was written are discarded")

    def _stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        torch.set_num_threads(self._threads_before)

    def close(self) -> None:
        self._stop()
        for t in self.threads:
            t.join(timeout=5.0)
        try:
            self.gen_engine.close()
        finally:
            self.engine.close()


def next_chunk(key: tuple[int, int] | None, start: tuple[int, int] | None, per: int, taken: set) -> tuple[int, int]:
    """Streaming: the chunk after ``key`` (or ``start`` itself, when ``key`` is None) that no batch
    has taken; chunks are (iteration, q) with ``per`` chunks an iteration."""
    def after(k):
        return (k[0], k[1] + 1) if k[1] + 1 < per else (k[0] + 1, 0)
    k = start if key is None else after(key)
    while k in taken:
        k = after(k)
    return k


def adapter_snapshot(models, adapters: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of every adapter's LoRA weights as they are now (one version)."""
    return {a: {n: t.detach().clone() for n, t in models.adapter_state(a).items()} for a in adapters}


def playable(versions: dict[int, dict], need: int, log=print) -> int:
    """The version a pipelined batch plays with: ``need``, or where the checkpoint a run resumed
    from does not hold it (written synchronously, or with a smaller ``train.max_staleness``), the
    oldest newer one, saying so (at most the first k batches after such a resume)."""
    if need in versions:
        return need
    got = min(v for v in versions if v > need)
    log(f"asynchronous training: the checkpoint holds no adapters of version {need} (it was written with a smaller "
        f"train.max_staleness); this batch plays with version {got}")
    return got


def keep_version(versions: dict[int, dict], version: int, state: dict, k: int, latest: int) -> int:
    """Keep ``state`` as ``version`` in ``versions`` and forget those no batch may play any more
    (older than the newest - k); returns the newest version."""
    versions[version] = state
    latest = max(latest, version)
    for v in [v for v in versions if v < latest - k]:
        del versions[v]
    return latest


def stamp(out: Rollout, version: int) -> Rollout:
    """Every reply of ``out`` recorded as generated by adapter ``version``."""
    for turn in out.turns:
        turn.versions = torch.full((len(turn.texts),), version)
    return out


def staleness_metrics(out: Rollout, iteration: int) -> dict:
    """``async/staleness_mean`` and ``async/staleness_max`` of the batch that ``iteration`` trains on."""
    ages = torch.cat([iteration - t.versions for t in out.turns]) if out.turns else torch.zeros(1, dtype=torch.long)
    return {"async/staleness_mean": float(ages.float().mean()), "async/staleness_max": int(ages.max())}


def versions_state(versions: dict[int, dict], latest: int) -> dict[int, dict]:
    """The versions older than ``latest`` (the checkpoint's own adapters are ``latest``), on the CPU."""
    return {v: {a: {n: t.cpu() for n, t in w.items()} for a, w in s.items()} for v, s in versions.items() if v < latest}


def _oldest(out: Rollout, default: int) -> int:
    """The oldest version among a rollout's replies (``default`` when it has none)."""
    return min((int(t.versions.min()) for t in out.turns if t.versions is not None and len(t.versions)), default=default)
