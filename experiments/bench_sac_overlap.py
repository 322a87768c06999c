"""``python -m experiments.bench_sac_overlap``: checkpointing and overlap settings side by side on gloo ranks (the code is `experiments.cpu.bench_sac_overlap`)."""

from experiments.cpu.bench_sac_overlap import build_parser, main  # noqa: F401 - build_parser: tests/test_cli_hygiene.py

if __name__ == "__main__":
    raise SystemExit(main())
