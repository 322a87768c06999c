"""The sequence-parallel kinds and their rank layout: one object says what a kind is, read by the pass and the simulator.

:class:`SPKind` declares the kinds ``autosp.compile(strategy=...)`` compiles (their names are today's strategy
strings: ``SPKind("ring")``, and ``SPKind.RING == "ring"``) with what each one is: whether it runs all-to-alls,
whether it runs a ring (and so lays the tokens out in zig-zag chunks, Note [Zig-zag layout] in autosp/inputs.py),
whether the memory planner plans it. :class:`SPLayout` is one kind over ``sp_size`` ranks with its degrees: which
ranks form its Ulysses groups and its ring groups (Note [Hybrid rank layout] in simulator/strategies.py), a ring
rank's neighbours, and the rule for the attention heads. Everything that places ranks reads it:
``autosp.groups.build_groups`` (the torch process groups), the export's groups and ring neighbours
(Note [Hybrid attention in the export] in autosp/export.py), the registry's ``Strategy.sp_groups``, the config's
``ZIGZAG_STRATEGIES`` and the planner's ``MEMORY_PLANNED_STRATEGIES``. Adding a kind: docs/design.md, "Adding a
sequence-parallel kind".

Standard library only, and re-exported by :mod:`simulator.workload`, the one module of the simulator that autosp
may import. Errors are :class:`SPLayoutError` (a ``ValueError``); autosp raises their message as its own error.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property


class SPLayoutError(ValueError):
    """Degrees or a world that the layout cannot have; the message says what to change."""


class SPKind(str, Enum):
    """A sequence-parallel kind the pass compiles: its name, whether it runs all-to-alls (over its Ulysses groups),
    whether it runs a ring (over its ring groups; the tokens then follow the zig-zag layout), and whether the memory
    planner plans it. A kind with both has a Ulysses degree of its own (``ulysses_size``); all-to-alls alone are
    Ulysses over the whole SP group, a ring alone a ring over it."""

    all_to_all: bool
    ring: bool
    memory_planned: bool

    def __new__(cls, name: str, all_to_all: bool, ring: bool, memory_planned: bool) -> SPKind:
        kind = str.__new__(cls, name)
        kind._value_ = name
        kind.all_to_all, kind.ring, kind.memory_planned = all_to_all, ring, memory_planned
        return kind

    ULYSSES = ("ulysses", True, False, True)
    RING = ("ring", False, True, True)
    HYBRID = ("hybrid", True, True, True)

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def zigzag(self) -> bool:
        """Whether the tokens follow the zig-zag layout: the ring's (Note [Zig-zag layout] in autosp/inputs.py)."""
        return self.ring

    @property
    def grouped(self) -> bool:
        """Whether it runs on Ulysses and ring groups of its own inside the SP group (its Ulysses degree given by
        ``ulysses_size``), rather than on the SP group itself."""
        return self.all_to_all and self.ring


COMPILED_STRATEGIES = tuple(kind.value for kind in SPKind)
"""The sequence-parallel strategies ``autosp.compile(strategy=...)`` compiles a program with, and so the ones a
workload is exported from (``metadata["strategy"]``): the names of :class:`SPKind`, the one declaration of them
(``autosp.config.STRATEGIES`` and ``simulator.strategies.SEQUENCE_PARALLEL`` read them through
:mod:`simulator.workload`)."""
MEMORY_PLANNED_STRATEGIES = tuple(kind.value for kind in SPKind if kind.memory_planned)
"""The compiled strategies the memory planner plans (``memory_plan="auto"``, and the default wherever a plan can be
made: Note [The default memory plan] in autosp/plan/auto.py): every kind (the hybrid at the Ulysses degree it is
compiled with)."""
ZIGZAG_STRATEGIES = tuple(kind.value for kind in SPKind if kind.zigzag)
"""The compiled strategies whose tokens follow the zig-zag layout (the ring and the hybrid)."""
CHOSEN_STRATEGIES = ("auto",)
"""Strategies of ``simulator.strategies.SEQUENCE_PARALLEL`` that ``autosp.compile(strategy=...)`` accepts but
resolves, before compiling, to one of ``COMPILED_STRATEGIES`` (and its degrees): ``auto``, the fastest that fits
by simulation (``autosp.plan.strategy_choice.choose_strategy``)."""


@dataclass(frozen=True)
class SPLayout:
    """A kind over ``sp_size`` ranks with its Ulysses degree: ``sp_size`` for Ulysses, 1 for the ring, a divisor of
    ``sp_size`` for the hybrid (build it with :meth:`from_options`). The SP group's ranks ``0..sp_size-1`` are a
    grid of :attr:`ring_size` ring ranks x :attr:`ulysses_size` Ulysses ranks, placed by :meth:`sp_rank`, the one
    place the rank layout is written; a world of ``W`` ranks holds ``W / sp_size`` SP groups of consecutive ranks
    (data-parallel replicas). Group tuples list absolute ranks in increasing order, which is their Ulysses or ring
    order: torch numbers a process group's members in increasing order, so :meth:`sp_rank` must increase with
    both ranks."""

    kind: SPKind
    sp_size: int
    ulysses_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SPKind(self.kind))
        sp, u = self.sp_size, self.ulysses_size
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
            raise SPLayoutError(f"sp_size must be a positive number of ranks, got {sp!r}")
        if not isinstance(u, int) or isinstance(u, bool) or u < 1 or sp % u:
            raise SPLayoutError(f"ulysses_size={u!r} does not divide sp_size={sp}; pass a divisor of {sp} "
                                "(ulysses_size x ring_size = sp_size)")
        fixed = None if self.kind.grouped else sp if self.kind.all_to_all else 1
        if fixed is not None and u != fixed:
            raise SPLayoutError(f"strategy={self.kind.value!r} has ulysses_size={fixed} over sp_size={sp}, not {u}")

    @classmethod
    def from_options(cls, strategy: str, sp_size: int, *, ulysses_size: int | None = None,
                     ring_size: int | None = None) -> SPLayout | None:
        """The layout of ``autosp.compile``'s ``strategy``, ``sp_size``, ``ulysses_size`` and ``ring_size``; None for
        a strategy chosen before compiling (:data:`CHOSEN_STRATEGIES`). Degrees are given to a kind with
        Ulysses and ring groups of its own (the hybrid: ``ulysses_size`` or ``ring_size``, or both, consistent),
        and refused elsewhere."""
        given = {k: v for k, v in (("ulysses_size", ulysses_size), ("ring_size", ring_size)) if v is not None}
        kind = SPKind(strategy) if strategy in COMPILED_STRATEGIES else None
        if kind is None or not kind.grouped:
            if given:
                raise SPLayoutError(f"{', '.join(given)} take(s) effect only with strategy='hybrid': pass "
                                    f"strategy='hybrid' too (or leave them out); got strategy={strategy!r}")
            if kind is None and strategy not in CHOSEN_STRATEGIES:
                raise SPLayoutError(f"strategy must be one of {COMPILED_STRATEGIES + CHOSEN_STRATEGIES}, got "
                                    f"{strategy!r}")
            return None if kind is None else cls(kind, sp_size, sp_size if kind.all_to_all else 1)
        if not given:
            raise SPLayoutError(f"strategy={kind.value!r} needs its Ulysses degree: pass ulysses_size= a divisor "
                                f"of sp_size={sp_size} (the ring then runs over sp_size // ulysses_size groups)")
        for name, value in given.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1 or sp_size % value:
                raise SPLayoutError(f"{name}={value!r} does not divide sp_size={sp_size}; pass a divisor of "
                                    f"{sp_size} (ulysses_size x ring_size = sp_size)")
        ulysses = given.get("ulysses_size", sp_size // given.get("ring_size", 1))
        if given.get("ring_size", sp_size // ulysses) != sp_size // ulysses:
            raise SPLayoutError(f"ulysses_size={ulysses} x ring_size={ring_size} is not sp_size={sp_size}; pass "
                                f"ring_size={sp_size // ulysses} (or leave it out)")
        return cls(kind, sp_size, ulysses)

    @property
    def ring_size(self) -> int:
        """Ranks of one ring group: the ring degree."""
        return self.sp_size // self.ulysses_size

    @property
    def zigzag(self) -> bool:
        return self.kind.zigzag

    @property
    def memory_planned(self) -> bool:
        return self.kind.memory_planned

    @property
    def zigzag_ulysses_size(self) -> int:
        """Ranks that split one zig-zag pair of chunks (Note [Zig-zag layout]): the Ulysses degree under a ring, 1
        where the tokens are not zig-zag."""
        return self.ulysses_size if self.zigzag else 1

    def sp_rank(self, ring_rank: int, ulysses_rank: int) -> int:
        """The SP rank at ring rank ``ring_rank`` of Ulysses rank ``ulysses_rank``: Ulysses innermost, so a Ulysses
        group is consecutive ranks and a ring group the ranks ``ulysses_size`` apart (Note [Hybrid rank layout])."""
        return ring_rank * self.ulysses_size + ulysses_rank

    @cached_property
    def _coordinates(self) -> tuple[tuple[int, int], ...]:
        r, u = self.ring_size, self.ulysses_size
        found = {self.sp_rank(j, i): (j, i) for j in range(r) for i in range(u)}
        increasing = all(self.sp_rank(j, i) < self.sp_rank(j, i + 1) for j in range(r) for i in range(u - 1)) and \
            all(self.sp_rank(j, i) < self.sp_rank(j + 1, i) for j in range(r - 1) for i in range(u))
        if sorted(found) != list(range(self.sp_size)) or not increasing:
            raise SPLayoutError(f"{type(self).__name__}.sp_rank must place the {self.sp_size} SP ranks once each, "
                                "increasing with the ring rank and with the Ulysses rank (torch numbers a group's "
                                "members in increasing order)")
        return tuple(found[s] for s in range(self.sp_size))

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(ring rank, Ulysses rank)`` of ``rank`` (an absolute rank: its SP rank is ``rank % sp_size``)."""
        return self._coordinates[rank % self.sp_size]

    def ring_neighbours(self, rank: int) -> tuple[int, int]:
        """``(previous, next)`` of absolute ``rank`` in its ring group, absolute ranks (a ring's ``recv`` and
        ``send`` peers)."""
        base, (j, i) = rank - rank % self.sp_size, self.coordinates(rank)
        r = self.ring_size
        return base + self.sp_rank((j - 1) % r, i), base + self.sp_rank((j + 1) % r, i)

    def _bases(self, world_size: int | None) -> range:
        world = self.sp_size if world_size is None else world_size
        if world < 1 or world % self.sp_size:
            raise SPLayoutError(f"sp_size={self.sp_size} does not divide the process group's {world} ranks; choose "
                                f"an sp_size that divides {world} (the rest of the ranks become data-parallel "
                                "replicas)")
        return range(0, world, self.sp_size)

    def sp_groups(self, world_size: int | None = None) -> tuple[tuple[int, ...], ...]:
        """The SP groups of a world of ``world_size`` ranks (default: one SP group): consecutive blocks."""
        return tuple(tuple(range(b, b + self.sp_size)) for b in self._bases(world_size))

    def ulysses_groups(self, world_size: int | None = None) -> tuple[tuple[int, ...], ...]:
        """Every SP group's Ulysses groups (the all-to-alls' groups), one per ring rank."""
        self._coordinates  # noqa: B018 - checks the placement
        return tuple(tuple(b + self.sp_rank(j, i) for i in range(self.ulysses_size))
                     for b in self._bases(world_size) for j in range(self.ring_size))

    def ring_groups(self, world_size: int | None = None) -> tuple[tuple[int, ...], ...]:
        """Every SP group's ring groups, one per Ulysses rank, in ring order."""
        self._coordinates  # noqa: B018 - checks the placement
        return tuple(tuple(b + self.sp_rank(j, i) for j in range(self.ring_size))
                     for b in self._bases(world_size) for i in range(self.ulysses_size))

    def heads_rule(self, heads: int) -> str | None:
        """Why ``heads`` attention heads cannot be split over the Ulysses groups (None: they can): the Ulysses
        degree must divide them (the ring alone takes any number). Worded as ``f"module M has {reason}"``."""
        u, sp = self.ulysses_size, self.sp_size
        if heads % u == 0:
            return None
        if not self.kind.grouped:
            return (f"{heads} attention heads, not divisible by sp_size={u}; choose an sp_size that divides the "
                    "number of heads, or strategy='ring' or 'hybrid' (any number of heads)")
        return (f"{heads} attention heads, not divisible by ulysses_size={u}; pass a ulysses_size that divides "
                f"both the heads and sp_size={sp} (one of {list(self.ulysses_degrees(heads))}; 1 is the ring alone)")

    def ulysses_degrees(self, heads: int) -> tuple[int, ...]:
        """The Ulysses degrees that split ``heads`` attention heads within this layout's SP groups, ascending:
        the divisors of both ``heads`` and ``sp_size`` (1 is the ring alone, ``sp_size`` Ulysses alone)."""
        return tuple(d for d in range(1, self.sp_size + 1) if self.sp_size % d == 0 and heads % d == 0)
