"""Session-wide test environment, set before anything imports DeepSpeed."""

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".torch_extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # bin/test's pytest-xdist workers: a worker per core, one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# setuptools before any test file: its distutils (which DeepSpeed's op builder loads) refuses to load once the
# standard library's distutils was imported, as the warning setuptools prints then advises
import setuptools  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _fresh_dynamo_caches():
    """Every test compiles afresh: Dynamo caches compiled code per code object (model class forward)
    with a recompile limit of 8, and the in-process tests compile many instances of the same classes."""
    import torch

    torch._dynamo.reset()
    yield


# Where the suite's time goes, by file: setup, call and teardown of every test summed per test file, the slowest
# files printed after pytest's own slowest tests and every file's latest seconds kept in .test-times.json (ignored by
# git, updated by each run, so a run of a few files keeps the others' times), so that a slower file shows up in
# each run rather than in an occasional profile (docs/reproduction.md).
_FILE_SECONDS: dict[str, float] = {}
_SLOWEST_FILES_SHOWN = 15
_TIMES = _ROOT / ".test-times.json"
_STARTED_FIRST = (
    "tests/experiments/test_reproduce.py",
    "tests/autosp/test_planner.py",
    "tests/autosp/test_deepspeed.py",
    "tests/autosp/test_equivalence.py",
)
"""Files that take minutes, started first where no .test-times.json says better (a fresh clone): pytest-xdist's
workers (bin/test) take whole files in collection order, so the longest going first lets the workers end together."""


def _recorded_file_seconds() -> dict[str, float]:
    import json

    try:
        return {str(k): float(v) for k, v in json.loads(_TIMES.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def pytest_collection_modifyitems(items):
    """Longest test files first (`_STARTED_FIRST`, then the times of earlier runs), each file's tests kept together
    and in their own order; the same order in every worker, which pytest-xdist requires."""
    recorded = _recorded_file_seconds()
    first = {path: rank for rank, path in enumerate(_STARTED_FIRST)}
    order = {}
    for item in items:
        order.setdefault(item.nodeid.split("::", 1)[0], len(order))

    def file_key(path: str) -> tuple:
        return (first.get(path, len(first)), -recorded.get(path, 0.0), order[path])

    items.sort(key=lambda item: file_key(item.nodeid.split("::", 1)[0]))


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    import json

    if not _FILE_SECONDS:
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest {min(_SLOWEST_FILES_SHOWN, len(ranked))} test files "
                                    f"(of {len(ranked)}, {total:.0f} s in tests)")
    for path, seconds in ranked[:_SLOWEST_FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {100 * seconds / total:4.1f}%  {path}")
    kept = {**_recorded_file_seconds(), **_FILE_SECONDS}
    _TIMES.write_text(json.dumps(dict(sorted(kept.items(), key=lambda item: -item[1])), indent=1) + "\n")
