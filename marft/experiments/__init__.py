"""Many runs: sweeps over a grid of config values with seeds, resumable across sessions
(:mod:`.sweep`, ``marft sweep``), and reports that read run folders and state comparisons with their
intervals (:mod:`.report`, ``marft report``).

May import :mod:`marft.run` and everything below it; the front doors (:mod:`marft.cli`) import it.
"""
