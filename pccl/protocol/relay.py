"""Who meets whom at a relay: the pairing rule of relay joins (sans-IO).

Two peers the master sent to a relay (``RelayOffer``) each dial it and present
``RelayJoin(key, peer_id, partner)``.  The rule, in the order it is checked:

* the key is :data:`~pccl.protocol.master.paths.RELAY_KEY_SIZE` bytes, and a peer does not
  name itself as its partner;
* a key whose pair is spliced already is not joined again (keys are drawn fresh for each
  attempt: a third join with a key in use is a replay);
* the first join of a key waits for its partner, if there is room: at most
  :attr:`JoinLimits.waiting` joins wait at once, and at most
  :attr:`JoinLimits.waiting_per_address` of them from one source address
  (:func:`pccl.net.admission.address_key`), so one host cannot fill the room of the others;
* the second join of a key must come from the partner the first one named, naming the first
  as its partner (the same peer twice, or anyone else, is refused: the first keeps waiting);
* the two are paired if fewer than :attr:`JoinLimits.pairs` pairs are spliced; otherwise both
  are refused (the relay is full).

A waiting join that its partner does not meet in time is withdrawn by the caller
(:meth:`Rendezvous.withdraw`), which also knows how long that is (``Config.connect_timeout``).
:class:`Rendezvous` keeps no time and does no I/O: :mod:`pccl.relay.hub` is its Trio shell.
"""

from __future__ import annotations

import dataclasses
import enum

from ..errors import InvalidArgument
from .master.paths import RELAY_KEY_SIZE

__all__ = ["JoinLimits", "RELAY_JOIN_LIMITS", "JoinState", "Join", "Wait", "Pair", "Refuse", "Outcome", "Rendezvous"]


@dataclasses.dataclass(frozen=True)
class JoinLimits:
    """How many joins a relay keeps waiting and how many pairs it splices at once."""

    #: Joins waiting for their partner, in all.
    waiting: int = 1024
    #: Joins waiting for their partner from one source address (a NAT holds many peers, and a
    #: peer joins once per connection it relays: up to ``Config.p2p_lanes`` of them at once).
    waiting_per_address: int = 256
    #: Pairs spliced at once (each holds two connections and up to two splice buffers).
    pairs: int = 512

    def __post_init__(self) -> None:
        if self.waiting < 1 or self.waiting_per_address < 1 or self.pairs < 1:
            raise InvalidArgument(f"join limits must all be at least 1, got {self}")


#: The default limits (:class:`JoinLimits`).
RELAY_JOIN_LIMITS = JoinLimits()


class JoinState(enum.Enum):
    WAITING = "waiting"  # for its partner
    PAIRED = "paired"  # met its partner: the pair is spliced (or being spliced)
    DONE = "done"  # withdrawn, refused, or its pair ended


@dataclasses.dataclass(eq=False)
class Join:
    """One join (identity is the connection that presented it)."""

    key: bytes
    peer_id: int
    partner: int
    source: str
    state: JoinState = JoinState.WAITING


@dataclasses.dataclass(frozen=True)
class Wait:
    """Outcome: ``join`` waits for its partner."""

    join: Join


@dataclasses.dataclass(frozen=True)
class Pair:
    """Outcome: ``second`` met ``first``, which was waiting: splice them."""

    first: Join
    second: Join


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Outcome: the new join is refused for ``reason``; so is ``waiter`` (the join it would have
    been paired with) when it is not ``None``."""

    reason: str
    waiter: Join | None = None


Outcome = Wait | Pair | Refuse


class Rendezvous:
    """The joins of one relay (see the module docstring).  Pure and synchronous."""

    def __init__(self, limits: JoinLimits = RELAY_JOIN_LIMITS) -> None:
        self.limits = limits
        self._waiting: dict[bytes, Join] = {}
        self._per_source: dict[str, int] = {}  # only sources with a waiting join
        self._spliced: set[bytes] = set()  # keys of the pairs spliced now

    @property
    def waiting(self) -> int:
        """Joins waiting for their partner."""
        return len(self._waiting)

    @property
    def pairs(self) -> int:
        """Pairs spliced (or being spliced)."""
        return len(self._spliced)

    def waiting_from(self, source: str) -> int:
        return self._per_source.get(source, 0)

    def join(self, key: bytes, peer_id: int, partner: int, source: str) -> Outcome:
        """Peer ``peer_id`` (connected from ``source``, an :func:`~pccl.net.admission.address_key`)
        joins ``key`` to meet ``partner``."""
        if len(key) != RELAY_KEY_SIZE:
            return Refuse(f"a relay key is {RELAY_KEY_SIZE} bytes, this join's has {len(key)}")
        if peer_id == partner:
            return Refuse(f"peer {peer_id:x} named itself as its partner")
        if key in self._spliced:
            return Refuse("the pair of this key is spliced already (a key serves one connection)")
        first = self._waiting.get(key)
        if first is None:
            if len(self._waiting) >= self.limits.waiting:
                return Refuse(f"the relay is full: {self.limits.waiting} joins wait for their partner")
            if self._per_source.get(source, 0) >= self.limits.waiting_per_address:
                return Refuse(f"{self.limits.waiting_per_address} joins from {source} wait for their partner already")
            join = Join(key, peer_id, partner, source)
            self._waiting[key] = join
            self._per_source[source] = self._per_source.get(source, 0) + 1
            return Wait(join)
        if peer_id == first.peer_id:
            return Refuse(f"peer {peer_id:x} joined this key twice")
        if peer_id != first.partner or partner != first.peer_id:
            return Refuse(f"peer {peer_id:x} (for peer {partner:x}) is not the partner this key waits for "
                          f"(peer {first.partner:x}, for peer {first.peer_id:x})")
        self._remove_waiter(first)
        if len(self._spliced) >= self.limits.pairs:
            first.state = JoinState.DONE
            return Refuse(f"the relay is full: {self.limits.pairs} pairs are spliced", waiter=first)
        second = Join(key, peer_id, partner, source, JoinState.PAIRED)
        first.state = JoinState.PAIRED
        self._spliced.add(key)
        return Pair(first, second)

    def withdraw(self, join: Join) -> bool:
        """``join`` stops waiting (no partner in time, its connection went, the relay stops).
        ``True`` if it was waiting; ``False`` (and nothing changes) once it was paired or done."""
        if join.state is not JoinState.WAITING:
            return False
        self._remove_waiter(join)
        join.state = JoinState.DONE
        return True

    def pair_ended(self, first: Join, second: Join) -> None:
        """The splice of a :class:`Pair` ended (idempotent)."""
        if first.state is JoinState.PAIRED:
            self._spliced.discard(first.key)
        first.state = second.state = JoinState.DONE

    def _remove_waiter(self, join: Join) -> None:
        del self._waiting[join.key]
        left = self._per_source[join.source] - 1
        if left:
            self._per_source[join.source] = left
        else:
            del self._per_source[join.source]
