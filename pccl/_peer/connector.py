"""Connections between peers over whatever path works: direct, dialled back, or relayed.

The rules (candidates, dial order, paths) are :mod:`pccl.protocol.paths`'; the master's side of
dial-backs and relay offers is :mod:`pccl.protocol.master.paths`.  This module is the peer's:

* :meth:`Connector.open` gives a service (ring wiring, a state fetch, a probe) an authenticated
  connection to another peer's listener of a :class:`~pccl.protocol.paths.Port`, on which this
  side speaks first, whoever dialled the TCP connection.  The pair's path is kept from the last
  time (:attr:`Connector.paths`) and used within ``Config.connect_timeout``, as a plain dial
  would be; when it fails, that connection fails (the peer is most likely dead or stalled) and
  the path is forgotten.  Without a path it is negotiated: the target's candidates are raced
  (:func:`race`, within ``Config.direct_connect_timeout``), then the master is asked for a
  dial-back, then for a relay (avoiding one the pair's last path failed at) — each step when the
  previous one failed, all of it within :meth:`Connector.open_bound`.  ``PeerUnreachable`` says
  what every step met.  Concurrent opens of one pair and port wait for one negotiation.
* :meth:`Connector.accept` is the accept handler of both listeners: after the framed handshake
  the first message is a ``Knock`` (a direct dial; handed to the port's handler, see
  :meth:`Connector.set_handler`), a ``ReverseHello`` (the dial-back this peer asked for: handed
  to the waiting :meth:`open`), or a ``Register`` (someone took this port for the master's: told
  so).
* The master's ``DialRequest`` makes this peer dial the requester back; its ``RelayOffer`` makes
  it meet a partner at a relay, as the opener (its :meth:`open` waits for it) or as the side that
  answers (the connection goes to the port's handler, as an accepted one would).

Every connection starts with ``Knock`` → ``KnockAck`` (or ``ReverseHello`` → ``KnockAck``), so
a dialler knows it reached the peer it wants; then the service's own first message follows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import trio

from ..errors import PCCLError, PeerUnreachable, ProtocolError
from ..net.base import Stream
from ..net.framed import FramedConnection
from ..net.serving import HandshakeSlot
from ..protocol import messages as m
from ..protocol.codec import MAX_DETAIL, clip_text
from ..protocol.paths import (STAGGER, CandidateOrigin, Dial, PathKind, Port, describe_port, dial_order,
                              relayed_via)
from .host import PeerHost
from .master_link import refuse_registration

__all__ = ["Connector", "Path", "AcceptHandler", "race", "RaceFailed"]

log = logging.getLogger(__name__)

#: A listener port's handler for a connection whose knock it accepted (or one dialled back or
#: relayed for it): reads the service's first message, serves, closes the connection.  ``slot``
#: is the accept slot to release once the connection proved itself (``None``: not accepted by a
#: listener).
AcceptHandler = Callable[[FramedConnection, "HandshakeSlot | None"], Awaitable[None]]

#: Which knocks each listener takes.
_SERVED_BY = {Port.P2P: (Port.P2P, Port.BENCHMARK), Port.SHARED_STATE: (Port.SHARED_STATE,)}

T = TypeVar("T")
L = TypeVar("L")


class RaceFailed(PCCLError, Generic[L]):
    """Every attempt of :func:`race` failed; :attr:`failures` holds (label, reason) in order."""

    def __init__(self, failures: list[tuple[L, str]]) -> None:
        self.failures = failures
        super().__init__("; ".join(f"{label}: {reason}" for label, reason in failures) or "nothing to try")


async def race(attempts: Sequence[tuple[L, Callable[[], Awaitable[T]]]], *, stagger: float, limit: float,
               discard: Callable[[T], None]) -> tuple[T, L]:
    """Happy Eyeballs (RFC 8305): start the attempts in order, each when the one before failed or
    had ``stagger`` seconds alone; the first to succeed wins, the others are cancelled (a result
    that comes in after the winner is passed to ``discard``).  Everything ends within ``limit``
    seconds.  ``RaceFailed`` when no attempt succeeded, with each attempt's ``PCCLError`` (or
    "no answer within ..." for those the limit cut short)."""
    winner: tuple[T, L] | None = None
    failures: dict[int, str] = {}
    started: list[int] = []

    async def run(index: int, attempt: Callable[[], Awaitable[T]], failed: trio.Event,
                  nursery: trio.Nursery) -> None:
        nonlocal winner
        try:
            result = await attempt()
        except PCCLError as exc:
            failures[index] = str(exc)
            failed.set()
            return
        if winner is None:
            winner = (result, attempts[index][0])
            nursery.cancel_scope.cancel()
        else:
            discard(result)

    with trio.move_on_after(limit):
        async with trio.open_nursery() as nursery:
            for index, (_label, attempt) in enumerate(attempts):
                failed = trio.Event()
                started.append(index)
                nursery.start_soon(run, index, attempt, failed, nursery)
                with trio.move_on_after(stagger):
                    await failed.wait()
                if winner is not None:
                    break
    if winner is not None:
        return winner
    for index in started:
        failures.setdefault(index, f"no answer within {limit:g} s")
    raise RaceFailed([(attempts[i][0], failures[i]) for i in sorted(failures)])


@dataclasses.dataclass
class Path:
    """The path this peer's connections of one port to one target take (see
    :mod:`pccl.protocol.paths`): ``via`` is the address dialled, or the relay's."""

    kind: PathKind
    via: str = ""
    relay: int | None = None
    #: The master epoch it was last reported in (a new master hears it at its next use).
    reported_epoch: int = -1


@dataclasses.dataclass(eq=False)
class _Pending:
    """An :meth:`Connector.open` waiting for the master's answer to its ``PathRequest``."""

    request: int
    target: int
    port: Port
    send: trio.MemorySendChannel[object]
    receive: trio.MemoryReceiveChannel[object]


@dataclasses.dataclass(frozen=True)
class _Arrived:
    conn: FramedConnection


@dataclasses.dataclass(frozen=True)
class _Unavailable:
    detail: str


class Connector:
    """One peer's connections to the others (see the module docstring)."""

    def __init__(self, host: PeerHost) -> None:
        self._host = host
        self._handlers: dict[Port, AcceptHandler] = {}
        #: (target, port) -> the path this peer's connections take.
        self.paths: dict[tuple[int, Port], Path] = {}
        self._pending: dict[int, _Pending] = {}
        self._negotiating: dict[tuple[int, Port], trio.Event] = {}
        #: A relay a pair's last path failed at, avoided by its next negotiation.
        self._avoid: dict[tuple[int, Port], int] = {}
        self._next_request = 1
        #: (requester, detail) pairs already warned about (a misconfigured advertisement).
        self._warned: set[str] = set()

    def set_handler(self, port: Port, handler: AcceptHandler) -> None:
        """Serve the connections for ``port`` (a service's side of its accepted connections)."""
        self._handlers[port] = handler

    def open_bound(self) -> float:
        """How long one :meth:`open` may take: the candidates, a dial-back and a relay."""
        config = self._host.config
        return config.connect_timeout + 3 * config.direct_connect_timeout

    def reset(self) -> None:
        """A new master epoch: attempts of the old master end, relayed paths are forgotten (relay
        ids are the master's), the others are reported again at their next use."""
        for pending in list(self._pending.values()):
            try:
                pending.send.send_nowait(_Unavailable("the master was lost"))
            except (trio.WouldBlock, trio.ClosedResourceError):
                pass
        self._avoid.clear()
        for key in [k for k, p in self.paths.items() if p.kind is PathKind.RELAYED]:
            del self.paths[key]
        for path in self.paths.values():
            path.reported_epoch = -1

    def forget(self, peer_id: int) -> None:
        """Forget the paths to ``peer_id`` (it left the run)."""
        for key in [k for k in self.paths if k[0] == peer_id]:
            del self.paths[key]

    # --- opening -------------------------------------------------------------------------------

    async def open(self, target: m.PeerEndpoint, port: Port) -> FramedConnection:
        """An authenticated connection to ``target``'s listener for ``port``, on which this side
        speaks first.  ``PeerUnreachable`` when no path works (saying what each step met),
        ``MasterLost``/the communicator's failure when the master goes meanwhile.
        Cancellation closes what was half made."""
        host = self._host
        key = (target.peer_id, port)
        while key in self._negotiating:  # another open negotiates this pair: use its outcome
            await self._negotiating[key].wait()
        path = self.paths.get(key)
        if path is not None:
            # A path that worked fails now: most likely the peer died or stalled (a plain dial
            # would fail as fast), seldom the network changed.  This connection fails; the next
            # one negotiates afresh, avoiding a relay that failed.
            try:
                conn, kind, via, relay = await self._over(path, target, port,
                                                          trio.current_time() + host.config.connect_timeout)
            except PCCLError as exc:
                if self.paths.get(key) is path:
                    del self.paths[key]
                    if path.relay is not None:
                        self._avoid[key] = path.relay
                log.info("peer %x: the %s path of %s connections to peer %x failed (%s); the next connection "
                         "finds another", host.peer_id, path.kind.name.lower(), describe_port(port), target.peer_id,
                         exc)
                raise PeerUnreachable(f"peer {target.peer_id:x}'s {path.kind.name.lower()} path failed: {exc}") from exc
            if kind is not path.kind or via != path.via:
                self._decided(key, Path(kind, via, relay), 0)
            elif path.reported_epoch != host.master_epoch:
                self._report(key, path, 0)
            return conn
        done = self._negotiating[key] = trio.Event()
        try:
            avoid = {self._avoid.pop(key)} if key in self._avoid else set()
            return await self._negotiate(target, port, trio.current_time() + self.open_bound(), [], avoid)
        finally:
            del self._negotiating[key]
            done.set()

    async def _over(self, path: Path, target: m.PeerEndpoint, port: Port,
                    deadline: float) -> tuple[FramedConnection, PathKind, str, int | None]:
        """A connection over a path kept from before (a reversed or relayed path asks the master
        again: each connection needs its own dial-back or rendezvous)."""
        if path.kind is PathKind.DIRECT:
            dial = Dial(*_split(path.via), CandidateOrigin.OBSERVED)
            with trio.move_on_at(deadline) as scope:
                conn = await self._knock(dial, target, port)
            if scope.cancelled_caught:
                raise PeerUnreachable(f"{path.via} did not answer within {self._host.config.connect_timeout:g} s")
            return conn, PathKind.DIRECT, path.via, None
        return await self._ask_master(target, port, deadline, relay_only=path.kind is PathKind.RELAYED,
                                      avoid=set(), detail="")

    async def _negotiate(self, target: m.PeerEndpoint, port: Port, deadline: float, failures: list[str],
                         avoid: set[int]) -> FramedConnection:
        host = self._host
        key = (target.peer_id, port)
        dials = dial_order(target, port, own_public_host=host.observed_host)
        attempts = [(dial, _bind(self._knock, dial, target, port)) for dial in dials]
        try:
            conn, dial = await race(attempts, stagger=STAGGER,
                                    limit=min(host.config.direct_connect_timeout, deadline - trio.current_time()),
                                    discard=_abort)
        except RaceFailed as exc:
            tried = "; ".join(f"{d.describe()}: {why}" for d, why in exc.failures) or "it has no candidates"
            failures.append(f"direct: {tried}")
        else:
            self._decided(key, Path(PathKind.DIRECT, dial.address), 0)
            return conn
        detail = clip_text("; ".join(failures), MAX_DETAIL)
        conn, kind, via, relay = await self._ask_master(target, port, deadline, relay_only=False, avoid=avoid,
                                                        detail=detail)
        self._decided(key, Path(kind, via, relay), 0)
        return conn

    async def _knock(self, dial: Dial, target: m.PeerEndpoint, port: Port) -> FramedConnection:
        """Dial ``dial``, run the handshake, and knock for ``target``'s ``port``."""
        host = self._host
        conn = await host.dial(dial.address)
        try:
            with trio.fail_after(host.config.connect_timeout):
                await conn.send(m.Knock(host.peer_id, target.peer_id, host.master_instance, int(port)))
                ack = await conn.receive()
            _check_ack(ack, target.peer_id, f"{dial.address}")
        except trio.TooSlowError:
            conn.abort()
            raise PeerUnreachable(f"{dial.address} did not answer the knock") from None
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _ask_master(self, target: m.PeerEndpoint, port: Port, deadline: float, *, relay_only: bool,
                          avoid: set[int], detail: str) -> tuple[FramedConnection, PathKind, str, int | None]:
        """Ask the master for a dial-back (or a relay at once, with ``relay_only``) and wait for
        the connection it brings.  A dial-back that does not come within twice
        ``direct_connect_timeout`` is given up for a relay; a relay that fails, for another."""
        host = self._host
        epoch = host.master_epoch
        request = self._next_request
        self._next_request += 1
        send, receive = trio.open_memory_channel[object](8)
        pending = self._pending[request] = _Pending(request, target.peer_id, port, send, receive)
        tried: list[str] = []
        try:
            await host.send(m.PathRequest(request, target.peer_id, int(port), relay_only, tuple(sorted(avoid)),
                                          detail), epoch=epoch)
            patience = deadline if relay_only else min(
                deadline, trio.current_time() + 2 * host.config.direct_connect_timeout)
            while True:
                outcome: object = None
                with trio.move_on_at(patience):
                    outcome = await receive.receive()
                if outcome is None:
                    if trio.current_time() >= deadline:
                        break
                    tried.append("no dial-back in time")
                    await host.send(m.PathRequest(request, target.peer_id, int(port), True, tuple(sorted(avoid))),
                                    epoch=epoch)
                    patience = deadline
                    continue
                if isinstance(outcome, _Arrived):
                    return outcome.conn, PathKind.REVERSED, "", None
                if isinstance(outcome, _Unavailable):
                    tried.append(outcome.detail)
                    break
                assert isinstance(outcome, m.RelayOffer)
                address = outcome.address or host.master_address
                try:
                    with trio.move_on_at(deadline):
                        conn = await self._join_relay(outcome, address)
                        return conn, PathKind.RELAYED, relayed_via(outcome.relay, address), outcome.relay
                    tried.append(f"relay {outcome.relay} at {address}: no splice in time")
                    break
                except PCCLError as exc:
                    host.raise_if_failed(epoch)
                    tried.append(f"relay {outcome.relay} at {address}: {exc}")
                    avoid.add(outcome.relay)
                    await host.send(m.PathRequest(request, target.peer_id, int(port), True, tuple(sorted(avoid))),
                                    epoch=epoch)
        finally:
            del self._pending[request]
            send.close()
            while True:  # a dial-back or an offer that came too late
                try:
                    late = receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                if isinstance(late, _Arrived):
                    late.conn.abort()
        host.raise_if_failed(epoch)
        steps = "; ".join([detail] * bool(detail) + tried) or "the master found no path"
        raise PeerUnreachable(f"no path to peer {target.peer_id:x} ({describe_port(port)}): {steps}")

    async def _join_relay(self, offer: m.RelayOffer, address: str) -> FramedConnection:
        """Meet ``offer.partner`` at the relay at ``address``; the connection, end to end
        authenticated and knocked (this side opens it if ``offer.initiator``)."""
        host = self._host
        relay_conn = await host.dial(address)
        try:
            with trio.fail_after(host.config.connect_timeout):
                await relay_conn.send(m.RelayJoin(offer.key, host.peer_id, offer.partner))
                answer = await relay_conn.receive()
            if isinstance(answer, m.RelayRefused):
                raise PeerUnreachable(f"the relay refused the join: {answer.reason}")
            if not isinstance(answer, m.RelayReady):
                raise ProtocolError(f"the relay at {address} answered a join with {type(answer).__name__}")
            stream = relay_conn.detach(remote_address=f"{address}(relay {offer.relay} to {offer.partner:x})")
        except trio.TooSlowError:
            relay_conn.abort()
            raise PeerUnreachable(f"peer {offer.partner:x} did not come to the relay in time") from None
        except BaseException:
            relay_conn.abort()
            raise
        return await self._end_to_end(stream, offer)

    async def _end_to_end(self, stream: Stream, offer: m.RelayOffer) -> FramedConnection:
        host = self._host
        role = m.HandshakeRole.CLIENT if offer.initiator else m.HandshakeRole.SERVER
        conn = await host.establish_over(stream, role=role)
        try:
            with trio.fail_after(host.config.connect_timeout):
                if offer.initiator:
                    await conn.send(m.Knock(host.peer_id, offer.partner, host.master_instance, offer.port))
                    _check_ack(await conn.receive(), offer.partner, "the relayed partner")
                else:
                    knock = await conn.receive()
                    problem = self._knock_problem(knock, expected_origin=offer.partner, ports=(Port(offer.port),))
                    await conn.send(m.KnockAck(host.peer_id, problem is None, problem or ""))
                    if problem is not None:
                        raise ProtocolError(f"relayed partner: {problem}")
        except trio.TooSlowError:
            conn.abort()
            raise PeerUnreachable("the relayed partner did not knock in time") from None
        except BaseException:
            conn.abort()
            raise
        return conn

    def _decided(self, key: tuple[int, Port], path: Path, request: int) -> None:
        self.paths[key] = path
        counters = self._host.counters
        if path.kind is PathKind.DIRECT:
            counters.paths_direct += 1
        elif path.kind is PathKind.REVERSED:
            counters.paths_reversed += 1
        else:
            counters.paths_relayed += 1
        how = {PathKind.DIRECT: f"direct to {path.via}", PathKind.REVERSED: "dialled back by it",
               PathKind.RELAYED: f"through {path.via}"}[path.kind]
        log.info("peer %x: %s connections to peer %x go %s", self._host.peer_id, describe_port(key[1]), key[0], how)
        self._report(key, path, request)

    def _report(self, key: tuple[int, Port], path: Path, request: int) -> None:
        host = self._host
        path.reported_epoch = host.master_epoch
        host.spawn(self._send_report, m.PathReport(key[0], int(key[1]), int(path.kind), path.via, request),
                   host.master_epoch)

    async def _send_report(self, report: m.PathReport, epoch: int) -> None:
        try:
            await self._host.send(report, epoch=epoch)
        except PCCLError:
            pass  # the master is gone: the next one hears it at the path's next use

    # --- the master's requests -----------------------------------------------------------------

    def on_dial_request(self, msg: m.DialRequest, epoch: int) -> None:
        self._host.spawn(self._dial_back, msg, epoch)

    def on_relay_offer(self, msg: m.RelayOffer, epoch: int) -> None:
        if msg.initiator:
            pending = self._pending.get(msg.request)
            if pending is None or pending.target != msg.partner:
                log.debug("peer %x: relay offer for attempt %d, which is over", self._host.peer_id, msg.request)
                return
            try:
                pending.send.send_nowait(msg)
            except (trio.WouldBlock, trio.ClosedResourceError):
                pass
            return
        self._host.spawn(self._answer_relay, msg, epoch)

    def on_path_unavailable(self, msg: m.PathUnavailable) -> None:
        pending = self._pending.get(msg.request)
        if pending is not None:
            try:
                pending.send.send_nowait(_Unavailable(msg.detail or "the master found no path"))
            except (trio.WouldBlock, trio.ClosedResourceError):
                pass

    async def _dial_back(self, msg: m.DialRequest, epoch: int) -> None:
        host = self._host
        requester = msg.requester
        self._warn_advertised(msg)
        dials = dial_order(requester, Port.P2P, own_public_host=host.observed_host)
        attempts = [(dial, _bind(self._reverse_hello, dial, msg)) for dial in dials]
        try:
            conn, dial = await race(attempts, stagger=STAGGER, limit=host.config.direct_connect_timeout,
                                    discard=_abort)
        except RaceFailed as exc:
            tried = "; ".join(f"{d.describe()}: {why}" for d, why in exc.failures) or "it has no candidates"
            log.info("peer %x: cannot dial peer %x back: %s", host.peer_id, requester.peer_id, tried)
            try:
                await host.send(m.DialFailed(msg.request, requester.peer_id, clip_text(tried, MAX_DETAIL)),
                                epoch=epoch)
            except PCCLError:
                pass
            return
        host.counters.dial_backs += 1
        self.paths.setdefault((requester.peer_id, Port.P2P), Path(PathKind.DIRECT, dial.address))
        await self._serve(conn, Port(msg.port), None)

    async def _reverse_hello(self, dial: Dial, msg: m.DialRequest) -> FramedConnection:
        host = self._host
        conn = await host.dial(dial.address)
        try:
            with trio.fail_after(host.config.connect_timeout):
                await conn.send(m.ReverseHello(msg.request, host.peer_id, msg.requester.peer_id, host.master_instance))
                _check_ack(await conn.receive(), msg.requester.peer_id, dial.address)
        except trio.TooSlowError:
            conn.abort()
            raise PeerUnreachable(f"{dial.address} did not answer the dial-back") from None
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _answer_relay(self, offer: m.RelayOffer, epoch: int) -> None:
        host = self._host
        address = offer.address or host.master_address
        try:
            conn = await self._join_relay(offer, address)
        except PCCLError as exc:
            log.info("peer %x: meeting peer %x at relay %d (%s) failed: %s", host.peer_id, offer.partner,
                     offer.relay, address, exc)
            return
        host.counters.relay_joins += 1
        await self._serve(conn, Port(offer.port), None)

    def _warn_advertised(self, msg: m.DialRequest) -> None:
        """The requester could not dial this peer: if that involves this peer's advertised
        endpoints, say so once (a wrong ``Config.advertise`` is the usual cause)."""
        if "advertised" not in msg.detail or msg.detail in self._warned:
            return
        self._warned.add(msg.detail)
        log.warning("peer %x: peer %x could not reach this peer directly (%s); check Config.advertise / "
                    "$PCCL_ADVERTISE: it is dialling back instead", self._host.peer_id, msg.requester.peer_id,
                    msg.detail)

    # --- accepting -----------------------------------------------------------------------------

    async def accept(self, stream: Stream, slot: HandshakeSlot, listener: Port) -> None:
        """Serve one connection a listener of ``listener``'s kind accepted (the module docstring)."""
        host = self._host
        conn: FramedConnection | None = None
        try:
            conn = await host.accept(stream)
            with trio.fail_after(host.config.connect_timeout):
                first = await conn.receive()
            if isinstance(first, m.Register):
                refused, conn = conn, None
                await refuse_registration(refused, "p2p" if listener is Port.P2P else "shared-state")
                raise ProtocolError(f"it registered, taking this peer's {describe_port(listener)} port for a master "
                                    "(it was told so)")
            if isinstance(first, m.Knock):
                problem = self._knock_problem(first, expected_origin=None, ports=_SERVED_BY[listener])
                await conn.send(m.KnockAck(host.peer_id, problem is None, problem or ""))
                if problem is not None:
                    raise ProtocolError(problem)
                served, conn = conn, None
                await self._serve(served, Port(first.port), slot)
                return
            if isinstance(first, m.ReverseHello) and listener is Port.P2P:
                pending = self._pending.get(first.request)
                problem = self._reverse_problem(first, pending)
                await conn.send(m.KnockAck(host.peer_id, problem is None, problem or ""))
                if problem is not None:
                    raise ProtocolError(problem)
                assert pending is not None
                slot.release()
                pending.send.send_nowait(_Arrived(conn))
                conn = None
                return
            raise ProtocolError(f"expected Knock, got {type(first).__name__}")
        except (PCCLError, trio.TooSlowError, trio.WouldBlock, trio.ClosedResourceError) as exc:
            slot.refuse(f"no knock within {host.config.connect_timeout:g} s"
                        if isinstance(exc, trio.TooSlowError) else exc)
            if conn is not None:
                conn.abort()
        except BaseException:
            if conn is not None:
                conn.abort()
            raise

    def _knock_problem(self, knock: m.Message, *, expected_origin: int | None, ports: tuple[Port, ...]) -> str | None:
        host = self._host
        if not isinstance(knock, m.Knock):
            return f"expected Knock, got {type(knock).__name__}"
        if knock.target != host.peer_id:
            return f"this is peer {host.peer_id:x}, not {knock.target:x}"
        if knock.instance != host.master_instance:
            return (f"peer {knock.origin:x} knocks for a run of master instance {knock.instance:x}; this peer's is "
                    f"{host.master_instance:x}")
        if expected_origin is not None and knock.origin != expected_origin:
            return f"expected peer {expected_origin:x}, not {knock.origin:x}"
        if knock.port not in ports:
            return f"this port does not serve {describe_port(knock.port)} connections"
        return None

    def _reverse_problem(self, hello: m.ReverseHello, pending: _Pending | None) -> str | None:
        host = self._host
        if hello.target != host.peer_id or hello.instance != host.master_instance:
            return f"this is peer {host.peer_id:x} of master instance {host.master_instance:x}"
        if pending is None or pending.target != hello.origin:
            return f"no dial-back {hello.request} from peer {hello.origin:x} is awaited (it ended)"
        return None

    async def _serve(self, conn: FramedConnection, port: Port, slot: HandshakeSlot | None) -> None:
        handler = self._handlers.get(Port.P2P if port is Port.BENCHMARK else port)
        if handler is None:
            conn.abort()
            return
        await handler(conn, slot)


def _check_ack(ack: m.Message, expected: int, where: str) -> None:
    if not isinstance(ack, m.KnockAck):
        raise ProtocolError(f"{where} answered the knock with {type(ack).__name__}")
    if not ack.accepted:
        raise PeerUnreachable(f"{where} refused: {ack.detail}")
    if ack.peer_id != expected:
        raise PeerUnreachable(f"{where} is peer {ack.peer_id:x}, not {expected:x}")


def _abort(conn: FramedConnection) -> None:
    conn.abort()


def _bind(fn: Callable[..., Awaitable[T]], *args: object) -> Callable[[], Awaitable[T]]:
    async def call() -> T:
        return await fn(*args)
    return call


def _split(address: str) -> tuple[str, int]:
    if address.startswith("["):
        host, _, port = address[1:].partition("]:")
    else:
        host, _, port = address.rpartition(":")
    return host, int(port)
