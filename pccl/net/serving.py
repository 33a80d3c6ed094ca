"""Accept loops that bound the connections still in their handshake.

A peer's listeners (its ring port and its shared-state port) face the network: without a bound,
anyone who can reach them could open idle connections until the process runs out of file
descriptors — and with them the peer's training.  :func:`serve_listener` lets at most
``max_pending`` accepted connections be *pending* (not yet authenticated, or however far the
handler says) at once; while that many are, it stops accepting, and further connections wait in
the kernel's listen backlog, where they cost this process nothing.  The handlers bound their
pending phase themselves (``Config.connect_timeout`` on the handshake), so a slot always comes
back.  The master applies the same rule to its own listener (:mod:`pccl.master`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ..errors import TransportError
from .base import Listener, Stream

__all__ = ["MAX_PENDING_HANDSHAKES", "HandshakeSlot", "serve_listener"]

#: Connections a peer's listener lets into the handshake at once.  A peer expects few: its ring
#: predecessor's lanes and the peers fetching shared state from it, each through its handshake
#: in a few round trips.
MAX_PENDING_HANDSHAKES = 32


class HandshakeSlot:
    """An accepted connection's place among the pending ones: :meth:`release` it once the
    connection is through its handshake (idempotent; done anyway when the handler returns)."""

    def __init__(self, slots: trio.Semaphore) -> None:
        self._slots: trio.Semaphore | None = slots

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()
            self._slots = None


async def serve_listener(
    listener: Listener,
    handler: Callable[[Stream, HandshakeSlot], Awaitable[None]],
    *,
    on_error: Callable[[TransportError], None],
    max_pending: int | None = None,
) -> None:
    """Accept connections and run ``handler(stream, slot)`` for each in a nursery, at most
    ``max_pending`` (default :data:`MAX_PENDING_HANDSHAKES`) of them holding their slot at once.

    When ``accept`` fails (``StreamClosed`` once the listener is closed), ``on_error`` gets the
    ``TransportError`` at once, and this returns after every running handler has returned.
    While every slot is taken the loop waits for one before it accepts, so it notices a closed
    listener only then (cancel it to stop it sooner).  Other exceptions propagate.
    """
    if max_pending is None:
        max_pending = MAX_PENDING_HANDSHAKES
    if max_pending < 1:
        raise ValueError(f"max_pending must be at least 1, got {max_pending}")
    slots = trio.Semaphore(max_pending)

    async def run(stream: Stream, slot: HandshakeSlot) -> None:
        try:
            await handler(stream, slot)
        finally:
            slot.release()

    async with trio.open_nursery() as nursery:
        while True:
            await slots.acquire()
            try:
                stream = await listener.accept()
            except TransportError as exc:
                slots.release()
                on_error(exc)
                return
            except BaseException:
                slots.release()
                raise
            nursery.start_soon(run, stream, HandshakeSlot(slots))
