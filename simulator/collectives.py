"""Collectives in the event loop: rendezvous of member ranks and bandwidth sharing between concurrent transfers.

Three pieces. :class:`CollectivePlanner` maps a collective on a set of ranks onto the topology: the algorithm's
flows (:func:`simulator.cost_model.traffic_pattern`, or the hierarchical all-to-all of Note [All-to-all
algorithms]) routed over links give the bytes each link carries per message byte, and the alpha term is the
algorithm's step count times the slowest route's latency; a plan may have several phases, run one after the other. The
:class:`Network` runs transfers as fluid flows that share links (see Note [Bandwidth sharing]). The
:class:`CollectiveRuntime` holds rendezvous: a collective starts only when every expected member has issued it,
so a late rank delays the others by exactly its lateness; it then waits the alpha term and moves its bytes.

Note [Bandwidth sharing]
~~~~~~~~~~~~~~~~~~~~~~~~
Each running collective *instance* (one group instance's transfer) loads a set of links; ``k_l`` counts the
instances using link ``l``. A link gives each of its users an equal share ``bw_l / k_l`` (processor sharing) and
a collective progresses at the pace of its most constrained link and instance:
``rate = min over (instance, link) of (bw_l / k_l) / load_l`` in "fraction of the transfer per second". Rates are
recomputed whenever a transfer starts or ends, which is exact for piecewise-constant sharing; stale completion
timers are ignored through a per-flow generation counter. A collective (each phase of it) first waits its alpha
term (using no bandwidth), then moves its bytes; alone, the transfer takes ``max_l load_l / bw_l``, the bottleneck link of the
alpha-beta model. Equal sharing is simpler than max-min fairness and can under-use a link whose users are
bottlenecked elsewhere; compute kernels do not slow down while communication runs (no SM or HBM contention is
modelled).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import simpy

from simulator.cost_model import algorithm_steps, traffic_pattern
from simulator.topology import Topology

LinkLoads = dict[int, float]

ALL_TO_ALL_ALGORITHMS = ("pairwise", "hierarchical")
"""All-to-all algorithms of :class:`CollectivePlanner` (see Note [All-to-all algorithms])."""


@dataclass(frozen=True)
class PlanPhase:
    """One phase of a collective: its alpha term, then its bytes, per message byte."""

    latency_s: float
    """Alpha term: the phase's algorithm steps times the slowest route's latency among its flows."""
    loads: tuple[LinkLoads, ...]
    """Per group instance: link index -> bytes carried per message byte."""
    seconds_per_byte: float
    """Bandwidth term alone, per message byte (max over instances and links of load / bandwidth)."""


@dataclass(frozen=True)
class CollectivePlan:
    """How one collective uses the topology: phases run one after the other (one phase for every algorithm but
    the hierarchical all-to-all)."""

    phases: tuple[PlanPhase, ...]

    @property
    def latency_s(self) -> float:
        """Alpha terms of all phases."""
        return sum(p.latency_s for p in self.phases)

    @property
    def seconds_per_byte(self) -> float:
        """Bandwidth terms of all phases, per message byte (on an otherwise idle network)."""
        return sum(p.seconds_per_byte for p in self.phases)


Flow = tuple[int, int, float]
"""``(src, dst, bytes per message byte)``."""


class CollectivePlanner:
    """Caches :class:`CollectivePlan` per (kind, instances, root) on one topology.

    ``all_to_all`` picks the all-to-all algorithm, one of :data:`ALL_TO_ALL_ALGORITHMS`.

    Note [All-to-all algorithms]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``pairwise`` (what NCCL's all-to-all does: a send and a receive with every peer): each member sends ``1/p``
    of its buffer straight to every other member, intra-node pairs over the node fabric, inter-node pairs over
    PCIe, NIC and network (and, on a rail-optimised network, the spine when the two GPUs sit on different rails),
    all at once; ``p - 1`` alpha steps of the slowest route. ``hierarchical`` (the 2-D algorithm of hierarchical
    all-to-alls, e.g. DeepSpeed's and Tutel's): the ``p = N x g`` members, ``g`` on each of ``N`` nodes, first
    exchange inside each node so that the member at local position ``j`` holds every block bound for position
    ``j`` of any node (each sends ``(g-1)/g`` of its buffer, ``1/g`` to each local peer, ``g - 1`` steps over
    the node fabric); then the members at each local position exchange across nodes (``(N-1)/N`` of the buffer,
    ``1/N`` to each, ``N - 1`` steps, on one rail). It sends the same bytes through every NIC as pairwise plus
    one pass over the node fabric, in ``g + N - 2`` alpha steps instead of ``p - 1``, all inter-node on one rail:
    it wins when latency dominates (small messages, many nodes) and loses a little when bandwidth does. A group
    that lives on one node, or has one member per node, runs one phase (it is then pairwise). The hierarchical
    algorithm needs the same number of members on every node it spans.
    """

    def __init__(self, topology: Topology, *, all_to_all: str = "pairwise") -> None:
        if all_to_all not in ALL_TO_ALL_ALGORITHMS:
            raise ValueError(f"unknown all-to-all algorithm {all_to_all!r}; choose one of {ALL_TO_ALL_ALGORITHMS}")
        self.topology = topology
        self.all_to_all = all_to_all
        self._cache: dict[tuple, CollectivePlan] = {}

    def plan(self, kind: str, instances: Sequence[Sequence[int]], root: int | None = None) -> CollectivePlan:
        """The plan of ``kind`` run concurrently on each of ``instances`` (p2p: ``((sender, receiver),)``)."""
        key = (kind, tuple(tuple(m) for m in instances), root)
        plan = self._cache.get(key)
        if plan is None:
            plan = self._build(kind, key[1], root)
            self._cache[key] = plan
        return plan

    def _flows(self, kind: str, members: tuple[int, ...], root: int | None) -> list[tuple[list[Flow], int]]:
        """The phases of ``kind`` on ``members``: each its flows and its number of alpha steps."""
        if kind == "all_to_all" and self.all_to_all == "hierarchical":
            return self._hierarchical_all_to_all(members)
        flows = traffic_pattern(kind, members, root=root if root in members else None)
        return [(flows, algorithm_steps(kind, len(members)))]

    def _hierarchical_all_to_all(self, members: tuple[int, ...]) -> list[tuple[list[Flow], int]]:
        by_node: dict[int, list[int]] = {}
        for rank in members:
            by_node.setdefault(self.topology.node_of(rank), []).append(rank)
        sizes = {len(local) for local in by_node.values()}
        if len(sizes) != 1:
            raise ValueError(f"the hierarchical all-to-all needs the same number of members on every node; group "
                             f"{members} has {dict((n, len(v)) for n, v in by_node.items())} per node: use the "
                             "pairwise algorithm or a group spread evenly over its nodes")
        g, nodes = sizes.pop(), list(by_node.values())
        intra = [(a, b, 1.0 / g) for local in nodes for a in local for b in local if a != b]
        rails = [[local[j] for local in nodes] for j in range(g)]
        inter = [(a, b, 1.0 / len(nodes)) for rail in rails for a in rail for b in rail if a != b]
        return [(flows, steps) for flows, steps in ((intra, g - 1), (inter, len(nodes) - 1)) if flows]

    def _host_copy(self, kind: str, instances: tuple[tuple[int, ...], ...]) -> CollectivePlan:
        """A device<->host copy on each instance (one rank each): its host-memory link, one alpha."""
        topo, loads, latency_s, seconds_per_byte = self.topology, [], 0.0, 0.0
        for members in instances:
            if len(members) != 1:
                raise ValueError(f"a {kind} copy runs on a group of one rank per instance, got {members}")
            links = topo.host_path(members[0], to_host=kind == "to_host")
            loads.append(dict.fromkeys(links, 1.0))
            latency_s = max(latency_s, sum(topo.links[i].latency_s for i in links))
            seconds_per_byte = max(seconds_per_byte, max(1.0 / topo.links[i].bandwidth_bytes_per_s for i in links))
        return CollectivePlan(phases=(PlanPhase(latency_s=latency_s, loads=tuple(loads),
                                                seconds_per_byte=seconds_per_byte),))

    def _build(self, kind: str, instances: tuple[tuple[int, ...], ...], root: int | None) -> CollectivePlan:
        if kind in ("to_host", "from_host"):
            return self._host_copy(kind, instances)
        topo = self.topology
        bandwidth = topo.link_bandwidth_bytes_per_s
        per_instance = [self._flows(kind, members, root) for members in instances]
        phases = []
        for k in range(max((len(p) for p in per_instance), default=0)):
            latency_s = seconds_per_byte = 0.0
            all_loads = []
            for inst_phases in per_instance:
                loads: LinkLoads = {}
                if k < len(inst_phases):
                    flows, steps = inst_phases[k]
                    worst_latency = 0.0
                    for src, dst, per_byte in flows:
                        for link in topo.path(src, dst):
                            loads[link] = loads.get(link, 0.0) + per_byte
                        worst_latency = max(worst_latency, topo.path_latency_s(src, dst))
                    latency_s = max(latency_s, steps * worst_latency)
                    seconds_per_byte = max(seconds_per_byte,
                                           max((v / bandwidth[i] for i, v in loads.items()), default=0.0))
                all_loads.append(loads)
            phases.append(PlanPhase(latency_s=latency_s, loads=tuple(all_loads), seconds_per_byte=seconds_per_byte))
        return CollectivePlan(phases=tuple(phases))

    def isolated_time_s(self, kind: str, members: Sequence[int], message_bytes: float, root: int | None = None) -> float:
        """Time of one collective on an otherwise idle network: per phase ``alpha + bytes * max_l load_l / bw_l``."""
        plan = self.plan(kind, (members,), root)
        return plan.latency_s + message_bytes * plan.seconds_per_byte

    def ring_p2p_plan(self, members: Sequence[int]) -> CollectivePlan:
        """One step of a ring exchange: every member sends to the next (``members[i] -> members[i+1]``, the last
        to the first) at once, as ring attention passes K/V chunks; each pair on its own route (node fabric
        between neighbours on one node, PCIe-NIC-network between nodes), so the step lasts as long as the
        slowest neighbour pair, sharing whatever links pairs have in common."""
        p = len(members)
        if p < 2:
            return CollectivePlan(phases=())
        return self.plan("send", tuple((members[i], members[(i + 1) % p]) for i in range(p)))

    def ring_step_time_s(self, members: Sequence[int], message_bytes: float) -> float:
        """Time of one ring step of :meth:`ring_p2p_plan` moving ``message_bytes`` per member, on an idle network."""
        plan = self.ring_p2p_plan(members)
        return plan.latency_s + message_bytes * plan.seconds_per_byte


@dataclass(eq=False)
class _Flow:
    loads: tuple[LinkLoads, ...]
    done: simpy.Event
    remaining: float = 1.0
    rate: float = 0.0
    generation: int = 0


class Network:
    """Fluid transfers sharing link bandwidth; see Note [Bandwidth sharing]."""

    def __init__(self, env: simpy.Environment, link_bandwidth_bytes_per_s: Sequence[float]) -> None:
        self.env = env
        self.bandwidth = list(link_bandwidth_bytes_per_s)
        self.users = [0] * len(self.bandwidth)
        self.active: list[_Flow] = []
        self._last_update = 0.0

    def transfer(self, loads: Sequence[LinkLoads]) -> simpy.Event:
        """Start a transfer putting ``loads[i][link]`` bytes on each link for each instance ``i``; the returned
        event succeeds when every byte has moved."""
        done = self.env.event()
        loads = tuple(dict(inst) for inst in loads if any(v > 0 for v in inst.values()))
        if not loads:
            done.succeed()
            return done
        self._advance()
        flow = _Flow(loads=loads, done=done)
        for inst in loads:
            for link in inst:
                self.users[link] += 1
        self.active.append(flow)
        self._reschedule()
        return done

    def _advance(self) -> None:
        dt = self.env.now - self._last_update
        if dt > 0:
            for flow in self.active:
                flow.remaining = max(0.0, flow.remaining - flow.rate * dt)
        self._last_update = self.env.now

    def _rate(self, flow: _Flow) -> float:
        bw, users = self.bandwidth, self.users
        return min(bw[link] / users[link] / load for inst in flow.loads for link, load in inst.items() if load > 0)

    def _reschedule(self) -> None:
        for flow in self.active:
            rate = self._rate(flow)
            if rate != flow.rate:
                flow.rate = rate
                flow.generation += 1
                timer = self.env.timeout(flow.remaining / rate)
                timer.callbacks.append(self._finisher(flow, flow.generation))

    def _finisher(self, flow: _Flow, generation: int):
        def finish(_event: simpy.Event) -> None:
            if flow.generation != generation:
                return
            self._advance()
            self.active.remove(flow)
            for inst in flow.loads:
                for link in inst:
                    self.users[link] -= 1
            flow.remaining = 0.0
            flow.done.succeed()
            self._reschedule()

        return finish


@dataclass(eq=False)
class _Pending:
    expected: int
    done: simpy.Event
    arrived: int = 0
    message_bytes: int = 0
    issuers: list[int] = field(default_factory=list)


class CollectiveRuntime:
    """Rendezvous plus transfer: :meth:`arrive` returns an event whose value is the transfer's start time."""

    def __init__(self, env: simpy.Environment, planner: CollectivePlanner, network: Network) -> None:
        self.env = env
        self.planner = planner
        self.network = network
        self.pending: dict[Hashable, _Pending] = {}
        self.completed = 0

    def arrive(self, rendezvous: Hashable, *, expected: int, issuer: int, kind: str,
               instances: tuple[tuple[int, ...], ...], message_bytes: int, root: int | None = None) -> simpy.Event:
        """Register that ``issuer`` issued the collective ``rendezvous``; ``expected`` issuers must arrive."""
        entry = self.pending.get(rendezvous)
        if entry is None:
            entry = _Pending(expected=expected, done=self.env.event())
            self.pending[rendezvous] = entry
        entry.arrived += 1
        entry.issuers.append(issuer)
        entry.message_bytes = max(entry.message_bytes, message_bytes)
        if entry.arrived >= entry.expected:
            del self.pending[rendezvous]
            self._launch(entry, self.planner.plan(kind, instances, root))
        return entry.done

    def _launch(self, entry: _Pending, plan: CollectivePlan) -> None:
        start_s = self.env.now
        nbytes = entry.message_bytes

        def run(k: int) -> None:
            if k == len(plan.phases):
                self.completed += 1
                entry.done.succeed(start_s)
                return
            phase = plan.phases[k]
            loads = [{link: per_byte * nbytes for link, per_byte in inst.items()} for inst in phase.loads]

            def transfer(_event: simpy.Event | None) -> None:
                self.network.transfer(loads).callbacks.append(lambda _done: run(k + 1))

            if phase.latency_s > 0:
                self.env.timeout(phase.latency_s).callbacks.append(transfer)
            else:
                transfer(None)

        run(0)
