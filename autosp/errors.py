"""The project's user-facing exception type.

Every mistake a user can make (a bad sp_size, unprepared inputs, a model shape
AutoSP cannot make exact) raises `AutoSPError`, a `ValueError` whose message says
what to change.  Raised before any collective runs, so no rank can hang on it.
"""


class AutoSPError(ValueError):
    """A configuration, input or model that AutoSP cannot make exactly sequence-parallel."""


class DocumentAttentionUnavailable(AutoSPError):
    """The batch needs a mask over the whole sequence (packed documents, padding, a window or chunks) that the
    program cannot apply: its code generator does not compile `autosp.document_attention` (Inductor, not yet), or
    it was compiled as causal attention for plain positions.

    Not a refusal the user sees: the compiled model catches it and runs that batch through its document program
    (compiled by aot_eager), saying so (Note [Document program] in autosp/model.py)."""
