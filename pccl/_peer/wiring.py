"""Setting up the ring connections of each topology round (the p2p side of a topology vote).

Every peer listens on a p2p port (bump-allocated from ``config.p2p_base_port``) and, in each
topology round, connects ``config.p2p_lanes`` lanes to its ring successor and reports the outcome
to the master (``P2PReport``).  A lane is a connection to the successor's p2p port opened over
the pair's path (:mod:`pccl._peer.connector`: direct, dialled back by the successor, or
relayed; handshake with the run token and knock), whose first message is ``P2PHello(round,
lane)``, answered by ``P2PHelloAck``.  The round's connections
live in :class:`~pccl._peer.ring_connections.P2PLinks`.  The master retries failed rounds and in the end
removes the peers that stay unreachable.

Lanes that carry on.  A round usually changes a few edges of the ring (a peer joins or leaves);
the others connect the same two peers again.  A lane whose two ends stay neighbours, with the same
lane count, and whose connection is at rest on this side (no frame under way, nothing unread:
:attr:`~pccl.net.framed.FramedConnection.at_rest`) is *kept*: the dialler sends the new round's
``P2PHello`` on it instead of dialling, and the acceptor, which kept its end for the same reason,
reads that hello from it (the only time anyone reads a ring connection between collectives).
Either side may have dropped its end (an op left a frame torn, or unread data), and then the
other learns it at once from the closed connection: the acceptor's read of a kept lane ends, and
the dialler, whose hello got no ack but a closed connection, dials that lane afresh.  A kept lane
whose successor does not answer within ``connect_timeout`` fails the round as a dial would.
Nothing is kept across masters (:meth:`RingWiring.reset`).

Settings both ends must share.  Every hello carries the dialler's ``Config.all_reduce_algorithm``:
peers with different settings would run different schedules (and a ``"ring"`` peer dials no
partner links that an ``"auto"`` partner would wait for).  The acceptor of a hello that differs
answers ``P2PHelloAck(refused=...)`` naming both settings, and both peers leave the run with
that ``InvalidUsage`` at once (:meth:`PeerHost.leave_lockstep`) instead of failing the round
again and again.  ``Config.p2p_lanes`` differing is a ``ProtocolError`` that fails the round.
"""

from __future__ import annotations

import logging

import trio

from .._groups import single_exception
from ..errors import (
    InvalidUsage,
    PCCLError,
    PeerUnreachable,
    ProtocolError,
    StreamClosed,
    TopologyUpdateFailed,
    TransportError,
)
from ..protocol.codec import MAX_DETAIL, clip_text
from ..net.base import Listener, Stream
from ..net.framed import FramedConnection
from ..net.serving import PEER_LIMITS, HandshakeSlot, RefusalLog, admission_for, serve_listener
from ..protocol import messages as m
from ..protocol.algorithms import link_partner_positions, parse_algorithm
from ..protocol.paths import Port
from ..protocol.sites import check_ring_sites
from .host import PeerHost
from .ring_connections import P2PLinks

__all__ = ["RingWiring"]

log = logging.getLogger(__name__)


class _PartnerUnreachable(PeerUnreachable):
    """A partner link of the round could not be opened (reported to the master as unreachable).
    A pccl error, so that several partners failing at once make no ERROR log line
    (:func:`~pccl._groups.single_exception` logs the leaves it does not raise)."""

    def __init__(self, peer_id: int, error: PCCLError) -> None:
        super().__init__(f"cannot open the partner link to peer {peer_id:x}: {error}")
        self.peer_id = peer_id
        self.error = error


class RingWiring:
    """The p2p listener and the ring connections of the current round, for one session."""

    def __init__(self, host: PeerHost, listener: Listener) -> None:
        self._host = host
        self.listener = listener
        self.links = P2PLinks(0, (0,), 0, host.config.lanes_for())
        algorithm = parse_algorithm(host.config.all_reduce_algorithm)
        #: ``Config.all_reduce_algorithm`` as the hellos carry it (module docstring).
        self._algorithm = "auto" if algorithm is None else algorithm.value
        self._round_scope: trio.CancelScope | None = None
        self._round_changed = trio.Event()
        #: Kept lanes on their way into a round (taken from the old round, not yet in the new
        #: one's links): closing aborts them.  Incoming ones map to the predecessor whose hello
        #: they wait for, outgoing ones (their round's ``_establish`` owns them) to ``None``.
        self._kept: dict[FramedConnection, int | None] = {}
        #: Who gets a handshake slot on the ring port (its counters are read by tests).
        self.admission = admission_for(PEER_LIMITS, wait_timeout=host.config.connect_timeout)
        host.serve_port(Port.P2P, self.accept_lane)

    def reset(self, peer_id: int) -> None:
        """Registered as ``peer_id`` with a master (again): the rounds of an earlier master are
        over; alone in a ring of one until the first round of this one."""
        if self._round_scope is not None:
            self._round_scope.cancel()
        self.close()
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
        try:
            check_ring_sites(msg.ring, msg.sites)
        except ValueError as exc:
            raise ProtocolError(f"the master sent a bad ConnectToPeers (round {msg.round}): {exc}") from None
        if self._round_scope is not None:
            self._round_scope.cancel()
        old = self.links
        lanes = host.config.ring_lanes((f.bandwidth, f.rtt) for f in msg.ring_links)
        links = self.links = P2PLinks(msg.round, tuple(msg.ring), host.peer_id, lanes,
                                      algorithm=parse_algorithm(host.config.all_reduce_algorithm),
                                      sites=tuple(msg.sites))
        # Lanes whose ends stay neighbours carry on (module docstring); the rest close.
        outgoing: list[FramedConnection | None] = []
        incoming: dict[int, FramedConnection] = {}
        if links.successor != host.peer_id:
            outgoing = old.take_outgoing(links.successor, lanes)
            incoming = old.take_incoming(links.predecessor, lanes)
        old.close()
        for conn, neighbour in list(self._kept.items()):
            if neighbour is not None and neighbour != links.predecessor:  # waits for an old neighbour's hello
                del self._kept[conn]
                conn.abort()
        for lane_conn in outgoing:
            if lane_conn is not None:
                self._kept[lane_conn] = None
        host.counters.p2p_rounds += 1
        self._round_changed.set()
        self._round_changed = trio.Event()
        self._round_scope = trio.CancelScope()
        endpoints = {e.peer_id: e for e in msg.neighbours}
        for lane, conn in incoming.items():
            self._kept[conn] = links.predecessor
            host.spawn(self._await_hello, conn, lane)
        host.spawn(self._establish, links, self._round_scope, endpoints, epoch, outgoing)

    def close(self) -> None:
        self.links.close()
        kept, self._kept = self._kept, {}
        for conn in kept:
            conn.abort()

    async def _establish(self, links: P2PLinks, scope: trio.CancelScope, endpoints: dict[int, m.PeerEndpoint],
                         epoch: int, kept: list[FramedConnection | None]) -> None:
        host = self._host
        dialled: list[FramedConnection | None] = [None] * links.lanes
        for lane, conn in enumerate(kept):
            self._kept.pop(conn, None)  # type: ignore[arg-type]
            dialled[lane] = conn  # the error paths below abort it
        with scope:
            ok = True
            unreachable: tuple[int, ...] = ()
            detail = ""
            partners: list[_PartnerUnreachable] = []
            try:
                async with trio.open_nursery() as nursery:
                    # The partner links are dialled beside the lanes: a round waits for one dial.
                    nursery.start_soon(self._partners_outcome, links, endpoints, partners)
                    lanes = await self._connect_successor(links, endpoints, dialled)
            except BaseExceptionGroup as group:
                raise single_exception(group) from None
            if links is not self.links:
                return
            if lanes is not None:
                ok, unreachable, detail = False, *lanes
            elif partners:
                failure = partners[0]
                log.info("peer %x: cannot connect to partner %x in round %d: %s",
                         host.peer_id, failure.peer_id, links.round, failure.error)
                ok, unreachable, detail = False, (failure.peer_id,), clip_text(str(failure.error), MAX_DETAIL)
            try:
                await host.send(m.P2PReport(links.round, ok, unreachable, detail), epoch=epoch, schedule_point=False)
            except PCCLError:
                pass  # the communicator failed, or the master of this round is gone

    async def _connect_successor(self, links: P2PLinks, endpoints: dict[int, m.PeerEndpoint],
                                 dialled: list[FramedConnection | None]) -> tuple[tuple[int, ...], str] | None:
        """Connect the round's lanes to the successor (the kept ones in ``dialled``); ``None``
        when done (or alone, or the round is over), else what the report says is unreachable."""
        host = self._host
        succ = links.successor
        if succ == host.peer_id:
            return None
        try:
            endpoint = endpoints.get(succ)
            if endpoint is None:
                raise ProtocolError(f"the master sent no endpoint for ring successor {succ:x}")
            try:
                async with trio.open_nursery() as nursery:
                    for lane in range(links.lanes):
                        nursery.start_soon(self._connect_lane, endpoint, links, lane, dialled)
            except BaseExceptionGroup as group:
                raise single_exception(group) from None
        except PCCLError as error:
            for conn in dialled:
                if conn is not None:
                    conn.abort()
            log.info("peer %x: cannot connect to ring successor %x in round %d: %s",
                     host.peer_id, succ, links.round, error)
            return (succ,), clip_text(str(error), MAX_DETAIL)
        except BaseException:
            for conn in dialled:
                if conn is not None:
                    conn.abort()
            raise
        if links is not self.links:
            for conn in dialled:
                conn.abort()  # type: ignore[union-attr]
            return None
        links.add_outgoing(succ, tuple(dialled))  # type: ignore[arg-type]
        return None

    async def _partners_outcome(self, links: P2PLinks, endpoints: dict[int, m.PeerEndpoint],
                                failures: list[_PartnerUnreachable]) -> None:
        try:
            await self._connect_partners(links, endpoints)
        except _PartnerUnreachable as failure:
            failures.append(failure)

    async def _connect_partners(self, links: P2PLinks, endpoints: dict[int, m.PeerEndpoint]) -> None:
        """Dial the round's partner links this peer owes (to its partners at higher ring
        positions; the lower position of each pair dials), all at once.  Partner links are not
        kept across rounds.  ``_PartnerUnreachable`` names the first partner that failed."""
        host = self._host
        ring = links.ring
        me = ring.index(host.peer_id)
        owed = [ring[p] for p in link_partner_positions(me, len(ring), links.algorithm, links.sites) if p > me]
        if not owed:
            return
        dialled: dict[int, FramedConnection] = {}

        async def dial(peer_id: int) -> None:
            try:
                endpoint = endpoints.get(peer_id)
                if endpoint is None:
                    raise ProtocolError(f"the master sent no endpoint for partner {peer_id:x}")
                conn = await host.open_peer(endpoint, Port.P2P)
                host.counters.p2p_partner_dials += 1
                dialled[peer_id] = conn
                with trio.fail_after(host.config.connect_timeout):
                    await conn.send(m.P2PHello(host.peer_id, links.round, 0, links.lanes, host.master_instance,
                                               partner=True, algorithm=self._algorithm))
                    ack = await conn.receive()
                self._raise_if_refused(ack, peer_id)
                if not isinstance(ack, m.P2PHelloAck) or ack.peer_id != peer_id or ack.round != links.round:
                    raise ProtocolError(f"partner {peer_id:x} answered the p2p hello with {ack!r}")
            except trio.TooSlowError:
                raise _PartnerUnreachable(peer_id, ProtocolError("no answer to the partner hello")) from None
            except PCCLError as error:
                raise _PartnerUnreachable(peer_id, error) from None

        try:
            try:
                async with trio.open_nursery() as nursery:
                    for peer_id in owed:
                        nursery.start_soon(dial, peer_id)
            except BaseExceptionGroup as group:
                raise single_exception(group) from None
        except BaseException:
            for conn in dialled.values():
                conn.abort()
            raise
        if links is not self.links:
            for conn in dialled.values():
                conn.abort()
            return
        for peer_id, conn in dialled.items():
            links.add_partner(peer_id, conn)

    async def _connect_lane(self, endpoint: m.PeerEndpoint, links: P2PLinks, lane: int,
                            dialled: list[FramedConnection | None]) -> None:
        """Lane ``lane`` to the successor: the kept connection in ``dialled[lane]`` if the
        successor takes it into this round, else a new one."""
        kept = dialled[lane]
        if kept is not None:
            if await self._hello_on_kept(kept, endpoint, links, lane):
                self._host.counters.p2p_lanes_kept += 1
                return
            dialled[lane] = None
        await self._dial_lane(endpoint, links, lane, dialled)

    async def _hello_on_kept(self, conn: FramedConnection, endpoint: m.PeerEndpoint, links: P2PLinks,
                             lane: int) -> bool:
        """Send this round's hello on a lane kept from the last round.  ``True``: the successor
        acknowledged it.  ``False`` (connection aborted): the successor had dropped its end, or
        the connection failed; dial afresh.  ``ProtocolError`` when no answer comes within
        ``connect_timeout`` (the successor is stalled or gone: dialling would wait as long)."""
        host = self._host
        try:
            with trio.fail_after(host.config.connect_timeout):
                await conn.send(m.P2PHello(host.peer_id, links.round, lane, links.lanes, host.master_instance,
                                           algorithm=self._algorithm))
                ack = await conn.receive()
        except trio.TooSlowError:
            conn.abort()
            raise ProtocolError(f"ring successor {endpoint.peer_id:x} did not acknowledge the p2p hello on kept "
                                f"lane {lane}") from None
        except PCCLError as exc:
            log.debug("peer %x: kept lane %d to %x is gone (%s); dialling it afresh", host.peer_id, lane,
                      endpoint.peer_id, exc)
            conn.abort()
            return False
        except BaseException:
            conn.abort()
            raise
        if not isinstance(ack, m.P2PHelloAck) or ack.peer_id != endpoint.peer_id or ack.round != links.round \
                or ack.refused:
            conn.abort()
            self._raise_if_refused(ack, endpoint.peer_id)
            raise ProtocolError(f"ring successor {endpoint.peer_id:x} answered the p2p hello on kept lane {lane} "
                                f"with {ack!r}")
        return True

    async def _dial_lane(self, endpoint: m.PeerEndpoint, links: P2PLinks, lane: int,
                         dialled: list[FramedConnection | None]) -> None:
        host = self._host
        conn = await host.open_peer(endpoint, Port.P2P)
        host.counters.p2p_dials += 1
        dialled[lane] = conn
        try:
            with trio.fail_after(host.config.connect_timeout):
                await conn.send(m.P2PHello(host.peer_id, links.round, lane, links.lanes, host.master_instance,
                                           algorithm=self._algorithm))
                ack = await conn.receive()
        except trio.TooSlowError:
            raise ProtocolError(f"ring successor {endpoint.peer_id:x} did not acknowledge the p2p hello") from None
        self._raise_if_refused(ack, endpoint.peer_id)
        if not isinstance(ack, m.P2PHelloAck) or ack.peer_id != endpoint.peer_id or ack.round != links.round:
            raise ProtocolError(f"ring successor {endpoint.peer_id:x} answered the p2p hello with {ack!r}")

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
        await self._host.accept_peer(stream, slot, Port.P2P)

    async def accept_lane(self, conn: FramedConnection, slot: HandshakeSlot | None) -> None:
        """Serve a connection knocked for this peer's p2p port (accepted, dialled back, or
        relayed): a ring lane (``P2PHello``), a bandwidth probe (``ProbeHello``) or a
        point-to-point connection (``PointHello``, :mod:`pccl._peer.point`).  An accepted
        connection keeps its slot (pccl.net.serving) until it delivered a hello that fits this
        peer's ring: without a run token the handshake alone proves little."""
        host = self._host
        held: FramedConnection | None = conn
        try:
            with trio.fail_after(host.config.connect_timeout):
                hello = await conn.receive()
                if not isinstance(hello, (m.P2PHello, m.ProbeHello, m.PointHello)):
                    raise ProtocolError(f"expected P2PHello, got {type(hello).__name__}")
                while isinstance(hello, m.P2PHello) and self.links.round < hello.round:  # the dialler may be ahead
                    await self._round_changed.wait()
            if isinstance(hello, m.ProbeHello):  # a bandwidth probe (pccl._peer.probes), not a ring lane
                self._check_instance(hello)
                if slot is not None:
                    slot.release()
                held = None
                await host.serve_probe(conn, hello)
                return
            if isinstance(hello, m.PointHello):  # another peer's sends to this one (pccl._peer.point)
                self._check_instance(hello)
                if slot is not None:
                    slot.release()
                held = None
                await host.serve_point(conn, hello)
                return
            self._check_instance(hello)
            await self._refuse_if_mismatched(conn, hello)
            if hello.partner:
                links = self._check_partner_hello(hello)
                if slot is not None:
                    slot.release()
                await self._add_partner(links, conn, hello)
                return
            links = self._check_hello(hello)
            if slot is not None:
                slot.release()
            await self._add_lane(links, conn, hello)
        except (PCCLError, trio.TooSlowError) as exc:
            reason = f"no P2PHello within {host.config.connect_timeout:g} s" if isinstance(exc, trio.TooSlowError) else exc
            if slot is not None:
                slot.refuse(reason)
            else:
                log.info("peer %x: a ring connection from %s was not taken: %s", host.peer_id, conn.remote_address,
                         reason)
            conn.abort()
        except BaseException:
            if held is not None:  # cancelled while pending: close now, not when the GC gets to it
                held.abort()
            raise

    async def _await_hello(self, conn: FramedConnection, lane: int) -> None:
        """Read the predecessor's hello for the new round from lane ``lane`` kept from the last
        round (module docstring), and take the lane into the round it names.  Anything else —
        a closed connection (the dialler dials afresh), a data frame an aborted op left, no hello
        within ``connect_timeout`` — drops the lane."""
        host = self._host
        try:
            with trio.fail_after(host.config.connect_timeout):
                hello = await conn.receive()
                if not isinstance(hello, m.P2PHello) or hello.lane != lane:
                    raise ProtocolError(f"expected the P2PHello of kept lane {lane}, got {hello!r}")
                while self.links.round < hello.round:  # the dialler may be ahead
                    await self._round_changed.wait()
            if self._kept.pop(conn, False) is False:
                raise ProtocolError("the lane was dropped meanwhile")  # a later round closed it
            await self._refuse_if_mismatched(conn, hello)
            await self._add_lane(self._check_hello(hello), conn, hello)
        except (PCCLError, trio.TooSlowError) as exc:
            # A closed connection is the dialler dialling afresh: expected.  Anything else (a
            # frame other than the hello, no hello in time) is worth a line.
            level = logging.DEBUG if isinstance(exc, TransportError) else logging.INFO
            log.log(level, "peer %x: kept lane %d from %s dropped: %s", host.peer_id, lane, conn.remote_address,
                    "no hello in time" if isinstance(exc, trio.TooSlowError) else exc)
            self._kept.pop(conn, None)
            conn.abort()
        except BaseException:
            self._kept.pop(conn, None)
            conn.abort()
            raise

    def _check_instance(self, hello: m.P2PHello | m.ProbeHello | m.PointHello) -> None:
        host = self._host
        if hello.instance != host.master_instance:
            raise ProtocolError(f"p2p hello from peer {hello.peer_id:x} for a round of another master "
                                f"(instance {hello.instance:x}, this peer's master is {host.master_instance:x})")

    async def _refuse_if_mismatched(self, conn: FramedConnection, hello: m.P2PHello) -> None:
        """A hello whose ``Config.all_reduce_algorithm`` differs from this peer's: answer with the
        refusal and leave the run with ``InvalidUsage`` naming both settings (module docstring)."""
        if hello.algorithm == self._algorithm:
            return
        host = self._host
        text = (f"peer {hello.peer_id:x} uses Config.all_reduce_algorithm={clip_text(hello.algorithm, 40)!r} and peer "
                f"{host.peer_id:x} uses {self._algorithm!r}: every peer of a run must use the same setting")
        with trio.move_on_after(host.config.connect_timeout):
            try:
                await conn.send(m.P2PHelloAck(host.peer_id, hello.round, refused=text))
            except PCCLError:
                pass  # the dialler learns it from the closed connection's failed rounds
        error = InvalidUsage(text)
        host.leave_lockstep(error)
        raise error

    def _raise_if_refused(self, ack: m.Message, peer_id: int) -> None:
        """The acceptor refused the hello for a setting the two peers do not share: leave the
        run with ``InvalidUsage`` saying why (module docstring)."""
        if isinstance(ack, m.P2PHelloAck) and ack.refused:
            error = InvalidUsage(f"peer {peer_id:x} refused this peer's ring connection: "
                                 f"{clip_text(ack.refused, MAX_DETAIL)}")
            self._host.leave_lockstep(error)
            raise error

    def _check_hello(self, hello: m.P2PHello) -> P2PLinks:
        """The current round's links if ``hello`` is a lane this peer expects in it, else
        ``ProtocolError``."""
        self._check_instance(hello)
        links = self.links
        if hello.round != links.round or hello.peer_id != links.predecessor or hello.peer_id == self._host.peer_id:
            raise ProtocolError(f"unexpected p2p hello from peer {hello.peer_id:x} for round {hello.round} "
                                f"(current round {links.round})")
        if hello.lanes != links.lanes or not 0 <= hello.lane < links.lanes:
            raise ProtocolError(f"peer {hello.peer_id:x} dials lane {hello.lane} of {hello.lanes}, this peer "
                                f"uses {links.lanes} lanes (Config.p2p_lanes must match)")
        return links

    def _check_partner_hello(self, hello: m.P2PHello) -> P2PLinks:
        """The current round's links if ``hello`` is a partner link this peer expects in it (from
        a partner at a lower ring position), else ``ProtocolError``."""
        self._check_instance(hello)
        links = self.links
        ring, me = links.ring, self._host.peer_id
        expected: tuple[int, ...] = ()
        if hello.round == links.round and me in ring and hello.peer_id in ring:
            mine = ring.index(me)
            expected = tuple(ring[p] for p in link_partner_positions(mine, len(ring), links.algorithm, links.sites)
                             if p < mine)
        if hello.peer_id not in expected:
            raise ProtocolError(f"unexpected partner hello from peer {hello.peer_id:x} for round {hello.round} "
                                f"(current round {links.round})")
        return links

    async def _add_partner(self, links: P2PLinks, conn: FramedConnection, hello: m.P2PHello) -> None:
        links.add_partner(hello.peer_id, conn)  # before the ack, as a lane (_add_lane)
        try:
            await conn.send(m.P2PHelloAck(self._host.peer_id, hello.round))
        except BaseException:
            links.remove_partner(hello.peer_id, conn)
            raise

    async def _add_lane(self, links: P2PLinks, conn: FramedConnection, hello: m.P2PHello) -> None:
        # Register before acknowledging: once the dialler has its ack it reports success, and
        # the round may complete at once; the connection must be in place by then.
        links.add_incoming(hello.peer_id, hello.lane, conn)
        try:
            await conn.send(m.P2PHelloAck(self._host.peer_id, hello.round))
        except BaseException:
            links.remove_incoming(hello.peer_id, hello.lane, conn)
            raise
