"""What the ``python -m experiments...`` command lines share: the parser, its help formatter, plain-text help.

The rules every command line of the project keeps (``tests/test_cli_hygiene.py`` lists them all and checks each):
``prog`` is the command a user types (``python -m experiments.reproduce``, not a file name); ``--help`` does
nothing else; every default and every choice is shown in ``--help``; the help is plain text (no reST markup,
`plain` strips a docstring's); arguments, choice-type flags included, are validated by the parser before any
work (a typo exits with status 2 and a message); outputs go under an output folder (``results/`` by default)
unless a flag says otherwise, and a flag that rewrites a tracked file says so in its help.
"""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]*)``")
_INTERPRETED = re.compile(r"`([^`]+)`")


def plain(text: str) -> str:
    """``text`` (a docstring) without reST markup: roles, literals and interpreted text keep their content,
    a literal-block ``::`` becomes ``:``."""
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    return re.sub(r"::$", ":", text, flags=re.MULTILINE)


def shown(value) -> str:
    """A default as ``--help`` shows it: sequences joined by spaces (as they are typed), floats short."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(shown, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Description and epilog as written; ``(default: ...)`` appended to the help of every option that has a
    default (not None, not False) unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += f" (default: {shown(action.default)})".replace("%", "%%")
        return text


def parser(module: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The parser of ``python -m module``: plain-text ``description``, defaults shown."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=plain(description),
                                   formatter_class=HelpFormatter, **kwargs)
