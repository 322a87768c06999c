"""The workload schema's closed vocabularies (op kinds, op classes, phases, collective kinds) and its error: what
the schema's types (`simulator.workload_types`), its loader (`simulator.workload`) and its semantic checks
(`simulator.validate`) read.  Standard library only.
"""

from __future__ import annotations

OP_KINDS = ("compute", "collective", "collective_start", "collective_wait")
"""``compute``: a kernel on the rank's compute stream. ``collective``: a blocking collective (start and wait at
once: the compute stream stalls until it completes). ``collective_start``: issues a collective on the comm stream
of its group and returns immediately; it *ends* when the collective completes, so the tensors it ``frees`` (a
``to_host`` copy's source) are freed then, while those it ``allocates`` (the destination) exist from the issue on
(Note [Host tensors]). ``collective_wait``: blocks the compute stream until the collective started
by the ``collective_start`` with the same key completes."""

OP_CLASSES = ("matmul", "attention", "elementwise", "reduction", "memory", "other")
"""Roofline efficiency class of a compute op (see :class:`simulator.hardware.DeviceSpec.efficiency`)."""

PHASES = ("forward", "backward", "optimizer")

COLLECTIVE_KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast",
                    "to_host", "from_host")
"""``to_host``/``from_host``: a copy of ``message_bytes`` between the rank's device and its node's host memory
(optimizer and activation offload), over the preset's host-memory link; its group has one member per instance, the rank."""


class WorkloadError(ValueError):
    """A workload document or object is malformed; the message says which field and what to change."""
