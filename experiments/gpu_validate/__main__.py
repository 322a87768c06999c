"""``python -m experiments.gpu_validate``: runs `experiments.gpu_validate.command.main`."""

from __future__ import annotations

from experiments.gpu_validate.command import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
