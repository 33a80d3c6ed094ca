"""The simulator's virtual network: hosts, directed links, connections, and network faults.

One :class:`World` holds the whole simulated internet of a run.  Each simulated host incarnation
gets its own network object (a :class:`~sim.engine.streams.SimNetwork`, or the subclass the
scenario names: for pccl, a :class:`pccl.net.base.Network`), bound to its identity so that
``connect`` knows the source host; the code under test cannot tell it from real TCP (both pass
``tests/net_conformance.py``).  The model below sees the streams' ends only through
:class:`StreamEnd` and :class:`ListenerEnd`.

Model (TCP connections, not packets — TCP never loses, reorders or duplicates bytes within a
connection, so the interesting behaviour is timing, flow control and how connections end):

* **Links** are directed host pairs with a :class:`LinkSpec`: one-way ``latency`` (+ optional
  ``jitter`` drawn from a per-link RNG, FIFO kept per connection), ``bandwidth`` shared fairly by
  the connections currently sending on the link (round-robin over segments of at most
  ``segment_size`` bytes), and a per-connection ``window``: bytes transmitted but not yet both
  acknowledged (one reverse latency after arrival) and read by the receiving application.  An
  eager reader therefore caps a connection at ``window / RTT`` (parallel connections matter, as on
  a WAN); a reader that does not read stops the sender after ``window`` bytes.
* **Sites** (datacenters, optional): :meth:`World.add_site` and :meth:`World.place` put hosts
  in sites.  Links between two hosts of one site get the site's ``inside`` spec; links between
  sites get the site pair's spec (:meth:`World.set_site_link`: latency, window), and every
  segment a site sends to any other site also passes its one **uplink** of ``uplink`` bytes/s,
  shared round-robin by all of the site's outbound links (:class:`Uplink`).  An explicit
  :meth:`World.set_link` for a host pair still wins.
* **Send buffers**: ``send_all`` copies into a per-connection buffer of ``send_buffer`` bytes and
  blocks while it is full — a sender that loops blocks, so virtual time advances.
* **Handshake**: SYN and SYN-ACK travel the links (one RTT), so connects obey partitions; nothing
  listening → RST → ``ConnectionRefused``; a machine that is down or cut off never answers →
  ``ConnectTimeout``.
* **Endings**: ``aclose`` sends FIN behind the data (or RST when unread data is discarded, as
  Linux does); ``abort`` and data arriving at a closed or dead endpoint answer RST.

Faults (synchronous methods, called by the runner's fault injector or by phase triggers):

* :meth:`World.kill` — the process dies, the machine stays up: every connection of the
  incarnation is reset at once (RST towards each peer, after the data already on the wire), its
  listeners vanish (later connects are refused).  The runner cancels the host's tasks *after*
  this, so nothing the corpse "sends" afterwards leaves the host.
* :meth:`World.power_off` — the machine vanishes: no FIN, no RST; data to it is black-holed and
  never acknowledged, connects time out.  Peers only notice through their own timeouts.
* :meth:`World.stall` / :meth:`World.unstall` — SIGSTOP-like: every link touching the host is
  held (nothing leaves or enters it; senders block on their windows), its connections stay open,
  and every network operation its tasks make blocks until the stall ends.
* :meth:`World.partition` / :meth:`World.heal` — hold traffic between sets of hosts (one-way or
  both ways); nothing is lost, it flows again on heal (TCP retransmits).
* :meth:`World.boot` — a (new) incarnation of a host: a join, or a restart after a kill.

Every network operation checks the caller's incarnation: an operation of a dead incarnation at a
later virtual instant than its death is recorded as a **zombie** failure (something outlived the
kill).  Event-driven: a heap ordered by ``(time, sequence)``, delivered by the runner's clock
when the run goes idle (:func:`sim.engine.determinism.sim_clock`) or by the :meth:`World.run`
task; nothing polls.
"""

from __future__ import annotations

import contextvars
import dataclasses
import heapq
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import trio

from .determinism import derive_rng
from .trace import Trace

__all__ = [
    "LinkSpec", "SiteSpec", "Uplink", "World", "Incarnation", "CURRENT_INCARNATION", "StreamEnd", "ListenerEnd",
    "OneWaiter",
]

logger = logging.getLogger(__name__)

#: The incarnation whose task is running; the runner sets it in each host's root task (child
#: tasks inherit it), and the network's zombie check reads it.
CURRENT_INCARNATION: contextvars.ContextVar["Incarnation | None"] = contextvars.ContextVar(
    "sim_current_incarnation", default=None
)

#: Names by which a host reaches itself.
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD = frozenset({"0.0.0.0", "::", ""})


class OneWaiter:
    """A ``trio.lowlevel.ParkingLot`` for at most one task at a time (one direction of a stream
    has one sender or receiver: the streams refuse a second one): ``park``, ``unpark_all`` and
    truthiness behave the same, without the lot's per-wake-up bookkeeping."""

    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: trio.lowlevel.Task | None = None

    def __bool__(self) -> bool:
        return self._task is not None

    async def park(self) -> None:
        assert self._task is None, "a second task parked where one waits at a time"
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def unpark_all(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)


class StreamEnd(Protocol):
    """What the model needs of one end of a connection (:class:`sim.engine.streams.SimStream`):
    the receive side that arrivals fill, and the teardown a reset, a kill or a power-off starts.
    The two modules are one model split in two, hence the private names."""

    _inc: Incarnation
    _in: Pipe
    _rbuf: deque[memoryview]
    _rbuf_bytes: int
    _recv_lot: OneWaiter
    _eof: bool
    _reset: bool
    _closed: bool

    def _send_rst(self) -> None: ...

    def _on_reset(self) -> None: ...

    def _close(self, *, abortive: bool) -> None: ...

    def _die(self, *, reset: bool) -> None: ...


class ListenerEnd(Protocol):
    """What the model needs of a bound port (:class:`sim.engine.streams.SimListener`)."""

    def _shutdown(self, *, reset_backlog: bool) -> None: ...


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """Properties of one directed link (see the module docstring for the model)."""

    latency: float = 0.005
    bandwidth: float = math.inf  # bytes per second, shared by the connections on the link
    window: int = 1 << 20  # bytes in flight per connection: throughput <= window / RTT
    jitter: float = 0.0  # extra one-way delay, uniform in [0, jitter]

    def __post_init__(self) -> None:
        if self.latency < 0 or self.jitter < 0:
            raise ValueError("latency and jitter must not be negative")
        if self.bandwidth <= 0:
            raise ValueError("bandwidth must be positive")
        if self.window < 1:
            raise ValueError("window must be at least one byte")


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """A datacenter: the links between its own hosts, and the bandwidth (bytes/s) of the one
    uplink all its traffic to other sites shares."""

    inside: LinkSpec = LinkSpec(latency=0.0001)
    uplink: float = math.inf

    def __post_init__(self) -> None:
        if self.uplink <= 0:
            raise ValueError("uplink bandwidth must be positive")


class Uplink:
    """A site's shared uplink: one transmitter that the site's outbound links take turns on
    (round-robin, one segment per turn), so that ``k`` busy links each get ``1 / k`` of it."""

    def __init__(self, world: "World", site: str, bandwidth: float) -> None:
        self.world = world
        self.site = site
        self.bandwidth = bandwidth
        self.busy_until = -math.inf
        self.waiting: deque[Link] = deque()
        self.next_wake = math.inf
        self.carried = 0

    def may_send(self, link: "Link", now: float) -> bool:
        """Whether ``link`` may transmit a segment now; if not, it queues for a turn and the
        uplink calls its ``service`` when the turn comes."""
        waiting = self.waiting
        if self.busy_until <= now and (not waiting or waiting[0] is link):
            if waiting:
                waiting.popleft()
            return True
        if link not in waiting:
            waiting.append(link)
        self._wake_at(max(self.busy_until, now))
        return False

    def sent(self, nbytes: int, now: float, tx: float) -> None:
        self.busy_until = now + tx
        self.carried += nbytes

    def _wake_at(self, at: float) -> None:
        if at < self.next_wake:
            self.next_wake = at
            self.world.at(at, self._wake, at)

    def _wake(self, at: float) -> None:
        if at == self.next_wake:
            self.next_wake = math.inf
        now = trio.current_time()
        while self.waiting and self.busy_until <= now:
            link = self.waiting[0]
            link.service()
            if self.waiting and self.waiting[0] is link:
                self.waiting.popleft()  # its turn came and it had nothing it could send
        if self.waiting:
            self._wake_at(max(self.busy_until, now))


class Incarnation:
    """One life of a host's process: its connections and listeners die with it."""

    def __init__(self, host: "_Host", number: int, born_at: float) -> None:
        self.host = host
        self.number = number
        self.born_at = born_at
        self.alive = True
        self.died_at: float | None = None
        self.death: str | None = None  # "kill" or "power_off"
        self.streams: dict[int, StreamEnd] = {}  # insertion-ordered: deterministic teardown
        self.listeners: dict[int, ListenerEnd] = {}
        self.attempts: list[Any] = []  # pending connect attempts

    @property
    def name(self) -> str:
        return self.host.name

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"dead ({self.death} at {self.died_at})"
        return f"<Incarnation {self.host.name}#{self.number} {state}>"


class _Host:
    def __init__(self, name: str) -> None:
        self.name = name
        self.machine_up = False
        self.process: Incarnation | None = None
        self.stalled = 0
        self.stall_lot = trio.lowlevel.ParkingLot()
        self.listeners: dict[int, Any] = {}  # port -> listener (the streams module looks it up)
        self.next_ephemeral = 49152
        self.incarnations = 0
        self.orphans: list[StreamEnd] = []  # connections of a powered-off incarnation

    def ephemeral_port(self) -> int:
        port = self.next_ephemeral
        self.next_ephemeral = 49152 + (port - 49152 + 1) % (65536 - 49152)
        return port


class _Partition:
    def __init__(self, pid: int, side: frozenset[str], other: frozenset[str] | None, both_ways: bool) -> None:
        self.pid = pid
        self.side = side
        self.other = other  # None: every host not in ``side``
        self.both_ways = both_ways

    def _in_other(self, host: str) -> bool:
        return host not in self.side if self.other is None else host in self.other

    def blocks(self, src: str, dst: str) -> bool:
        if src in self.side and self._in_other(dst):
            return True
        return self.both_ways and dst in self.side and self._in_other(src)


class Pipe:
    """One direction of a connection: the sender's buffer, the wire, and the flow control."""

    __slots__ = (
        "link", "src", "dst", "sendq", "queued", "fin_pending", "fin_sent", "transmitted",
        "arrived", "read", "acked", "acks", "last_arrival", "active", "window_blocked",
        "send_lot", "dead",
    )

    def __init__(self, link: "Link", src: StreamEnd, dst: StreamEnd) -> None:
        self.link = link
        self.src = src
        self.dst = dst
        self.sendq: deque[memoryview] = deque()
        self.queued = 0
        self.fin_pending = False
        self.fin_sent = False
        self.transmitted = 0
        self.arrived = 0
        self.read = 0
        self.acked = 0
        self.acks: deque[tuple[float, int]] = deque()
        self.last_arrival = -math.inf
        self.active = False
        self.window_blocked = False
        self.send_lot = OneWaiter()
        self.dead = False  # reset or black-holed: nothing more is transmitted

    def outstanding(self, now: float) -> int:
        acks = self.acks
        while acks and acks[0][0] <= now:
            self.acked = acks.popleft()[1]
        return self.transmitted - min(self.acked, self.read)

    def enqueue(self, chunk: bytes) -> None:
        self.sendq.append(memoryview(chunk))
        self.queued += len(chunk)
        self.link.activate(self)

    def drop(self) -> None:
        """Forget everything not yet transmitted (a reset or a dead host)."""
        self.dead = True
        self.sendq.clear()
        self.queued = 0
        self.fin_pending = False
        self.send_lot.unpark_all()


class Link:
    """A directed host pair: transmits the segments of its connections and control packets."""

    def __init__(self, world: "World", src: str, dst: str, spec: LinkSpec, uplink: Uplink | None = None) -> None:
        self.world = world
        self.src = src
        self.dst = dst
        self.spec = spec
        self.uplink = uplink  # the source site's shared uplink, between sites
        self.rng = derive_rng(world.seed, "link", f"{src}->{dst}")
        self.active: deque[Pipe] = deque()
        self.control: deque[tuple[Callable[..., None], tuple[Any, ...], Pipe | None]] = deque()
        self.busy_until = -math.inf
        self.next_service = math.inf
        self.last_served: Pipe | None = None
        self.carried = 0  # payload bytes delivered over this link
        self.reverse: Link | None = None  # dst -> src, which carries the acknowledgements

    def delay(self) -> float:
        jitter = self.spec.jitter
        return self.spec.latency + (self.rng.uniform(0.0, jitter) if jitter else 0.0)

    def held(self) -> bool:
        return self.world._held(self.src, self.dst)

    def activate(self, pipe: Pipe) -> None:
        if not pipe.active and not pipe.dead:
            pipe.active = True
            self.active.append(pipe)
        self.service()

    def send_control(self, fn: Callable[..., None], args: tuple[Any, ...], pipe: Pipe | None = None) -> None:
        """Queue a zero-size packet (SYN, SYN-ACK, RST); ``pipe`` keeps it behind that pipe's data."""
        self.control.append((fn, args, pipe))
        self.service()

    def service(self) -> None:
        """Transmit whatever may leave now; schedule the next service when the link is busy."""
        world = self.world
        if self.held():
            return  # World._release() services every link again when a hold ends
        now = trio.current_time()
        while self.control:
            fn, args, pipe = self.control.popleft()
            at = now + self.delay()
            if pipe is not None:
                at = max(at, pipe.last_arrival)
                pipe.last_arrival = at
            world.at(at, fn, *args)
        active = self.active
        bandwidth = self.spec.bandwidth
        uplink = self.uplink
        if uplink is not None:
            bandwidth = min(bandwidth, uplink.bandwidth)
        while active or self.last_served is not None:
            if self.busy_until > now:
                self.schedule_service(self.busy_until)
                return
            if uplink is not None and not uplink.may_send(self, now):
                return  # the uplink calls service() again at this link's turn
            # The pipe served last goes behind the ones that became ready meanwhile (fair
            # round-robin even when they arrived while the link was busy).
            last = self.last_served
            if last is not None:
                self.last_served = None
                if (last.queued or last.fin_pending) and not last.dead:
                    active.append(last)
                else:
                    last.active = False
                if not active:
                    break
            pipe = active.popleft()
            pipe.active = False
            if pipe.dead:
                continue
            if pipe.queued == 0:
                if pipe.fin_pending:
                    pipe.fin_pending = False
                    pipe.fin_sent = True
                    at = max(now + self.delay(), pipe.last_arrival)
                    pipe.last_arrival = at
                    world.at(at, world._arrive_fin, pipe)
                continue
            room = self.spec.window - pipe.outstanding(now)
            if room <= 0:
                # Parked until an acknowledgement returns (timed) or the reader reads (it
                # calls unblock); either may not suffice, and then it parks again.
                pipe.window_blocked = True
                if pipe.acks:
                    world.at(pipe.acks[0][0], self.unblock, pipe)
                continue
            # Several segments per window, so a window pipelines instead of stop-and-wait.
            n = min(room, pipe.queued, world.segment_size, max(self.spec.window // 8, 1024))
            views: list[memoryview] = []
            need = n
            sendq = pipe.sendq
            while need:
                head = sendq[0]
                if len(head) <= need:
                    views.append(sendq.popleft())
                    need -= len(head)
                else:
                    views.append(head[:need])
                    sendq[0] = head[need:]
                    need = 0
            pipe.queued -= n
            pipe.transmitted += n
            tx = n / bandwidth
            self.busy_until = now + tx
            if uplink is not None:
                uplink.sent(n, now, tx)
            at = max(now + tx + self.delay(), pipe.last_arrival)
            pipe.last_arrival = at
            world.at(at, world._arrive_data, pipe, views, n)
            if pipe.send_lot:
                pipe.send_lot.unpark_all()
            pipe.active = True  # until re-queued (or retired) at the next turn
            self.last_served = pipe

    def unblock(self, pipe: Pipe) -> None:
        if pipe.window_blocked:
            pipe.window_blocked = False
            self.activate(pipe)

    def schedule_service(self, at: float) -> None:
        if at < self.next_service:
            self.next_service = at
            self.world.at(at, self._timed_service, at)

    def _timed_service(self, at: float) -> None:
        if at == self.next_service:
            self.next_service = math.inf
        self.service()


class World:
    """The simulated internet of one run (see the module docstring).

    ``network_class(world, incarnation, **options)`` makes the network object :meth:`boot` hands
    out (:class:`sim.engine.streams.SimNetwork` or a workload's subclass).  ``trace`` receives
    network-level events (listen, connect, reset, faults).  ``tap``, if set, observes bytes as
    hosts send, read and links carry them (phase triggers and coverage use it; see
    :mod:`sim.engine.tap`).  All fault methods are synchronous and take effect at the current
    virtual instant.
    """

    def __init__(
        self,
        *,
        seed: int,
        network_class: Callable[..., Any],
        trace: Trace | None = None,
        default_link: LinkSpec | None = None,
        send_buffer: int = 256 * 1024,
        segment_size: int = 64 * 1024,
        syn_timeout: float = 127.0,
    ) -> None:
        self.seed = seed
        self.network_class = network_class
        self.trace = trace if trace is not None else Trace()
        self.default_link = default_link or LinkSpec()
        self.send_buffer = send_buffer
        self.segment_size = segment_size
        self.syn_timeout = syn_timeout
        self.tap: Any = None
        self.hosts: dict[str, _Host] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self._link_specs: dict[tuple[str, str], LinkSpec] = {}
        self.sites: dict[str, SiteSpec] = {}
        self.uplinks: dict[str, Uplink] = {}
        self.site_of: dict[str, str] = {}
        self._site_links: dict[tuple[str, str], LinkSpec] = {}
        self._locate: Callable[[str], str | None] | None = None
        self._partitions: dict[int, _Partition] = {}
        self._next_partition = 1
        self._incarnations = 0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._wait_scope: trio.CancelScope | None = None
        self._next_stream_id = 0
        self.events_processed = 0
        #: Called with (incarnation, operation) when a dead incarnation's code runs on.
        self.on_zombie: Callable[[Incarnation, str], None] | None = None

    # -- configuration -----------------------------------------------------------------------

    def set_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        """Give the link a→b (and b→a unless ``both_ways`` is false) ``spec``."""
        pairs = [(a, b), (b, a)] if both_ways else [(a, b)]
        for pair in pairs:
            self._link_specs[pair] = spec
            if pair in self.links:
                self.links[pair].spec = spec

    def add_site(self, name: str, spec: SiteSpec) -> None:
        """Declare (or redefine) site ``name``."""
        self.sites[name] = spec
        uplink = self.uplinks.get(name)
        if uplink is None:
            self.uplinks[name] = Uplink(self, name, spec.uplink)
        else:
            uplink.bandwidth = spec.uplink
        self._respec()

    def place(self, host: str, site: str) -> None:
        """Put ``host`` in ``site`` (declared with :meth:`add_site`)."""
        if site not in self.sites:
            raise ValueError(f"unknown site {site!r}")
        self.site_of[host] = site
        self._respec()

    def place_by(self, locate: Callable[[str], str | None]) -> None:
        """Hosts not :meth:`place`-d explicitly are in site ``locate(name)`` (``None``: none),
        hosts that join later included."""
        self._locate = locate
        self._respec()

    def site(self, host: str) -> str | None:
        site = self.site_of.get(host)
        if site is None and self._locate is not None:
            site = self._locate(host)
            if site is not None and site not in self.sites:
                raise ValueError(f"host {host!r} placed in unknown site {site!r}")
        return site

    def set_site_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        """Links from hosts of site ``a`` to hosts of site ``b`` (and back unless ``both_ways``
        is false) get ``spec``; their bytes also pass ``a``'s uplink."""
        for pair in ([(a, b), (b, a)] if both_ways else [(a, b)]):
            self._site_links[pair] = spec
        self._respec()

    def _spec_and_uplink(self, src: str, dst: str) -> tuple[LinkSpec, Uplink | None]:
        spec = self._link_specs.get((src, dst))
        s, d = self.site(src), self.site(dst)
        if s is None or d is None:
            return spec or self.default_link, None
        if s == d:
            return spec or self.sites[s].inside, None
        return spec or self._site_links.get((s, d), self.default_link), self.uplinks[s]

    def _respec(self) -> None:
        for (src, dst), link in self.links.items():
            link.spec, link.uplink = self._spec_and_uplink(src, dst)

    def link(self, src: str, dst: str) -> Link:
        link = self.links.get((src, dst))
        if link is None:
            if self.site_of or self._locate is not None:
                link = Link(self, src, dst, *self._spec_and_uplink(src, dst))
            else:
                link = Link(self, src, dst, self._link_specs.get((src, dst), self.default_link))
            self.links[(src, dst)] = link
        return link

    # -- the event loop ------------------------------------------------------------------------

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``when`` (FIFO among equal times)."""
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))
        scope = self._wait_scope
        if scope is not None and when < scope.deadline:  # only while World.run waits (simulate())
            scope.deadline = when

    async def sleep_until(self, when: float) -> None:
        """Sleep until virtual time ``when``, for simulated work (a workload's compute), woken by
        this queue: the event reschedules the task, where trio's sleep expires a cancel scope's
        deadline and raises ``Cancelled`` through the task to end it, several times the cost.
        Cancellation works as for ``trio.sleep_until`` (the event then finds nobody to wake).

        Unlike ``trio.sleep_until``, the wake-up is this queue's event: at its instant it comes
        before trio's deadlines when :func:`sim_clock` delivers the events (a simulated run),
        after them under :func:`~sim.engine.runner.simulate`, and a ``when`` already past waits
        until the current instant goes idle.  Deterministic either way.  ``ValueError`` for NaN."""
        if math.isnan(when):
            raise ValueError("sleep_until: when is NaN")
        task: list[trio.lowlevel.Task | None] = [trio.lowlevel.current_task()]

        def wake() -> None:
            sleeper = task[0]
            if sleeper is not None:
                task[0] = None
                trio.lowlevel.reschedule(sleeper)

        def abort(_: object) -> trio.lowlevel.Abort:
            task[0] = None
            return trio.lowlevel.Abort.SUCCEEDED

        self.at(when, wake)
        await trio.lowlevel.wait_task_rescheduled(abort)

    def next_time(self) -> float:
        """When the earliest pending event is due (``inf``: none)."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def deliver(self, now: float) -> None:
        """Run every event due at or before ``now``, in (time, FIFO) order (events they add for
        ``now`` included)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, fn, args = heapq.heappop(heap)
            self.events_processed += 1
            fn(*args)

    async def run(self) -> None:
        """Deliver events forever, as a task (for :func:`sim.engine.runner.simulate`; the
        runner's clock delivers them itself, :func:`sim.engine.determinism.sim_clock`); cancel
        it to stop."""
        heap = self._heap
        while True:
            self.deliver(trio.current_time())
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._wait_scope = scope
                await trio.sleep_forever()
            self._wait_scope = None

    # -- hosts -------------------------------------------------------------------------------

    def host(self, name: str) -> _Host:
        host = self.hosts.get(name)
        if host is None:
            if not name or ":" in name or name in _LOOPBACK or name in _WILDCARD:
                raise ValueError(f"invalid simulated host name {name!r}")
            host = self.hosts[name] = _Host(name)
        return host

    def boot(self, name: str, **options: Any) -> Any:
        """Power the machine on (if needed) and start a new incarnation; return its network
        (``network_class(self, incarnation, **options)``).

        Raises ``RuntimeError`` if an incarnation of ``name`` is still alive.
        """
        host = self.host(name)
        if host.process is not None:
            raise RuntimeError(f"host {name} is still running incarnation {host.process.number}")
        self._incarnations += 1
        if not host.machine_up:
            self._answer_orphans(host)
        host.machine_up = True
        host.incarnations += 1
        inc = Incarnation(host, self._incarnations, trio.current_time())
        host.process = inc
        self.trace.record("net", "boot", host=name, incarnation=inc.number)
        return self.network_class(self, inc, **options)

    def _answer_orphans(self, host: _Host) -> None:
        """A machine comes back after a power-off: peers still retransmitting into its old
        connections now reach a kernel that knows nothing of them, and it answers RST."""
        for stream in host.orphans:
            peer_pipe = stream._in
            if peer_pipe is not None and (peer_pipe.queued or peer_pipe.transmitted > peer_pipe.arrived):
                stream._send_rst()
        host.orphans.clear()

    def alive(self, name: str) -> bool:
        host = self.hosts.get(name)
        return host is not None and host.process is not None

    def incarnation(self, name: str) -> Incarnation | None:
        host = self.hosts.get(name)
        return None if host is None else host.process

    def kill(self, name: str) -> Incarnation | None:
        """The host's process dies (kill -9); its kernel resets every connection.  Returns the
        dead incarnation, or ``None`` if nothing was running."""
        return self._end(name, "kill")

    def power_off(self, name: str) -> Incarnation | None:
        """The machine vanishes without a word; returns the dead incarnation (or ``None``)."""
        inc = self._end(name, "power_off")
        host = self.hosts.get(name)
        if host is not None:
            host.machine_up = False
            # Nothing leaves a machine that is off, not even packets queued behind a hold.
            for (src, _dst), link in self.links.items():
                if src == name:
                    link.control.clear()
        return inc

    def _end(self, name: str, how: str) -> Incarnation | None:
        host = self.hosts.get(name)
        if host is None or host.process is None:
            if host is not None and how == "power_off":
                self.trace.record("net", how, host=name, incarnation=None)
            return None
        inc = host.process
        inc.alive = False
        inc.died_at = trio.current_time()
        inc.death = how
        host.process = None
        self.trace.record("net", how, host=name, incarnation=inc.number)
        if how == "power_off":
            host.orphans.extend(inc.streams.values())
        for listener in list(inc.listeners.values()):
            listener._shutdown(reset_backlog=how == "exit")
        for stream in list(inc.streams.values()):
            if how == "exit":  # the process ended: its kernel closes the sockets (FIN, or RST)
                stream._close(abortive=False)
            else:
                stream._die(reset=how == "kill")
        for attempt in inc.attempts:
            attempt.abandon()
        inc.attempts.clear()
        # A stall of a dead process is moot: release waiters so nothing stays parked.  (Without
        # this, a corpse's shielded cleanup — e.g. Communicator.aclose sending Leave — parked in
        # the stall gate stayed parked until the unstall and then ran on: a false zombie.)
        host.stall_lot.unpark_all()
        return inc

    def stall(self, name: str) -> None:
        """Freeze the host: its traffic is held both ways and its network operations block."""
        host = self.host(name)
        host.stalled += 1
        self.trace.record("net", "stall", host=name, depth=host.stalled)

    def unstall(self, name: str) -> None:
        host = self.host(name)
        if host.stalled == 0:
            return
        host.stalled -= 1
        self.trace.record("net", "unstall", host=name, depth=host.stalled)
        if host.stalled == 0:
            host.stall_lot.unpark_all()
            self._release()

    def partition(self, side: Iterable[str], other: Iterable[str] | None = None, *, both_ways: bool = True) -> int:
        """Hold all traffic from ``side`` to ``other`` (default: every other host) and, unless
        ``both_ways`` is false, back.  Returns an id for :meth:`heal`."""
        side_set = frozenset(side)
        other_set = None if other is None else frozenset(other)
        pid = self._next_partition
        self._next_partition += 1
        self._partitions[pid] = _Partition(pid, side_set, other_set, both_ways)
        self.trace.record(
            "net", "partition", id=pid, side=sorted(side_set),
            other=None if other_set is None else sorted(other_set), both_ways=both_ways,
        )
        return pid

    def heal(self, pid: int | None = None) -> None:
        """End partition ``pid`` (all partitions if ``None``); held traffic flows again."""
        if pid is None:
            ended = list(self._partitions)
            self._partitions.clear()
        else:
            ended = [pid] if self._partitions.pop(pid, None) is not None else []
        if ended:
            self.trace.record("net", "heal", ids=ended)
            self._release()

    def heal_all(self) -> None:
        """End every partition and stall (the liveness phase starts from a healed network)."""
        for host in self.hosts.values():
            while host.stalled:
                self.unstall(host.name)
        self.heal()

    def _held(self, src: str, dst: str) -> bool:
        hosts = self.hosts
        if hosts[src].stalled or hosts[dst].stalled:
            return True
        for partition in self._partitions.values():
            if partition.blocks(src, dst):
                return True
        return False

    def _release(self) -> None:
        for link in list(self.links.values()):
            link.service()

    # -- arrivals (called from the event loop) --------------------------------------------------

    def _arrive_data(self, pipe: Pipe, views: list[memoryview], n: int) -> None:
        dst = pipe.dst
        dst_host = dst._inc.host
        pipe.link.carried += n
        if self.tap is not None:
            self.tap.on_carried(pipe.link.src, pipe.link.dst, n)
        if not dst_host.machine_up or pipe.dead:
            return  # black hole: never acknowledged
        if dst._closed or dst._reset or not dst._inc.alive:
            dst._send_rst()  # the kernel answers data for a socket that is gone
            return
        dst._rbuf.extend(views)
        dst._rbuf_bytes += n
        pipe.arrived += n
        link = pipe.link
        back = link.reverse
        if back is None:
            back = link.reverse = self.link(link.dst, link.src)
        pipe.acks.append((trio.current_time() + back.delay(), pipe.arrived))
        if dst._recv_lot:
            dst._recv_lot.unpark_all()

    def _arrive_fin(self, pipe: Pipe) -> None:
        dst = pipe.dst
        if not dst._inc.host.machine_up or pipe.dead:
            return
        dst._eof = True
        if dst._recv_lot:
            dst._recv_lot.unpark_all()

    def _arrive_rst(self, target: StreamEnd) -> None:
        if not target._inc.host.machine_up:
            return
        target._on_reset()

    # -- ids -----------------------------------------------------------------------------------

    def _stream_id(self) -> int:
        self._next_stream_id += 1
        return self._next_stream_id

    def zombie(self, inc: Incarnation, operation: str) -> None:
        """A dead incarnation's code ran on after its death instant: report it."""
        message = (
            f"{operation} by {inc.name} incarnation {inc.number}, which died "
            f"({inc.death}) at t={inc.died_at}"
        )
        if self.on_zombie is not None:
            self.on_zombie(inc, operation)
        else:
            self.trace.fail("zombie", inc.name, message)

    def statistics(self) -> dict[str, int]:
        return {
            "events": self.events_processed,
            "links": len(self.links),
            "bytes_carried": sum(link.carried for link in self.links.values()),
        }
