"""A point-to-point message's payload moved by a worker thread: the fast path on real TCP.

:mod:`pccl._peer.point` announces, matches and acknowledges messages on the Trio thread; the
bulk bytes go through the connection's :class:`~pccl.net.framed_threads.BlockingDataChannel`
(the ring's thread path) when its stream offers blocking I/O — the receiver fills its buffer
with blocking ``recv_into(MSG_WAITALL)`` calls straight from the socket, one Trio hand-off per
frame instead of a trip through the run loop per segment batch.  Streams without blocking I/O
(the simulator's, TLS) keep the async path.

Liveness: the thread takes the payload in pieces of ``piece`` bytes and records when each one
completed; the Trio side fails the transfer (``trio.TooSlowError``) when a piece took longer
than ``timeout`` — a sender slower than ``piece / timeout`` counts as stalled, as on the async
path.  While the data comes fast the thread takes larger pieces (``large_piece``,
:func:`next_piece`): fewer blocking calls, and a sender then counts as stalled if its rate falls
more than :data:`HEADROOM`-fold within one piece, below ``large_piece / timeout``.  A stall, a failure of the link (its connections aborted) or a cancellation of
the waiting task stops the thread by aborting the connection (a half-read frame is never left on
a connection that stays open); the Trio side always waits until the thread has returned, so no
thread writes into the buffer after this returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import outcome
import trio

from .. import kernels
from ..net.framed import FramedConnection
from ..net.framed_threads import BlockingDataChannel, thread_channel
from ..net.thread_io import ThreadCancel
from ..protocol.codec import DataHeader

__all__ = ["receive_payload", "send_payload", "next_piece"]


#: A piece grows to ``large_piece`` only while, at the rate of the last one, it would arrive within
#: this fraction of the timeout: a sender is then called stalled only if its rate falls this many
#: times within one piece (below ``large_piece / timeout``), or it sends nothing for ``timeout``.
HEADROOM = 16


def next_piece(nbytes: int, seconds: float, *, piece: int, large_piece: int, timeout: float) -> int:
    """The size of the thread path's next piece after ``nbytes`` took ``seconds``: ``large_piece``
    while that rate brings it within ``timeout / HEADROOM``, else ``piece``.  Each piece is one
    blocking call (and one backup copy), so large pieces cost fewer wake-ups: ~5% more
    throughput for 64 MiB messages on loopback."""
    return large_piece if seconds * large_piece * HEADROOM < nbytes * timeout else piece


async def receive_payload(conn: FramedConnection, view: memoryview, *, timeout: float, piece: int,
                          backup: memoryview, saved: Callable[[int], None], large_piece: int | None = None) -> None:
    """Receive the current data frame's next ``view.nbytes`` payload bytes into ``view``, each
    ``piece`` of them within ``timeout`` seconds (``trio.TooSlowError`` otherwise; the connection
    is then aborted).  On the thread path pieces of ``large_piece`` bytes (default ``piece``) follow
    a piece that arrived fast enough (:func:`next_piece`).  Each piece of ``view`` is first copied into ``backup`` (as long as
    ``view``), and ``saved(n)`` told that the first ``n`` bytes are, before it is overwritten.
    The copy uses streaming stores (:func:`pccl.kernels.save_copy`, the GIL released): the
    backup is read back only after a failure, so writing it must neither read its cache lines
    first nor evict the payload's.
    Transport errors as for the connection's ``receive_data_into``."""
    target, copy = np.frombuffer(view, np.uint8), np.frombuffer(backup, np.uint8)
    channel = thread_channel(conn)
    if channel is None:
        for start in range(0, view.nbytes, piece):
            end = min(start + piece, view.nbytes)
            kernels.save_copy(copy[start:end], target[start:end])
            saved(end)
            with trio.fail_after(timeout):
                await conn.receive_data_into(view[start:end])
        return
    large_piece = piece if large_piece is None else large_piece
    cancel = ThreadCancel()
    progress = [time.monotonic()]  # when the last piece completed (written by the thread)

    def work() -> None:
        size, start = piece, 0
        while start < view.nbytes:
            end = min(start + size, view.nbytes)
            began = time.monotonic()
            kernels.save_copy(copy[start:end], target[start:end])
            saved(end)
            channel.receive_data_into(view[start:end], cancel)
            progress[0] = now = time.monotonic()
            size = next_piece(end - start, now - began, piece=piece, large_piece=large_piece, timeout=timeout)
            start = end

    await _in_thread(channel, cancel, work, (progress, timeout))


async def send_payload(conn: FramedConnection, header: DataHeader, payload: memoryview) -> None:
    """Send one data frame (``header`` and ``payload``, straight from the caller's memory).  The
    connection's async send lock is held meanwhile, so its other senders (offers, keepalives)
    wait for the frame's end.  Errors and cancellation as for the connection's ``send_data``
    (a frame cancelled midway aborts the connection)."""
    channel = thread_channel(conn)
    if channel is None:
        await conn.send_data(header, payload)
        return
    async with conn.send_lock:
        cancel = ThreadCancel()
        await _in_thread(channel, cancel, lambda: channel.send_data(header, payload, cancel), None)


async def _in_thread(channel: BlockingDataChannel, cancel: ThreadCancel, work: Callable[[], None],
                     watch: tuple[list[float], float] | None) -> None:
    """Run ``work`` in a worker thread and wait for it; ``watch`` (a progress time the thread
    updates, and a timeout): ``trio.TooSlowError`` once no progress was made for that long.  A
    stall or a cancellation aborts the connection (whatever the thread was doing) and waits
    for the thread to return."""
    finished = trio.Event()
    result: list[outcome.Outcome[None]] = []
    token = trio.lowlevel.current_trio_token()

    def deliver(value: outcome.Outcome[None]) -> None:
        def settle() -> None:
            result.append(value)
            finished.set()
        token.run_sync_soon(settle)

    stalled = False
    trio.lowlevel.start_thread_soon(work, deliver, name="pccl-p2p")
    try:
        if watch is None:
            await finished.wait()
        while not finished.is_set():
            assert watch is not None
            left = watch[0][0] + watch[1] - time.monotonic()
            if left <= 0:
                stalled = True
                break
            with trio.move_on_after(left):
                await finished.wait()
    finally:
        if not finished.is_set():  # stalled or cancelled: stop the thread, wait until it returned
            for connection in cancel.cancel():
                connection.abort()  # type: ignore[attr-defined]  # makes a blocked syscall return
            channel.connection.abort()  # a frame half-done between two calls ends the connection too
            with trio.CancelScope(shield=True):
                await finished.wait()
        cancel.close()
    if stalled:
        raise trio.TooSlowError
    result[0].unwrap()
