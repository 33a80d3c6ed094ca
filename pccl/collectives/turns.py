"""How many large operations run their lane threads at once on one set of ring links, and in
which order they start.

Why: a large op on real TCP runs one sender and one receiver thread per lane
(:mod:`pccl.collectives.threaded`).  With hundreds of them called at once, every op started its
threads together: thousands of threads fought for the GIL and for each lane's send lock and read
role while the Trio thread (which reads the master connection and sends heartbeats) starved —
measured on the 2-core box, 300 concurrent 512 KiB all-reduces on two in-process peers took
34.5 s with 1,199 threads alive, and 500 did not finish in 60 s.  The lanes are one pipe each
way: ops running side by side only share it, so a few at a time move the same bytes.

How: :class:`ThreadTurns` gives at most :data:`THREAD_OPS` ops of a :class:`~pccl.collectives.links.RingLinks`
a *turn* (their threads) at once; the others wait in Trio, which costs nothing while they wait.
Turns are given in **commence order**: an op is admitted only when no op commenced before it
is still waiting for its turn here or commenced here without having reached its data path yet
(:meth:`SeqRegistry.commenced <pccl.collectives.seq_registry.SeqRegistry.commenced>`, recorded by the
communicator as the master's Commences arrive, which every participant sees in the same
order, and as it sends a Begin on the fast path).  The order is that of the records, not of
the seqs: the master's seqs count up as it commences, but a begun op's derived seq sorts after
all of them although every participant commenced it before the ops voted after it.  Admission
in any other order could deadlock across peers: peer A running ops 5-8 while waiting for B, B
running 9-12 while waiting for A.  In commence order the earliest unfinished op gets its turn
on every participant, so the run always progresses.  An op that ends or is
cancelled before its turn (its seq retired, or its wait cancelled) leaves the order at once.
Ops whose seq nobody recorded as commenced (the collectives called directly, without a
communicator) have no known order: they run at once, without a turn, as they always did —
except on the partner links, where such an op takes the one turn only when it is free
(:meth:`ThreadTurns.try_take`; :mod:`pccl.collectives.halving`).

With ``beside`` (the partner links' turns: begun ops), an op for which it holds is admitted past
the slots, in its commence-order place, while every op holding a turn is one for which it holds
too (docs/protocol.rst, "Crossings").

A single op, or the first of a batch, is admitted without waiting: the fast path costs one
comparison.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable
from typing import Protocol

import trio

__all__ = ["ThreadTurns", "THREAD_OPS"]

#: Ops of one set of ring links whose lane threads run at once.  Two let one op's start overlap
#: the previous one's end; more only add threads contending for the same lanes.
THREAD_OPS = 2


class CommenceOrder(Protocol):
    """What :class:`ThreadTurns` needs of the registry that records commenced seqs."""

    def is_commenced(self, seq: int) -> bool: ...
    def rank(self, seq: int) -> int | None: ...
    def first_commenced(self) -> int | None: ...
    def started(self, seq: int) -> None: ...
    def add_turn_listener(self, admit: Callable[[], None]) -> None: ...


class ThreadTurns:
    """The turns of one set of ring links' large ops (see the module docstring).  Trio thread only."""

    def __init__(self, order: CommenceOrder, slots: int = THREAD_OPS,
                 beside: Callable[[int], bool] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"need at least one turn at a time, got {slots}")
        self._order = order
        self._slots = slots
        #: Which ops may run beside each other past the slots (see :meth:`_admit`).
        self._beside = beside
        self._running = 0
        #: Of _running, the ops admitted as ``beside``, by seq (recorded at admission: a turn
        #: taken otherwise, by :meth:`try_take`, is not one of them whatever its seq).
        self._beside_seqs: collections.Counter[int] = collections.Counter()
        #: Ops waiting for their turn: (rank in the commence order, counter, seq, event), a heap.
        self._waiting: list[tuple[int, int, int, trio.Event]] = []
        self._counter = 0  # ties (one seq used twice, as tests may) keep arrival order
        order.add_turn_listener(self._admit)

    @property
    def running(self) -> int:
        """Ops that hold a turn now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Ops waiting for their turn."""
        return len(self._waiting)

    async def take(self, seq: int) -> bool:
        """Wait for ``seq``'s turn; True if it took one, to be given back with :meth:`give_back`
        once its threads have all returned.  An op whose seq was never recorded as commenced
        (the collectives called directly, as tests do: nothing tells its order) runs at once,
        without a turn (False).

        Cancellation while waiting leaves the order (the next op may be admitted) and raises
        ``Cancelled``; no turn is held then.  No other error escapes.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        rank = self._order.rank(seq)
        if rank is None:
            return False
        entry = (rank, self._counter, seq, trio.Event())
        self._counter += 1
        heapq.heappush(self._waiting, entry)
        self._order.started(seq)  # it waits here now: later ops wait for it through _waiting
        self._admit()
        if entry[3].is_set():
            return True  # the fast path: nobody ahead
        try:
            await entry[3].wait()
            return True
        except BaseException:
            if entry[3].is_set():
                self.give_back(seq)  # admitted and cancelled at once: pass the turn on
            else:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
                self._admit()  # it may have held back the next one
            raise

    def try_take(self) -> bool:
        """Take a turn at once if one is free and no op waits for one (to be given back with
        :meth:`give_back`); else False.  For an op outside the commence order that must not run
        beside others (:mod:`pccl.collectives.halving`)."""
        if self._running >= self._slots or self._waiting:
            return False
        self._running += 1
        return True

    def give_back(self, seq: int | None = None) -> None:
        """An admitted op's threads have all returned: the next op may take its turn.  ``seq``:
        the op's, needed when these turns admit ops ``beside`` each other."""
        self._running -= 1
        if seq is not None and self._beside_seqs[seq]:
            self._beside_seqs[seq] -= 1
            if not self._beside_seqs[seq]:
                del self._beside_seqs[seq]
        self._admit()

    def _admit(self) -> None:
        """Give turns to waiting ops in commence order, while turns are free and no op
        commenced earlier is still to come to its data path.  With ``beside``, the next op in
        that order for which it holds is also admitted past the slots while every op holding a
        turn is one for which it holds (:mod:`pccl.collectives.links`: begun ops on the partner
        links, whose commence order differs between peers only in a crossing)."""
        while self._waiting:
            rank, _, seq, event = self._waiting[0]
            side = self._beside is not None and self._beside(seq)
            if self._running >= self._slots and not (side and self._running == self._beside_seqs.total()):
                return
            first = self._order.first_commenced()
            first_rank = None if first is None else self._order.rank(first)
            if first_rank is not None and first_rank < rank:
                return
            heapq.heappop(self._waiting)
            self._running += 1
            if side:
                self._beside_seqs[seq] += 1
            event.set()
