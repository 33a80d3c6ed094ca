"""The errors of the simulated network, and the vocabulary that lets a workload substitute its own.

The code under test catches its own transport's exceptions (pccl catches
``pccl.errors.PeerDisconnected``, not something of the simulator's), so the simulated streams
raise whatever classes their network's :class:`TransportErrors` names.  The engine's defaults
below serve workloads that bring no transport of their own (the toy); a workload whose code
expects its library's errors gives its network class a vocabulary of those (the pccl workload's
is in :mod:`pccl_sim.workloads.pccl.network`).  Choosing a class costs nothing per call: the
vocabulary is a class attribute of the network, read only when an error is raised.

The default classes carry the same names as the transport errors they stand in for, so a trace
that records an error's class name (``type(exc).__name__``) reads the same under either
vocabulary.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "SimNetworkError",
    "TransportError",
    "PeerDisconnected",
    "ConnectionRefused",
    "ConnectTimeout",
    "AddressInUse",
    "StreamClosed",
    "InvalidUsage",
    "InvalidArgument",
    "TransportErrors",
    "ENGINE_ERRORS",
]


class SimNetworkError(Exception):
    """Base class of the engine's default errors."""


class TransportError(SimNetworkError):
    """A connection-level failure."""


class PeerDisconnected(TransportError):
    """The remote end closed or reset the connection, or its host died."""


class ConnectionRefused(TransportError):
    """Nothing accepted the connection at that address."""


class ConnectTimeout(TransportError):
    """The connection attempt did not complete in time."""


class AddressInUse(TransportError):
    """No port could be bound in the requested range."""


class StreamClosed(TransportError):
    """This side already closed the stream (or its sending half) and then used it."""


class InvalidUsage(SimNetworkError):
    """The caller used the network wrongly (two tasks sending on one stream at once, say)."""


class InvalidArgument(InvalidUsage, ValueError):
    """An argument is unacceptable: a malformed address, a buffer that is not contiguous."""


@dataclasses.dataclass(frozen=True)
class TransportErrors:
    """The exception class the simulated network raises for each condition (module docstring)."""

    #: Any other connection-level failure (listening on an address that is not the host's).
    transport: type[Exception] = TransportError
    peer_disconnected: type[Exception] = PeerDisconnected
    connection_refused: type[Exception] = ConnectionRefused
    connect_timeout: type[Exception] = ConnectTimeout
    address_in_use: type[Exception] = AddressInUse
    stream_closed: type[Exception] = StreamClosed
    invalid_usage: type[Exception] = InvalidUsage
    invalid_argument: type[Exception] = InvalidArgument


#: The engine's own vocabulary (the classes above).
ENGINE_ERRORS = TransportErrors()
