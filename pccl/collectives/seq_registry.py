"""Which operation seqs have ended, been commenced or started on a peer (:class:`SeqRegistry`,
shared by every inbox of a communicator), and the one rule both kinds of lane reader apply to a
data frame's header (:func:`classify`).  Split from :mod:`pccl.collectives.links`, which
re-exports them."""

from __future__ import annotations

import collections
import enum
import heapq
import weakref
from collections.abc import Callable

from ..protocol.codec import DataHeader

__all__ = ["SeqRegistry", "FrameAction", "classify"]

#: How many retired seqs are remembered.  A late frame belongs to an op that ended moments ago;
#: this only bounds memory over a long run.
_RETIRED_MEMORY = 1 << 16


class SeqRegistry:
    """Which operation seqs have ended on this peer, shared by all inboxes of a communicator;
    and which were commenced here but have not reached their data path yet (the order in which
    :class:`~pccl.collectives.turns.ThreadTurns` admits large ops).

    Every retirement wakes the operations waiting on a parked header so they re-check it.
    """

    def __init__(self) -> None:
        self._retired: set[int] = set()
        self._order: collections.deque[int] = collections.deque()
        # Weak: inboxes of torn-down rings must not live as long as the communicator's registry.
        self._listeners: list[weakref.WeakMethod[Callable[[], None]]] = []
        #: Seqs commenced here that have not reached their data path, nor ended, with their rank
        #: in the commence order (a heap of (rank, seq) with lazy deletion over the dict).
        self._commenced: dict[int, int] = {}
        self._commenced_heap: list[tuple[int, int]] = []
        self._next_rank = 0
        #: Seqs commenced or started here and not retired: a frame of any other begun op
        #: (derived seq) is read off its lane into memory rather than parked
        #: (:class:`~pccl.collectives.links.Inbox`).
        self._known: set[int] = set()
        self._turn_listeners: list[weakref.WeakMethod[Callable[[], None]]] = []

    def add_listener(self, wake: Callable[[], None]) -> None:
        """Call the bound method ``wake()`` (on the Trio thread) at every change while its
        object lives: an Inbox wakes its waiting readers (tasks and threads) this way."""
        self._listeners = [ref for ref in self._listeners if ref() is not None]
        self._listeners.append(weakref.WeakMethod(wake))  # type: ignore[arg-type]

    def add_turn_listener(self, admit: Callable[[], None]) -> None:
        """Call the bound method ``admit()`` (Trio thread) whenever a commenced seq reaches its
        data path or ends, while its object lives: a :class:`~pccl.collectives.turns.ThreadTurns`
        may then admit the next op."""
        self._turn_listeners = [ref for ref in self._turn_listeners if ref() is not None]
        self._turn_listeners.append(weakref.WeakMethod(admit))  # type: ignore[arg-type]

    def is_retired(self, seq: int) -> bool:
        return seq in self._retired

    def commenced(self, seq: int) -> None:
        """The master commenced ``seq`` with this peer, or this peer began it (call in the order
        the Commences arrive and the Begins are sent, before the op can reach its data path):
        until :meth:`started` or :meth:`retire`, large ops commenced *after* it wait for it
        (:class:`~pccl.collectives.turns.ThreadTurns`).

        The order is the order of these calls, not of the seqs: the master's seqs count up in
        the order it sends the Commences, but a begun op's derived seq (top bit set) sorts after
        all of them, although a peer that began it ran it before any later Commence arrived,
        and a peer that voted for it was told it before any op its Begin preceded.  Ordered by
        seq, the voter ran a later voted op first on the partner links while the beginner ran
        the begun one: each waited for the other's frames until the watchdog aborted both."""
        if seq in self._retired or seq in self._commenced:
            return
        self._known.add(seq)
        rank = self._next_rank
        self._next_rank = rank + 1
        self._commenced[seq] = rank
        heapq.heappush(self._commenced_heap, (rank, seq))

    def rank(self, seq: int) -> int | None:
        """``seq``'s place in the commence order while it is commenced here (neither started
        nor ended): lower ranks were commenced earlier."""
        return self._commenced.get(seq)

    def started(self, seq: int) -> None:
        """``seq`` reached its data path (or never will): it no longer holds later ops back.
        Idempotent."""
        if seq not in self._retired:
            self._known.add(seq)
        if seq in self._commenced:
            del self._commenced[seq]
            if not self._commenced:
                self._commenced_heap.clear()  # the lazily deleted entries go too
            else:
                self.first_commenced()  # drops those below the lowest one left
            for ref in self._turn_listeners:
                admit = ref()
                if admit is not None:
                    admit()

    def is_known(self, seq: int) -> bool:
        """Whether ``seq`` was commenced or started here and has not ended."""
        return seq in self._known

    def is_commenced(self, seq: int) -> bool:
        """Whether ``seq`` was commenced here and has neither started nor ended."""
        return seq in self._commenced

    def first_commenced(self) -> int | None:
        """The seq commenced here first of those that have neither started nor ended, if any."""
        heap = self._commenced_heap
        commenced = self._commenced
        while heap and commenced.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def retire(self, seq: int) -> None:
        """Mark ``seq`` ended: its frames still in flight will be discarded.  Idempotent."""
        if seq in self._retired:
            return
        self._retired.add(seq)
        self._known.discard(seq)
        self._order.append(seq)
        while len(self._order) > _RETIRED_MEMORY:
            self._retired.discard(self._order.popleft())
        self.started(seq)
        self.notify()

    def notify(self) -> None:
        """Wake every waiter (they re-check their condition)."""
        for ref in self._listeners:
            wake = ref()
            if wake is not None:
                wake()


class FrameAction(enum.Enum):
    """What a reader does with the data frame whose header it just read."""

    TAKE = "take"  # the reader's own frame: receive its payload
    DISCARD = "discard"  # a late frame of an op that ended here: drop its payload
    PARK = "park"  # another op's frame (running here, or about to start): leave it for its owner


def classify(header: DataHeader, seq: int, registry: SeqRegistry) -> FrameAction:
    """The one rule both kinds of reader (Trio task, worker thread) apply to a data frame."""
    if header.op_seq == seq:
        return FrameAction.TAKE
    if registry.is_retired(header.op_seq):
        return FrameAction.DISCARD
    return FrameAction.PARK
