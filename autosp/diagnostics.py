"""Errors from torch.compile turned into AutoSP errors that say what to change."""

from __future__ import annotations

import re

from autosp.errors import AutoSPError


def graph_break_error(err: Exception, model: str) -> AutoSPError:
    """An `AutoSPError` for a construct Dynamo cannot trace into one graph, naming it and where it is."""
    text = str(err)
    construct = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text.split("from user code:")[-1])
    where = f" at {frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]} in {frames[-1][2]}()" if frames else ""
    return AutoSPError(
        f"{model}.forward does not trace as one graph: {construct}{where}.  AutoSP compiles with fullgraph=True, since a "
        "graph break would split attention from its all-to-alls and hide token-mixing ops from its analysis; "
        "change that code so torch.compile can trace it (or move it out of the model's forward)"
    )
