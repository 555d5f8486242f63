"""One training run: its config (:mod:`.config`), its assembly from the config (:mod:`.assemble`), the
run folder with its files, checkpoints, metrics and evaluation schedule (:mod:`.checkpoints`,
:mod:`.trackers`, :mod:`.evaluation`), where episodes come from (:mod:`.rollout`, the team loop) and
the trainer's steps (:mod:`.trainer`) with each adapter's policy update (:mod:`.learner`).

May import everything below it: :mod:`marft.engines`, :mod:`marft.maths`, :mod:`marft.envs`,
:mod:`marft.serving`, :mod:`marft.team`, :mod:`marft.turns`, :mod:`marft.errors`; never
:mod:`marft.distributed`, :mod:`marft.experiments` or the front doors (:mod:`marft.api`,
:mod:`marft.cli`), and never Ray. A new tracker goes in :mod:`.trackers`.
"""
