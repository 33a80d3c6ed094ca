"""One connection to the master (one *master epoch*): sending on it, reading from it, and the
heartbeat that watches it.

A :class:`MasterLink` is made for each registration: the session's first, and one per
reconnection.  It knows nothing of what the messages mean: its reader hands each one to the
handler its owner's dispatch table names for the message's type (a type with no handler is the
master's protocol error), and it reports how the connection ended — garbage, a broken
connection, a silent master — to the owner (:class:`LinkOwner`, the session).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import trio

from ..config import Config
from ..errors import Kicked, KickReason, MasterUnreachable, PCCLError, ProtocolError, TransportError
from ..net.framed import FramedConnection
from ..protocol import messages as m
from .heartbeat import PeerFacts, run_heartbeat

__all__ = ["Dispatch", "LinkOwner", "MasterLink", "handshake", "kicked_error", "refuse_registration"]

#: What the reader does with a message, by its exact type.
Dispatch = Mapping[type, Callable[["MasterLink", m.Message], None]]


def kicked_error(notice: m.KickNotice) -> Kicked:
    try:
        reason = KickReason(notice.reason)
    except ValueError:  # a newer master's reason code
        reason = KickReason.UNSPECIFIED
    return Kicked(reason, notice.detail)


async def refuse_registration(connection: FramedConnection, port: str) -> None:
    """Answer a ``Register`` that came to this peer's ``port`` (``"p2p"``, ``"shared-state"``)
    with ``KickNotice(NOT_A_MASTER)`` and close the connection, within a second: its dialler
    took this peer's address for the master's and says so (:func:`handshake`; an older
    dialler shows the notice's detail).  Transport errors are swallowed: the caller refuses the
    connection anyway.  Cancellation aborts the connection."""
    detail = f"this address is a pccl peer's {port} port, not a master"
    try:
        with trio.move_on_after(1.0):
            await connection.send(m.KickNotice(int(KickReason.NOT_A_MASTER), detail))
            await connection.aclose()
            return
    except TransportError:
        pass
    finally:
        connection.abort()  # (a no-op once closed)


async def handshake(connection: FramedConnection, register: m.Register, *, timeout: float,
                    master_address: str) -> m.Welcome:
    """Send ``register`` on a fresh master connection and wait for its ``Welcome`` (heartbeats
    may come first).  ``MasterUnreachable`` if none comes within ``timeout`` or the connection
    breaks, or if ``master_address`` is a peer's port (:func:`refuse_registration`); ``Kicked``
    if the master refuses; ``ProtocolError`` for anything else first."""
    try:
        await connection.send(register)
        with trio.fail_after(timeout):
            while True:
                msg = await connection.receive()
                if isinstance(msg, m.Welcome):
                    return msg
                if isinstance(msg, m.KickNotice):
                    if msg.reason == KickReason.NOT_A_MASTER:
                        raise MasterUnreachable(f"{master_address} is not the master's address: {msg.detail} "
                                                "(give open_communicator the address pccl master listens on)")
                    raise kicked_error(msg)
                if not isinstance(msg, m.Heartbeat):
                    raise ProtocolError(f"the master sent {type(msg).__name__} before Welcome")
    except trio.TooSlowError:
        raise MasterUnreachable(f"the master at {master_address} did not answer the registration") from None
    except TransportError as exc:
        raise MasterUnreachable(f"lost the connection to the master at {master_address}: {exc}") from exc


class LinkOwner(PeerFacts, Protocol):
    """What a link needs from the session that owns it."""

    def fail(self, error: PCCLError, *, cause: BaseException | None = None) -> None: ...

    def connection_lost(self, link: MasterLink, error: PCCLError) -> None: ...

    async def send(self, msg: m.Message, *, epoch: int | None = None, schedule_point: bool = True) -> None: ...

    def heartbeat(self) -> m.Heartbeat: ...

    def is_current(self, link: MasterLink) -> bool: ...

    def reader_cancelled(self, link: MasterLink) -> None: ...


class MasterLink:
    """The master connection of one epoch: what :func:`~pccl._peer.heartbeat.run_heartbeat`
    watches (its :class:`~pccl._peer.heartbeat.HeartbeatSubject`) and what the reader reads."""

    def __init__(self, owner: LinkOwner, connection: FramedConnection, epoch: int) -> None:
        self.owner = owner
        self.connection = connection
        self.epoch = epoch
        self.master_address = owner.master_address
        self.last_heard = trio.current_time()
        #: When the last message to the master went out on this connection (heartbeats too).
        self.last_sent = self.last_heard
        #: Cancelled when the link is given up: its reader and heartbeat end.
        self.scope = trio.CancelScope()

    # --- HeartbeatSubject ----------------------------------------------------------------------

    @property
    def peer_id(self) -> int:
        return self.owner.peer_id

    @property
    def config(self) -> Config:
        return self.owner.config

    @property
    def failure(self) -> PCCLError | None:
        return self.owner.failure

    def fail(self, error: PCCLError) -> None:
        """The heartbeat found the master silent: the connection is lost."""
        self.owner.connection_lost(self, error)

    async def send(self, msg: m.Message) -> None:
        await self.owner.send(msg, epoch=self.epoch)

    def heartbeat(self) -> m.Heartbeat:
        return self.owner.heartbeat()

    # --- writing -------------------------------------------------------------------------------

    async def write(self, msg: m.Message, *, schedule_point: bool) -> None:
        """Send ``msg``.  Cancellation before anything is written sends nothing; once the message
        went out (``send_nowait``), the flush finishes it and never raises ``Cancelled`` for a
        whole frame.  Without a schedule point, a vote waits for its answer in its second
        scheduler turn, not its third (in the simulator's fault-free default run, a third of the
        training loop's turns were this yield).  ``TransportError`` as it comes."""
        await trio.lowlevel.checkpoint_if_cancelled()
        connection = self.connection
        if connection.send_nowait(msg):
            self.last_sent = trio.current_time()
            if schedule_point or connection.needs_flush:
                await connection.flush()
        else:
            await connection.send(msg)
            self.last_sent = trio.current_time()

    async def write_shielded(self, msg: m.Message, timeout: float) -> bool:
        """Send ``msg`` whole even when the caller is cancelled, within ``timeout``; ``False``
        if that ran out.  ``TransportError`` as it comes."""
        connection = self.connection
        sent = connection.send_nowait(msg)
        if sent:
            self.last_sent = trio.current_time()
            if not connection.needs_flush:
                return True  # written at once: nothing to shield (the common case, and a latency-bound one)
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + timeout
            if sent:
                await connection.flush()
            else:
                await connection.send(msg)
                self.last_sent = trio.current_time()
        return not scope.cancelled_caught

    def give_up(self) -> None:
        """Stop the reader and the heartbeat and drop the connection (not gracefully)."""
        self.scope.cancel()
        self.connection.abort()

    # --- reading -------------------------------------------------------------------------------

    async def run(self, dispatch: Dispatch) -> None:
        """Read and dispatch until the link is given up, with the heartbeat beside the reader."""
        with self.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, dispatch)
                nursery.start_soon(run_heartbeat, self)

    async def _read(self, dispatch: Dispatch) -> None:
        owner = self.owner
        try:
            while True:
                msg = await self.connection.receive()
                self.last_heard = trio.current_time()
                if not owner.is_current(self):
                    return  # given up meanwhile: what it still had is the old epoch's
                handler = dispatch.get(type(msg))
                if handler is None:
                    owner.fail(ProtocolError(f"the master sent an unexpected {type(msg).__name__}"))
                    return
                handler(self, msg)
        except ProtocolError as exc:
            if owner.is_current(self):
                owner.fail(ProtocolError(f"the master at {self.master_address} sent garbage: {exc}"), cause=exc)
        except TransportError as exc:
            error = MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}")
            error.__cause__ = exc
            owner.connection_lost(self, error)
        except trio.Cancelled:
            if not self.scope.cancel_called and owner.is_current(self):
                # Cancelled from outside, not given up: the communicator stops (close, or a
                # scope around it was cancelled).  What it still waits for from the master
                # cannot come any more.
                owner.reader_cancelled(self)
            raise
