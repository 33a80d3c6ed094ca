"""How a collective call of one communicator gets to its tag, and which calls hold one.

:class:`CallGate` (one per :class:`~pccl._peer.collective_service.CollectiveService`) counts the
attempts that hold a tag route (:meth:`~CallGate.hold`, :meth:`~CallGate.release`) and the calls
between their start and their choice of path (:meth:`~CallGate.alone`, for the fast path), and
runs the part of an attempt before it claims its tag (:meth:`~CallGate.enter`): it joins this
peer's re-wire if one stands, follows the master epoch, waits for a cancelled call on the tag
to be settled and asks whether the call is alone.  The re-wire
(:meth:`~CallGate.idle`, then the vote) waits until no attempt holds a tag, because the master
refuses a topology vote while this peer has a collective in flight.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from .collective_plans import Plan
from .host import MasterLost, PeerHost
from .ring_link_cache import RingLinkCache
from ..protocol.phases import TopologyVote

__all__ = ["CallGate"]


class CallGate:
    """The attempts of one collective service that hold a tag route or are starting (see the
    module docstring)."""

    def __init__(self, host: PeerHost, links: RingLinkCache) -> None:
        self._host = host
        self._links = links
        self._holding = 0  # attempts of this service that hold a tag route
        self._holding_changed = trio.Event()
        self._starting = 0  # calls between their start and their choice of path (see alone())
        #: A test's pause (``pccl.testing.hold_call_before_route``): awaited with the tag at the
        #: end of :meth:`enter`'s awaits, where a re-wire of this peer may have begun meanwhile.
        self.before_route: Callable[[int], Awaitable[None]] | None = None

    @property
    def holding(self) -> int:
        """Attempts that hold a tag route."""
        return self._holding

    @property
    def starting(self) -> int:
        """Calls between their start and their choice of path."""
        return self._starting

    def hold(self) -> None:
        """An attempt holds its tag route from now on."""
        self._holding += 1
        self._changed()

    def release(self, tag: int) -> None:
        """Close ``tag``'s route; the attempt that held it holds none any more."""
        self._host.close_route(tag)
        self._holding -= 1
        self._changed()

    def _changed(self) -> None:
        self._holding_changed.set()
        self._holding_changed = trio.Event()

    async def idle(self) -> None:
        """Return once no attempt holds a tag and no cancelled call's vote is still being
        withdrawn (the master refuses a topology vote with a collective of this peer in flight)."""
        while True:
            while self._holding:
                await self._holding_changed.wait()
            # A cancelled call's vote is withdrawn first (the vote waits for that anyway), and
            # a call that started meanwhile holds its tag: wait for it too, or the vote would
            # be refused with a collective in flight.
            await self._host.settled()
            if not self._holding:
                return

    async def enter(self, plan: Plan, *, fast: bool) -> tuple[int, bool]:
        """The part of an attempt of ``plan`` before it claims its tag: return the master epoch
        it runs in and whether it is :meth:`alone` (always ``False`` unless ``fast``).  Raises
        ``MasterLost`` if the master changed since the call started."""
        # A re-wire of this peer (an internal vote that refuses collectives) standing before or begun
        # during the awaits below: this legal call joins it and starts on the new ring, never refused.
        alone: bool | None = None
        while alone is None or self._host.phase.topology_vote is TopologyVote.REWIRE:
            while self._host.phase.topology_vote is TopologyVote.REWIRE:
                await self._host.rewire()
            epoch = self._host.master_epoch
            self._links.follow(epoch)
            if epoch != plan.epoch:  # a call never spans two masters (loops stand anywhere after one)
                raise MasterLost(f"the master changed during {plan.what}")
            await self._host.settled(plan.tag)  # a cancelled call's vote on this tag is withdrawn first
            alone = fast and await self.alone()
            if self.before_route is not None:
                await self.before_route(plan.tag)
        return epoch, alone

    async def alone(self) -> bool:
        """Whether this call is the only collective of this peer, both in flight and starting:
        calls started together (a nursery's tasks, which Trio runs in an order that differs per
        peer) all see each other here after one checkpoint, so none of them begins and none can
        cross another peer's begun op (docs/protocol.rst, "Crossings")."""
        if not self._host.config.fast_commit or self._holding:
            return False
        self._starting += 1
        try:
            await trio.lowlevel.checkpoint()
        finally:
            self._starting -= 1
        return not self._starting
