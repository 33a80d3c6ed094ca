"""Moving bytes: each connection's two pipes, the links that carry them, the sites' uplinks, and
what happens when a segment, a FIN or an RST arrives.

Model (TCP connections, not packets — TCP never loses, reorders or duplicates bytes within a
connection, so the interesting behaviour is timing, flow control and how connections end):

* a :class:`Pipe` is one direction of a connection: the sender's buffer, the bytes on the wire
  and the flow control;
* a :class:`Link` is a directed host pair with the :class:`~pccl_sim.engine.topology.LinkSpec` the
  topology gives it: one-way ``latency`` (+ optional ``jitter`` drawn from a per-link RNG, FIFO
  kept per connection), ``bandwidth`` shared fairly by the connections currently sending on it
  (round-robin over segments of at most ``segment_size`` bytes), and a per-connection ``window``:
  bytes transmitted but not yet both acknowledged (one reverse latency after arrival) and read by
  the receiving application.  An eager reader therefore caps a connection at ``window / RTT``
  (parallel connections matter, as on a WAN); a reader that does not read stops the sender after
  ``window`` bytes;
* between sites every segment also passes the source site's one :class:`Uplink`, shared
  round-robin by all the site's outbound links;
* control packets (SYN, SYN-ACK, RST) take one latency and no bandwidth; one queued behind a
  pipe's data arrives after it.

Rules:

* a link whose host is stalled, or that a partition cuts, transmits nothing and keeps
  everything: :meth:`Delivery.release` services every link again when a hold ends;
* bytes for a machine that is off, or on a pipe that died, vanish unacknowledged (a black hole);
  data for a socket that is gone is answered with RST, as a kernel does;
* everything happens in event callbacks (:mod:`pccl_sim.engine.clock`) or in the sending call itself:
  nothing waits, nothing polls.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import trio

from .clock import EventQueue
from .determinism import derive_rng
from .hosts import Hosts, Incarnation
from .topology import LinkSpec, Topology

__all__ = ["OneWaiter", "Endpoint", "Pipe", "Link", "Uplink", "Delivery"]


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


class Endpoint(Protocol):
    """What arrivals need of one end of a connection (:class:`pccl_sim.engine.sockets.Socket`): the
    receive side that they fill, and the reset an RST starts."""

    inc: Incarnation
    rbuf: deque[memoryview]
    rbuf_bytes: int
    recv_lot: OneWaiter
    eof: bool
    reset: bool
    closed: bool

    def send_rst(self) -> None: ...

    def on_reset(self) -> None: ...


class Uplink:
    """A site's shared uplink: one transmitter that the site's outbound links take turns on
    (round-robin, one segment per turn), so that ``k`` busy links each get ``1 / k`` of it."""

    def __init__(self, queue: EventQueue, site: str, bandwidth: float) -> None:
        self.queue = queue
        self.site = site
        self.bandwidth = bandwidth
        self.busy_until = -math.inf
        self.waiting: deque[Link] = deque()
        self.next_wake = math.inf
        self.carried = 0

    def may_send(self, link: Link, now: float) -> bool:
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
            self.queue.at(at, self._wake, at)

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

class Pipe:
    """One direction of a connection: the sender's buffer, the wire, and the flow control."""

    __slots__ = (
        "link", "src", "dst", "sendq", "queued", "fin_pending", "fin_sent", "transmitted",
        "arrived", "read", "acked", "acks", "last_arrival", "active", "window_blocked",
        "send_lot", "dead",
    )

    def __init__(self, link: Link, src: Endpoint, dst: Endpoint) -> None:
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

    def __init__(self, delivery: Delivery, src: str, dst: str, spec: LinkSpec, uplink: Uplink | None = None) -> None:
        self.delivery = delivery
        self.src = src
        self.dst = dst
        # Hosts are never forgotten: their stall depths are read at every service.
        self.src_host = delivery.hosts[src]
        self.dst_host = delivery.hosts[dst]
        self.spec = spec
        self.uplink = uplink  # the source site's shared uplink, between sites
        self.rng = derive_rng(delivery.seed, "link", f"{src}->{dst}")
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
        delivery = self.delivery
        if self.src_host.stalled or self.dst_host.stalled or delivery.topology.blocks(self.src, self.dst):
            return  # Delivery.release() services every link again when a hold ends
        now = trio.current_time()
        while self.control:
            fn, args, pipe = self.control.popleft()
            at = now + self.delay()
            if pipe is not None:
                at = max(at, pipe.last_arrival)
                pipe.last_arrival = at
            delivery.at(at, fn, *args)
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
                    delivery.at(at, delivery.arrive_fin, pipe)
                continue
            room = self.spec.window - pipe.outstanding(now)
            if room <= 0:
                # Parked until an acknowledgement returns (timed) or the reader reads (it
                # calls unblock); either may not suffice, and then it parks again.
                pipe.window_blocked = True
                if pipe.acks:
                    delivery.at(pipe.acks[0][0], self.unblock, pipe)
                continue
            # Several segments per window, so a window pipelines instead of stop-and-wait.
            n = min(room, pipe.queued, delivery.segment_size, max(self.spec.window // 8, 1024))
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
            delivery.at(at, delivery.arrive_data, pipe, views, n)
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
            self.delivery.at(at, self._timed_service, at)

    def _timed_service(self, at: float) -> None:
        if at == self.next_service:
            self.next_service = math.inf
        self.service()


class Delivery:
    """The world's links and the arrivals at their ends (see the module docstring).

    ``send_buffer`` is each connection's send buffer (bytes a sender may queue before it
    blocks), ``segment_size`` the largest segment a link transmits at once.  ``tap``, if set,
    observes bytes as hosts send and read them and as links carry them (:mod:`pccl_sim.engine.tap`).
    """

    def __init__(self, *, seed: int, queue: EventQueue, topology: Topology, hosts: Hosts, send_buffer: int,
                 segment_size: int) -> None:
        self.seed = seed
        self.at = queue.at
        self.queue = queue
        self.topology = topology
        self.hosts = hosts
        self.send_buffer = send_buffer
        self.segment_size = segment_size
        self.tap: Any = None
        self.links: dict[tuple[str, str], Link] = {}
        self._uplinks: dict[str, Uplink] = {}
        self._next_socket_id = 0
        topology.subscribe(self._respec)

    def link(self, src: str, dst: str) -> Link:
        """The link ``src→dst`` (made on first use; both hosts must exist)."""
        link = self.links.get((src, dst))
        if link is None:
            spec, site = self.topology.spec_of(src, dst)
            link = Link(self, src, dst, spec, None if site is None else self._uplink(site))
            self.links[(src, dst)] = link
        return link

    def _uplink(self, site: str) -> Uplink:
        bandwidth = self.topology.sites[site].uplink
        uplink = self._uplinks.get(site)
        if uplink is None:
            uplink = self._uplinks[site] = Uplink(self.queue, site, bandwidth)
        else:
            uplink.bandwidth = bandwidth
        return uplink

    def _respec(self) -> None:
        for (src, dst), link in self.links.items():
            spec, site = self.topology.spec_of(src, dst)
            link.spec, link.uplink = spec, None if site is None else self._uplink(site)

    def release(self) -> None:
        """A hold ended (a partition healed, a stall ended): let every link transmit again."""
        for link in list(self.links.values()):
            link.service()

    def silence(self, host: str) -> None:
        """Forget the control packets queued on ``host``'s outbound links (its machine is off:
        nothing leaves it, not even packets queued behind a hold)."""
        for (src, _dst), link in self.links.items():
            if src == host:
                link.control.clear()

    def next_socket_id(self) -> int:
        """A number for a new socket, unique in the world."""
        self._next_socket_id += 1
        return self._next_socket_id

    # -- arrivals (event callbacks) ----------------------------------------------------------

    def arrive_data(self, pipe: Pipe, views: list[memoryview], n: int) -> None:
        dst = pipe.dst
        dst_host = dst.inc.host
        pipe.link.carried += n
        if self.tap is not None:
            self.tap.on_carried(pipe.link.src, pipe.link.dst, n)
        if not dst_host.machine_up or pipe.dead:
            return  # black hole: never acknowledged
        if dst.closed or dst.reset or not dst.inc.alive:
            dst.send_rst()  # the kernel answers data for a socket that is gone
            return
        dst.rbuf.extend(views)
        dst.rbuf_bytes += n
        pipe.arrived += n
        link = pipe.link
        back = link.reverse
        if back is None:
            back = link.reverse = self.link(link.dst, link.src)
        pipe.acks.append((trio.current_time() + back.delay(), pipe.arrived))
        if dst.recv_lot:
            dst.recv_lot.unpark_all()

    def arrive_fin(self, pipe: Pipe) -> None:
        dst = pipe.dst
        if not dst.inc.host.machine_up or pipe.dead:
            return
        dst.eof = True
        if dst.recv_lot:
            dst.recv_lot.unpark_all()

    def arrive_rst(self, target: Endpoint) -> None:
        if not target.inc.host.machine_up:
            return
        target.on_reset()

    def statistics(self) -> dict[str, int]:
        return {
            "links": len(self.links),
            "bytes_carried": sum(link.carried for link in self.links.values()),
        }
