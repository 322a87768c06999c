"""Collectives in the event loop: rendezvous of member ranks and bandwidth sharing between concurrent transfers.

Three pieces. :class:`CollectivePlanner` maps a collective on a set of ranks onto the topology: the algorithm's
flows (:func:`simulator.cost_model.traffic_pattern`) routed over links give the bytes each link carries per
message byte, and the alpha term is the algorithm's step count times the slowest route's latency. The
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
timers are ignored through a per-flow generation counter. A collective first waits its alpha term (using no
bandwidth), then moves its bytes; alone, the transfer takes ``max_l load_l / bw_l``, the bottleneck link of the
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


@dataclass(frozen=True)
class CollectivePlan:
    """How one collective uses the topology, per message byte."""

    latency_s: float
    """Alpha term: algorithm steps times the slowest member route's latency."""
    loads: tuple[LinkLoads, ...]
    """Per group instance: link index -> bytes carried per message byte."""
    seconds_per_byte: float
    """Bandwidth term alone, per message byte (max over instances and links of load / bandwidth)."""


class CollectivePlanner:
    """Caches :class:`CollectivePlan` per (kind, instances, root) on one topology."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._cache: dict[tuple, CollectivePlan] = {}

    def plan(self, kind: str, instances: Sequence[Sequence[int]], root: int | None = None) -> CollectivePlan:
        """The plan of ``kind`` run concurrently on each of ``instances`` (p2p: ``((sender, receiver),)``)."""
        key = (kind, tuple(tuple(m) for m in instances), root)
        plan = self._cache.get(key)
        if plan is None:
            plan = self._build(kind, key[1], root)
            self._cache[key] = plan
        return plan

    def _build(self, kind: str, instances: tuple[tuple[int, ...], ...], root: int | None) -> CollectivePlan:
        topo = self.topology
        bandwidth = topo.link_bandwidth_bytes_per_s
        latency_s = 0.0
        seconds_per_byte = 0.0
        all_loads = []
        for members in instances:
            loads: LinkLoads = {}
            worst_latency = 0.0
            for src, dst, per_byte in traffic_pattern(kind, members, root=root if root in members else None):
                for link in topo.path(src, dst):
                    loads[link] = loads.get(link, 0.0) + per_byte
                worst_latency = max(worst_latency, topo.path_latency_s(src, dst))
            latency_s = max(latency_s, algorithm_steps(kind, len(members)) * worst_latency)
            seconds_per_byte = max(seconds_per_byte, max((v / bandwidth[i] for i, v in loads.items()), default=0.0))
            all_loads.append(loads)
        return CollectivePlan(latency_s=latency_s, loads=tuple(all_loads), seconds_per_byte=seconds_per_byte)

    def isolated_time_s(self, kind: str, members: Sequence[int], message_bytes: float, root: int | None = None) -> float:
        """Time of one collective on an otherwise idle network: ``alpha + bytes * max_l load_l / bw_l``."""
        plan = self.plan(kind, (members,), root)
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
        loads = [{link: per_byte * nbytes for link, per_byte in inst.items()} for inst in plan.loads]

        def complete(_event: simpy.Event) -> None:
            self.completed += 1
            entry.done.succeed(start_s)

        def transfer(_event: simpy.Event | None) -> None:
            self.network.transfer(loads).callbacks.append(complete)

        if plan.latency_s > 0:
            self.env.timeout(plan.latency_s).callbacks.append(transfer)
        else:
            transfer(None)
