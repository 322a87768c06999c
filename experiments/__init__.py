"""Experiments: reproduce the paper's AutoSP-vs-hand-written results.

This package owns everything a researcher runs to compare systems, laid out by
where the numbers come from:

- ``cpu/`` — measured on real CPU gloo ranks (side-by-side measurement, memory
  cap, peak memory, the checkpointing/overlap bench);
- ``paper_scale/`` — traced on a fake process group and simulated at paper
  scale (AutoSP and the baselines as rewrites of its traces);
- ``calibration/`` — the simulator's cpu-gloo preset measured and validated;
- ``models/`` — model presets; ``baselines/`` — the systems compared;
- ``launch`` (the multi-rank launcher), ``tables`` (CSV/Markdown/plot writers),
  ``reproduce`` (the reproduction's command line), ``reproduction/`` (its tables, one
  module each), ``paper`` (the write-up), ``notebooks/``.

It may import `autosp` and `simulator`; only the tests import it.
"""
