"""The two kinds of Ray actor, as plain classes (:mod:`marft.distributed.parts` wraps them with
``ray.remote``): a rollout worker plays a shard of an iteration's episodes; a learner updates one
adapter with :class:`marft.run.learner.AdapterLearner` (or, with ``cluster.learners_per_adapter`` > 1,
its share of each minibatch, gradients summed over torch.distributed). Neither imports Ray: they
are tested and used as ordinary objects.

Each actor builds what it needs from the run's config on its own machine (the base model once, with
every adapter) and is handed weights only as adapter state dicts (a few MB), never the base model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import time

import torch

from ..run.learner import AdapterLearner, metric_prefix


def on_cpu(obj):
    """``obj`` (tensors in dicts, lists and tuples) with every tensor on the CPU: what crosses to
    another Ray process, since a CUDA tensor unpickles only where its GPU index exists."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(on_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(v) for v in obj)
    return obj


def _build(cfg, threads: int, with_env: bool, cwd: str = ""):
    """(cfg, team, models, environment factory or None) in this process, with ``threads`` torch
    threads; relative paths in the config (model, data, environment files) are read from ``cwd``,
    the driver's working directory, where this machine has it (one machine, a shared file system)."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    from ..run.assemble import prepare, quiet_libraries
    from ..engines.models import TeamModel
    from ..team import build_team

    cfg = dataclasses.replace(cfg, threads=threads)
    if cfg.model.device.startswith("cuda"):  # the GPU Ray gave this actor, numbered 0 here whatever the driver's
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device="cuda"))
    if with_env:
        return (cfg, *prepare(cfg))
    quiet_libraries()  # what prepare does, without building an environment a learner never uses
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    team = build_team(cfg.team)
    return cfg, team, TeamModel(team, cfg.model), None


def adapter_digest(models, adapter: str) -> str:
    """sha256 of an adapter's weights as bytes, in name order (equal digests: equal weights)."""
    h = hashlib.sha256()
    for name, t in sorted(models.adapter_state(adapter).items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RolloutWorker:
    """Holds the base model(s) with every adapter and an engine (``rollout.engine``); plays shards."""

    def __init__(self, cfg, threads: int, cwd: str = ""):
        from ..engines import make_engine

        self.cfg, self.team, self.models, self.make_env = _build(cfg, threads, with_env=True, cwd=cwd)
        self.engine = make_engine(self.cfg, self.models)
        self.version = -1

    def set_adapters(self, version: int, states: dict) -> int:
        """Act with these adapter weights from now on; ``version`` counts updates (for checks)."""
        for adapter, state in states.items():
            self.models.load_adapter_state(adapter, state)
        self.engine.update()
        self.version = version
        return version

    def play(self, resets: list, seed: int) -> tuple:
        """(the shard's Rollout, its size in bytes as pickled, which is what Ray moves)."""
        from ..run.rollout import play

        out = play(self.cfg, self.team, self.engine, self.make_env, resets, seed)
        return out, len(pickle.dumps(out))

    def digests(self) -> dict:
        return {a: adapter_digest(self.models, a) for a in self.team.adapters}

    def close(self) -> None:
        self.engine.close()


class Learner:
    """One adapter's learner (one of ``world`` data-parallel ones): an
    :class:`marft.run.learner.AdapterLearner` over this process's own copy of the model, updating on the
    jobs the driver sends (a dict: iteration, batch, n_adapters; :class:`marft.distributed.RayPolicy`)."""

    def __init__(self, cfg, adapter: str, threads: int, rank: int = 0, world: int = 1, cwd: str = ""):
        cfg, team, models, _ = _build(cfg, threads, with_env=False, cwd=cwd)
        self.adapter, self.rank, self.world = adapter, rank, world
        self.messages: list[str] = []
        self.models = models
        self.learner = AdapterLearner(cfg, models, adapter, log=self.messages.append)

    # torch.distributed among the learners of one adapter
    def address(self) -> tuple[str, int]:
        """An address (this machine, a free port) for rank 0 to serve the process group on."""
        import socket

        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - not under Ray (tests)
            host = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def join(self, host: str, port: int) -> int:
        """Join the adapter's process group (gloo on CPU, NCCL on GPU); blocks until all have joined."""
        import torch.distributed as dist

        device = next(self.models.bases[self.models.base_of[self.adapter]].parameters()).device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world)
        self.learner.group = dist.group.WORLD
        return self.rank

    def load(self, adapter_state: dict | None, opt_state: dict | None) -> None:
        if adapter_state is not None:
            self.models.load_adapter_state(self.adapter, adapter_state)
        if opt_state is not None:
            self.learner.load_optimizer(opt_state)

    def update(self, job: dict) -> dict:
        """One policy update. ``job``: iteration, batch (a :class:`marft.run.learner.PolicyBatch` of this
        adapter's turns only), n_adapters. Returns the :class:`marft.run.learner.UpdateStats` (whose
        outcomes the driver counts, in adapter order, against ``train.max_bad_updates``), the
        metrics, the warnings logged, and (rank 0) the new adapter weights."""
        t0 = time.perf_counter()
        self.messages.clear()
        stats = self.learner.update(job["batch"], job["iteration"])
        result = {"stats": stats, "metrics": stats.metrics(metric_prefix(self.adapter, job["n_adapters"])),
                  "messages": list(self.messages), "seconds": time.perf_counter() - t0}
        if self.rank == 0:
            result["state"] = {k: v.detach().cpu().clone() for k, v in self.models.adapter_state(self.adapter).items()}
        return result

    def optimizer_state(self) -> dict:
        return on_cpu(self.learner.optimizer.state_dict())

    def digest(self) -> str:
        return adapter_digest(self.models, self.adapter)

    def gradients(self, job: dict) -> list[torch.Tensor]:
        """The summed gradient of the first minibatch of ``job`` (no step taken): for the
        data-parallel check that world learners give what one gives."""
        return on_cpu(self.learner.first_gradients(job["batch"], job["iteration"]))
