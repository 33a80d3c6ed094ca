"""Setting up the ring connections of each topology round (the p2p side of a topology vote).

Every peer listens on a p2p port (bump-allocated from ``config.p2p_base_port``) and, in each
topology round, dials its ring successor ``config.p2p_lanes`` times (framed handshake with the run
token, then ``P2PHello``/``P2PHelloAck`` per lane) and reports the outcome to the master
(``P2PReport``).  The round's connections live in :class:`~pccl._peer.links.P2PLinks`; a new
round closes the old round's connections.  The master retries failed rounds and in the end
removes the peers that stay unreachable.
"""

from __future__ import annotations

import logging

import trio

from .._groups import single_exception
from ..errors import PCCLError, ProtocolError, StreamClosed, TopologyUpdateFailed, TransportError
from ..net.base import Listener, Stream, format_address
from ..net.framed import FramedConnection
from ..net.serving import PEER_LIMITS, HandshakeSlot, RefusalLog, admission_for, serve_listener
from ..protocol import messages as m
from .host import PeerHost
from .links import P2PLinks

__all__ = ["RingWiring"]

log = logging.getLogger(__name__)


class RingWiring:
    """The p2p listener and the ring connections of the current round, for one session."""

    def __init__(self, host: PeerHost, listener: Listener) -> None:
        self._host = host
        self.listener = listener
        self.links = P2PLinks(0, (0,), 0, host.config.lanes_for())
        self._round_scope: trio.CancelScope | None = None
        self._round_changed = trio.Event()
        #: Who gets a handshake slot on the ring port (its counters are read by tests).
        self.admission = admission_for(PEER_LIMITS, wait_timeout=host.config.connect_timeout)

    def reset(self, peer_id: int) -> None:
        """Registered as ``peer_id`` with a master (again): the rounds of an earlier master are
        over; alone in a ring of one until the first round of this one."""
        if self._round_scope is not None:
            self._round_scope.cancel()
        self.links.close()
        self.links = P2PLinks(0, (peer_id,), peer_id, self._host.config.lanes_for())
        self._round_changed.set()
        self._round_changed = trio.Event()

    def start_round(self, msg: m.ConnectToPeers, epoch: int) -> None:
        """The master's ``ConnectToPeers`` (master epoch ``epoch``): drop the old round's
        connections, dial the new successor in the background.  ``ProtocolError`` for a stale
        or foreign round."""
        host = self._host
        if msg.round <= self.links.round or host.peer_id not in msg.ring:
            raise ProtocolError(f"the master sent a bad ConnectToPeers (round {msg.round})")
        if self._round_scope is not None:
            self._round_scope.cancel()
        self.links.close()
        lanes = host.config.ring_lanes((f.bandwidth, f.rtt) for f in msg.ring_links)
        self.links = P2PLinks(msg.round, tuple(msg.ring), host.peer_id, lanes)
        host.counters.p2p_rounds += 1
        self._round_changed.set()
        self._round_changed = trio.Event()
        self._round_scope = trio.CancelScope()
        endpoints = {e.peer_id: e for e in msg.neighbours}
        host.spawn(self._establish, self.links, self._round_scope, endpoints, epoch)

    def close(self) -> None:
        self.links.close()

    async def _establish(self, links: P2PLinks, scope: trio.CancelScope, endpoints: dict[int, m.PeerEndpoint],
                         epoch: int) -> None:
        host = self._host
        with scope:
            ok = True
            unreachable: tuple[int, ...] = ()
            succ = links.successor
            if succ != host.peer_id:
                dialled: list[FramedConnection | None] = [None] * links.lanes
                try:
                    endpoint = endpoints.get(succ)
                    if endpoint is None:
                        raise ProtocolError(f"the master sent no endpoint for ring successor {succ:x}")
                    try:
                        async with trio.open_nursery() as nursery:
                            for lane in range(links.lanes):
                                nursery.start_soon(self._dial_lane, endpoint, links, lane, dialled)
                    except BaseExceptionGroup as group:
                        raise single_exception(group) from None
                except PCCLError as error:
                    for conn in dialled:
                        if conn is not None:
                            conn.abort()
                    log.info("peer %x: cannot connect to ring successor %x in round %d: %s",
                             host.peer_id, succ, links.round, error)
                    ok, unreachable = False, (succ,)
                except BaseException:
                    for conn in dialled:
                        if conn is not None:
                            conn.abort()
                    raise
                else:
                    if links is not self.links:
                        for conn in dialled:
                            conn.abort()  # type: ignore[union-attr]
                        return
                    links.add_outgoing(succ, tuple(dialled))  # type: ignore[arg-type]
            try:
                await host.send(m.P2PReport(links.round, ok, unreachable), epoch=epoch)
            except PCCLError:
                pass  # the communicator failed, or the master of this round is gone

    async def _dial_lane(self, endpoint: m.PeerEndpoint, links: P2PLinks, lane: int,
                         dialled: list[FramedConnection | None]) -> None:
        host = self._host
        address = format_address(endpoint.host, endpoint.p2p_port)
        conn = await host.dial(address)
        dialled[lane] = conn
        try:
            with trio.fail_after(host.config.connect_timeout):
                await conn.send(m.P2PHello(host.peer_id, links.round, lane, links.lanes, host.master_instance))
                ack = await conn.receive()
        except trio.TooSlowError:
            raise ProtocolError(f"{address} did not acknowledge the p2p hello") from None
        if not isinstance(ack, m.P2PHelloAck) or ack.peer_id != endpoint.peer_id or ack.round != links.round:
            raise ProtocolError(f"{address} answered the p2p hello with {ack!r}")

    async def serve(self) -> None:
        """Accept the ring connections other peers dial (run in the session's nursery).

        A listener that fails for good (``StreamClosed`` is the session closing it; running out
        of descriptors is waited out inside ``accept``) means this peer can never be wired into
        a ring again: it leaves the run at once with ``TopologyUpdateFailed`` rather than stall
        every topology round until the master gives up on it (``P2P_UNREACHABLE``)."""
        def failed(exc: TransportError) -> None:
            if isinstance(exc, StreamClosed):
                return
            log.error("peer %x: p2p listener failed, accepting no more ring connections: %s",
                      self._host.peer_id, exc)
            error = TopologyUpdateFailed(f"this peer's p2p listener failed ({exc}); it cannot be wired into "
                                         "a ring and left the run")
            error.__cause__ = exc
            self._host.leave_lockstep(error)

        await serve_listener(self.listener, self._accept, on_error=failed, admission=self.admission,
                             refusals=RefusalLog(f"peer {self._host.peer_id:x} ring port", logger=log))

    async def _accept(self, stream: Stream, slot: HandshakeSlot) -> None:
        # The connection keeps its slot (pccl.net.serving) until it delivered a hello that fits
        # this peer's ring: without a run token the handshake alone proves nothing.
        host = self._host
        conn: FramedConnection | None = None
        try:
            conn = await host.accept(stream)
            with trio.fail_after(host.config.connect_timeout):
                hello = await conn.receive()
                if not isinstance(hello, (m.P2PHello, m.ProbeHello)):
                    raise ProtocolError(f"expected P2PHello, got {type(hello).__name__}")
                while isinstance(hello, m.P2PHello) and self.links.round < hello.round:  # the dialler may be ahead
                    await self._round_changed.wait()
            if hello.instance != host.master_instance:
                raise ProtocolError(f"p2p hello from peer {hello.peer_id:x} for a round of another master "
                                    f"(instance {hello.instance:x}, this peer's master is {host.master_instance:x})")
            if isinstance(hello, m.ProbeHello):  # a bandwidth probe (pccl.topology), not a ring lane
                slot.release()
                probe_conn, conn = conn, None
                await host.serve_probe(probe_conn, hello)
                return
            links = self.links
            if hello.round != links.round or hello.peer_id != links.predecessor or hello.peer_id == host.peer_id:
                raise ProtocolError(f"unexpected p2p hello from peer {hello.peer_id:x} for round {hello.round} "
                                    f"(current round {links.round})")
            if hello.lanes != links.lanes or not 0 <= hello.lane < links.lanes:
                raise ProtocolError(f"peer {hello.peer_id:x} dials lane {hello.lane} of {hello.lanes}, this peer "
                                    f"uses {links.lanes} lanes (Config.p2p_lanes must match)")
            slot.release()
            # Register before acknowledging: once the dialler has its ack it reports success, and
            # the round may complete at once; the connection must be in place by then.
            links.add_incoming(hello.peer_id, hello.lane, conn)
            try:
                await conn.send(m.P2PHelloAck(host.peer_id, hello.round))
            except BaseException:
                links.remove_incoming(hello.peer_id, hello.lane, conn)
                raise
        except (PCCLError, trio.TooSlowError) as exc:
            slot.refuse(f"no P2PHello within {host.config.connect_timeout:g} s"
                        if isinstance(exc, trio.TooSlowError) else exc)
            if conn is not None:
                conn.abort()
        except BaseException:
            if conn is not None:  # cancelled while pending: close now, not when the GC gets to it
                conn.abort()
            raise
