"""The differential fuzzer of AutoSP's sequence-sharding analysis: random programs (`programs`) and their oracle
(`oracle`); the command line is ``python -m experiments.fuzz_analysis``."""
