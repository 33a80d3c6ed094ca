"""Hooks for pccl's own tests, as :mod:`trio.testing` is for trio's: the internals a test needs
to plant a fault at an exact moment or to read a state, reached by name instead of through
private attributes.  Not part of the public face (``import pccl`` does not import it) and
without any compatibility promise.

- :func:`session`, :func:`sync_service`, :func:`all_reduce_service`: a communicator's parts.
"""

from __future__ import annotations

from .._peer.collective_service import AllReduceService
from .._peer.session import PeerSession
from .._peer.sync import StateSyncService
from ..communicator import Communicator, internals_of

__all__ = ["session", "sync_service", "all_reduce_service"]


def session(comm: Communicator) -> PeerSession:
    """The peer session under ``comm``: its master connection, votes, routes and ring wiring."""
    return internals_of(comm).session


def sync_service(comm: Communicator) -> StateSyncService:
    """``comm``'s shared-state sync service (its listener and admission among others)."""
    return internals_of(comm).sync


def all_reduce_service(comm: Communicator) -> AllReduceService:
    """``comm``'s all-reduce service."""
    return internals_of(comm).all_reduce
