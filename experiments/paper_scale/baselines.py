"""Paper-scale baselines in the simulator: hand-written Ulysses, ring attention and ZeRO-3, from real traces.

What each system is (its name, trace options, ZeRO stage, SP degree and whole-step recipe) is its entry in
`simulator.strategies.STRATEGIES`; the systems simulated at paper scale are ``STRATEGIES.table("paper-scale")``.
This module explains how those entries model the paper's baselines.

Note [Baselines as AutoSP variants]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The paper compares AutoSP on 8×A100-80GB with three hand-written baselines; the
simulator only needs a workload (graphs, tensors' lifetimes, collectives) for each.
Each is derived from a graph the real compiler produces for the same model:

- ``ulysses``: DeepSpeed-Ulysses computes exactly AutoSP's sequence-parallel graph
  (the same shards, the same all-to-alls around every attention) but is written by
  hand: no activation checkpointing, blocking all-to-alls.  Traced with
  ``checkpointing="none"`` and ``overlap_communication=False`` (where `autosp`
  has those options), sharded over 8 ranks; static memory as AutoSP's (the
  ledger under ZeRO 1, see experiments.paper_scale.config).
- ``ulysses+ckpt``: hand-written Ulysses with per-layer activation checkpointing,
  as Ulysses is run for long sequences in practice.  Traced like ``ulysses`` but
  with ``checkpointing="layer"``; see Note [Ulysses with per-layer checkpointing].
- ``ring``: that same Ulysses trace, rewritten: no all-to-alls, each
  attention split into 8 chunks between peer-to-peer K,V (and dK,dV) transfers
  around the ring (see Note [Ring attention as a rewrite of the Ulysses trace] in
  simulator.workload_rewrites); static memory as Ulysses'.
- ``zero3``: the model compiled without sequence parallelism (``autosp.compile``
  with ``sp_size=1``, ``checkpointing="none"``: each rank trains on the full
  sequence), rewritten with ZeRO-3's per-module parameter all-gathers and gradient
  reduce-scatters over the 8 data-parallel ranks; static memory from the ledger
  under ZeRO 3 (see Note [ZeRO-3 as a rewrite of the single-device trace]).

Every system then gets DeepSpeed's gradient reduction and optimizer step (Note
[DeepSpeed gradient reduction] in simulator/training_step.py; the rewrite and the step are put together by
`simulator.strategies.WorkloadRecipe.build`); step time and activation memory of a full model are
extrapolated from one- and two-layer traces (Note [Depth extrapolation] in simulator/max_length.py), and the
longest sequence is found by `experiments.paper_scale.simulate.max_length`, all in
experiments.paper_scale.simulate.

Note [Ulysses with per-layer checkpointing]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hand-written per-layer checkpoint (``torch.utils.checkpoint`` around each decoder
layer) keeps each layer's input and reruns the whole layer forward in backward,
its four all-to-alls included.  AutoSP's ``checkpointing="layer"`` on the Ulysses
trace (blocking all-to-alls) is that program: the residual stream between layers
is kept and everything else of a layer is recomputed in backward, the all-to-alls
included (see the option's description in autosp/config.py).  An earlier model used
``checkpointing="full"``, which never recomputes a collective and so kept the four
all-to-all outputs of every layer (about (2 + 2·kv_heads/heads)× the layer input's
bytes more per layer): a weaker baseline than the one people run.  The CPU
measurement (``ulysses+ckpt`` in the measured-cpu and memory-cap tables) runs the
real per-layer checkpoint.
"""
