"""The transfer watchdog: stops the rings on a round's connections once no byte moved on them
for ``config.peer_timeout``.

It catches a neighbour that the master still hears but this peer does not (a partition between
two peers, a wedged process); a stalled or dead peer is otherwise removed by the master's
heartbeat timeout, which aborts the op.  One watchdog task per communicator, started on first
use in the communicator's nursery, watches every ring: spawning one per op would cost more than
a small op's whole ring.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import trio

from .host import PeerHost
from .ring_connections import P2PLinks

__all__ = ["RingWatchdog", "Watch"]

log = logging.getLogger(__name__)

#: How many checks per ``peer_timeout`` the watchdog makes.
CHECKS_PER_TIMEOUT = 4


@dataclasses.dataclass(eq=False)
class Watch:
    """One running ring under the watchdog: what to call when its connections stall."""

    on_stall: Callable[[], None]


@dataclasses.dataclass(eq=False)
class _LinkWatch:
    """A round's connections under the watchdog: their byte count when they last moved, and
    the rings running on them."""

    last: int
    since: float
    watches: set[Watch] = dataclasses.field(default_factory=set)


class RingWatchdog:
    """Watches the ring connections of ``host`` while rings run on them."""

    def __init__(self, host: PeerHost) -> None:
        self._host = host
        self._links: dict[P2PLinks, _LinkWatch] = {}
        self._added = trio.Event()
        self._started = False

    def watch(self, p2p: P2PLinks, on_stall: Callable[[], None]) -> Watch:
        """Put a ring running on ``p2p`` under the watchdog until :meth:`unwatch`: if no byte
        moves on ``p2p`` for ``peer_timeout``, ``on_stall()`` is called (once, synchronously,
        from the watchdog task).  If the communicator is shutting down no watchdog starts: the
        op fails with the communicator anyway."""
        watch = Watch(on_stall)
        link = self._links.get(p2p)
        if link is None:
            # The connections were idle until now: their silence so far is no stall.
            link = self._links[p2p] = _LinkWatch(p2p.bytes_moved(), trio.current_time())
        link.watches.add(watch)
        if not self._started:
            self._started = self._host.spawn(self._run)
        else:
            self._added.set()
        return watch

    def unwatch(self, p2p: P2PLinks, watch: Watch) -> None:
        link = self._links.get(p2p)
        if link is None:
            return  # stalled already
        link.watches.discard(watch)
        if not link.watches:
            del self._links[p2p]

    async def _run(self) -> None:
        """Stop the rings on a round's connections once no byte moved on them for
        ``peer_timeout`` while rings ran there.

        The watch is per connection set, not per op: an op queued behind others on a busy lane
        waits its turn without moving a byte itself, and is no stall as long as the lanes move.
        A stall stops every ring on the connections at once, with one warning.  Checks every
        ``peer_timeout / CHECKS_PER_TIMEOUT`` while rings run, so a stall is caught within
        ``peer_timeout`` plus one period; parks while none runs.  Counters advance as the
        sockets move bytes, so a frame in flight counts as progress.  Runs until the
        communicator's nursery is cancelled.
        """
        timeout = self._host.config.peer_timeout
        while True:
            if not self._links:
                self._added = trio.Event()
                await self._added.wait()
                continue
            await trio.sleep(timeout / CHECKS_PER_TIMEOUT)
            now = trio.current_time()
            for p2p, link in list(self._links.items()):
                moved = p2p.bytes_moved()
                if moved != link.last:
                    link.last, link.since = moved, now
                elif now - link.since >= timeout:
                    del self._links[p2p]
                    log.warning("peer %x: no data moved on the ring connections to %x and from %x for %.3g s; "
                                "aborting %d collective(s)", self._host.peer_id, p2p.successor, p2p.predecessor,
                                now - link.since, len(link.watches))
                    for watch in link.watches:
                        try:
                            watch.on_stall()
                        except Exception:  # one op's shell failing must not end the others' watch
                            log.exception("peer %x: a stalled collective's abort failed", self._host.peer_id)
