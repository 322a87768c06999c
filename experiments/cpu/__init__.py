"""Measured runs on real CPU gloo ranks: side-by-side measurement of the systems (`measure`), the memory-cap
search (`memory_cap`), per-rank peak tensor memory (`peak_memory`), the checkpointing/overlap bench
(`bench_sac_overlap`), what the 2-rank benches share (`two_ranks`)."""
