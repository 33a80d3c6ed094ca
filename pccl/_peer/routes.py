"""Where the master's answers to running operations go: collective replies by tag, shared-state
replies to the running sync.

An operation opens its route before it votes and closes it when it is over; the session's
reader delivers into it.  A message for a route that is not open is dropped (an answer to an
operation that ended); a route that overflows is the master flooding it (a protocol error,
:class:`Flooded`).  When the master is lost or the session fails, :meth:`Routes.end_all` closes
every route, and the operations waiting on them see the end.

The phase rule is told when a collective begins and ends; a collective *abandoned* (cancelled
before the master answered its vote) keeps its tag until its route closes, and
:meth:`Routes.settled` waits for that.
"""

from __future__ import annotations

import logging

import trio

from ..errors import ProtocolError
from ..protocol import messages as m
from .host import CollectiveRoute
from .phase import PhaseRule

__all__ = ["COLLECTIVE_REPLIES", "Flooded", "Routes", "SYNC_REPLIES"]

log = logging.getLogger(__name__)

#: Collective messages routed by tag.
COLLECTIVE_REPLIES = (m.CollectiveCommence, m.CollectiveComplete, m.CollectiveAbort, m.CollectiveRejected)
#: Shared-state messages routed to the running sync.
SYNC_REPLIES = (m.SyncPlan, m.SyncComplete, m.SyncRejected)
#: Capacity of a collective route and of the sync route: the master sends a handful per op.
_ROUTE_CAPACITY = 16
_SYNC_ROUTE_CAPACITY = 8


class Flooded(ProtocolError):
    """The master sent more messages to one route than an operation can have outstanding."""


class Routes:
    def __init__(self, phase: PhaseRule) -> None:
        self._phase = phase
        self._collectives: dict[int, CollectiveRoute] = {}
        self._abandoned_settled = trio.Event()  # set (and replaced) when an abandoned route closes
        self._sync: trio.MemorySendChannel[m.Message] | None = None

    # --- collectives ---------------------------------------------------------------------------

    def open(self, tag: int) -> CollectiveRoute:
        self._phase.begin_collective(tag)
        route = self._collectives[tag] = CollectiveRoute(_ROUTE_CAPACITY)
        return route

    def close(self, tag: int) -> None:
        route = self._collectives.pop(tag, None)
        if route is not None:
            route.close()
            if tag in self._phase.abandoned:
                self._abandoned_settled.set()
                self._abandoned_settled = trio.Event()
            self._phase.end_collective(tag)

    def abandon(self, tag: int) -> None:
        self._phase.abandon_collective(tag)

    async def settled(self, tag: int | None = None) -> None:
        """Wait until no abandoned collective (of ``tag``, or any) holds its tag."""
        while (tag in self._phase.abandoned) if tag is not None else self._phase.abandoned:
            await self._abandoned_settled.wait()

    def deliver_collective(self, msg: m.CollectiveCommence | m.CollectiveComplete | m.CollectiveAbort
                           | m.CollectiveRejected) -> None:
        route = self._collectives.get(msg.tag)
        if route is None:
            log.debug("dropping %s for tag %d: no collective waits for it", type(msg).__name__, msg.tag)
            return
        try:
            route.deliver(msg)
        except trio.WouldBlock:
            raise Flooded(f"the master flooded collective tag {msg.tag}") from None
        except trio.ClosedResourceError:
            # Closed with the master it came from (a later master's verdict on an op in doubt
            # reaches the op through its intercept instead).
            log.debug("dropping %s for tag %d: its route closed", type(msg).__name__, msg.tag)

    # --- the sync ------------------------------------------------------------------------------

    def open_sync(self) -> trio.MemoryReceiveChannel[m.Message]:
        assert self._sync is None, "one sync at a time (the phase rule)"
        self._sync, receive = trio.open_memory_channel[m.Message](_SYNC_ROUTE_CAPACITY)
        return receive

    def close_sync(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None  # later sync messages are dropped, not sent into a closed channel

    def deliver_sync(self, msg: m.Message) -> None:
        if self._sync is None:
            log.debug("dropping %s: no sync is running", type(msg).__name__)
            return
        try:
            self._sync.send_nowait(msg)
        except trio.WouldBlock:
            raise Flooded("the master flooded the shared-state sync with messages") from None

    # --- the end of an epoch -------------------------------------------------------------------

    def end_all(self) -> None:
        """The master's answers will not come: close every route (the operations see the end)."""
        for route in self._collectives.values():
            route.close()
        self.close_sync()
