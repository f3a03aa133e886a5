"""The one exception type for bad user input.

The CLI turns a `UserError` into one line on stderr and exit code 2 (no traceback unless `--debug`).
Library code raises it wherever the fix is on the user's side: a bad recipe key, a missing file, an
unknown reward, a hub id that cannot be reached offline.
"""


class UserError(Exception):
    """Bad input from the user. The message says what is wrong and what to do."""
