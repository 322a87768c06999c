"""Traced and simulated at paper scale (8×A100-80GB): AutoSP traced on a fake process group and simulated
(`simulate`), the baselines as rewrites of those traces (`baselines`; the rewrites are `simulator.workload_rewrites`)."""
