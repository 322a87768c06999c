"""``python -m experiments.calibrate_cpu``: calibrate the cpu-gloo simulator preset on this machine (the code is `experiments.calibration.calibrate_cpu`)."""

from experiments.calibration.calibrate_cpu import main

if __name__ == "__main__":
    raise SystemExit(main())
