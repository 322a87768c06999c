"""``python -m experiments.validate_simulator``: compare real gloo steps with their simulation (the code is `experiments.calibration.validate_simulator`)."""

from experiments.calibration.validate_simulator import build_parser, main  # noqa: F401 - build_parser: tests/test_cli_hygiene.py

if __name__ == "__main__":
    raise SystemExit(main())
