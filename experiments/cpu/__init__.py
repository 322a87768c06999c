"""Measured runs on real CPU gloo ranks: side-by-side measurement of the systems and the memory-cap search
(`measure`), per-rank peak tensor memory (`peak_memory`), the checkpointing/overlap bench (`bench_sac_overlap`)."""
