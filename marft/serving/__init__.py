"""The team behind an OpenAI-compatible endpoint: the server (:mod:`.serve`, ``marft serve``), tool
calls in chat replies (:mod:`.tool_calls`), and the runner that plays a user's agent program
(``task.kind: workflow``) against it and turns its recorded calls into a rollout (:mod:`.workflow`).

May import: :mod:`marft.engines`, :mod:`marft.envs`, :mod:`marft.team`, :mod:`marft.turns`,
:mod:`marft.errors`; never the run (:mod:`marft.run`) or the front doors.
"""
