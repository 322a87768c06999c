"""The project's user-facing exception type.

Every mistake a user can make (a bad sp_size, unprepared inputs, a model shape
AutoSP cannot make exact) raises `AutoSPError`, a `ValueError` whose message says
what to change.  Raised before any collective runs, so no rank can hang on it.
"""


class AutoSPError(ValueError):
    """A configuration, input or model that AutoSP cannot make exactly sequence-parallel."""


class DocumentAttentionUnavailable(AutoSPError):
    """The batch needs a mask over the whole sequence (packed documents, padding, a window or chunks) that the
    program's code generator cannot compile (Inductor does not compile `autosp.document_attention` yet).

    Not a refusal the user sees: the compiled model catches it and compiles that batch's program with
    aot_eager instead, saying so (Note [Code generator per batch] in autosp/api.py)."""
