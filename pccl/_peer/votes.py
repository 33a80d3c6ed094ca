"""This peer's votes at the master: ``update_topology()``, the all-reduce's re-wire,
``optimize_topology()`` and ``are_peers_pending()``.

A vote is a message to the master and a :class:`Waiter` for its answer, which the session's
reader sets (:meth:`Votes.topology_completed`, :meth:`Votes.topology_rejected`,
:meth:`Votes.pending_answered`).  A cancelled vote stands at the master: the waiter stays, and
the next call of the same kind waits on it (the phase rule joins it).  At most one topology vote
and one pending-peers query are outstanding.

Across a lost master (see :mod:`pccl.protocol.lifecycle`): the topology waiter survives the
loss — being accepted by the master this peer reconnects to *is* its topology update, and the
first ``TopologyComplete`` of the new epoch answers it; the pending-peers query does not (the
new master never heard it), and a re-wire that belonged to the old master ends with
``MasterLost``.
"""

from __future__ import annotations

import logging
from typing import Generic, Protocol, TypeVar

import trio

from ..errors import Kicked, PCCLError, PhaseMismatch
from ..protocol import messages as m
from ..protocol.lifecycle import Event, Lifecycle
from ..protocol.phases import TopologyVote
from .host import MasterLost
from .phase import PhaseRule

__all__ = ["VoteHost", "Votes", "Waiter", "fresh_error"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def fresh_error(error: PCCLError) -> PCCLError:
    """A new instance of ``error`` to raise (raising one object from many places tangles tracebacks)."""
    if isinstance(error, Kicked):
        copy: PCCLError = Kicked(error.reason, error.detail)
    else:
        copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy


class Waiter(Generic[_T]):
    """One outstanding answer from the master."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._value: _T | None = None
        self._error: PCCLError | None = None

    def set(self, value: _T) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: PCCLError) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self) -> _T:
        await self._event.wait()
        if self._error is not None:
            raise fresh_error(self._error)
        return self._value  # type: ignore[return-value]


class VoteHost(Protocol):
    """What the votes need from the session."""

    master_address: str

    @property
    def peer_id(self) -> int: ...

    @property
    def lifecycle(self) -> Lifecycle: ...

    @property
    def phase(self) -> PhaseRule: ...

    def raise_if_failed(self, epoch: int | None = None) -> None: ...

    async def until_accepted(self) -> None: ...

    async def settled(self, tag: int | None = None) -> None: ...

    async def send(self, msg: m.Message, *, epoch: int | None = None, schedule_point: bool = True) -> None: ...


class Votes:
    def __init__(self, host: VoteHost) -> None:
        self._host = host
        self._topology: Waiter[m.TopologyComplete] | None = None
        self._pending: Waiter[bool] | None = None

    # --- the calls -----------------------------------------------------------------------------

    async def optimize(self) -> None:
        """Vote to optimise this group's ring: the master has the links probed (the session runs
        the probes), solves, and the round completes with the new ring installed.  A master lost
        meanwhile: return once the restarted master accepted this peer, with that master's ring;
        until this peer's next topology update (where the group's loops realign) return without
        measuring."""
        host = self._host
        await trio.lowlevel.checkpoint_if_cancelled()
        if not host.lifecycle.aligned:
            # Rejoined a restarted master: the group's loops realign at the next update_topology
            # (until then collectives abort at once); an optimisation now would wait for peers
            # that are elsewhere in their step.  Nothing to measure yet.
            await host.until_accepted()
            log.info("peer %x: optimize_topology skipped: rejoined a restarted master, realigning at the "
                     "next update_topology", host.peer_id)
            return
        await host.settled()
        host.raise_if_failed()
        epoch = host.lifecycle.epoch
        if host.phase.join_topology(TopologyVote.OPTIMIZE):
            waiter = self._topology
            assert waiter is not None
        else:
            waiter = self.begin_topology(TopologyVote.OPTIMIZE)
            log.debug("peer %x: optimise vote", host.peer_id)
            try:
                await host.send(m.VoteOptimize(), epoch=epoch, schedule_point=False)
            except BaseException:
                if self._topology is waiter:
                    self.end_topology(None)
                raise
        await waiter.wait()
        if host.lifecycle.epoch != epoch:
            # The master was lost meanwhile, and this was the acceptance by the next one: this
            # peer stays rejoined until its next update_topology.
            log.info("peer %x: optimize_topology ended by the loss of the master", host.peer_id)

    async def topology(self, *, accept_new_peers: bool) -> None:
        """Vote to accept pending peers (``True``: ``update_topology``) or to re-wire this group
        (``False``); return when the round completed.  A vote outstanding when the master is
        lost becomes the wait for this peer's acceptance by the master it reconnects to."""
        host = self._host
        lifecycle = host.lifecycle
        await trio.lowlevel.checkpoint_if_cancelled()
        if not lifecycle.aligned:
            # Reconnecting, or registered again and not yet accepted (or accepted meanwhile):
            # being accepted by the master is this peer's topology update — it returns when the
            # accepting peers' update_topology does, as a newcomer's open_communicator does, and
            # the loops meet again.  Not so for a re-wire inside an all-reduce: that call
            # belonged to the old master and ends (the all-reduce aborts).
            await host.until_accepted()
            self._realigned(accept_new_peers)
            return
        await host.settled()  # a cancelled all-reduce's Init must not stand at the master
        host.raise_if_failed()
        kind = TopologyVote.ACCEPT if accept_new_peers else TopologyVote.REWIRE
        epoch = lifecycle.epoch
        if host.phase.join_topology(kind):
            waiter = self._topology
            assert waiter is not None
        else:
            waiter = self.begin_topology(kind)
            log.debug("peer %x: topology vote (%s)", host.peer_id, kind.value)
            try:
                await host.send(m.VoteTopology(accept_new_peers), epoch=epoch, schedule_point=False)
            except MasterLost:
                pass  # the vote stands as the wait for acceptance by the next master
            except BaseException:
                # Not sent (cancelled while waiting to send, or the session failed): no vote stands.
                if self._topology is waiter:
                    self.end_topology(None)
                raise
        await waiter.wait()
        if lifecycle.epoch != epoch:  # the master was lost meanwhile: this was the acceptance by the next
            self._realigned(accept_new_peers)

    def _realigned(self, accept_new_peers: bool) -> None:
        if not accept_new_peers:
            raise MasterLost(f"the master at {self._host.master_address} was lost during a re-wire")
        self._host.lifecycle.handle(Event.REALIGNED)

    async def peers_pending(self) -> bool:
        """Whether a registered peer waits to be accepted, answered once every accepted peer
        asked.  After a lost master: once the restarted master accepted this peer, ``True``
        until its next topology update (see :meth:`pccl.Communicator.are_peers_pending`)."""
        host = self._host
        await trio.lowlevel.checkpoint_if_cancelled()
        host.raise_if_failed()
        if host.lifecycle.holds_master and not host.lifecycle.rejoined:
            waiter = self._pending
            if waiter is None:
                waiter = self._pending = Waiter()
                try:
                    await host.send(m.VotePeersPending(), epoch=host.lifecycle.epoch, schedule_point=False)
                except MasterLost:  # not sent: no vote stands at any master
                    if self._pending is waiter:
                        self._pending = None
                    waiter = None
                except BaseException:
                    if self._pending is waiter:
                        self._pending = None
                    raise
            if waiter is not None:
                try:
                    return await waiter.wait()
                except MasterLost:
                    pass
        await host.until_accepted()
        return True

    # --- the topology waiter -------------------------------------------------------------------

    def begin_topology(self, kind: TopologyVote) -> Waiter[m.TopologyComplete]:
        self._host.phase.begin_topology(kind)
        waiter = self._topology = Waiter()
        return waiter

    def end_topology(self, error: PCCLError | None) -> None:
        waiter, self._topology = self._topology, None
        if waiter is not None:
            self._host.phase.end_topology()
            if error is not None:
                waiter.fail(error)

    async def wait_topology(self) -> m.TopologyComplete:
        """Wait for the outstanding topology vote's answer (``open_communicator``'s acceptance)."""
        waiter = self._topology
        assert waiter is not None, "no topology vote stands"
        return await waiter.wait()

    @property
    def topology_outstanding(self) -> bool:
        return self._topology is not None

    # --- answers (from the reader) -------------------------------------------------------------

    def topology_completed(self, msg: m.TopologyComplete) -> None:
        waiter = self._topology
        self.end_topology(None)
        if waiter is not None:
            waiter.set(msg)

    def topology_rejected(self, msg: m.TopologyRejected) -> None:
        if self._topology is None:
            log.debug("dropping TopologyRejected: no topology vote stands")
            return
        log.warning("peer %x: the master ended this peer's topology vote: %s", self._host.peer_id, msg.detail)
        self.end_topology(PhaseMismatch(msg.detail or "phase mismatch"))

    def pending_answered(self, msg: m.PeersPendingResult) -> None:
        log.debug("peer %x: peers pending: %s", self._host.peer_id, msg.pending)
        waiter, self._pending = self._pending, None
        if waiter is not None:
            waiter.set(msg.pending)

    def master_gone(self, error: PCCLError) -> None:
        """The master's answer to the pending-peers query will not come."""
        waiter, self._pending = self._pending, None
        if waiter is not None:
            waiter.fail(error)

    def fail_all(self, error: PCCLError) -> None:
        """The session failed: every outstanding vote ends with ``error``."""
        self.end_topology(error)
        self.master_gone(error)

