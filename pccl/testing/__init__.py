"""Hooks for pccl's own tests, as :mod:`trio.testing` is for trio's: the internals a test needs
to plant a fault at an exact moment or to read a state, reached by name instead of through
private attributes.  Not part of the public face (``import pccl`` does not import it) and
without any compatibility promise.

- :func:`session`, :func:`sync_service`, :func:`all_reduce_service`: a communicator's parts.
- :func:`install_master_state`: a master runs another consensus machine (a planted fault).
"""

from __future__ import annotations

from .._peer.collective_service import CollectiveService
from .._peer.session import PeerSession
from .._peer.sync import StateSyncService
from ..communicator import Communicator, internals_of
from ..master.server import Master, server_of
from ..protocol.master.machine import MasterState

__all__ = ["session", "sync_service", "all_reduce_service", "install_master_state"]


def session(comm: Communicator) -> PeerSession:
    """The peer session under ``comm``: its master connection, votes, routes and ring wiring."""
    return internals_of(comm).session


def sync_service(comm: Communicator) -> StateSyncService:
    """``comm``'s shared-state sync service (its listener and admission among others)."""
    return internals_of(comm).sync


def all_reduce_service(comm: Communicator) -> CollectiveService:
    """``comm``'s all-reduce service."""
    return internals_of(comm).all_reduce


def install_master_state(master: Master, state: MasterState) -> None:
    """Make ``master`` run ``state`` as its consensus machine from now on: a planted fault, such
    as the simulator's broken masters (:mod:`pccl_sim.workloads.pccl.mutants`).  Call it right after
    the master started, before any peer can have connected (a connect takes a round trip).

    Raises ``RuntimeError``, and changes nothing, once a peer is connected or known to the
    machine: the machine it started with has seen that peer, and the new one would not know it.
    """
    server = server_of(master)
    if server.conns or server.state.peers():
        raise RuntimeError("cannot install a master state: peers are connected already")
    server.state = state
