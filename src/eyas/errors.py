"""One exception type for every user-facing failure.

The CLI prints `EyasError` messages as a single line and exits non-zero; anything else is
a bug and keeps its traceback.
"""


class EyasError(Exception):
    """A problem the user can fix: bad input, a missing package, mismatched stages."""
