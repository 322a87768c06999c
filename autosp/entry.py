"""What AutoSP's command-line entry points share (``python -m autosp.train``, ``python -m autosp.examples.train_lm``).

- A refusal (an `AutoSPError`) prints one line, ``autosp: error: <message>``, once, and exits 2; ``--debug``
  (or ``AUTOSP_DEBUG=1``) shows every rank's traceback instead (`run`, Note [One line per refusal]).  Any other
  exception keeps its traceback.  An argparse error is printed once too (`ArgumentParser`).
- AutoSP's progress is visible without configuring logging: a handler on the ``autosp`` logger, INFO on rank 0,
  WARNING on the others (`configure_logging`).  Library code only logs; entry points configure.
- The first run's slow steps say what they are doing before they start: DeepSpeed's JIT build of a C++ op
  (`announce_deepspeed_comm_build`, `announce_optimizer_build`) and the first step's compile (`announce_first_compile`).
- The flags both take, worded once (`add_model_arguments`, `add_sp_arguments`, `add_launcher_arguments`), and the
  check that numeric flags are in range (`require_at_least`).

Note [One line per refusal]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank of a job runs the same checks, so a refusal is usually raised on every rank, each at its own time.
Under torchrun (and the deepspeed launcher) the first rank to exit non-zero ends the others (SIGTERM): a rank
still running when it is ended prints nothing.  The rule, deterministic whenever the ranks refuse within
`REFUSAL_WAIT_S` of one another:

- the node's first rank (``LOCAL_RANK`` 0; ``RANK`` 0 or a plain process without a launcher) prints its line at
  once and exits 2;
- any other rank that refuses prints nothing yet and waits up to `REFUSAL_WAIT_S`, its process group still up.
  When the first rank refuses too, the launcher ends this rank as the first one exits, and only the first
  rank's line is shown.  When the first rank does not (a refusal on this rank only, while the first rank waits
  in a collective for it), this rank prints its own line, marked with its rank, after the wait and exits 2;
  the first rank's collective may then fail with its own traceback ("Connection closed by peer") before the
  launcher ends it.

One line per node, then, since each node's launcher output is a log of its own.  ``--debug`` drops the rule:
every rank raises at once and prints its traceback.

The launcher's own report follows whatever the ranks print: torchrun, seeing a rank exit non-zero, prints a
line per rank it ended, its own traceback and a ``ChildFailedError`` table (40 lines on 2 ranks, plus its
4-line OMP_NUM_THREADS banner when that variable is unset).  No rank can shorten it: it is printed whenever a
rank exits with a status other than 0 (torch/distributed/launcher/api.py, ``launch_agent``), and a refusal must
exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from autosp.config import ACCEPTED_STRATEGIES
from autosp.errors import AutoSPError
from autosp.presets import PRESETS, model_argument

log = logging.getLogger(__name__)

T = TypeVar("T")

EXIT_REFUSED = 2
"""The exit status of a refusal (as argparse's for a bad command line)."""

REFUSAL_WAIT_S = 10.0
"""How long a rank other than the node's first waits before printing its refusal (Note [One line per refusal])."""

DEBUG_ENV = "AUTOSP_DEBUG"


def positive_int(value: str) -> int:
    """An argparse type: a positive integer, else a message naming the value."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: give a positive number")
    return number


def debug_requested(flag: bool = False) -> bool:
    """``--debug`` given, or ``AUTOSP_DEBUG`` set to anything but "", "0", "false" or "no"."""
    return flag or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="on a refusal (an AutoSPError), show every rank's full traceback instead of one line "
                             f"(also: {DEBUG_ENV}=1)")


def add_launcher_arguments(parser: argparse.ArgumentParser) -> None:
    """``--debug``, and the ``--local_rank`` the deepspeed launcher passes (hidden: ``LOCAL_RANK`` in the
    environment says the same)."""
    add_debug_argument(parser)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def require_at_least(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: tuple[str, ...],
                     minimum: int) -> None:
    """A parser error for the first of ``flags`` (their ``dest`` names) set below ``minimum``: 1 asks for a
    positive number, 0 for zero or a positive one.  A flag left unset (None) passes."""
    wanted = {1: "a positive number", 0: "zero or a positive number"}[minimum]
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < minimum:
            parser.error(f"--{flag.replace('_', '-')} {value}: give {wanted}")


def add_model_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--model`` (a preset or a Hugging Face config.json), ``--num-layers`` and ``--dtype``."""
    parser.add_argument("--model", default="tiny-llama", type=model_argument,
                        help=f"a preset ({', '.join(PRESETS)}) or the path of a Hugging Face config.json (or its "
                             "folder) (default: %(default)s)")
    parser.add_argument("--num-layers", type=int, help="override the number of decoder layers (default: the model's)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"),
                        help="parameter and compute dtype (default: bf16 on GPUs, fp32 on CPU)")


def add_sp_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, strategy_help: str) -> None:
    """``--sp-size``, ``--strategy`` (its help ``strategy_help``: what each entry point adds to it differs) and
    ``--ulysses-size``."""
    parser.add_argument("--sp-size", type=int,
                        help="ranks sharing one sequence; divides the world size, the rest is data parallelism "
                             "(default: all ranks)")
    parser.add_argument("--strategy", choices=ACCEPTED_STRATEGIES, help=strategy_help)
    parser.add_argument("--ulysses-size", type=int,
                        help="with --strategy hybrid: ranks of each Ulysses group, a divisor of the SP size and of "
                             "the attention heads")


def _first_rank() -> bool:
    """Whether this process is its node's first rank (a process without a launcher is)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0"


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def _wait_for_the_first_rank() -> None:
    """Wait `REFUSAL_WAIT_S` on a rank other than the node's first, to be ended by the launcher if that rank
    refuses too (Note [One line per refusal]).  SIGTERM ends the wait silently, whatever handler was installed."""
    if _first_rank():
        return
    with contextlib.suppress(ValueError):  # not the main thread: no signal handler to reset
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(REFUSAL_WAIT_S)


def report_refusal(err: AutoSPError) -> None:
    """Print ``autosp: error: <message>`` to stderr once per node (Note [One line per refusal])."""
    _wait_for_the_first_rank()
    where = "" if _first_rank() else f"[rank {_rank()}] "
    message = " ".join(str(err).split("\n"))  # one line, whatever the message holds
    sys.stderr.write(f"autosp: error: {where}{message}\n")
    sys.stderr.flush()


def run(body: Callable[[], T], *, debug: bool = False) -> T:
    """``body()`` (one rank's whole run), then every rank's process group torn down.

    After a successful ``body()`` the ranks meet at a barrier before the group is destroyed: a gloo peer torn
    down while another still talks to it can abort that process.  An `AutoSPError` is reported as one line
    (`report_refusal`, before the group is torn down) and ends the process with status 2 (``SystemExit``);
    with ``debug`` (or ``AUTOSP_DEBUG=1``) it propagates with its traceback.  Other exceptions propagate.
    """
    try:
        result = body()
        if dist.is_initialized():
            dist.barrier()
        return result
    except AutoSPError as err:
        if debug_requested(debug):
            raise
        report_refusal(err)
        raise SystemExit(EXIT_REFUSED) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, its error (``prog: error: ...``, status 2) printed once per node: every rank parses the
    same command line, so the node's first rank fails too (Note [One line per refusal]).  Under a launcher
    (``LOCAL_RANK`` set) the error is one line, without the usage (a dozen lines) that a plain run prints first."""

    def error(self, message: str):
        _wait_for_the_first_rank()
        if "LOCAL_RANK" not in os.environ:
            super().error(message)
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


class _Handler(logging.StreamHandler):
    """The handler `configure_logging` installs (told apart from the user's by its type)."""


def configure_logging() -> None:
    """Show the ``autosp`` loggers' records on stderr: INFO and above on rank 0, WARNING and above elsewhere.

    Each line names its time, rank, level and logger.  Called again, it replaces its own handler.  Other
    libraries' loggers and the root logger are left alone; records still propagate to the root logger's
    handlers, if a user configured any.
    """
    rank = _rank()
    logger = logging.getLogger("autosp")
    for handler in [h for h in logger.handlers if isinstance(h, _Handler)]:
        logger.removeHandler(handler)
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == "0" else logging.WARNING)


def _pending_op_build(builder_name: str) -> str | None:
    """The folder DeepSpeed will JIT-build its op ``builder_name`` (an op builder class) into, if it will build
    it: the accelerator has that op, it was not installed prebuilt, and no build of it is cached; else None."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        from torch.utils.cpp_extension import _get_build_directory

        builder = get_accelerator().create_op_builder(builder_name)
        if (builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
                or installed_ops.get(builder.name, False)):
            return None
        folder = _get_build_directory(builder.name, verbose=False)
        return None if os.path.exists(os.path.join(folder, f"{builder.name}.so")) else folder
    except Exception:  # a DeepSpeed or torch without these internals: nothing to announce
        log.debug("could not tell whether DeepSpeed builds %s", builder_name, exc_info=True)
        return None


def announce_deepspeed_comm_build(logger: logging.Logger = log) -> None:
    """Say so before DeepSpeed builds its shared-memory communication op (on CPU, when ``deepspeed.comm`` starts
    in `autosp.deepspeed_initialize`: C++, first run only, about 2 minutes on 2 cores), if it will."""
    import deepspeed.comm as ds_comm

    folder = None if ds_comm.is_initialized() else _pending_op_build("ShareMemCommBuilder")
    if folder is not None:
        logger.info("DeepSpeed builds its shared-memory communication op as it starts (C++, first run only: about "
                    "2 minutes on a small CPU machine; cached in %s)", folder)


class _DropBuildNotices(io.TextIOBase):
    """Stdout less DeepSpeed's "DeepSpeed <op> built successfully" lines (printed by every rank at every start,
    the op built or not), which go to the DEBUG log."""

    def __init__(self, stream, logger: logging.Logger):
        self._stream, self._logger, self._line = stream, logger, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self._line = (self._line + text).split("\n")
        for line in lines:
            if line.startswith("DeepSpeed ") and line.endswith(" built successfully"):
                self._logger.debug("%s", line)
            else:
                self._stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._line:
            self._stream.write(self._line)
            self._line = ""
        self._stream.flush()


@contextlib.contextmanager
def without_build_notices(logger: logging.Logger = log):
    """Within: DeepSpeed's "built successfully" lines left off stdout (`_DropBuildNotices`)."""
    stream = _DropBuildNotices(sys.stdout, logger)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()


_OPTIMIZER_BUILDERS = {"adam": ("FusedAdamBuilder", "CPUAdamBuilder"), "adamw": ("FusedAdamBuilder", "CPUAdamBuilder"),
                       "lamb": ("FusedLambBuilder", None), "lion": ("FusedLionBuilder", "CPULionBuilder")}
"""DeepSpeed config optimizer type -> the op builder of its fused optimizer (on the device, and offloaded)."""


def announce_optimizer_build(ds_config: dict, logger: logging.Logger = log) -> None:
    """Say so before ``deepspeed.initialize`` JIT-builds the fused optimizer a DeepSpeed config's "optimizer"
    entry names (on GPUs; first run only, minutes), if it will."""
    entry = ds_config.get("optimizer") or {}
    kind = str(entry.get("type", "")).lower()
    if kind not in _OPTIMIZER_BUILDERS or (entry.get("params") or {}).get("torch_adam"):
        return
    offload = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device")
    name = _OPTIMIZER_BUILDERS[kind][offload in ("cpu", "nvme")]
    folder = None if name is None else _pending_op_build(name)
    if folder is not None:
        logger.info("DeepSpeed builds the C++ op of its %s optimizer now (first run only: minutes; cached in %s)",
                    entry.get("type"), folder)


def announce_first_compile(sp_model, logger: logging.Logger = log) -> None:
    """Say what the first step does before it runs: the compile, seconds on a small model, minutes on a large one
    (Inductor)."""
    config = sp_model.config
    logger.info("compiling the model for SP=%d (%s, %s) on the first step: Dynamo traces it, AutoSP rewrites the "
                "graph, %s compiles it; later steps reuse the program", sp_model.groups.sp_size, config.strategy,
                config.compiler, config.compiler)
