"""The project's user-facing exception type.

Every mistake a user can make (a bad sp_size, unprepared inputs, a model shape
AutoSP cannot make exact) raises `AutoSPError`, a `ValueError` whose message says
what to change.  Raised before any collective runs, so no rank can hang on it.
"""


class AutoSPError(ValueError):
    """A configuration, input or model that AutoSP cannot make exactly sequence-parallel."""
