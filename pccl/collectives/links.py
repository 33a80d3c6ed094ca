"""The data connections of one ring position: lanes to the successor and from the predecessor
(and partner links).

A :class:`RingLinks` bundles, for the current ring, ``lanes`` framed connections on which this
peer *sends* to its successor and ``lanes`` on which it *receives* from its predecessor (with two
peers both may be the same connections, used in opposite directions).  It outlives operations:
the communicator builds one per ring configuration and hands it to every all-reduce.

Several operations share the lanes at once.  Sending needs no coordination beyond
:class:`~pccl.net.framed.FramedConnection`'s send lock (frames stay whole).  Receiving is
demultiplexed by the frame header's ``op_seq`` without copies and without a reader task:

* A receiving operation takes the lane's *read role* (one reader at a time, a Trio task or a
  worker thread), reads the next data header (a cancellable, resumable read) and, if the header
  is its own, receives the payload straight into its destination while still holding the role.
* A header of another operation that is running or about to start here is *parked*: the read
  role is given up and the owner's reader, if it waits, is woken (no other Trio waiter is: with
  thousands of ops on a lane, waking all at every frame cost quadratic time); the owner picks
  it up when it asks for its next frame.  Because each lane carries every operation's frames
  in the senders' order and the master starts an operation on all peers, the owner will come.
* A header of a begun op (a derived seq, fast commit) that this peer has neither commenced nor
  started is *kept*: its payload is read into memory and the lane read on; the op takes its
  kept frames first when it begins here, and a retirement drops them.  Parked, it could block
  frames this peer needs before it begins that op (peers that began two ops in different
  orders: docs/protocol.rst, "Crossings").  What an inbox keeps is bounded
  (:data:`KEPT_BYTES_LIMIT`): a frame that would take it over the bound is parked instead (the
  sender is then held back by TCP, as before; a frame larger than the bound alone is never read
  into memory), and is read into memory after all once kept frames were taken and it fits.
  Kept frames are dropped when their seq retires and when the links are replaced or closed
  (:meth:`RingLinks.drop_kept`: a new topology round, a new master epoch, an abort), since a
  derived seq belongs to one round and can no longer start after it.  A partner link's inbox
  keeps a running begun op's frames too (``keep_running``): begun ops run beside each other
  there, each reading several links in its own order.
* A header of an operation that ended here (:meth:`SeqRegistry.retire`, called when an op
  finishes or aborts, and by the communicator for seqs it never started) is a *late frame*: its
  payload is discarded.  A late frame can therefore never be taken for a later operation's.

On real TCP the lanes also offer a thread-side fast path
(:class:`~pccl.net.framed_threads.BlockingDataChannel`): large all-reduces then run their
per-lane send and receive loops in worker threads, and :meth:`Inbox.receive_blocking` does the
same demultiplexing with a threading condition.  Small all-reduces on the same links run in their
Trio task (:mod:`pccl.collectives.inline`) and read through :meth:`Inbox.receive_into`; the read
role and the parked header are shared by both kinds of reader, so the two kinds of operation
run concurrently on one lane (a thread that gives the role up wakes waiting Trio tasks through
the Trio token).  Large ops take their threads a few at a time, in commence order
(:attr:`RingLinks.turns`): the earliest unfinished op gets its turn on every peer, so the run
progresses (in arrival order two peers could run disjoint ops, each waiting behind a frame
parked for an op the other has not admitted).

Both kinds of reader apply one rule to every header (:func:`classify`: take, discard, park) and
one check to their own frames (:meth:`Inbox._check_own`).  A lane whose frame was torn — a
payload receive or a send cancelled midway — is aborted by the framed connection itself; a lane
that delivered a malformed or unexpected header is marked broken, and the op that met it aborts
it when it ends (:meth:`RingLinks.abort_broken`, on the Trio thread, once no worker thread uses
it).  Every later use raises; the communicator then rebuilds the links (the re-wire that follows
an abort).  Cancelling an operation while it merely waits for a header or for a lane lock leaves
the lane intact.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import trio

from ..errors import InvalidArgument, InvalidUsage, ProtocolError
from ..net.framed import FramedConnection
from ..net.framed_threads import BlockingDataChannel, thread_channel
from ..net.thread_io import ThreadCancel
from ..protocol.algorithms import AllReduceAlgorithm
from ..protocol.codec import DataHeader
from ..protocol.peer_ack import ack_targets
from .frame_finish import finish_discard, finish_payload
from .lane_sends import LaneSends
from .seq_registry import FrameAction, SeqRegistry, classify
from .turns import ThreadTurns

__all__ = ["KEPT_BYTES_LIMIT", "SeqRegistry", "FrameAction", "classify", "Inbox", "RingLinks"]

logger = logging.getLogger(__name__)

#: How many payload bytes one inbox keeps, at most, for begun ops not known here yet
#: (:meth:`Inbox._stashable`).  A frame that would take it over this bound is parked at the head
#: of the inbox instead (TCP then holds its sender back).  The trade-off: a crossing whose kept
#: frames fit (small ops, and a step of a large op's frames) does not block the link; one larger
#: than this still parks, and waits for its op to begin here (docs/protocol.rst, "Frames for an op
#: a neighbour has not begun yet").  Without a bound, a broadcast root streaming 256 MiB to a
#: peer that had not begun the op, or a peer sending frames of seqs that never start, made the
#: receiver hold all of it in memory.
KEPT_BYTES_LIMIT = 4 << 20


class Inbox:
    """The receiving side of one lane: demultiplexes data frames by ``op_seq``.

    ``kept_limit``: the most payload bytes kept in memory for begun ops not known here yet
    (default :data:`KEPT_BYTES_LIMIT`); beyond it their frames park.  ``keep_running``: keep
    the frames of begun ops running here too, not only of those not known here (a partner
    link's, where begun ops run beside each other: :attr:`RingLinks.partner_turns`); Trio
    readers only."""

    def __init__(self, connection: FramedConnection, registry: SeqRegistry, *,
                 kept_limit: int = KEPT_BYTES_LIMIT, keep_running: bool = False) -> None:
        if kept_limit < 0:
            raise InvalidArgument(f"kept_limit must be >= 0, got {kept_limit}")
        self.connection = connection
        self.kept_limit = kept_limit
        self.keep_running = keep_running
        self._registry = registry
        self._parked: DataHeader | None = None
        # One reader at a time, a Trio task or a worker thread: whoever holds the read role
        # (_reading) reads headers and payloads; the state is guarded by _cond.
        self._cond = threading.Condition()
        self._reading = False
        #: Worker threads inside a wait loop of :meth:`receive_blocking` (guarded by _cond; each
        #: counts itself *before* checking its condition, so a waker that reads 0 without the
        #: lock, after changing what they check, has no thread to wake).
        self._thread_waiters = 0
        #: Trio tasks waiting for the read role, in arrival order: (their op's seq, their event).
        #: Only a task that may read now is woken (:meth:`_wake_trio`): with thousands of ops
        #: waiting on one lane, waking them all at every frame cost quadratic time.
        self._trio_waiters: collections.deque[tuple[int, trio.Event]] = collections.deque()
        #: Frames of begun ops not known here yet (:meth:`_stashable`), read off the lane in
        #: arrival order, by seq (guarded by _cond; their owner takes them before the lane's).
        self._stash: dict[int, collections.deque[tuple[DataHeader, bytearray]]] = {}
        self._kept_bytes = 0  # payload bytes in _stash (guarded by _cond)
        self._capped_seq: int | None = None  # the last seq whose frame parked for the bound (logged once)
        self.channel: BlockingDataChannel | None = thread_channel(connection)
        # Threads wake Trio readers through the run's token (only lanes with threads need it).
        self._token = trio.lowlevel.current_trio_token() if self.channel is not None else None
        registry.add_listener(self.wake_threads)

    def wake_threads(self) -> None:
        """Wake the readers waiting for the lane (Trio thread): threads waiting in
        :meth:`receive_blocking` re-check their condition, and the Trio task waiting in
        :meth:`receive_into` that may read now, if any, is woken.  Nothing to do (no lock
        taken) when nobody waits: every small op ends here.  Frames kept for ops that ended
        (:meth:`_stashable`) are dropped here too (a retirement notifies every inbox)."""
        if self._stash:
            with self._cond:
                for seq in [q for q in self._stash if self._registry.is_retired(q)]:
                    self._drop_seq(seq, "it ended here")
        if self._thread_waiters:
            with self._cond:
                self._cond.notify_all()
        if self._trio_waiters:  # only the Trio thread adds to it
            self._wake_trio()

    def _wake_trio(self) -> None:
        """Wake the Trio waiter that may take the read role now (Trio thread): the owner of the
        parked header, or the longest waiting one when nothing is parked (or the parked frame
        is late).  Nobody while the role is held: its holder wakes the next one."""
        with self._cond:
            if self._reading or not self._trio_waiters:
                return
            header = self._parked
            if header is None or not self._blocks(header, -1):
                chosen = [self._trio_waiters.popleft()]
            else:
                chosen = [w for w in self._trio_waiters if w[0] == header.op_seq]
                if chosen:
                    self._trio_waiters = collections.deque(w for w in self._trio_waiters if w[0] != header.op_seq)
        for _seq, event in chosen:
            event.set()

    def _wake_from_thread(self) -> None:
        """Worker-thread side of :meth:`wake_threads` for the Trio waiters (call with _cond held)."""
        if self._trio_waiters and self._token is not None:
            try:
                self._token.run_sync_soon(self._wake_trio)
            except trio.RunFinishedError:  # pragma: no cover - the run is over: nobody waits
                pass

    def _can_read(self, seq: int) -> bool:
        """Whether ``seq``'s reader may take the read role now (call with _cond held)."""
        if self._reading:
            return False
        header = self._parked
        return header is None or not self._blocks(header, seq)

    def _blocks(self, header: DataHeader, seq: int) -> bool:
        """Whether the parked ``header`` keeps ``seq``'s reader off the lane (call with _cond
        held): another op's frame that may not be kept now (a parked frame of a begun op is read
        into memory by the next reader once it fits)."""
        return classify(header, seq, self._registry) is FrameAction.PARK and not self._stashable(header)

    async def _take_read_role(self, seq: int) -> tuple[bool, DataHeader | None]:
        """Take the read role for ``seq``'s reader; returns ``(True, header)`` with the parked
        header it must handle first (its own, or a late one to discard), or ``None``; or
        ``(False, None)`` without the role when a frame of ``seq`` was kept meanwhile (another
        reader read it into memory: :attr:`keep_running`), to be taken first.  Cancellable
        while waiting (a task woken and cancelled at once passes the wake-up on)."""
        while True:
            with self._cond:
                if self._stash.get(seq):
                    return False, None
                if self._can_read(seq):
                    self._reading = True
                    return True, self._parked
                entry = (seq, trio.Event())
                self._trio_waiters.append(entry)
            try:
                await entry[1].wait()
            except BaseException:
                with self._cond:
                    try:
                        self._trio_waiters.remove(entry)
                    except ValueError:
                        pass
                if entry[1].is_set():
                    self._wake_trio()
                raise

    def _release_read_role(self) -> None:
        with self._cond:
            self._reading = False
        self.wake_threads()

    def _check_own(self, header: DataHeader, stream: int, step: int, offset: int, nbytes: int) -> None:
        """This op's frame must be exactly the one its schedule expects next; otherwise the lane
        is unusable (peers disagree on the schedule, or one misbehaves): receiving is marked
        broken, which makes the op that met it abort the connection when it ends
        (:meth:`RingLinks.abort_broken`), and ``ProtocolError`` is raised."""
        if (header.stream, header.step, header.offset, header.nbytes) == (stream, step, offset, nbytes):
            return
        msg = (
            f"{self.connection.remote_address} sent op {header.op_seq} frame stream={header.stream} "
            f"step={header.step} offset={header.offset} nbytes={header.nbytes}; expected "
            f"stream={stream} step={step} offset={offset} nbytes={nbytes}"
        )
        logger.warning("%s", msg)
        self.connection.frames.mark_receive_broken(msg)
        raise ProtocolError(msg)

    def _stashable(self, header: DataHeader) -> bool:
        """Whether another op's frame is kept in memory instead of parked: a begun op's (derived
        seq: top bit set) that this peer has neither commenced nor started.  Its owner may
        start here only after ops whose frames come later on this lane (peers that began two
        ops in different orders: docs/protocol.rst, "Crossings"); parked, its header would
        block them.  A master's seq is never kept: the commence order settles its owner's
        turn, and ops that are running or commenced here always come for their frames.

        Only while the kept bytes stay within :attr:`kept_limit`: beyond it the frame parks
        (logged once per seq), and TCP holds its sender back.

        With :attr:`keep_running` (a partner link), a frame of a begun op running here is kept
        too: begun ops run beside each other on the partner links, each reading its partners
        in its own order, so a frame parked for one of them while it waits on another link
        would block the link for the op reading it (the owner takes it from memory, woken if
        it waits for the link: :meth:`_wake_owner`)."""
        if not header.op_seq >> 63 or (self._registry.is_known(header.op_seq) and not self.keep_running):
            return False
        if self._kept_bytes + header.nbytes <= self.kept_limit:
            return True
        if self._capped_seq != header.op_seq:
            self._capped_seq = header.op_seq
            logger.info("parking a frame of begun op %d (%d bytes) from %s: %d of %d bytes already kept for ops "
                        "not begun here", header.op_seq, header.nbytes, self.connection.remote_address,
                        self._kept_bytes, self.kept_limit)
        return False

    @property
    def kept_bytes(self) -> int:
        """Payload bytes kept in memory now for begun ops not known here (at most
        :attr:`kept_limit`)."""
        return self._kept_bytes

    def _keep(self, header: DataHeader, payload: bytearray) -> None:
        with self._cond:
            self._stash.setdefault(header.op_seq, collections.deque()).append((header, payload))
            self._kept_bytes += len(payload)

    def _wake_owner(self, seq: int) -> None:
        """A frame of ``seq`` was kept (Trio thread): if its reader waits for the read role, wake
        it to take the frame from memory (:meth:`_take_read_role`)."""
        with self._cond:
            chosen = [w for w in self._trio_waiters if w[0] == seq]
            if chosen:
                self._trio_waiters = collections.deque(w for w in self._trio_waiters if w[0] != seq)
        for _seq, event in chosen:
            event.set()

    def _drop_seq(self, seq: int, why: str, level: int = logging.DEBUG) -> None:
        """Drop ``seq``'s kept frames (call with _cond held)."""
        frames = self._stash.pop(seq)
        nbytes = sum(len(payload) for _, payload in frames)
        self._kept_bytes -= nbytes
        logger.log(level, "dropping %d kept frames (%d bytes) of op %d from %s: %s", len(frames), nbytes, seq,
                   self.connection.remote_address, why)

    def drop_kept(self, why: str) -> None:
        """Drop every kept frame (Trio thread): their ops can no longer start on these links (a
        new round, a new master epoch, the links closing).  Logged per seq at info, with ``why``."""
        if not self._stash:
            return
        with self._cond:
            for seq in list(self._stash):
                self._drop_seq(seq, f"never begun here; {why}", logging.INFO)
        self.wake_threads()  # a frame parked for the bound may be kept now

    def _kept(self, seq: int, stream: int, step: int, offset: int, destination: memoryview, in_thread: bool) -> bool:
        """Hand ``seq``'s oldest kept frame, if any, to its owner (it came before every frame
        of ``seq`` still on the lane).  ``in_thread``: called from a worker thread (else the Trio
        thread), for the wake-up of a reader waiting behind a frame parked for the bound."""
        with self._cond:
            frames = self._stash.get(seq)
            if not frames:
                return False
            header, payload = frames.popleft()
            if not frames:
                del self._stash[seq]
            self._kept_bytes -= len(payload)
            # A frame parked for the bound may fit now: the reader waiting behind it may read it.
            freed = self._parked is not None and not self._reading
            if freed and in_thread:
                self._cond.notify_all()
                self._wake_from_thread()
        if freed and not in_thread:
            self.wake_threads()
        self._check_own(header, stream, step, offset, destination.nbytes)
        destination.cast("B")[:] = payload
        return True

    def _late(self, header: DataHeader) -> None:
        logger.debug("discarding a late frame of ended op %d (%d bytes) from %s", header.op_seq, header.nbytes,
                     self.connection.remote_address)

    def receive_blocking(
        self, *, seq: int, stream: int, step: int, offset: int, destination: memoryview, cancel: ThreadCancel
    ) -> int:
        """:meth:`receive_into` for worker threads (needs :attr:`channel`).

        ``Interrupted`` once ``cancel`` is cancelled while waiting (the lane stays intact; the
        canceller must call :meth:`wake_threads`); a cancellation during the payload is handled
        by the caller aborting the connection (see :class:`~pccl.net.thread_io.ThreadCancel`).
        """
        channel = self.channel
        assert channel is not None
        nbytes = destination.nbytes
        if self._stash and self._kept(seq, stream, step, offset, destination, True):
            return nbytes
        cond = self._cond
        with cond:
            self._thread_waiters += 1
            try:
                while True:
                    cancel.check()
                    if self._can_read(seq):
                        self._reading = True
                        header = self._parked
                        break
                    cond.wait()  # another reader, or another op's frame: its owner takes it (or a retire wakes us)
            finally:
                self._thread_waiters -= 1
        reading = True  # whether this thread holds the lane's read role (self._reading)
        try:
            while True:
                if header is None:
                    header = channel.receive_data_header(cancel)
                action = classify(header, seq, self._registry)
                if action is FrameAction.TAKE:
                    with cond:
                        self._parked = None
                    self._check_own(header, stream, step, offset, nbytes)
                    try:
                        channel.receive_data_into(destination, cancel)
                    except BaseException:
                        self._repark_unread(header)
                        raise
                    return nbytes
                if action is FrameAction.DISCARD:
                    self._late(header)
                    with cond:
                        self._parked = None
                    try:
                        channel.discard_data(cancel)
                    except BaseException:
                        self._repark_unread(header)
                        raise
                    header = None
                    continue
                if self._stashable(header):
                    with cond:
                        self._parked = None
                    payload = bytearray(header.nbytes)
                    try:
                        channel.receive_data_into(memoryview(payload), cancel)
                    except BaseException:
                        self._repark_unread(header)
                        raise
                    self._keep(header, payload)
                    header = None
                    continue
                with cond:  # PARK: leave it for its owner, wait until this op may read again
                    self._parked = header
                    self._reading = reading = False
                    cond.notify_all()
                    self._wake_from_thread()
                    self._thread_waiters += 1
                    try:
                        while True:
                            cancel.check()
                            if self._can_read(seq):
                                self._reading = reading = True
                                header = self._parked
                                break
                            cond.wait()
                    finally:
                        self._thread_waiters -= 1
        finally:
            with cond:
                if reading:
                    self._reading = False
                cond.notify_all()
                self._wake_from_thread()

    def _repark_unread(self, header: DataHeader) -> None:
        """Receiving (or discarding) ``header``'s payload failed.  If the connection is still
        intact, the failure came before the receive started a transfer on the socket (a
        cancellation at its start; what the connection had already buffered may be consumed,
        and the connection counts what is left): park the header again, so the next reader
        discards the rest as a late frame once its op has ended, instead of leaving the lane
        with a frame nobody will finish reading (every later receive would fail)."""
        if not self.connection.broken:
            with self._cond:
                self._parked = header

    async def receive_into(
        self, *, seq: int, stream: int, step: int, offset: int, destination: memoryview, schedule_point: bool = True
    ) -> int:
        """Receive this op's next frame, which must be exactly ``(seq, stream, step, offset)``
        with ``destination.nbytes`` payload bytes, straight into ``destination``.

        Returns the payload size.  Raises :class:`ProtocolError` (after logging; the lane is
        then broken) if the frame of this op that arrives is not the expected one (peers
        disagree on the schedule, or a peer misbehaves), transport errors if the lane is
        broken.  Cancellation while waiting for the frame, or reading another op's (finished shielded:
        :mod:`~pccl.collectives.frame_finish`), loses nothing; during its own payload it aborts
        the lane.  ``schedule_point``: as for :meth:`~pccl.net.framed.FramedConnection.receive_data_into`.
        """
        nbytes = destination.nbytes
        while True:
            if self._stash and self._kept(seq, stream, step, offset, destination, False):
                if schedule_point:
                    await trio.lowlevel.checkpoint()
                return nbytes
            reading, header = await self._take_read_role(seq)
            if reading:
                break
        try:
            while True:
                if header is None:
                    header = await self.connection.receive_data_header()
                action = classify(header, seq, self._registry)
                if action is FrameAction.TAKE:
                    with self._cond:
                        self._parked = None
                    self._check_own(header, stream, step, offset, nbytes)
                    try:
                        await self.connection.receive_data_into(destination, schedule_point=schedule_point)
                    except BaseException:
                        self._repark_unread(header)
                        raise
                    return nbytes
                if action is FrameAction.DISCARD:
                    self._late(header)
                    with self._cond:
                        self._parked = None
                    try:
                        await finish_discard(self.connection)  # a cancelled reader must not cut it
                    except BaseException:
                        self._repark_unread(header)
                        raise
                    header = None
                    continue
                if self._stashable(header):
                    with self._cond:
                        self._parked = None
                    payload = bytearray(header.nbytes)
                    try:
                        await finish_payload(self.connection, memoryview(payload))  # as a discard
                    except BaseException:
                        self._repark_unread(header)
                        raise
                    self._keep(header, payload)
                    self._wake_owner(header.op_seq)
                    header = None
                    continue
                with self._cond:  # PARK: leave it for its owner
                    self._parked = header
                reading = False
                self._release_read_role()
                while True:  # (a frame of this op may be kept meanwhile: take it from memory)
                    reading, header = await self._take_read_role(seq)
                    if reading or self._kept(seq, stream, step, offset, destination, False):
                        break
                if not reading:
                    if schedule_point:
                        await trio.lowlevel.checkpoint()
                    return nbytes
        finally:
            if reading:
                self._release_read_role()


def _begun(seq: int) -> bool:
    """Whether ``seq`` is a begun op's (derived on the fast path: the top bit set)."""
    return bool(seq >> 63)


class RingLinks:
    """The lanes of one ring position: ``to_next[j]`` sends, ``from_prev[j]`` receives lane ``j``.

    Both lists must have the same length on every peer of the ring (``lanes``), since sub-chunk
    ``k`` travels on lane ``k mod lanes``.  With two peers, ``to_next`` and ``from_prev`` may be
    the same connections.  ``threaded`` (default: whenever every connection offers it) selects the
    thread-side fast path for all operations on these links.  The links do not own the
    connections' lifetime: :meth:`aclose` is a convenience for the communicator and tests.
    """

    def __init__(
        self,
        to_next: Sequence[FramedConnection],
        from_prev: Sequence[FramedConnection],
        *,
        registry: SeqRegistry | None = None,
        threaded: bool | None = None,
        partners: Mapping[int, FramedConnection] | None = None,
        algorithm: AllReduceAlgorithm | None = None,
        sites: tuple[int, ...] = (),
        kept_limit: int = KEPT_BYTES_LIMIT,
    ) -> None:
        if not to_next or len(to_next) != len(from_prev):
            raise InvalidArgument(
                f"need the same non-zero number of lanes in both directions, got {len(to_next)} and {len(from_prev)}"
            )
        self.registry = registry if registry is not None else SeqRegistry()
        self.to_next = tuple(to_next)
        self.inboxes = tuple(Inbox(c, self.registry, kept_limit=kept_limit) for c in from_prev)
        channels = [thread_channel(c) for c in self.to_next]
        #: Thread-side senders per lane, when every lane offers the fast path (else ``None``).
        self.send_channels: tuple[BlockingDataChannel, ...] | None = None
        available = all(ch is not None for ch in channels) and all(i.channel is not None for i in self.inboxes)
        if threaded and not available:
            raise InvalidArgument("threaded lanes need connections that offer blocking I/O (real TCP)")
        #: Per lane, the sends small ops could not complete at once (with :attr:`send_channels`).
        self.send_queues: tuple[LaneSends, ...] | None = None
        #: Which large ops run their lane threads now (with :attr:`send_channels`).
        self.turns: ThreadTurns | None = None
        if available and threaded is not False:
            self.send_channels = tuple(ch for ch in channels if ch is not None)
            self.send_queues = tuple(LaneSends() for _ in self.send_channels)
            self.turns = ThreadTurns(self.registry)
        #: Partner links (halving-doubling, :mod:`pccl.collectives.halving`): one connection per
        #: partner's ring position, carrying data frames both ways; its inbox demultiplexes them
        #: by seq like a lane's.  Empty: the ring has none, and every all-reduce takes the ring.
        self.partners: dict[int, Inbox] = {
            position: Inbox(connection, self.registry, kept_limit=kept_limit, keep_running=True)
            for position, connection in sorted((partners or {}).items())
        }
        #: Lane 0 to the successor read backwards: what the successor sends back on it (peer
        #: commit's acks, :mod:`pccl._peer.peer_commit_driver`; nothing else does).  The
        #: predecessor's lane 0 inbox when both directions share one connection.
        self.reverse = (self.inboxes[0] if self.to_next[0] is self.inboxes[0].connection
                        else Inbox(self.to_next[0], self.registry, kept_limit=kept_limit))

        #: The all-reduce algorithm every op on these links is forced to (``None``: chosen per
        #: op; ``Config.all_reduce_algorithm``).
        self.algorithm = algorithm
        #: The site of each ring position (``ConnectToPeers.sites``; ``()`` unknown): whether
        #: all-reduces may run :mod:`pccl.collectives.hierarchical`.
        self.sites = tuple(sites)
        #: Ops on the partner links take turns one at a time, in commence order: a partner link
        #: is read in its frames' order, and two ops whose peers went through them in different
        #: orders could each wait behind a frame of the other (:mod:`pccl.collectives.halving`).
        #: Except begun ops (derived seqs, fast commit) beside each other: two of them run here
        #: at once only in a crossing, whose commence order differs between peers, so in turns
        #: each peer's first waited for the other's frames until the watchdog; side by side,
        #: each reads its frames, and the partner inboxes keep the others' in memory
        #: (``keep_running``; docs/protocol.rst, "Crossings").
        self.partner_turns: ThreadTurns | None = (
            ThreadTurns(self.registry, slots=1, beside=_begun) if self.partners else None)

    def has_partners(self, positions: Sequence[int]) -> bool:
        """Whether there is a partner link to every ring position in ``positions``."""
        partners = self.partners
        if not partners:
            return not positions
        return all(p in partners for p in positions)

    @contextlib.asynccontextmanager
    async def partner_turn(self, seq: int, what: str) -> AsyncIterator[None]:
        """Run op ``seq`` (``what``, for the error) on the partner links in its turn: ops take
        them one at a time in commence order (:attr:`partner_turns`; cancellable while it
        waits).  An op not recorded as commenced runs only when the links are free, else
        ``InvalidUsage``: two such ops beside each other could each wait behind the other's
        frames."""
        turns = self.partner_turns
        taken = False
        if turns is not None:
            if self.registry.is_commenced(seq):
                taken = await turns.take(seq)
            elif turns.try_take():
                taken = True
            else:
                raise InvalidUsage(
                    f"{what} would run over the partner links beside another op, but it was not recorded as "
                    "commenced: record every concurrent op's seq (RingLinks.registry.commenced, in the same order "
                    "on every peer, as the communicator does) or run them one at a time")
        self.registry.started(seq)
        try:
            yield
        finally:
            if taken:
                assert turns is not None
                turns.give_back(seq)

    def ack_links(self, position: int, n: int) -> dict[int, tuple[FramedConnection, Inbox]]:
        """Per ack target of ring ``position`` among ``n`` (:func:`~pccl.protocol.peer_ack.ack_targets`:
        the ring neighbours and the partner links), the connection peer commit's acks to it go
        out on and the inbox its acks come in on, by one rule both ends of a pair apply alike:
        the successor over lane 0, a partner over its partner link, the predecessor (when no
        partner) back over its lane 0 (:attr:`reverse` at the other end)."""
        if n < 2:
            return {}
        successor, predecessor = (position + 1) % n, (position - 1) % n
        out: dict[int, tuple[FramedConnection, Inbox]] = {}
        for target in ack_targets(position, n, self.partners):
            partner = self.partners.get(target)
            send = (self.to_next[0] if target == successor else partner.connection if partner is not None
                    else self.inboxes[0].connection)
            inbox = self.inboxes[0] if target == predecessor else partner if partner is not None else self.reverse
            out[target] = (send, inbox)
        return out

    @property
    def threaded(self) -> bool:
        """Whether operations on these links run their lane loops in worker threads (every
        connection offers a :class:`~pccl.net.framed_threads.BlockingDataChannel`)."""
        return self.send_channels is not None

    @property
    def lanes(self) -> int:
        return len(self.to_next)

    def retire(self, seq: int) -> None:
        """Discard any frame of ``seq`` still to come (the op ended or was never started here)."""
        self.registry.retire(seq)

    def drop_kept(self, why: str) -> None:
        """Drop the frames every inbox keeps for ops not begun here (:meth:`Inbox.drop_kept`):
        called when these links are replaced (a new topology round or master epoch: a derived
        seq belongs to one round, and an op of the old one never starts on the new links) and
        when they are aborted or closed."""
        for inbox in self._all_inboxes():
            inbox.drop_kept(why)

    def _all_inboxes(self) -> tuple[Inbox, ...]:
        extra = () if self.reverse in self.inboxes else (self.reverse,)
        return (*self.inboxes, *self.partners.values(), *extra)

    @property
    def kept_bytes(self) -> int:
        """Payload bytes kept now, over every inbox, for ops not begun here."""
        return sum(inbox.kept_bytes for inbox in self._all_inboxes())

    def connections(self) -> tuple[FramedConnection, ...]:
        return (*self.to_next, *(inbox.connection for inbox in self.inboxes),
                *(inbox.connection for inbox in self.partners.values()))

    def abort_broken(self) -> None:
        """Abort the connections a torn frame or a bad header left unusable (Trio thread, once
        no thread of the op that met it uses them): every op on them then fails fast until the
        ring is re-wired."""
        for connection in self.connections():
            if connection.broken:
                connection.abort()

    def abort(self) -> None:
        """Abort every connection (RST): used when a ring is torn down after a failure."""
        self.drop_kept("the links were aborted")
        for c in self.to_next:
            c.abort()
        for inbox in (*self.inboxes, *self.partners.values()):
            inbox.connection.abort()

    async def aclose(self) -> None:
        self.drop_kept("the links were closed")
        with trio.CancelScope(shield=True):
            for c in self.to_next:
                await c.aclose()
            for inbox in (*self.inboxes, *self.partners.values()):
                await inbox.connection.aclose()
