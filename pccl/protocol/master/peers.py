"""The master's records: a peer's connection and status, a topology round, the read-only view
of a peer, and the phase table the master's dispatch checks (sans-IO).

Peers.  A connection is CONNECTED until it sends ``Register``; then it is REGISTERED (it has a
peer id and waits); it becomes ACCEPTED when a topology round it took part in succeeds.  One
status field: registered and accepted peers are disjoint by construction.

Reports.  A peer's heartbeats also report what the status page shows of it (its last sync, its
payload totals): the machine keeps each connection's last one and the run's totals
(:class:`ReportedBytes`) and reads none of it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from typing import NamedTuple

from .. import messages as m
from .. import phases as ph
from ..phases import TopologyVote

__all__ = ["PeerStatus", "TopologyVote", "GLOBAL_SCOPE", "PeerRecord", "RoundRecord", "PeerInfo", "PhaseRow",
           "PHASES", "REFUSAL_DETAIL", "ReportedBytes"]


# --- the phase rules ---------------------------------------------------------------------------


class PeerStatus(enum.Enum):
    CONNECTED = "connected"  # handshake done, not registered yet
    REGISTERED = "registered"  # has a peer id, waits to be accepted
    ACCEPTED = "accepted"
    RELAY = "relay"  # a relay registered on this connection (pccl.protocol.master.paths); never a peer


@dataclasses.dataclass(frozen=True)
class PhaseRow:
    """One row of :data:`PHASES`: when peers may send one message type."""

    #: (a tuple: ``in`` finds a status by identity, without the Enum's Python-level hash)
    senders: tuple[PeerStatus, ...]
    refused_while: tuple[tuple[ph.Activity, str], ...] = ()


_C, _R, _A, _RELAY = PeerStatus.CONNECTED, PeerStatus.REGISTERED, PeerStatus.ACCEPTED, PeerStatus.RELAY

#: OUT_OF_PHASE details for every (call, refusing activity) pair of the phase table
#: (:data:`pccl.protocol.phases.RULES`), formatted with ``msg`` and ``op`` (the sender's
#: collective in flight).
REFUSAL_DETAIL: dict[tuple[ph.Call, ph.Activity], str] = {
    (ph.Call.TOPOLOGY_VOTE, ph.Activity.TOPOLOGY): "topology vote while already voting or in a topology round",
    (ph.Call.TOPOLOGY_VOTE, ph.Activity.COLLECTIVE): "topology vote with collective tag {op.tag} in flight",
    (ph.Call.TOPOLOGY_VOTE, ph.Activity.SYNC): "topology vote during a shared-state sync",
    (ph.Call.OPTIMIZE_VOTE, ph.Activity.TOPOLOGY): "optimise vote while already voting or in a topology round",
    (ph.Call.OPTIMIZE_VOTE, ph.Activity.COLLECTIVE): "optimise vote with collective tag {op.tag} in flight",
    (ph.Call.OPTIMIZE_VOTE, ph.Activity.SYNC): "optimise vote during a shared-state sync",
    (ph.Call.PENDING_QUERY, ph.Activity.PENDING_QUERY): "second are_peers_pending vote before the answer",
    (ph.Call.COLLECTIVE, ph.Activity.TOPOLOGY): "collective tag {msg.tag} during a topology update",
    (ph.Call.COLLECTIVE, ph.Activity.SYNC): "collective tag {msg.tag} during a shared-state sync",
    (ph.Call.SYNC, ph.Activity.TOPOLOGY): "shared-state sync during a topology update",
    (ph.Call.SYNC, ph.Activity.COLLECTIVE): "shared-state sync with collective tag {op.tag} in flight",
    (ph.Call.SYNC, ph.Activity.SYNC): "second shared-state sync vote before the first completed",
}

#: The phase rules, checked by the master's dispatch before the message's handler runs.  A
#: type missing here is one peers never send: PROTOCOL_ERROR.  A sender outside ``senders``:
#: OUT_OF_PHASE "<type> while <status>".  A vote (a message that starts a call of
#: :mod:`pccl.protocol.phases`) from a sender busy with an activity that refuses the call
#: (checked in the table's order): OUT_OF_PHASE with that pair's detail.  Checks that depend on
#: what the message names (a round, a seq, a sync or an attempt, a reused tag) stay in the
#: handlers.
PHASES: dict[type[m.Message], PhaseRow] = {
    m.Register: PhaseRow((_C,)),
    m.Heartbeat: PhaseRow((_C, _R, _A, _RELAY)),
    m.Leave: PhaseRow((_C, _R, _A, _RELAY)),
    m.P2PReport: PhaseRow((_R, _A)),
    m.PathRequest: PhaseRow((_R, _A)),
    m.DialFailed: PhaseRow((_R, _A)),
    m.PathReport: PhaseRow((_R, _A)),
    m.RelayRegister: PhaseRow((_C,)),
    m.RelayStats: PhaseRow((_RELAY,)),
    m.ProbeReport: PhaseRow((_A,)),
    m.CollectiveDone: PhaseRow((_A,)),
    m.CollectiveWithdraw: PhaseRow((_A,)),
    # (registered too: for the ops of a master before a restart; this master's own only once
    # accepted, checked by the handler)
    m.CollectiveAsk: PhaseRow((_R, _A)),
    m.CollectiveAnswer: PhaseRow((_R, _A)),
    m.SyncReport: PhaseRow((_A,)),
    **{kind: PhaseRow((_A,), tuple((a, REFUSAL_DETAIL[call, a]) for a in ph.RULES[call].refused_while))
       for kind, call in ph.CALL_OF_MESSAGE.items()},
}


# --- state -------------------------------------------------------------------------------------


#: Round scope key of the global (accepting) round; group rounds use the group number (≥ 0).
GLOBAL_SCOPE = -1


@dataclasses.dataclass(eq=False)
class PeerRecord:
    conn_id: int
    host: str
    last_heard: float
    status: PeerStatus = PeerStatus.CONNECTED
    peer_id: int = 0
    group: int = 0
    p2p_port: int = 0
    shared_state_port: int = 0
    #: Where else the peer may be reached (:mod:`pccl.protocol.paths`), as it registered them.
    candidates: tuple[m.Candidate, ...] = ()
    topology_vote: TopologyVote | None = None
    round_scope: int | None = None  # scope key of the round this peer takes part in
    pending_vote: bool = False
    report: m.Heartbeat | None = None  # the last heartbeat (see "Reports")

    def endpoint(self) -> m.PeerEndpoint:
        return m.PeerEndpoint(self.peer_id, self.host, self.p2p_port, self.shared_state_port, self.candidates)


@dataclasses.dataclass
class ReportedBytes:
    """The payload bytes the peers' heartbeats reported, summed over every connection since the
    master started: each report adds what its connection's totals grew by since its last."""

    tx: int = 0
    rx: int = 0

    def take(self, peer: PeerRecord, report: m.Heartbeat) -> None:
        """``report`` is ``peer``'s latest heartbeat."""
        before = peer.report
        self.tx += max(0, report.tx_bytes - (before.tx_bytes if before is not None else 0))
        self.rx += max(0, report.rx_bytes - (before.rx_bytes if before is not None else 0))
        peer.report = report


@dataclasses.dataclass(eq=False)
class RoundRecord:
    scope: int
    round_id: int
    participants: tuple[int, ...]  # peer ids
    reports: dict[int, m.P2PReport] = dataclasses.field(default_factory=dict)
    dropped: bool = False  # a participant left during this attempt
    failed_attempts: int = 0  # consecutive attempts with an unreachable report
    blame: Counter[int] = dataclasses.field(default_factory=Counter)
    #: The last failure detail each blamed peer's neighbours reported (its kick names it).
    details: dict[int, str] = dataclasses.field(default_factory=dict)


class PeerInfo(NamedTuple):
    """Read-only view of one connection, for tests, logs and the simulator's checkers.  A named
    tuple: the simulator's checkers take a view of every peer after every change of the
    master's state, and a frozen dataclass cost four times as much to build."""

    conn_id: int
    peer_id: int
    group: int
    status: PeerStatus
    topology_vote: TopologyVote | None
    in_round: bool
    pending_vote: bool
    #: The host the master observed and the p2p port the peer advertised.
    host: str = ""
    p2p_port: int = 0
