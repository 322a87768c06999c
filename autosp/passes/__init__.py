"""AutoSP's graph passes, one module each, applied in order by `autosp.pipeline`.

Each pass is ``<verb>_<object>_pass(gm, example_inputs, *, ctx) -> gm`` over a
Dynamo FX graph traced on one rank's shard of the tokens.
"""
