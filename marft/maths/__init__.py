"""The mathematics of the algorithms: advantages and returns (:mod:`.advantages`), the PPO and value
losses (:mod:`.losses`), the critic's value heads and the features they read (:mod:`.critic`), one
object per ``train.algorithm`` that turns a rollout into rewards, values, advantages and returns
(:mod:`.algorithms`), and the statistics of evaluations and reports (:mod:`.stats`: the intervals of
an accuracy over problems, tasks and seeds, pass@k, rank correlation; pure functions of numbers).

May import: torch, :mod:`marft.turns` (the typed rollout) and :mod:`marft.engines` (the critic's
features are the base model's hidden states). A new algorithm goes in :mod:`.algorithms`: a targets
function and one entry in ``ALGORITHMS``. A new statistic goes in :mod:`.stats` (math, statistics
and torch only).
"""
