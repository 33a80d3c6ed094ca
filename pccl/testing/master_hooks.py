"""Hooks into a running master: a frozen snapshot of its consensus machine's views for tests,
the machine itself for the simulator's checkers, and a planted machine for its mutants."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from ..master.server import Master, server_of
from ..protocol.master.collectives import OpInfo
from ..protocol.master.machine import MasterState
from ..protocol.master.paths import PathView, RelayView
from ..protocol.master.peers import PeerInfo
from ..protocol.master.sync import SyncRoundInfo

__all__ = ["MasterSnapshot", "master_snapshot", "master_state", "install_master_state"]


@dataclasses.dataclass(frozen=True)
class MasterSnapshot:
    """What the master's consensus machine knows at one moment (its read-only views)."""

    peers: tuple[PeerInfo, ...]
    #: Collectives in flight.
    ops: tuple[OpInfo, ...]
    #: Shared-state sync rounds in flight.
    syncs: tuple[SyncRoundInfo, ...]
    #: The paths between peers (direct, reversed, relayed) it knows.
    paths: tuple[PathView, ...]
    relays: tuple[RelayView, ...]
    #: Measured bandwidth per (sender, receiver) peer id pair.
    measured_links: Mapping[tuple[int, int], float]


def master_snapshot(master: Master) -> MasterSnapshot:
    """A snapshot of ``master``'s consensus machine."""
    state = server_of(master).state
    return MasterSnapshot(tuple(state.peers()), tuple(state.ops()), tuple(state.syncs()),
                          tuple(state.paths()), tuple(state.relays()),
                          types.MappingProxyType(state.measured_links()))


def master_state(master: Master) -> MasterState:
    """The consensus machine ``master`` runs, for the simulator's checkers and benchmarks that
    plant measurements (tests read :func:`master_snapshot` instead)."""
    return server_of(master).state


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
