"""Scale-out on Ray (``pip install marft[ray]``; ``cluster:`` in the config; docs/scaling.md): a Ray
run is the trainer of one process (:mod:`marft.run.trainer`) with two other parts.

:mod:`.actors` holds the rollout worker and the learner as plain classes; :mod:`.parts` holds the
parts that drive them as Ray actors: :class:`RayEpisodes` (where episodes come from) and
:class:`RayPolicy` (how the policy is updated), on a :class:`RayCluster`. Only :mod:`.parts`
imports Ray, and only when a run asks for it. May import :mod:`marft.run` and below.
"""
from __future__ import annotations

from .parts import RayCluster, RayEpisodes, RayPolicy, ray_parts, shard

__all__ = ["RayCluster", "RayEpisodes", "RayPolicy", "ray_parts", "shard"]
