"""User-facing errors and warnings: one line that says what is wrong and how to fix it.

Raise :class:`UserError` for anything the user can fix (a config value, a missing file, a
malformed record). The command line prints its message on one line and exits with status 2;
``--debug`` shows the traceback. Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, with a message that names the fix."""


WARNED: set = set()  # the keys warned about in this process (tests reset it)


def warn_once(message: str, key: str | None = None) -> None:
    """``message`` on stderr the first time ``key`` (the message itself by default) is warned about
    in this process: one warning per run, not one per rollout, batch or setting."""
    import sys

    key = message if key is None else key
    if key not in WARNED:
        WARNED.add(key)
        print(message, file=sys.stderr)


def hub_unreachable() -> tuple[str, str | None]:
    """(the Hub's endpoint, why it cannot be reached, or None): one TCP connection, at most 5 s,
    instead of the libraries' retries."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError as e:
        return endpoint, e.strerror or type(e).__name__
    return endpoint, None
