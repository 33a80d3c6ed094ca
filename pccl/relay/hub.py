"""The relay's splice: two joined connections become one byte pipe (the Trio shell of
:class:`pccl.protocol.relay.Rendezvous`).

A connection that presented ``RelayJoin`` (after the framed handshake with the run token) is
handed to :meth:`RelayHub.serve`:

* the first of a pair waits for its partner, at most ``Config.connect_timeout`` (then
  ``RelayRefused``: the partner never came); waiting costs its descriptor and a task, nothing
  more, and the rendezvous bounds how many wait (in all and per source address);
* the second one's task does the splice: ``RelayReady`` to both, then the framing ends
  (:meth:`~pccl.net.framed.FramedConnection.detach`, keeping bytes read ahead) and two pumps copy
  bytes each way through a buffer of :data:`SPLICE_BUFFER` bytes per direction, allocated only
  while the pair is spliced;
* an end of one side is passed on as it came: a clean EOF as a half-close (TLS has none: then a
  close), a reset as a reset (the other side's receives fail as a broken link's would), and the
  pair is over once both directions are;
* every byte forwarded is counted, per pair and in all (:class:`HubCounters`: the relay's
  ``RelayStats`` heartbeat reports them to the master).

The bytes are not looked at: over the splice the two peers run the framed handshake end to end
(the run token proves each to the other), then their own protocol.  A relay sees their traffic in
the clear unless the hops to it use TLS.
"""

from __future__ import annotations

import dataclasses
import logging

import trio

from .._groups import single_exception
from ..errors import InvalidUsage, PCCLError, TransportError
from ..config import Config
from ..net.admission import address_key
from ..net.base import Stream
from ..net.framed import FramedConnection
from ..net.serving import HandshakeSlot
from ..protocol import messages as m
from ..protocol.relay import RELAY_JOIN_LIMITS, Join, JoinLimits, Pair, Refuse, Rendezvous, Wait

__all__ = ["RelayHub", "HubCounters", "SPLICE_BUFFER"]

log = logging.getLogger(__name__)

#: Bytes buffered per direction of a spliced pair (two per pair, while it is spliced).  A
#: quarter MiB keeps a relay at link rate on a fast long link and bounds a full relay
#: (``JoinLimits.pairs`` pairs) at 256 MiB.
SPLICE_BUFFER = 256 * 1024
#: How long sending ``RelayReady``/``RelayRefused`` to a joiner may take.
ANSWER_TIMEOUT = 5.0


@dataclasses.dataclass
class HubCounters:
    """What a hub did since it started."""

    #: Pairs spliced, in all.
    pairs_total: int = 0
    #: Joins refused (bad joins, no partner in time, the relay full).
    refused: int = 0
    #: Payload bytes forwarded, both directions of every pair.
    forwarded_bytes: int = 0


@dataclasses.dataclass(eq=False)
class _Waiter:
    conn: FramedConnection
    met: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: Set by the partner's task when the splice is over (or was refused).
    over: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: Why the pair was refused after all (the relay was full), for the waiter's log.
    refused: str | None = None


@dataclasses.dataclass(eq=False)
class _Splice:
    first: Join
    second: Join
    forwarded: int = 0


class RelayHub:
    """Pairs joins and splices them (see the module docstring).  One per relay; the master's
    own relay (``pccl master --relay``) has one too."""

    def __init__(self, config: Config, *, limits: JoinLimits = RELAY_JOIN_LIMITS,
                 buffer_size: int = SPLICE_BUFFER) -> None:
        self._config = config
        self._rendezvous = Rendezvous(limits)
        self._waiters: dict[Join, _Waiter] = {}
        self._buffer_size = buffer_size
        self.counters = HubCounters()

    @property
    def pairs(self) -> int:
        """Pairs spliced now."""
        return self._rendezvous.pairs

    @property
    def waiting(self) -> int:
        """Joins waiting for their partner now."""
        return self._rendezvous.waiting

    def stats(self) -> m.RelayStats:
        """The ``RelayStats`` this hub reports to the master."""
        return m.RelayStats(self.pairs, self.waiting, self.counters.forwarded_bytes)

    async def serve(self, conn: FramedConnection, join: m.RelayJoin, slot: HandshakeSlot | None) -> None:
        """Serve a connection that presented ``join``, until its splice is over (or it was
        refused).  Closes ``conn`` in every case.  Never raises a pccl error (each is logged)."""
        source = address_key(conn.remote_address)
        outcome = self._rendezvous.join(join.key, join.peer_id, join.partner, source)
        try:
            if isinstance(outcome, Refuse):
                self.counters.refused += 1
                if outcome.waiter is not None:
                    self._refuse_waiter(outcome.waiter, outcome.reason)
                await self._refuse(conn, outcome.reason, slot)
            elif isinstance(outcome, Wait):
                if slot is not None:
                    slot.release()  # a valid join: the rendezvous bounds the waiting ones
                await self._wait(conn, outcome.join)
            else:
                assert isinstance(outcome, Pair)
                if slot is not None:
                    slot.release()
                await self._splice(outcome, conn)
        finally:
            conn.abort()

    # --- the two sides ----------------------------------------------------------------------------

    async def _wait(self, conn: FramedConnection, join: Join) -> None:
        waiter = _Waiter(conn)
        self._waiters[join] = waiter
        try:
            with trio.move_on_after(self._config.connect_timeout):
                await waiter.met.wait()
            if not waiter.met.is_set() and self._rendezvous.withdraw(join):
                self.counters.refused += 1
                await self._refuse(conn, f"peer {join.partner:x} did not come within "
                                   f"{self._config.connect_timeout:g} s (Config.connect_timeout)", None)
                return
            # The partner's task has this connection now: wait until it is done with it.
            await waiter.over.wait()
            if waiter.refused is not None:
                await self._refuse(conn, waiter.refused, None)
        finally:
            del self._waiters[join]
            self._rendezvous.withdraw(join)  # cancelled while waiting (a no-op once it was paired)

    def _refuse_waiter(self, join: Join, reason: str) -> None:
        waiter = self._waiters.get(join)
        if waiter is not None:
            waiter.refused = reason
            waiter.met.set()
            waiter.over.set()

    async def _refuse(self, conn: FramedConnection, reason: str, slot: HandshakeSlot | None) -> None:
        if slot is not None:
            slot.refuse(f"relay join refused: {reason}")
        else:
            log.info("relay join from %s refused: %s", conn.remote_address, reason)
        with trio.move_on_after(ANSWER_TIMEOUT):
            try:
                await conn.send(m.RelayRefused(reason))
            except PCCLError:
                pass

    async def _splice(self, pair: Pair, second_conn: FramedConnection) -> None:
        first = pair.first
        waiter = self._waiters.get(first)
        splice = _Splice(first, pair.second)
        if waiter is None:  # the first one's task is gone (it cannot be: it waits in _wait)
            self._rendezvous.pair_ended(first, pair.second)
            await self._refuse(second_conn, "the partner's connection is gone", None)
            return
        waiter.met.set()
        first_conn = waiter.conn
        self.counters.pairs_total += 1
        label = f"relay pair {first.peer_id:x}<->{pair.second.peer_id:x}"
        try:
            with trio.move_on_after(ANSWER_TIMEOUT) as answering:
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(first_conn.send, m.RelayReady())
                        nursery.start_soon(second_conn.send, m.RelayReady())
                except BaseExceptionGroup as group:
                    # A side reset before its RelayReady: one error for the handlers below (a
                    # group would escape serve, which promises never to raise a pccl error).
                    raise single_exception(group) from None
            if answering.cancelled_caught:
                log.info("%s: a side did not take RelayReady in time", label)
                return
            a = first_conn.detach()
            b = second_conn.detach()
            log.debug("%s spliced (%s, %s)", label, first_conn.remote_address, second_conn.remote_address)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, a, b, splice, nursery.cancel_scope)
                nursery.start_soon(self._pump, b, a, splice, nursery.cancel_scope)
            log.debug("%s over after %d bytes", label, splice.forwarded)
        except TransportError as exc:
            log.info("%s: %s", label, exc)
        except PCCLError as exc:  # detach of a connection not at rest: a joiner sent before RelayReady
            log.info("%s: %s", label, exc)
        finally:
            self._rendezvous.pair_ended(first, pair.second)
            first_conn.abort()
            second_conn.abort()
            waiter.over.set()

    async def _pump(self, source: Stream, sink: Stream, splice: _Splice, scope: trio.CancelScope) -> None:
        """Copy ``source`` to ``sink`` until ``source`` ends: EOF becomes a half-close (or a
        close), a reset or a failed send ends the whole pair at once with resets both ways."""
        buffer = memoryview(bytearray(self._buffer_size))
        counters = self.counters
        try:
            while True:
                n = await source.receive_into(buffer)
                if n == 0:
                    break
                await sink.send_all(buffer[:n])
                splice.forwarded += n
                counters.forwarded_bytes += n
        except TransportError:
            source.abort()
            sink.abort()
            scope.cancel()
            return
        try:
            await sink.send_eof()
        except InvalidUsage:  # TLS: no half-close; the partner sees the close after the data
            await sink.aclose()
            scope.cancel()
        except TransportError:
            source.abort()
            sink.abort()
            scope.cancel()
