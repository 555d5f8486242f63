"""User-facing errors: one line that says what is wrong and how to fix it.

Raise :class:`UserError` for anything the user can fix (a config value, a missing file, a
malformed record). The command line prints its message on one line and exits with status 2;
``--debug`` shows the traceback. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, with a message that names the fix."""
