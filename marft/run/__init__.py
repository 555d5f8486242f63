"""One training run: its config (:mod:`.config`); its pieces built from the config (:mod:`.assemble`:
seeds, team, models, tasks); the run object (:mod:`.folder`: the run folder, its files, metrics,
checkpoints (:mod:`.checkpoints`), machine record and the schedule of saves and evaluations); the
trainer's steps (:mod:`.trainer`) over its parts: where episodes come from (:mod:`.episodes`; the
runners in :mod:`.rollout`: the team loop, or an agent program) and how the policy and the critic
are updated (:mod:`.updates`, each adapter's update in :mod:`.learner`); the whole run's loop
(:mod:`.training`), held-out evaluation (:mod:`.evaluation`), trackers (:mod:`.trackers`) and the
check of an agent program (:mod:`.workflow_check`).

May import everything below it: :mod:`marft.engines`, :mod:`marft.maths`, :mod:`marft.envs`,
:mod:`marft.serving`, :mod:`marft.team`, :mod:`marft.turns`, :mod:`marft.errors`; never
:mod:`marft.distributed`, :mod:`marft.experiments` or the front doors (:mod:`marft.api`,
:mod:`marft.cli`), and never Ray. A new tracker goes in :mod:`.trackers`.
"""
