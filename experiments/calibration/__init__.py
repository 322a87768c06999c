"""The simulator on this machine: measure the cpu-gloo preset (`calibrate_cpu`), then check it against real
gloo steps (`validate_simulator`)."""
