"""Scale-out on Ray (``pip install marft[ray]``; ``cluster:`` in the config; docs/scaling.md).

:mod:`.actors` holds the rollout worker and the learner as plain classes; :mod:`.driver` holds the
:class:`DistributedTrainer`, which runs the trainer's steps with them as Ray actors. Only the
driver imports Ray, and only when a run asks for it.
"""
from __future__ import annotations

from .driver import DistributedTrainer, merge_rollouts, shard

__all__ = ["DistributedTrainer", "merge_rollouts", "shard"]
