"""``python -m experiments.gpu_check``: attention TFLOP/s and step MFU of a traced Llama step on a GPU preset beside
public measurements (the code is `experiments.paper_scale.gpu_check`)."""

from experiments.paper_scale.gpu_check import build_parser, main  # noqa: F401 - build_parser: tests/test_cli_hygiene.py

if __name__ == "__main__":
    raise SystemExit(main())
