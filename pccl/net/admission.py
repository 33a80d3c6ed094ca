"""Who gets a handshake slot: the admission rule of a listener that faces the internet (sans-IO).

A pccl port (the master's, a peer's ring and shared-state ports) must stay usable while anyone
who can reach it opens connections and says nothing, dribbles a byte a second, or opens them
faster than they can be served.  The rule, in the words of the people it protects: a connection
that has proved nothing costs almost nothing and cannot make anyone else wait; one source
address cannot take more than a fair share.  It has three parts:

* **Pending slots.**  A connection that holds a slot has a task running its handshake (and
  whatever else its listener wants to see before trusting it: the master waits for
  ``Register``, a peer's ports for their first request).  At most ``pending`` connections hold
  one, and at most ``per_address`` of them come from one source address (:func:`address_key`:
  an IPv4 address, or the /64 prefix of an IPv6 one, which is what one host gets).  The
  handler gives its slot back as soon as the connection proved itself, or failed.
* **Waiting room.**  Every other connection is accepted at once anyway — the kernel's backlog is
  first come, first served, so leaving the surplus there would queue a legitimate dialler behind
  a flood — and parked: no task, no buffer, not even a read, only the descriptor.  Up to
  ``waiting`` of them wait; each gives up after ``wait_timeout`` (the dialler's own handshake
  deadline has passed by then).  When a slot frees, the waiting connection to start is taken
  from the address with the fewest slots (the fair share), the newest first: under a flood the
  oldest waiters are the ones nobody is waiting for any more (adaptive LIFO), and a legitimate
  dialler behind the same address is served at the next free slot instead of after every idle
  connection opened before it.
* **Overflow.**  When the waiting room is full, the oldest waiter of the address with the most
  connections (slots and waiting) is dropped to make room: a flood from one address displaces
  itself, never the others.

Slots are not taken away from a connection once given (it is mid-handshake with whoever holds
it); the handshake's own deadlines (``Config.first_bytes_timeout`` for its first bytes,
``Config.connect_timeout`` for all of it) bound how long an idle or slow one keeps its slot.

:class:`Admission` is the pure state machine (time is an input, decisions come back as
:data:`Effect` lists); :func:`pccl.net.serving.serve_listener` is the Trio shell that accepts,
starts handlers and closes what is dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections import deque

from ..errors import InvalidArgument
from .base import parse_address

__all__ = [
    "AdmissionLimits",
    "Admission",
    "Ticket",
    "TicketState",
    "Start",
    "Drop",
    "Effect",
    "address_key",
]


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """How many unproven connections a listener keeps, in which states (see the module docstring)."""

    #: Connections holding a slot (a task running their handshake) at once.
    pending: int
    #: Slots one source address may hold at once.
    per_address: int
    #: Connections accepted and parked until a slot frees.
    waiting: int

    def __post_init__(self) -> None:
        if self.pending < 1 or self.per_address < 1 or self.waiting < 0:
            raise InvalidArgument(f"admission limits need pending >= 1, per_address >= 1, waiting >= 0; got {self}")

    def within(self, descriptors: int) -> AdmissionLimits:
        """These limits shrunk (if need be) so that slots and waiting room together hold at
        most ``descriptors`` connections: slots take at most half of them (at least one), the
        waiting room the rest."""
        pending = max(1, min(self.pending, descriptors // 2))
        waiting = max(0, min(self.waiting, descriptors - pending))
        return AdmissionLimits(pending, min(self.per_address, pending), waiting)


class TicketState(enum.Enum):
    WAITING = "waiting"  # accepted and parked
    PENDING = "pending"  # holds a slot: its handler runs
    DONE = "done"  # gave its slot back, or was dropped


@dataclasses.dataclass(eq=False)
class Ticket:
    """One accepted connection's place in the admission (identity is the connection)."""

    key: str
    arrived: float
    state: TicketState = TicketState.WAITING


@dataclasses.dataclass(frozen=True)
class Start:
    """Effect: start the handler of this (formerly waiting or new) connection; it holds a slot."""

    ticket: Ticket


@dataclasses.dataclass(frozen=True)
class Drop:
    """Effect: close this waiting connection unserved (``reason`` says why, for the log)."""

    ticket: Ticket
    reason: str


Effect = Start | Drop


def address_key(remote_address: str) -> str:
    """The source a connection counts against: its IPv4 address, the /64 prefix of an IPv6 one
    (an IPv4-mapped IPv6 address counts as the IPv4 address), or the host as written for a
    name that is not an IP address (the simulator's hosts)."""
    try:
        host = parse_address(remote_address)[0]
    except InvalidArgument:
        return remote_address
    host = host.split("%", 1)[0]  # an IPv6 zone id names the interface, not the host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class Admission:
    """The admission state of one listener (see the module docstring).  Pure and synchronous:
    the caller passes the time and executes the returned effects in order."""

    def __init__(self, limits: AdmissionLimits, *, wait_timeout: float) -> None:
        if wait_timeout <= 0:
            raise InvalidArgument(f"wait_timeout must be positive, got {wait_timeout}")
        self.limits = limits
        self.wait_timeout = wait_timeout
        self._pending: dict[str, int] = {}  # key -> slots held (only keys holding one)
        self._waiting: dict[str, deque[Ticket]] = {}  # key -> waiters, oldest first (only non-empty)
        self._pending_total = 0
        self._waiting_total = 0
        self._served: dict[str, int] = {}  # key -> when it last got a slot (a counter: round robin)
        self._serial = 0

    # --- the interface ------------------------------------------------------------------------

    def arrive(self, key: str, now: float) -> tuple[Ticket, list[Effect]]:
        """A connection from ``key`` was accepted at ``now``: its ticket, and what to do
        (``Start`` it, or nothing while it waits; ``Drop`` another waiter to make room, or this
        one if there is no waiting room at all)."""
        ticket = Ticket(key, now)
        effects: list[Effect] = self.expire(now)
        if self._pending_total < self.limits.pending and self._pending.get(key, 0) < self.limits.per_address:
            self._start(ticket, effects)
            return ticket, effects
        if self.limits.waiting == 0:
            ticket.state = TicketState.DONE
            effects.append(Drop(ticket, self._why_no_slot(key)))
            return ticket, effects
        if self._waiting_total >= self.limits.waiting:
            victim_key = max(self._waiting, key=self._weight)
            victim, count = self._waiting[victim_key][0], self._weight(victim_key)[0]
            self._remove_waiter(victim)
            effects.append(Drop(victim, f"the waiting room is full ({self.limits.waiting} connections); "
                                        f"its address has {count} waiting or in a handshake"))
        self._waiting.setdefault(key, deque()).append(ticket)
        self._waiting_total += 1
        return ticket, effects

    def release(self, ticket: Ticket, now: float) -> list[Effect]:
        """The connection of ``ticket`` is done with its slot (it proved itself, or failed, or
        its handler ended); a waiting ticket is simply forgotten.  Idempotent.  Returns the
        waiters to start in its place (and any expired ones to drop)."""
        effects: list[Effect] = []
        if ticket.state is TicketState.PENDING:
            ticket.state = TicketState.DONE
            self._pending_total -= 1
            left = self._pending[ticket.key] - 1
            if left:
                self._pending[ticket.key] = left
            else:
                del self._pending[ticket.key]
        elif ticket.state is TicketState.WAITING:
            self._remove_waiter(ticket)
        effects += self.expire(now)
        self._fill(effects)
        return effects

    def expire(self, now: float) -> list[Effect]:
        """Drop the waiters that have waited ``wait_timeout`` by ``now``."""
        effects: list[Effect] = []
        limit = now - self.wait_timeout
        for key in [k for k, q in self._waiting.items() if q[0].arrived <= limit]:
            queue = self._waiting[key]
            while queue and queue[0].arrived <= limit:
                ticket = queue[0]
                self._remove_waiter(ticket)
                effects.append(Drop(ticket, f"no handshake slot came free within {self.wait_timeout:g} s"))
        return effects

    @property
    def next_deadline(self) -> float | None:
        """When the oldest waiter gives up (``None`` while nobody waits)."""
        if not self._waiting:
            return None
        return min(q[0].arrived for q in self._waiting.values()) + self.wait_timeout

    @property
    def pending(self) -> int:
        return self._pending_total

    @property
    def waiting(self) -> int:
        return self._waiting_total

    def pending_from(self, key: str) -> int:
        return self._pending.get(key, 0)

    def waiting_from(self, key: str) -> int:
        queue = self._waiting.get(key)
        return len(queue) if queue else 0

    # --- internals ------------------------------------------------------------------------------

    def _start(self, ticket: Ticket, effects: list[Effect]) -> None:
        ticket.state = TicketState.PENDING
        self._pending[ticket.key] = self._pending.get(ticket.key, 0) + 1
        self._pending_total += 1
        self._serial += 1
        self._served[ticket.key] = self._serial
        effects.append(Start(ticket))

    def _fill(self, effects: list[Effect]) -> None:
        """Give free slots to waiters: the address with the fewest slots first (the one served
        longest ago among equals), its newest waiter first."""
        while self._pending_total < self.limits.pending and self._waiting:
            eligible = [k for k in self._waiting if self._pending.get(k, 0) < self.limits.per_address]
            if not eligible:
                return
            key = min(eligible, key=lambda k: (self._pending.get(k, 0), self._served.get(k, 0)))
            queue = self._waiting[key]
            ticket = queue.pop()
            if not queue:
                del self._waiting[key]
            self._waiting_total -= 1
            self._start(ticket, effects)
        self._forget_idle_keys()

    def _remove_waiter(self, ticket: Ticket) -> None:
        queue = self._waiting[ticket.key]
        queue.remove(ticket)  # the oldest (expiry, overflow) or a rare early release: cheap enough
        if not queue:
            del self._waiting[ticket.key]
        self._waiting_total -= 1
        ticket.state = TicketState.DONE

    def _weight(self, key: str) -> tuple[int, float]:
        """Order of displacement: most connections first, then the oldest waiter first."""
        queue = self._waiting[key]
        return len(queue) + self._pending.get(key, 0), -queue[0].arrived

    def _why_no_slot(self, key: str) -> str:
        if self._pending.get(key, 0) >= self.limits.per_address:
            return f"its address holds {self.limits.per_address} handshake slots already"
        return f"all {self.limits.pending} handshake slots are taken"

    def _forget_idle_keys(self) -> None:
        # The round-robin memory only matters for addresses that still have connections here.
        if len(self._served) > 4 * (len(self._pending) + len(self._waiting)) + 64:
            self._served = {k: v for k, v in self._served.items() if k in self._pending or k in self._waiting}
