"""``python -m experiments.calibrate_cpu``: calibrate the cpu-gloo simulator preset on this machine (the code is `experiments.calibration.calibrate_cpu`)."""

from experiments.calibration.calibrate_cpu import build_parser, main  # noqa: F401 - build_parser: tests/test_cli_hygiene.py

if __name__ == "__main__":
    raise SystemExit(main())
