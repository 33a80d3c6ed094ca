"""Finishing another op's frame that a lane reader has begun to read, even if the reader is
cancelled meanwhile (:class:`~pccl.collectives.links.Inbox`).

A reader that holds a lane's read role also reads the frames of other ops that arrive first:
a begun op's frame into memory (kept for its owner), an ended op's late frame into nothing.
Cut midway, the frame's payload would be partly read and the connection unusable (it is
aborted: :meth:`~pccl.net.framed.FramedConnection.receive_data_into`), failing every op on it
until a re-wire, although the cancelled reader's own op lost nothing.  Readers are cancelled
routinely while idle on a lane — a peer-commit agreement stops its ack readers the moment it
ends (:mod:`pccl._peer.peer_commit_driver`), while another op's frames may be arriving on their
links — so these reads finish shielded, within :data:`FINISH_FRAME_TIMEOUT`: a kept frame is at
most ``Inbox.kept_limit`` bytes, and its whole payload follows its header on the wire.
"""

from __future__ import annotations

import trio

from ..errors import TransferTimeout
from ..net.framed import FramedConnection

__all__ = ["FINISH_FRAME_TIMEOUT", "finish_payload", "finish_discard"]

#: Seconds a cancelled reader still waits for the rest of another op's frame it has begun to
#: read.  Past it the connection is aborted (as an unshielded cut would) and
#: :class:`~pccl.errors.TransferTimeout` is raised.
FINISH_FRAME_TIMEOUT = 10.0


async def finish_payload(connection: FramedConnection, buffer: memoryview) -> None:
    """Receive the current data frame's payload into ``buffer``, shielded from cancellation
    for at most :data:`FINISH_FRAME_TIMEOUT` s."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + FINISH_FRAME_TIMEOUT) as scope:
        await connection.receive_data_into(buffer)
    _check(scope, connection)


async def finish_discard(connection: FramedConnection) -> None:
    """Read and drop the rest of the current data frame's payload, shielded as
    :func:`finish_payload`."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + FINISH_FRAME_TIMEOUT) as scope:
        await connection.discard_data()
    _check(scope, connection)


def _check(scope: trio.CancelScope, connection: FramedConnection) -> None:
    if scope.cancelled_caught:  # the connection was aborted mid-payload
        raise TransferTimeout(f"another op's frame from {connection.remote_address} did not arrive whole within "
                              f"{FINISH_FRAME_TIMEOUT:g} s")
