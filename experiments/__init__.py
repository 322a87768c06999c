"""Experiments: reproduce the paper's AutoSP-vs-hand-written results.

This package owns everything a researcher runs to compare systems: the
hand-written baselines, the CPU/gloo measurements, the paper-scale simulations
and the tables and figures they produce (``python -m experiments.reproduce``).
It may import `autosp` and `simulator`; nothing imports it.
"""
