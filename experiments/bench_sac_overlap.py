"""``python -m experiments.bench_sac_overlap``: checkpointing and overlap settings side by side on gloo ranks (the code is `experiments.cpu.bench_sac_overlap`)."""

from experiments.cpu.bench_sac_overlap import main

if __name__ == "__main__":
    raise SystemExit(main())
