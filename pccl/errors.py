"""The pccl exception tree.

Every error pccl raises to its caller is a :class:`PCCLError`.  No bare trio, OS or msgspec
exception and no ExceptionGroup crosses the public API.  Errors say whose fault they are:
``InvalidUsage``/``InvalidArgument`` are the caller's, ``ProtocolError`` is the remote side's,
the rest are the environment's (peers dying, the master going away).
"""

from __future__ import annotations

import enum

__all__ = [
    "PCCLError",
    "InvalidUsage",
    "InvalidArgument",
    "TooFewPeers",
    "CollectiveAborted",
    "PhaseMismatch",
    "TopologyUpdateFailed",
    "SharedStateSyncFailed",
    "RevisionViolation",
    "CheckpointError",
    "KickReason",
    "Kicked",
    "MasterUnreachable",
    "AuthenticationFailed",
    "ProtocolError",
    "FrameTooLarge",
    "TransportError",
    "PeerDisconnected",
    "ConnectionRefused",
    "ConnectTimeout",
    "AddressInUse",
    "StreamClosed",
    "PeerUnreachable",
    "TransferTimeout",
]


class PCCLError(Exception):
    """Base class of every error pccl raises."""


# --- caller bugs -------------------------------------------------------------------------------


class InvalidUsage(PCCLError):
    """The caller used the API wrongly (wrong phase, concurrent sync and collective, reused tag…)."""


class InvalidArgument(InvalidUsage, ValueError):
    """An argument is unacceptable: wrong dtype, size, contiguity, overlapping buffers, bad address."""


# --- run-time conditions -----------------------------------------------------------------------


class TooFewPeers(PCCLError):
    """The operation needs at least two peers in the group and this peer is alone."""


class CollectiveAborted(PCCLError):
    """A participant left mid-operation; an in-place buffer holds its input again. Retry."""


class TransferTimeout(PCCLError):
    """A ``send`` or ``recv`` did not complete within its ``timeout=``.  Withdrawn before its
    message was under way, nothing else changed; otherwise the connections with that peer were
    closed and its other pending sends and receives failed with ``PeerDisconnected``."""


class PhaseMismatch(PCCLError):
    """This call could never complete: every other member of the group waits in a call that
    needs this peer in another one (say ``all_reduce`` while this peer runs
    ``update_topology``), or every member waits in collectives on tags not all of them started
    (``all_reduce(tag=1)`` here, ``all_reduce(tag=2)`` there).  The master ended all of them;
    the message names who waits where (and on which tags).
    ``update_topology`` and ``sync_shared_state`` raise it; an ``all_reduce`` raises
    ``CollectiveAborted`` caused by it.  ``steps()`` recovers on its own: it starts the step
    again (``update_topology``, then the sync), where the loops meet."""


class TopologyUpdateFailed(PCCLError):
    """This peer cannot take part in topology updates any more (its ring listener failed for
    good); it left the run."""


class SharedStateSyncFailed(PCCLError):
    """The shared-state synchronisation could not complete."""


class RevisionViolation(SharedStateSyncFailed):
    """This peer took part in its group's last sync and now offers a revision beyond that
    sync's revision + 1: it jumped without syncing.  The master kicks it."""


class CheckpointError(PCCLError):
    """A checkpoint could not be written or read: the file is missing, truncated, altered or of
    another shape than the state to load into (the message names the file and the tensor)."""


class KickReason(enum.IntEnum):
    """Why the master removed a peer.  Sent on the wire: values are stable."""

    UNSPECIFIED = 0
    PROTOCOL_ERROR = 1
    OUT_OF_PHASE = 2
    TIMEOUT = 3
    AUTHENTICATION = 4
    REVISION_VIOLATION = 5
    SHARED_STATE_MISMATCH = 6
    STRATEGY_VIOLATION = 7
    P2P_UNREACHABLE = 8
    SHUTDOWN = 9
    DUPLICATE_TAG = 10
    FRAME_TOO_LARGE = 11
    #: Not from a master: a peer's p2p or shared-state port answers a ``Register`` with it (the
    #: dialler took the peer's address for the master's); ``open_communicator`` raises
    #: ``MasterUnreachable`` naming the port.
    NOT_A_MASTER = 12


class Kicked(PCCLError):
    """The master removed this peer; :attr:`reason` says why, :attr:`detail` gives specifics."""

    def __init__(self, reason: KickReason, detail: str = "") -> None:
        self.reason = KickReason(reason)
        self.detail = detail
        msg = f"kicked by the master: {self.reason.name}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class MasterUnreachable(PCCLError):
    """The master cannot be reached, or the connection to it was lost."""


class AuthenticationFailed(PCCLError):
    """The other side did not prove the run token (or this side could not)."""


class ProtocolError(PCCLError):
    """The other side sent malformed, oversized, out-of-phase or unknown data."""


class FrameTooLarge(ProtocolError):
    """The other side announced a frame longer than this side accepts (``Config.max_frame_size``
    for control frames); refused from the 5-byte prefix, before anything was allocated."""


# --- transport (raised by pccl.net; the runtime maps them to the errors above) -----------------


class TransportError(PCCLError):
    """A connection-level failure.  ``__cause__`` carries the underlying OS/trio error."""


class PeerDisconnected(TransportError):
    """The remote end closed or reset the connection, or it broke.  ``send``/``recv`` raise it
    (naming the peer) when the peer died, closed its connections or fell silent for
    ``Config.peer_timeout``: retry-safe, a receiver's array holds its old values."""


class ConnectionRefused(TransportError):
    """Nothing accepted the connection at that address."""


class ConnectTimeout(TransportError):
    """The connection attempt did not complete in time."""


class AddressInUse(TransportError):
    """No port could be bound in the requested range."""


class StreamClosed(TransportError):
    """This side already closed the stream (or its sending half) and then used it."""


class PeerUnreachable(TransportError):
    """No path to another peer: none of its candidates answered, it could not dial back, and no
    relay joined the two (the message says what each attempt met)."""
