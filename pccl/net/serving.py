"""Accept loops for ports that face the internet: admission, deadlines, and refusals in the log.

Every pccl port — the master's, each peer's ring and shared-state ports — is reachable by anyone
who can reach the host, and must stay usable while someone opens connections and says nothing,
sends a byte a second, or reconnects as fast as it is closed.  :func:`serve_listener` is the one
accept loop for all of them:

* it accepts every connection at once and lets the pure rule of :mod:`pccl.net.admission` decide
  who gets a *slot* (a task running the handshake), who waits parked (a descriptor, nothing
  more), and who is dropped; a source address gets at most its fair share of the slots, so a
  flood from one address never delays a dialler from another;
* the handler gives its slot back (:meth:`HandshakeSlot.release`) once the connection proved
  itself — not at the end of the handshake but at the first message that means something (the
  master's ``Register``, a peer's ``P2PHello`` or ``StateRequest``): without a run token the
  handshake proves nothing, and a connection that finished it and then idles must not be free;
* the handshake bounds the time an idle or slow connection holds its slot: its first bytes (the
  TLS handshake and the preamble) within ``Config.first_bytes_timeout``, all of it within
  ``Config.connect_timeout`` (:func:`pccl.net.framed.accept_framed`); a parked connection gives up
  after ``Config.connect_timeout``;
* slots and waiting room together stay within a quarter of the process's descriptor limit, so
  a flood cannot run the process out of descriptors (which would fail its own outgoing
  connections too);
* every refused connection is logged at most once, through :class:`RefusalLog`: the first few of
  each 10 s window one line each, the rest counted and summed up in one line at the window's end.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable

import trio

from ..errors import TransportError
from .admission import Admission, AdmissionLimits, Drop, Effect, Start, Ticket, TicketState, address_key
from .base import Listener, Stream

__all__ = [
    "MAX_PENDING_HANDSHAKES",
    "PEER_LIMITS",
    "HandshakeSlot",
    "RefusalLog",
    "serve_listener",
    "admission_for",
    "descriptor_budget",
]

log = logging.getLogger(__name__)

#: Connections a peer's listener lets into the handshake at once.  A peer expects few: its ring
#: predecessor's lanes and the peers fetching shared state from it, each through its handshake
#: in a few round trips.
MAX_PENDING_HANDSHAKES = 128
#: A peer listener's admission limits: one address may hold 64 slots, as many as the most ring
#: lanes a predecessor dials at once (``Config.p2p_lanes`` ≤ 64); a thousand more may wait.
PEER_LIMITS = AdmissionLimits(pending=MAX_PENDING_HANDSHAKES, per_address=64, waiting=1024)

#: Refusals logged one line each per window; the rest of the window is counted.
REFUSALS_LOGGED_PER_WINDOW = 10
REFUSAL_WINDOW = 10.0


def descriptor_budget() -> int | None:
    """How many connections one listener may keep unproven: a quarter of the process's soft
    descriptor limit (``None`` where the platform does not say)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return max(4, soft // 4)


def admission_for(limits: AdmissionLimits, *, wait_timeout: float) -> Admission:
    """A listener's admission state: ``limits`` shrunk to :func:`descriptor_budget`, and
    ``wait_timeout`` for parked connections (pass ``Config.connect_timeout``: the dialler has
    given up by then).  Keep it to read its counters while :func:`serve_listener` uses it."""
    budget = descriptor_budget()
    if budget is not None:
        limits = limits.within(budget)
    return Admission(limits, wait_timeout=wait_timeout)


class RefusalLog:
    """Logs refused connections: one line per connection at most, and under a flood only the
    first :data:`REFUSALS_LOGGED_PER_WINDOW` of every :data:`REFUSAL_WINDOW` seconds; the rest
    are counted and reported by :meth:`flush` ("and 480 more refused in the last 10 s")."""

    def __init__(self, what: str, *, logger: logging.Logger = log, per_window: int = REFUSALS_LOGGED_PER_WINDOW,
                 window: float = REFUSAL_WINDOW) -> None:
        self.what = what
        self._logger = logger
        self._per_window = per_window
        self._window = window
        self._window_end: float | None = None
        self._logged = 0
        self._suppressed: collections.Counter[str] = collections.Counter()
        #: Refusals reported so far (logged or counted).
        self.total = 0

    def refused(self, remote: str, reason: object, *, level: int = logging.INFO) -> None:
        """``remote`` was refused (closed without being served) for ``reason``."""
        now = trio.current_time()
        self.total += 1
        if self._window_end is not None and now >= self._window_end:
            self.flush()
        if self._window_end is None:
            self._window_end = now + self._window
            self._logged = 0
        if self._logged < self._per_window:
            self._logged += 1
            self._logger.log(level, "%s refused %s: %s", self.what, remote, reason)
        else:
            self._suppressed[address_key(remote)] += 1

    @property
    def flush_at(self) -> float | None:
        """When :meth:`flush` has a summary to write (``None``: nothing counted)."""
        return self._window_end if self._suppressed else None

    def flush(self) -> None:
        """End the current window: log how many refusals were only counted in it, if any."""
        if self._suppressed:
            count = sum(self._suppressed.values())
            source, most = self._suppressed.most_common(1)[0]
            self._logger.warning("%s: and %d more connections refused in the last %g s (%d from %s)",
                                 self.what, count, self._window, most, source)
        self._suppressed.clear()
        self._window_end = None


class HandshakeSlot:
    """An accepted connection's slot among the unproven ones (:mod:`pccl.net.admission`).

    :meth:`release` it as soon as the connection proved itself (idempotent; done anyway when the
    handler returns); :meth:`refuse` to log why it was not served (rate-limited)."""

    def __init__(self, server: _Server, ticket: Ticket, remote: str) -> None:
        self._server = server
        self._ticket = ticket
        self.remote_address = remote

    @property
    def released(self) -> bool:
        """Whether the slot was given back (the connection proved itself, or was refused)."""
        return self._ticket.state is TicketState.DONE

    def release(self) -> None:
        self._server.release(self._ticket)

    def refuse(self, reason: object, *, level: int = logging.INFO) -> None:
        """Log (once, rate-limited with every other refusal of this listener) that this
        connection is refused for ``reason``, and give the slot back.  The handler closes it."""
        self._server.refusals.refused(self.remote_address, reason, level=level)
        self.release()


class _Server:
    """The Trio side of one listener's admission: streams by ticket, and the effects."""

    def __init__(self, admission: Admission, refusals: RefusalLog, nursery: trio.Nursery,
                 handler: Callable[[Stream, HandshakeSlot], Awaitable[None]]) -> None:
        self.admission = admission
        self.refusals = refusals
        self._nursery = nursery
        self._handler = handler
        self._streams: dict[Ticket, Stream] = {}  # waiting connections
        self._closed = False
        self.changed = trio.Event()

    def arrive(self, stream: Stream) -> None:
        ticket, effects = self.admission.arrive(address_key(stream.remote_address), trio.current_time())
        self._streams[ticket] = stream
        self._apply(effects)

    def release(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.DONE:
            return
        self._apply(self.admission.release(ticket, trio.current_time()))

    def expire(self) -> None:
        self._apply(self.admission.expire(trio.current_time()))

    def close_waiting(self) -> None:
        """The listener is done: close the parked connections; handlers that end from now on
        start nobody."""
        self._closed = True
        for stream in self._streams.values():
            stream.abort()
        self._streams.clear()

    def _apply(self, effects: list[Effect]) -> None:
        if self._closed:
            return
        for effect in effects:
            stream = self._streams.pop(effect.ticket)
            if isinstance(effect, Start):
                self._nursery.start_soon(self._run, stream, HandshakeSlot(self, effect.ticket, stream.remote_address))
            else:
                assert isinstance(effect, Drop)
                stream.abort()
                self.refusals.refused(stream.remote_address, effect.reason)
        self.changed.set()

    async def _run(self, stream: Stream, slot: HandshakeSlot) -> None:
        try:
            await self._handler(stream, slot)
        finally:
            slot.release()

    async def housekeeping(self) -> None:
        """Drop waiters whose time is up, and write the refusal summary at each window's end."""
        while True:
            self.changed = trio.Event()
            deadlines = [t for t in (self.admission.next_deadline, self.refusals.flush_at) if t is not None]
            if not deadlines:
                await self.changed.wait()
                continue
            with trio.move_on_at(min(deadlines)):
                await self.changed.wait()
                continue
            self.expire()
            at = self.refusals.flush_at
            if at is not None and trio.current_time() >= at:
                self.refusals.flush()


async def serve_listener(
    listener: Listener,
    handler: Callable[[Stream, HandshakeSlot], Awaitable[None]],
    *,
    on_error: Callable[[TransportError], None],
    admission: Admission,
    refusals: RefusalLog | None = None,
) -> None:
    """Accept connections and run ``handler(stream, slot)`` for each admitted one, in a nursery
    (see the module docstring for who is admitted when).

    ``admission`` (from :func:`admission_for`; one per listener) decides; ``refusals``
    (default: a new :class:`RefusalLog` named after the listener) logs the connections dropped
    here and those the handler refuses through its slot.

    When ``accept`` fails (``StreamClosed`` once the listener is closed), ``on_error`` gets the
    ``TransportError`` at once, the waiting connections are closed, and this returns after every
    running handler has returned.  Other exceptions (``on_error``'s included) propagate;
    cancellation closes the waiting connections and cancels the handlers.
    """
    if refusals is None:
        refusals = RefusalLog(f"listener {listener.address}")
    async with trio.open_nursery() as nursery:
        server = _Server(admission, refusals, nursery, handler)
        housekeeping = trio.CancelScope()

        async def run_housekeeping() -> None:
            with housekeeping:
                await server.housekeeping()

        nursery.start_soon(run_housekeeping)
        try:
            while True:
                try:
                    stream = await listener.accept()
                except TransportError as exc:
                    on_error(exc)
                    return
                server.arrive(stream)
        finally:
            server.close_waiting()
            housekeeping.cancel()
            refusals.flush()
