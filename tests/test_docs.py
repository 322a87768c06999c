"""The docs cannot drift silently: what README.md, docs/*.md and paper/README.md name exists, and the commands of
README.md and docs/*.md are accepted as written.

Read from the documents themselves (nothing is listed twice):

- every backticked repository path (``autosp/api.py``, ``passes/joint/``, ``masks.py``) exists: a path starting
  at a top-level entry of the checkout is checked there (unless git ignores it: an output such as
  ``paper/build/paper.md``), a shorter one must be the end of some file's or folder's path;
- every module named as ``python -m MODULE`` or as a backticked dotted name (``simulator.ledger``,
  ``autosp.tracing.trace_fake_step``) is found by the import system's path finder, without importing anything
  (a package run with ``-m`` needs a ``__main__.py``; a trailing attribute must be named in the module's source);
- every Note cited (``Note`` followed by its bracketed title) is defined in the code, on a line of its own;
- every relative Markdown link (``[text](docs/guide.md#anchor)``) names a file that exists and, with an anchor, a
  heading of that file (GitHub's spelling of it);
- README.md is one page: at most ``README_MAX_LINES`` lines (the rest is in the user guide under docs/);
- every ``autosp.NAME`` in the Python examples of README.md and of the user guide (docs/*.md but design.md, whose
  examples may show internals) is in ``autosp.__all__``;
- every ``bash`` block of README.md and docs/*.md carries a mode in an HTML comment just above it, ``<!-- readme-test: MODE -->``:
  ``run`` executes each line (in bash, after ``source bin/env.sh``, from the root; keep such blocks cheap and
  free of outputs), ``parse`` hands each command's arguments, as written, to the parser of the program it
  starts (``python -m M`` / ``torchrun ... -m M`` / ``deepspeed ... --module M`` / ``bash bin/reproduce``:
  the module's ``build_parser()``, and torchrun's and the deepspeed launcher's own parsers for their
  arguments), for commands too long or needing GPUs to run here; ``skip: REASON`` (a network install) checks
  nothing and says why.  A block without a mode fails.  README keeps at least one ``run`` block (the set-up check).

And from the code (the ``.py``, ``.ipynb`` and ``.sh`` files of autosp/, simulator/, experiments/, tests/, scripts/
and bin/, read as prose: a citation broken over comment lines, docstring lines, adjacent string literals or a
notebook's source lines is read whole):

- every Note the code cites is defined, as the documents' are;
- every section of docs/design.md that the code or a document cites (the path followed by the section's title in
  double quotes, with or without a comma; a Markdown link to design.md followed by the quoted title; or the path, a
  comma and a bare capitalised title) is a heading of design.md: its whole text, or its text before `` (`` or ``: ``;
- docs/design.md, the map of contracts and recipes, stays at most ``DESIGN_MAX_LINES`` lines.

This module is the checker: its own examples of right and wrong citations are not read as citations.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.machinery
import importlib.util
import io
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "paper/README.md")
COMMAND_DOCS = DOCS[:-1]
"""The documents whose command blocks are run or parsed: README.md and docs/*.md."""
USER_DOCS = tuple(d for d in COMMAND_DOCS if d != "docs/design.md")
"""README.md and the user guide: their Python examples use only the public API."""
README_MAX_LINES = 300
DESIGN = "docs/design.md"
DESIGN_MAX_LINES = 600
"""docs/design.md is a map of contracts and recipes that point to the code's Notes, not a lab notebook."""
CODE_DIRS = ("autosp", "simulator", "experiments", "tests", "scripts", "bin")
CODE_SUFFIXES = (".py", ".ipynb", ".sh")
CHECKER = "tests/test_docs.py"
"""This module: its examples of citations, good and bad, are not citations."""
PACKAGES = ("autosp", "simulator", "experiments", "tests")
BLOCK = re.compile(r"(?:<!--\s*readme-test:\s*(?P<mode>[^>]*?)\s*-->\s*\n)?```(?P<lang>\w*)\n(?P<body>.*?)```",
                   re.DOTALL)
PATH_LIKE = re.compile(r"^[\w.-]+(/[\w.*-]+)*/?$")
FILE_SUFFIXES = (".py", ".md", ".json", ".csv", ".ipynb", ".toml", ".ini", ".txt", ".sh", ".png")


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        return [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]


def _ignored(path: str) -> bool:
    try:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
    except OSError:
        return path.startswith(("results/", "paper/build"))


def _find_module(name: str):
    """The spec of module ``name`` from the path finder, one component at a time: no package is imported."""
    spec, path, parts = None, [str(ROOT)], name.split(".")
    for i in range(len(parts)):
        if path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec


def _code_text(text: str) -> str:
    """``text`` without fenced blocks (their paths are checked as commands, or are outputs)."""
    return BLOCK.sub("", text)


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _code_text(text))


def _check_path(token: str, files: list[str], top: set[str]) -> str | None:
    """``token`` when it is a repository path that does not exist; None when it exists or is not one (a
    placeholder such as ``NAME.md``, an output such as ``results/`` or ``run.json``, a module name)."""
    token = token.rstrip(".,;:)")
    if not PATH_LIKE.match(token) or token.startswith((".", "-")) or "*" in token:
        return None
    if any(re.fullmatch(r"[A-Z_]+", Path(part).stem) for part in token.split("/") if part):
        return None  # a placeholder: NAME.md, WORKLOAD.json, S/P
    if "/" not in token:
        if not token.endswith(".py"):
            return None  # a bare output name (run.json) or a word
        return None if any(f == token or f.endswith("/" + token) for f in files) else token
    if _ignored(token):
        return None  # an output: results/, paper/build/
    if token.split("/")[0] in top:
        return None if (ROOT / token).exists() else token
    folders = {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}
    ok = any(f.endswith("/" + token) for f in files) or any(d.endswith("/" + token) or d == token for d in folders)
    return None if ok else token


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_only_paths_modules_and_notes_that_exist(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    files = _tracked()
    top = {f.split("/")[0] for f in files}
    missing = []
    plain_blocks = [m.group("body") for m in BLOCK.finditer(text) if m.group("lang") == ""]
    words = [w for token in _backticked(text) for w in token.split()]
    words += [w for body in plain_blocks for w in re.split(r"[\s,()·]+", body) if w.endswith((*FILE_SUFFIXES, "/"))]
    for word in words:
        bad = _check_path(word, files, top)
        if bad:
            missing.append(f"path {bad}")
    modules = {m.rstrip(".") for m in re.findall(r"python -m ([\w.]+)", text)}
    dotted = {w.rstrip(".,;:()") for token in _backticked(text) for w in re.split(r"[\s(\[]", token)}
    dotted = {w for w in dotted if re.fullmatch(rf"({'|'.join(PACKAGES)})(\.\w+)+", w)}
    for name in sorted(modules):
        if name.split(".")[0] not in PACKAGES:  # an installed tool (pip): found without importing it
            if importlib.util.find_spec(name.split(".")[0]) is None:
                missing.append(f"module {name} (python -m)")
            continue
        spec = _find_module(name)
        if spec is None:
            missing.append(f"module {name} (python -m)")
        elif spec.submodule_search_locations is not None and _find_module(name + ".__main__") is None:
            missing.append(f"package {name} has no __main__.py (python -m)")
    for name in sorted(dotted):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            spec = _find_module(".".join(parts[:cut]))
            if spec is not None:
                break
        if spec is None or spec.origin is None:
            missing.append(f"module {name}")
            continue
        rest = parts[cut:]
        if rest and not re.search(rf"\b{re.escape(rest[0])}\b", Path(spec.origin).read_text(encoding="utf-8")):
            missing.append(f"{rest[0]} in {'.'.join(parts[:cut])} ({name})")
    defined = _defined_notes(files)
    for title in _cited_notes(text):
        if title not in defined:
            missing.append("Note " + f"[{title}]")
    assert missing == [], f"{doc} names what does not exist: {sorted(set(missing))}"


def _defined_notes(files: list[str]) -> set[str]:
    """The titles of the Notes the code defines: ``Note [Title]`` on a line of its own (a comment's or a docstring's)."""
    defined = set()
    for f in files:
        if f.endswith(".py") and f.split("/")[0] in PACKAGES:
            defined |= set(re.findall(r"^\s*(?:#\s*)?Note \[([^\]]+)\]\s*$", (ROOT / f).read_text(encoding="utf-8"),
                                      re.MULTILINE))
    return defined


def _as_prose(text: str) -> str:
    """``text`` read as prose: escaped quotes and newlines of string literals and notebook JSON undone, adjacent
    string literals joined (``"a " "b"``, ``"a " f"b"``, a notebook's ``"a\\n", "b"``), comment markers and line
    breaks dropped, runs of white space made one space."""
    text = text.replace('\\"', '"').replace("\\n", " ")
    text = re.sub(r"""["']\s*,?\s*[rfb]?["']""", " ", text)
    text = re.sub(r"\s*\n\s*#*\s*|\s+#+\s+", " ", text)
    return re.sub(r"\s+", " ", text)


def _cited_notes(text: str) -> list[str]:
    """The titles of the Notes ``text`` cites (the placeholder ``...`` aside)."""
    return [t.strip() for t in re.findall(r"Note \[([^\]]{1,200})\]", _as_prose(text)) if t.strip() != "..."]


DESIGN_CITATION = [
    re.compile(r"docs/design\.md(?:'s recipe)?(?:,\s*|\s+)\(?\s*\"([^\"]{1,120})\""),  # path then "Section"
    re.compile(r"\]\((?:docs/)?design\.md\)\s*\(\s*\"([^\"]{1,120})\""),  # [design.md](design.md) ("Section")
    re.compile(r"docs/design\.md,\s+([A-Z][\w' ×-]{0,80}?)(?=[,;)])"),  # path, Section,
]


def _design_citations(text: str) -> list[str]:
    """The sections of docs/design.md that ``text`` cites, by title."""
    prose = _as_prose(text)
    return [m.group(1).strip() for pattern in DESIGN_CITATION for m in pattern.finditer(prose)]


def _design_sections(markdown: str) -> set[str]:
    """The titles a citation may use for each heading: the heading, and its text before `` (`` or ``: ``."""
    names = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", _code_text(markdown), re.MULTILINE):
        names |= {heading, heading.split(" (")[0], heading.split(": ")[0]}
    return names


def _code_files(files: list[str]) -> list[str]:
    return [f for f in files if f.split("/")[0] in CODE_DIRS and f.endswith(CODE_SUFFIXES) and f != CHECKER
            and (ROOT / f).is_file()]


@pytest.mark.parametrize("text, cited", [
    ('(docs/design.md, "Trace reuse")', ["Trace reuse"]),
    ('# see docs/design.md, "Activation\n# offload in the planner").', ["Activation offload in the planner"]),
    ('"fields: docs/design.md, \\"Cluster files\\"; an example"', ["Cluster files"]),
    ('raise E("see docs/design.md, "\n    "Cluster files, for the fields")', ["Cluster files"]),
    ("(docs/design.md, Cluster files)", ["Cluster files"]),
    ('docs/design.md "Trace reuse across lengths")', ["Trace reuse across lengths"]),
    ("docs/design.md's recipe \"Adding a memory\ntechnique\" says", ["Adding a memory technique"]),
    ('[design.md](design.md) ("The simulator\'s model")', ["The simulator's model"]),
    ("(docs/design.md): the map", []),
])
def test_design_citation_rule(text, cited):
    assert _design_citations(text) == cited


@pytest.mark.parametrize("text, cited", [
    ("Note [One program\n    per length] in autosp/model.py", ["One program per length"]),
    ('f"(Note [Mask programs probed on shorter " f"blocks])"', ["Mask programs probed on shorter blocks"]),
    ('"    # (Note [Fixed or\\n",\n    "    # per-token gap] in"', ["Fixed or per-token gap"]),
    ("the `Note [...]` blocks", []),
])
def test_note_citation_rule(text, cited):
    assert _cited_notes(text) == cited


def test_design_sections_cited_anywhere_are_headings_of_design_md():
    """A renamed or removed section of docs/design.md fails here until every citation of it is retargeted."""
    sections = _design_sections((ROOT / DESIGN).read_text(encoding="utf-8"))
    assert {"Trace reuse", "Choosing a strategy", "Deciding fast", "Stage 3: the partitioned graphs"} <= sections
    citing = _code_files(_tracked()) + [d for d in DOCS if d != DESIGN]
    bad = sorted({f"{f}: {title!r}" for f in citing for title in _design_citations((ROOT / f).read_text(
        encoding="utf-8")) if title not in sections})
    assert bad == [], ("these cite a section docs/design.md does not have (a heading, or its text before ' (' or "
                       "': '); cite one it has or keep the heading:\n" + "\n".join(bad))


def test_code_cites_only_notes_that_are_defined():
    files = _tracked()
    defined = _defined_notes(files)
    bad = sorted({f"{f}: Note [{title}]" for f in _code_files(files)
                  for title in _cited_notes((ROOT / f).read_text(encoding="utf-8")) if title not in defined})
    assert bad == [], "these cite a Note that no module defines (on a line of its own):\n" + "\n".join(bad)


def test_design_md_is_a_map_not_a_notebook():
    lines = (ROOT / DESIGN).read_text(encoding="utf-8").count("\n")
    assert lines <= DESIGN_MAX_LINES, (
        f"{DESIGN} has {lines} lines (at most {DESIGN_MAX_LINES}): keep contracts and recipes there and move the "
        "detail into the Note it points to; measured figures belong in run records, not in the page")


def _blocks(doc: str = "README.md"):
    text = (ROOT / doc).read_text(encoding="utf-8")
    return [(m.group("mode"), m.group("lang"), m.group("body"), text.count("\n", 0, m.start()) + 1)
            for m in BLOCK.finditer(text)]


def _commands(body: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments and blank lines dropped."""
    lines, current = [], ""
    for raw in body.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line and not current:
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append((current + line).strip())
        current = ""
    return [ln for ln in lines if ln]


def _parse_module_args(module: str, args: list[str]) -> str | None:
    """None when ``module``'s parser accepts ``args``; its error otherwise."""
    if _find_module(module) is None:
        return f"no module {module}"
    package = importlib.util.find_spec(module).submodule_search_locations is not None  # run as its __main__
    target = importlib.import_module(module + ".__main__" if package else module)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            target.build_parser().parse_args(args)
    except SystemExit as exc:
        errors = [ln for ln in err.getvalue().splitlines() if "error" in ln] or [err.getvalue()[-500:]]
        return f"python -m {module} {shlex.join(args)}: exit {exc.code}: {errors[-1]}"
    return None


def _parse(command: str) -> str | None:
    words = shlex.split(command)
    while words and re.fullmatch(r"\w+=.*", words[0]):
        words = words[1:]
    program, args = words[0], words[1:]
    if program == "source" or program == "bash":
        if not (ROOT / args[0]).is_file():
            return f"no file {args[0]}"
        if args[0] == "bin/reproduce":
            return _parse_module_args("experiments.reproduce", args[1:])
        return None
    if program == "python" and args[:1] == ["-m"]:
        return _parse_module_args(args[1], args[2:])
    if program == "python" and args and args[0].endswith(".py"):
        return None if (ROOT / args[0]).is_file() else f"no file {args[0]}"
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        launched = get_args_parser().parse_args(args)
        if not launched.module:
            return f"{command}: run the module with -m"
        return _parse_module_args(launched.training_script, launched.training_script_args)
    if program == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        launched = parse_args(args)
        if not launched.module:
            return f"{command}: run the module with --module"
        return _parse_module_args(launched.user_script, launched.user_args)
    if program == "jupyter":
        return None if (ROOT / args[-1]).exists() else f"no path {args[-1]}"
    return f"{command}: tests/test_docs.py does not know {program!r}; teach it or mark the block 'skip: REASON'"


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_doc_command_blocks_run_or_parse_as_written(doc):
    failures, ran = [], 0
    for mode, lang, body, line in _blocks(doc):
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        if lang == "" and not re.search(r"^(python|bash|torchrun|deepspeed) ", body, re.MULTILINE):
            continue  # a plain block that is not commands (the layout tree)
        where = f"{doc} line {line}"
        if mode is None:
            failures.append(f"{where}: a command block without <!-- readme-test: run|parse|skip: REASON -->")
        elif mode.startswith("skip:"):
            assert mode[5:].strip(), f"{where}: say why the block is skipped"
        elif mode == "parse":
            for command in _commands(body):
                error = _parse(command)
                if error:
                    failures.append(f"{where}: {error}")
        elif mode == "run":
            script = "set -euo pipefail\nsource bin/env.sh\n" + "\n".join(_commands(body)) + "\n"
            proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
            ran += 1
            if proc.returncode != 0:
                failures.append(f"{where}: exit {proc.returncode}\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        else:
            failures.append(f"{where}: unknown mode {mode!r}")
    assert failures == [], "\n".join(failures)
    assert ran >= 1 or doc != "README.md", "README has no block the test runs: keep the set-up check runnable"


def test_readme_is_one_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to "
                                       "a page of the user guide under docs/ and link it from README's table")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, code marks and punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_links_name_files_and_headings_that_exist(doc):
    text = _code_text((ROOT / doc).read_text(encoding="utf-8"))
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (ROOT / doc).parent / path if path else ROOT / doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+\s+(.+?)\s*$", _code_text(file.read_text(encoding="utf-8")), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert broken == [], f"{doc} links to what does not exist: {broken}"


def test_python_examples_use_public_names():
    tree = ast.parse((ROOT / "autosp" / "__init__.py").read_text(encoding="utf-8"))
    public = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "__all__" for t in node.targets))
    used = {(doc, name) for doc in USER_DOCS for _, lang, body, _ in _blocks(doc) if lang == "python"
            for name in re.findall(r"\bautosp\.(\w+)", body)}
    outside = sorted((doc, name) for doc, name in used if name not in public)
    assert {doc for doc, _ in used} >= {"README.md"} and outside == [], (
        f"autosp names outside autosp.__all__ (doc, name): {outside}")


def test_env_sh_puts_the_venv_tools_on_path():
    """After ``source bin/env.sh`` the README's tools are the .venv's (skipped where .venv is not set up: tox)."""
    venv_bin = ROOT / ".venv" / "bin"
    if not (venv_bin / "python").exists():
        pytest.skip(".venv is not set up (bash bin/bootstrap creates it)")
    script = f"source {shlex.quote(str(ROOT / 'bin' / 'env.sh'))} && for t in python torchrun deepspeed jupyter pytest; do command -v $t; done"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env["PATH"] = "/usr/bin:/bin"
    proc = subprocess.run(["bash", "-c", script], cwd="/", env=env, capture_output=True, text=True, timeout=60,
                          input="")
    found = proc.stdout.split()
    assert proc.returncode == 0 and len(found) == 5, proc.stdout + proc.stderr
    assert all(Path(p).parent == venv_bin for p in found), found


def test_paper_readme_names_every_placeholder_kind_the_paper_uses():
    used = set(re.findall(r"\{\{(\w+):", (ROOT / "paper" / "paper.md").read_text(encoding="utf-8")))
    documented = set(re.findall(r"`\{\{(\w+):", (ROOT / "paper" / "README.md").read_text(encoding="utf-8")))
    assert used and used <= documented, f"paper/README.md does not explain {sorted(used - documented)}"


def test_no_tracked_text_file_holds_a_merge_conflict_marker():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    offenders = [name for name in tracked.split()
                 if name.endswith((".py", ".md", ".json", ".ini", ".toml", ".txt", ".sh", ".ipynb", ".csv"))
                 and marker.search((ROOT / name).read_text(errors="replace"))]
    assert offenders == []
