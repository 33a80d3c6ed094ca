"""The heartbeat of one master connection: keep the master hearing from this peer, and notice
a master that fell silent.

:func:`run_heartbeat` runs beside the connection's reader (:mod:`pccl._peer.master_link`) for as
long as the connection is this peer's master link.  It talks to a :class:`HeartbeatSubject` —
the link — so a test can drive it with a stand-in.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from ..config import Config
from ..errors import MasterUnreachable, PCCLError
from ..protocol import messages as m

__all__ = ["HeartbeatSubject", "PeerFacts", "run_heartbeat"]

log = logging.getLogger(__name__)

#: Scheduler turns the heartbeat task gives the reader before it calls a quiet master silent
#: (the reader needs two or three to take in a message waiting on the socket).
_READER_TURNS = 10


class PeerFacts(Protocol):
    """Who this peer is towards its master: what the heartbeat, the master link and the
    reconnection all read from the session."""

    master_address: str

    @property
    def peer_id(self) -> int: ...

    @property
    def config(self) -> Config: ...

    @property
    def failure(self) -> PCCLError | None: ...


class HeartbeatSubject(PeerFacts, Protocol):
    """What :func:`run_heartbeat` needs (one master connection; tests substitute a stand-in)."""

    @property
    def last_heard(self) -> float: ...

    @property
    def last_sent(self) -> float: ...

    def fail(self, error: PCCLError) -> None: ...

    async def send(self, msg: m.Message) -> None: ...

    def heartbeat(self) -> m.Heartbeat: ...


async def run_heartbeat(subject: HeartbeatSubject) -> None:
    """Keep the master hearing from this peer at least every ``config.heartbeat_interval``, and
    report ``MasterUnreachable`` (via ``subject.fail``) once the master has been silent for
    ``config.peer_timeout``.  Returns when the subject has failed or a send fails.

    A heartbeat goes out when the interval passed since the last message to the master, or, at
    the interval's cadence, when its report (what the status page shows) changed since the last
    heartbeat.  A peer busy voting every step sends none on top of its votes: any message
    refreshes the master's deadline for it (heartbeats were about 40% of what the master read in
    the simulator's default run).

    The master's silence is counted in this loop's running time: a wake-up more than half an
    interval late means the loop was blocked (user code on the Trio thread) or starved of CPU (a
    busy host), and that time is not the master's silence — the master's messages of that time
    wait unread, or, when the master is starved too (the same busy host, or the same process),
    were never sent.  A master silent for ``peer_timeout`` of running time is still declared
    unreachable, however often the loop blocks in between (the master's own deadlines for its
    peers are counted the same way)."""
    cfg = subject.config
    interval = cfg.heartbeat_interval
    reported: m.Heartbeat | None = None
    due = trio.current_time() + interval
    heard, lost = subject.last_heard, 0.0  # lost: the time the loop did not run since `heard`
    while subject.failure is None:
        await trio.sleep_until(due)
        now = trio.current_time()
        late = now - due
        if late >= cfg.peer_timeout / 2:
            log.warning("peer %x: no heartbeat could go to the master for %.3g s: the event loop was blocked "
                        "(the master removes peers silent for Config.peer_timeout = %g s); run long "
                        "computations off the Trio thread", subject.peer_id, late + interval,
                        cfg.peer_timeout)
        if subject.last_heard != heard:
            heard, lost = subject.last_heard, 0.0
        if late > interval / 2:
            lost += late
        if now - subject.last_heard - lost > cfg.peer_timeout:
            # Before calling the master silent, let the reader take in what may be waiting
            # unread (after a stall too short to count as lost above).  Counted in scheduler
            # turns, not time, since the loop may block again meanwhile; a hung master is
            # still caught within a few turns.
            for _ in range(_READER_TURNS):
                await trio.lowlevel.checkpoint()
                if subject.failure is not None:
                    return
                if trio.current_time() - subject.last_heard - lost <= cfg.peer_timeout:
                    break
            else:
                silent = trio.current_time() - subject.last_heard - lost
                stalled = f" (and {lost:.3g} s while this peer's event loop did not run)" if lost else ""
                subject.fail(MasterUnreachable(f"the master at {subject.master_address} has been silent for "
                                               f"{silent:.3g} s{stalled}"))
                return
        heartbeat = subject.heartbeat()
        now = trio.current_time()
        if heartbeat == reported and subject.last_sent + interval > now:
            due = subject.last_sent + interval  # the master heard from this peer meanwhile
            continue
        try:
            await subject.send(heartbeat)
        except PCCLError:
            return
        reported = heartbeat
        # From when the send returned: a send held up (a stalled network, say) is not a late
        # wake-up, and whatever arrived meanwhile (a kick notice) gets an interval to be read.
        due = trio.current_time() + interval
