"""The workload schema: the plain-data collective schedule that the simulator consumes, and its JSON form.

A :class:`Workload` is what ``autosp/export.py`` writes after compiling a model: for every rank an ordered
program of operations (compute kernels and collectives) with their FLOPs, bytes moved, dependencies and the
tensors they allocate and free, plus the process groups the collectives run on and each rank's static memory
(parameters, gradients, optimizer state). The types are plain data (:mod:`simulator.workload_types`, re-exported
here: ``autosp`` imports the schema from this module); :class:`Workload` adds their JSON form and round-trips
through it (:meth:`Workload.to_json` / :meth:`Workload.from_json`). Everything uses only the standard library so
that ``autosp`` can import it without pulling in SimPy. The format is versioned by :data:`SCHEMA_VERSION`;
loading a malformed or wrong-version document raises :class:`WorkloadError`, a ``ValueError`` whose message names
the offending field and what to change. Semantic checks across ops (dependencies, tensor lifetimes, matching
collectives) live in :mod:`simulator.validate`, which a load runs unless told not to.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from simulator.sp_layout import (  # noqa: F401 - the sequence-parallel kinds and layout, re-exported for autosp
    CHOSEN_STRATEGIES,
    COMPILED_STRATEGIES,
    MEMORY_PLANNED_STRATEGIES,
    ZIGZAG_STRATEGIES,
    SPKind,
    SPLayout,
    SPLayoutError,
)
from simulator.validate import validate_workload
from simulator.workload_kinds import (  # noqa: F401 - the schema's vocabulary, re-exported
    COLLECTIVE_KINDS,
    OP_CLASSES,
    OP_KINDS,
    PHASES,
    WorkloadError,
)
from simulator.workload_types import (  # noqa: F401 - the schema's types, re-exported for autosp
    HOST_GROUP,
    RING_GROUPS,
    SCHEMA_VERSION,
    Collective,
    Op,
    RankProgram,
    StaticMemory,
    WorkloadData,
    checked_int,
)

_T = TypeVar("_T")


class Workload(WorkloadData):
    """A whole training step, every rank's program plus the process groups (:class:`WorkloadData`'s fields), with
    its JSON form."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (inverse of :meth:`from_dict`)."""
        return {
            "version": self.version,
            "name": self.name,
            "world_size": self.world_size,
            "symmetric": self.symmetric,
            "groups": {name: [list(m) for m in inst] for name, inst in self.groups.items()},
            "ranks": {str(r): _program_to_dict(p) for r, p in sorted(self.ranks.items())},
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, validate: bool = True) -> Workload:
        """Build a workload from :meth:`to_dict` output; raises :class:`WorkloadError` when malformed."""
        if not isinstance(data, Mapping):
            raise WorkloadError(f"a workload document must be a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise WorkloadError(
                f"workload schema version {version!r} is not supported (this simulator reads version "
                f"{SCHEMA_VERSION}); re-export the workload with a matching autosp/simulator"
            )
        _require(data, ("name", "world_size", "groups", "ranks"), "workload")
        ranks_doc = data["ranks"]
        if not isinstance(ranks_doc, Mapping):
            raise WorkloadError("workload.ranks must be an object mapping rank numbers to programs")
        ranks = _by_int_key(ranks_doc, "workload.ranks", "a rank number",
                            lambda key, prog: _program_from_dict(prog, f"ranks[{key}]"))
        groups = data["groups"]
        if not isinstance(groups, Mapping):
            raise WorkloadError("workload.groups must be an object mapping group names to rank lists")
        workload = cls(
            name=str(data["name"]),
            world_size=checked_int(data["world_size"], "workload.world_size"),
            groups=groups,
            ranks=ranks,
            symmetric=bool(data.get("symmetric", False)),
            metadata=dict(data.get("metadata") or {}),
            version=version,
        )
        if validate:
            validate_workload(workload)
        return workload

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write the workload as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, separators=(",", ":"))

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], *, validate: bool = True) -> Workload:
        """Read a workload written by :meth:`to_json`; raises :class:`WorkloadError` when malformed."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{os.fspath(path)} is not valid JSON ({exc}); pass a file written by "
                                "Workload.to_json") from None
        return cls.from_dict(data, validate=validate)


def _require(data: Mapping[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise WorkloadError(f"{where} is missing required field(s) {', '.join(missing)}")


def _by_int_key(doc: Mapping[str, Any], where: str, noun: str, read: Callable[[str, Any], _T]) -> dict[int, _T]:
    """``doc`` (a JSON object, so its keys are strings) keyed by its keys read as integers, each value ``read(key,
    value)``; a key that is no integer is refused as not ``noun``."""
    out = {}
    for key, value in doc.items():
        try:
            number = int(key)
        except (TypeError, ValueError):
            raise WorkloadError(f"{where} key {key!r} is not {noun}") from None
        out[number] = read(key, value)
    return out


def _int_tuple(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise WorkloadError(f"{where} must be a list of integers, got {value!r}")
    return tuple(checked_int(v, where) for v in value)


def _program_to_dict(program: RankProgram) -> dict[str, Any]:
    return {
        "static_memory": dataclasses.asdict(program.static_memory),
        "tensors": {str(t): b for t, b in program.tensors.items()},
        **({"host_tensors": sorted(program.host_tensors)} if program.host_tensors else {}),
        "ops": [_op_to_dict(op) for op in program.ops],
    }


def _op_to_dict(op: Op) -> dict[str, Any]:
    out: dict[str, Any] = {"id": op.id, "name": op.name, "kind": op.kind, "phase": op.phase}
    if op.kind == "compute" or op.op_class != "other":
        out["op_class"] = op.op_class
    if op.attention_scores:
        out["attention_scores"] = op.attention_scores
    for key in ("flops", "bytes_read", "bytes_written"):
        value = getattr(op, key)
        if value or op.kind == "compute":
            out[key] = value
    for key in ("deps", "allocates", "frees"):
        value = getattr(op, key)
        if value:
            out[key] = list(value)
    if op.collective is not None:
        coll = {f.name: getattr(op.collective, f.name) for f in dataclasses.fields(Collective)}
        if coll["peer"] is None:
            del coll["peer"]
        out["collective"] = coll
    return out


def _program_from_dict(data: object, where: str) -> RankProgram:
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where} must be an object with ops, tensors and static_memory")
    _require(data, ("ops",), where)
    static_doc = data.get("static_memory") or {}
    if not isinstance(static_doc, Mapping):
        raise WorkloadError(f"{where}.static_memory must be an object")
    known = {f.name for f in dataclasses.fields(StaticMemory)}
    unknown = set(static_doc) - known
    if unknown:
        raise WorkloadError(f"{where}.static_memory has unknown field(s) {sorted(unknown)}; allowed: {sorted(known)}")
    static = StaticMemory(**{k: checked_int(v, f"{where}.static_memory.{k}") for k, v in static_doc.items()})
    tensors_doc = data.get("tensors") or {}
    if not isinstance(tensors_doc, Mapping):
        raise WorkloadError(f"{where}.tensors must be an object mapping tensor ids to byte sizes")
    tensors = _by_int_key(tensors_doc, f"{where}.tensors", "an integer tensor id",
                          lambda key, size: checked_int(size, f"{where}.tensors[{key}]"))
    ops_doc = data["ops"]
    if not isinstance(ops_doc, list):
        raise WorkloadError(f"{where}.ops must be a list")
    ops = tuple(_op_from_dict(op, f"{where}.ops[{i}]") for i, op in enumerate(ops_doc))
    host = _int_tuple(data.get("host_tensors", ()), f"{where}.host_tensors")
    return RankProgram(ops=ops, tensors=tensors, static_memory=static, host_tensors=frozenset(host))


_OP_FIELDS = {f.name for f in dataclasses.fields(Op)}
_COLLECTIVE_FIELDS = {f.name for f in dataclasses.fields(Collective)}


def _op_from_dict(data: object, where: str) -> Op:
    if not isinstance(data, Mapping):
        raise WorkloadError(f"{where} must be an object")
    _require(data, ("id", "name", "kind"), where)
    unknown = set(data) - _OP_FIELDS
    if unknown:
        raise WorkloadError(f"{where} has unknown field(s) {sorted(unknown)}; allowed: {sorted(_OP_FIELDS)}")
    collective = None
    coll_doc = data.get("collective")
    if coll_doc is not None:
        if not isinstance(coll_doc, Mapping):
            raise WorkloadError(f"{where}.collective must be an object")
        _require(coll_doc, ("kind", "group", "message_bytes", "key"), f"{where}.collective")
        unknown = set(coll_doc) - _COLLECTIVE_FIELDS
        if unknown:
            raise WorkloadError(f"{where}.collective has unknown field(s) {sorted(unknown)}")
        peer = coll_doc.get("peer")
        collective = Collective(
            kind=str(coll_doc["kind"]),
            group=str(coll_doc["group"]),
            message_bytes=checked_int(coll_doc["message_bytes"], f"{where}.collective.message_bytes"),
            key=str(coll_doc["key"]),
            peer=None if peer is None else checked_int(peer, f"{where}.collective.peer"),
        )
    return Op(
        id=checked_int(data["id"], f"{where}.id"),
        name=str(data["name"]),
        kind=str(data["kind"]),
        op_class=str(data.get("op_class", "other")),
        phase=str(data.get("phase", "forward")),
        flops=checked_int(data.get("flops", 0), f"{where}.flops"),
        bytes_read=checked_int(data.get("bytes_read", 0), f"{where}.bytes_read"),
        bytes_written=checked_int(data.get("bytes_written", 0), f"{where}.bytes_written"),
        attention_scores=checked_int(data.get("attention_scores", 0), f"{where}.attention_scores"),
        deps=_int_tuple(data.get("deps", ()), f"{where}.deps"),
        allocates=_int_tuple(data.get("allocates", ()), f"{where}.allocates"),
        frees=_int_tuple(data.get("frees", ()), f"{where}.frees"),
        collective=collective,
    )
