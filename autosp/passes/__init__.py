"""AutoSP's graph passes, grouped by the stage of compilation they run at.

The folders follow the data path (docs/design.md, "The pass stages and their contracts"):

``dynamo/``
    Contract: a Dynamo FX graph (torch-level ops, nested higher-order-op bodies)
    traced on one rank's shard of the tokens with single-device semantics goes
    in; an exact sequence-parallel graph comes out.  Every value is classified
    by the sequence-sharding analysis (`autosp.passes.dynamo.sharding`); every
    op that mixes tokens is rewritten by a rule (Ulysses attention, exact loss,
    reductions over the sequence, global positions) or refused with an
    `AutoSPError`.  Passes are ``<verb>_<object>_pass(gm, example_inputs, *, ctx)``
    and keep ``node.meta["example_value"]`` valid; `autosp.pipeline` runs them.
``joint/``
    Contract: AOTAutograd's joint forward+backward aten graph goes in, with
    ``node.meta["recompute"]`` tags set for the min-cut partitioner; nothing
    else changes (activation checkpointing).
``partitioned/``
    Contract: one partitioned forward or backward aten graph goes in, the same
    computation comes out scheduled for the hardware (all-to-alls split into
    start and wait around independent work); numerics never change.
"""
