"""`autosp.entry`, what the command-line entry points share: a refusal is one line once (the traceback with
--debug), argparse errors once, AutoSP's progress logged without configuring logging, DeepSpeed's build
notices off stdout.  In-process and cheap; ``tests/autosp/test_train.py`` runs a refusal under torchrun."""

from __future__ import annotations

import logging
import socket
import traceback

import pytest
import torch.distributed as dist

from autosp import entry
from autosp.errors import AutoSPError


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", entry.DEBUG_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def autosp_logger():
    """The ``autosp`` logger's handlers and level, restored after the test."""
    logger = logging.getLogger("autosp")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _refuse():
    raise AutoSPError("sp_size=3 does not divide\nthe world")


def test_a_refusal_is_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        entry.run(_refuse)
    assert exited.value.code == entry.EXIT_REFUSED == 2
    assert capsys.readouterr().err == "autosp: error: sp_size=3 does not divide the world\n"


def test_debug_flag_or_env_shows_the_traceback(monkeypatch, capsys):
    with pytest.raises(AutoSPError) as raised:
        entry.run(_refuse, debug=True)
    assert "in _refuse" in "".join(traceback.format_tb(raised.tb))
    monkeypatch.setenv(entry.DEBUG_ENV, "1")
    with pytest.raises(AutoSPError):
        entry.run(_refuse)
    monkeypatch.setenv(entry.DEBUG_ENV, "0")
    with pytest.raises(SystemExit):
        entry.run(_refuse)
    assert capsys.readouterr().err.count("autosp: error:") == 1


def test_other_errors_keep_their_traceback_and_results_pass_through():
    def broken():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        entry.run(broken)
    assert entry.run(lambda: {"loss": 1.0}) == {"loss": 1.0}


def test_other_ranks_wait_for_the_first_before_printing(monkeypatch, capsys):
    waits = []
    monkeypatch.setattr(entry.time, "sleep", waits.append)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        entry.run(_refuse)
    assert waits == [] and capsys.readouterr().err.startswith("autosp: error: sp_size=3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(SystemExit):
        entry.run(_refuse)
    assert waits == [entry.REFUSAL_WAIT_S]
    assert capsys.readouterr().err == "autosp: error: [rank 5] sp_size=3 does not divide the world\n"


def test_argparse_errors_are_one_line_under_a_launcher(monkeypatch, capsys):
    parser = entry.ArgumentParser(prog="python -m x")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--compiler", "inductr"])
    assert exited.value.code == 2 and capsys.readouterr().err.startswith("usage: python -m x")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        parser.parse_args(["--compiler", "inductr"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m x: error: argument --compiler: invalid choice: 'inductr'")


def test_entry_points_take_debug():
    from autosp import train
    from autosp.examples import train_lm

    assert train.parse_args(["--debug"]).debug and not train.parse_args([]).debug
    assert train_lm.parse_args(["--data", __file__, "--output-dir", "out", "--debug"]).debug


def test_train_main_refusal_one_line_or_traceback_with_debug(tmp_path, monkeypatch, capsys, autosp_logger):
    """``python -m autosp.train``'s main, one rank in-process: a --deepspeed-config that is not an object is
    refused right after the process group starts (before any model or compile)."""
    from autosp import train

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port)), ("OMP_NUM_THREADS", "1")):
        monkeypatch.setenv(name, value)
    config = tmp_path / "ds.json"
    config.write_text("[]")
    argv = ["--model", "tiny-llama", "--seq-len", "16", "--steps", "2", "--compiler", "aot_eager",
            "--deepspeed-config", str(config)]
    with pytest.raises(SystemExit) as exited:
        train.main(argv)
    assert exited.value.code == 2 and not dist.is_initialized()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " rank 0 INFO " not in ln]
    assert lines == [f"autosp: error: --deepspeed-config {config}: expected a JSON object (a DeepSpeed config), "
                     "got list"]
    with pytest.raises(AutoSPError) as raised:
        train.main([*argv, "--debug"])
    assert "in ds_config" in "".join(traceback.format_tb(raised.tb)) and not dist.is_initialized()


def test_autosp_progress_is_logged_on_rank_0_only(monkeypatch, capsys, autosp_logger):
    entry.configure_logging()
    entry.configure_logging()  # again: still one handler
    assert sum(isinstance(h, entry._Handler) for h in autosp_logger.handlers) == 1
    logging.getLogger("autosp.some.module").info("compiling")
    assert " rank 0 INFO autosp.some.module: compiling" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    entry.configure_logging()
    logging.getLogger("autosp.some.module").info("compiling")
    logging.getLogger("autosp.some.module").warning("careful")
    err = capsys.readouterr().err
    assert "compiling" not in err and " rank 1 WARNING autosp.some.module: careful" in err


def test_deepspeed_build_notices_leave_stdout(capsys):
    with entry.without_build_notices():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("a result", end="")
        print(" line")
    assert capsys.readouterr().out == "a result line\n"
