"""Every control message pccl sends, as msgspec Structs in one tagged union.

Tags are small integers and stable on the wire.  Ranges, so that issues can add messages
without colliding:

* 1–49    master ↔ peer (registration, votes, membership, heartbeats, kick)
* 50–79   collectives
* 80–109  shared state
* 110–129 topology / bandwidth probes
* 130–159 connectivity: candidates, knocks, connection reversal, relays
* 160–169 point-to-point (``send`` / ``recv``)
* 200–219 connection handshake and authentication

The connectivity messages live in :mod:`._connectivity`, the point-to-point ones in
:mod:`._point`, peer-agreed completion's in :mod:`._peer_commit`, the base class and the shared field
types in :mod:`._base`; this package re-exports both, so ``messages.Knock`` is the one name to
use.  Add every new message class to ``ALL_MESSAGES`` at the bottom.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import Annotated

import msgspec

from ._base import U16, U32, U64, Candidate, Message, PeerEndpoint
from ._connectivity import (
    CONNECTIVITY_MESSAGES,
    DialFailed,
    DialRequest,
    Knock,
    KnockAck,
    PathReport,
    PathRequest,
    PathUnavailable,
    RelayJoin,
    RelayOffer,
    RelayReady,
    RelayRefused,
    RelayRegister,
    RelayStats,
    RelayWelcome,
    ReverseHello,
)
from ._peer_commit import (PEER_COMMIT_MESSAGES, CollectiveAnswer, CollectiveAsk, CollectiveQuery, CommitPhase,
                           UndecidedOp)
from ._point import (
    POINT_MESSAGES,
    PointAck,
    PointHello,
    PointHelloAck,
    PointKeepalive,
    PointMismatch,
    PointOffer,
    PointReady,
)


# --- 1–49: master ↔ peer membership (pccl/protocol/master/machine.py, pccl/_peer/) ----------------
#
# Flow (see pccl/protocol/master/ for the rules):  peer → Register;  master → Welcome(peer_id).
# Accepted peers → VoteTopology; at consensus master → ConnectToPeers(round, ring, neighbours) to
# every participant (accepted + newcomers); each dials its ring successor over the p2p port
# (P2PHello / P2PHelloAck after the framed handshake) → P2PReport(round, ok, unreachable).  All
# ok → TopologyComplete(round, ring, membership); otherwise the master sends a fresh
# ConnectToPeers with a new round id (automatic retry, no re-vote).  A peer's first
# TopologyComplete is its acceptance.  Heartbeat flows both ways; KickNotice precedes a close.


class LinkFigure(msgspec.Struct, frozen=True, array_like=True):
    """A measured directed link: bytes/s and round-trip seconds (``bandwidth`` 0: not measured)."""

    bandwidth: Annotated[float, msgspec.Meta(ge=0)]
    rtt: Annotated[float, msgspec.Meta(ge=0)]


class Membership(msgspec.Struct, frozen=True, array_like=True):
    """A communicator's membership attributes, counting accepted peers only (never pending ones)."""

    world_size: U32
    global_world_size: U32
    num_peer_groups: U32
    largest_peer_group_size: U32


class Register(Message, tag=1):
    """Peer → master, first message: join ``peer_group``; ports of this peer's listeners.

    ``previous_peer_id``: the id this peer had before it lost its master (0 = none); a
    restarted master gives it back when it can.  ``candidates``: where else the others may
    reach it (its advertised endpoints, then its interface addresses with the bound ports;
    an advertised endpoint with an empty host means the host the master observes).
    ``undecided``: the peer-agreed ops of an earlier master this peer is ready for and has
    no outcome of (docs/protocol.rst, "A master restart while peers are in doubt").
    """

    peer_group: U32
    p2p_port: U16
    shared_state_port: U16
    previous_peer_id: U64 = 0
    candidates: tuple[Candidate, ...] = ()
    undecided: tuple[UndecidedOp, ...] = ()


class VoteTopology(Message, tag=2):
    """Peer → master: ``update_topology()`` (accept pending peers, global vote) when
    ``accept_new_peers``, else re-wire this peer's group only (group vote)."""

    accept_new_peers: bool = True


class P2PReport(Message, tag=3):
    """Peer → master: result of dialling the ring successor for ``round``.

    ``unreachable`` lists the peer ids this peer could not connect to (empty when ``ok``).
    """

    round: U64
    ok: bool
    unreachable: tuple[U64, ...] = ()
    #: What the failed connection met (which candidates, which path), for the master's log and kick.
    detail: str = ""


class VotePeersPending(Message, tag=4):
    """Peer → master: vote for the ``are_peers_pending()`` query (phase-independent)."""


class Heartbeat(Message, tag=5):
    """Either direction: I am alive.  Any message counts as a sign of life; this one is for idle
    periods.

    Peer → master, it also reports what the master's status page shows (the master sends the
    defaults).  ``synced``: the peer completed a shared-state sync, and ``revision``,
    ``sync_tx_bytes`` and ``sync_rx_bytes`` describe its last one; ``tx_bytes``/``rx_bytes`` are
    its running totals of all-reduce and shared-state payload bytes.  Trailing fields with
    defaults keep the wire compatible both ways (msgspec fills missing trailing fields with
    their defaults and skips extra ones), so adding them did not change the protocol version.
    """

    synced: bool = False
    revision: U64 = 0
    sync_tx_bytes: U64 = 0
    sync_rx_bytes: U64 = 0
    tx_bytes: U64 = 0
    rx_bytes: U64 = 0


class Leave(Message, tag=6):
    """Peer → master: I am closing on purpose; remove me now (no timeout wait)."""


class Welcome(Message, tag=20):
    """Master → peer: registered, with this id.  Acceptance comes with a TopologyComplete.
    ``instance`` identifies this master process (a restarted master draws a new one);
    ``observed_host`` is the source address the master sees this peer's connection come from
    (behind NAT: the NAT's public address), which decides whether two peers share one."""

    peer_id: U64
    instance: U64 = 0
    observed_host: str = ""
    #: This master runs ops begun with ``CollectiveBegin.peer_commit`` as peer-agreed (a master
    #: without the field would ignore the flag: a peer that commits on its own set must not use it).
    peer_commit: bool = False


class ConnectToPeers(Message, tag=21):
    """Master → participant of a topology round: (re)connect to your ring neighbours.

    ``ring`` is this peer's group ring (peer ids, in order) for the round; ``neighbours`` the
    endpoints of the peers it may connect to, each once (:func:`pccl.protocol.ring.ring_contacts`):
    its predecessor and successor (one entry for a ring of two, none when alone), then its
    halving-doubling partners (:func:`pccl.protocol.algorithms.partner_positions`), then its
    hierarchical partners (:func:`pccl.protocol.algorithms.site_partners`).
    A newer round supersedes an older one: drop the older attempt's connections.
    ``ring_links[i]`` is the master's measurement of the edge ``ring[i] -> ring[i + 1]`` (empty
    when nothing is measured): with ``Config.p2p_lanes="auto"`` every peer sizes the round's
    lanes from them alike.
    ``sites[i]`` is the site (datacenter) of ``ring[i]`` as the master's measurements show it
    (:mod:`pccl.protocol.sites`: sites numbered along the ring from 0), empty when unknown;
    an older peer ignores it (trailing field).
    """

    round: U64
    ring: tuple[U64, ...]
    neighbours: tuple[PeerEndpoint, ...]
    ring_links: tuple[LinkFigure, ...] = ()
    sites: tuple[U32, ...] = ()


class TopologyComplete(Message, tag=22):
    """Master → participant: the round succeeded; ``ring`` is the group ring in order (endpoints
    of every member, for later shared-state transfers) and ``membership`` the fresh attributes."""

    round: U64
    ring: tuple[PeerEndpoint, ...]
    membership: Membership


class PeersPendingResult(Message, tag=23):
    """Master → voter: whether any registered peer waits for acceptance (at consensus time)."""

    pending: bool


class KickNotice(Message, tag=24):
    """Master → peer, just before closing: why (``pccl.errors.KickReason`` value) and details."""

    reason: U32
    detail: str = ""


class TopologyRejected(Message, tag=25):
    """Master → topology voter: its vote (accept or re-wire) is withdrawn because it can never
    complete: every member of its group waits in a call that needs the others in another one
    (a phase mismatch; ``detail`` names who waits where).  The call raises ``PhaseMismatch``."""

    detail: str = ""


class P2PHello(Message, tag=40):
    """Peer → peer, first message on a ring connection after the framed handshake: lane ``lane``
    of ``lanes`` from ring predecessor ``peer_id`` in topology round ``round`` of the master
    ``instance`` (round ids start again at 1 when the master restarts).  With ``partner``: not
    a lane but the round's partner link from ``peer_id`` (a halving-doubling partner at a lower
    ring position, :func:`pccl.protocol.algorithms.partner_positions`; ``lane`` is 0).
    ``algorithm``: the dialler's ``Config.all_reduce_algorithm`` (``"auto"`` or an
    :class:`~pccl.protocol.algorithms.AllReduceAlgorithm` value), which must be the acceptor's:
    peers with different settings would run different schedules."""

    peer_id: U64
    round: U64
    lane: U32 = 0
    lanes: U32 = 1
    instance: U64 = 0
    partner: bool = False
    algorithm: str = "auto"


class P2PHelloAck(Message, tag=41):
    """Peer → peer: the acceptor expects this connection (it is a ring neighbour in ``round``).
    A non-empty ``refused`` instead says why it never will (a setting that differs between the
    two peers, such as ``Config.all_reduce_algorithm``): both peers leave the run with
    ``InvalidUsage`` saying so, rather than retry the round."""

    peer_id: U64
    round: U64
    refused: str = ""


# --- 50–79: collective votes (master side in pccl/protocol/master/collectives.py; data path in
# pccl/collectives) ---
#
# Every accepted peer of a group sends CollectiveInit(tag, params).  At consensus the master
# checks the parameters agree and answers Commence(tag, seq, ring) — or CollectiveRejected(tag,
# code) to every voter.  Each participant then sends CollectiveDone(tag, seq, aborted) and
# receives exactly one final message per (tag, seq): CollectiveComplete when every live
# participant reported success, or CollectiveAbort as soon as one reports failure or dies first.
# After a final message the tag is free again; a Done that arrives after an abort (same seq) is
# ignored by the master.  A voter whose caller gave up before the answer sends
# CollectiveWithdraw(tag): its Init is removed and it is answered CollectiveRejected(WITHDRAWN)
# if the op had not commenced (else the Commence already on its way is the answer).


class RejectCode(enum.IntEnum):
    """Why the master refused to commence a collective (CollectiveRejected.code)."""

    PARAMETER_MISMATCH = 1  # peers disagree on count / dtype / op / quantization → InvalidUsage
    TAG_IN_USE = 2  # this peer reused an in-flight tag → InvalidUsage (this peer only)
    TOO_FEW_PEERS = 3  # fewer than two participants → TooFewPeers
    STALE_RING = 4  # a group member left since the ring was built: re-wire, then retry
    PHASE_MISMATCH = 5  # the group's other members wait in other calls (see TopologyRejected)
    WITHDRAWN = 6  # answer to this peer's CollectiveWithdraw: its vote is gone, the tag is free
    ROOT_ABSENT = 7  # a broadcast's root is not an accepted member of the group → retry-safe error


class CollectiveKind(enum.IntEnum):
    """What a collective computes (``CollectiveInit.kind``; the master runs each from its row in
    pccl.protocol.master.kinds, a peer from its row in pccl.collectives.kinds)."""

    ALL_REDUCE = 0
    BROADCAST = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3


class CollectiveInit(Message, tag=50):
    """Peer → master: vote to start collective ``tag`` with these parameters."""

    tag: U64
    count: U64
    dtype: U32  # pccl.types.DType
    op: U32  # pccl.types.ReduceOp
    quant_kind: U32 = 0  # pccl.types.QuantKind
    quant_dtype: U32 = 0  # pccl.types.DType of the wire type (0 when quant_kind is NONE)
    #: Digest of how the buffer is cut into arrays whose boundaries no frame straddles (an
    #: ``all_reduce_many`` bucket reduced in place over its members); 0 for one flat array.
    layout: U64 = 0
    #: What it computes (a CollectiveKind; trailing, so a peer that sends none asks for an all-reduce).
    kind: U32 = 0
    #: A broadcast's root (its peer id); 0 for the other kinds.
    root: U64 = 0
    #: Bits per quantized value when narrower than ``quant_dtype`` (4: two values per uint8 byte);
    #: 0: ``quant_dtype``'s own width (trailing, so an older peer's Init means 8 or 16 bits).
    quant_bits: U32 = 0
    #: Elements per ``(min, max)`` pair of MIN_MAX quantization; 0: one pair per frame.
    quant_block: U32 = 0


class CollectiveCommence(Message, tag=51):
    """Master → participant: run it; ``seq`` is global and unique, ``ring`` the participants."""

    tag: U64
    seq: U64
    ring: tuple[U64, ...]
    #: An all-gather's element count of each participant, in ``ring`` order (empty otherwise).
    counts: tuple[U64, ...] = ()


class CollectiveDone(Message, tag=52):
    """Participant → master: my part of op ``seq`` finished (``aborted`` = it failed locally)."""

    tag: U64
    seq: U64
    aborted: bool = False


class CollectiveComplete(Message, tag=53):
    """Master → participant: every live participant finished; the result stands."""

    tag: U64
    seq: U64


class CollectiveAbort(Message, tag=54):
    """Master → participant: op ``seq`` failed somewhere; restore inputs, raise, retry later."""

    tag: U64
    seq: U64
    #: Why, as the master saw it (``participant 1a2b left before finishing``); may be empty.
    detail: str = ""
    #: A RejectCode when the abort means what that rejection means (a begun op whose peers
    #: disagree, a Begin on a stale ring, a phase mismatch); 0: the op failed.
    code: U32 = 0


class CollectiveRejected(Message, tag=55):
    """Master → voter: collective ``tag`` will not commence (``code`` is a RejectCode)."""

    tag: U64
    code: U32
    detail: str = ""


class CollectiveWithdraw(Message, tag=56):
    """Peer → master: withdraw my Init for ``tag`` (the call was cancelled before an answer)."""

    tag: U64
    #: A frame cut mid-way left this peer's ring connections of the group's current round torn (a
    #: cancelled send or payload receive, here or by a withdrawn op's end): the ring is stale, and
    #: no op may begin on it.  Sent with no vote to withdraw too, as that notice alone (trailing:
    #: an older master ignores it, an older peer never sends it).
    torn: bool = False


class CollectiveBegin(Message, tag=57):
    """Peer → master, one-way: this peer began op ``seq`` on its group's ring of topology round
    ``round`` without a vote (the fast path; ``seq`` is :func:`derived_seq`); the rest are the
    fields of the ``CollectiveInit`` it would have sent, checked against the others' Begins."""

    tag: U64
    seq: U64
    round: U64
    count: U64
    dtype: U32
    op: U32
    quant_kind: U32 = 0
    quant_dtype: U32 = 0
    layout: U64 = 0
    kind: U32 = 0
    root: U64 = 0
    quant_bits: U32 = 0
    quant_block: U32 = 0
    #: The sender commits among the op's participants (docs/protocol.rst, "Design: completion
    #: agreed among peers"): the master resolves the op by query instead of aborting it on a death.
    peer_commit: bool = False

    def as_init(self) -> CollectiveInit:
        """The vote this Begin stands for."""
        return CollectiveInit(self.tag, self.count, self.dtype, self.op, self.quant_kind, self.quant_dtype,
                              self.layout, self.kind, self.root, self.quant_bits, self.quant_block)


def derived_seq(round_id: int, tag: int, n: int) -> int:
    """The seq of the ``n``-th use (from 0) of ``tag`` since topology round ``round_id`` on the
    fast path: the same on every peer, and apart from the master's seqs (which count up from 1)
    by its top bit."""
    digest = hashlib.blake2b(struct.pack(">QQQ", round_id, tag, n), digest_size=8, person=b"pccl-seq").digest()
    return (1 << 63) | (int.from_bytes(digest, "big") >> 1)


MEMBERSHIP_MESSAGES: tuple[type[Message], ...] = (
    Register, VoteTopology, P2PReport, VotePeersPending, Heartbeat, Leave,
    Welcome, ConnectToPeers, TopologyComplete, PeersPendingResult, KickNotice, TopologyRejected,
    P2PHello, P2PHelloAck,
)
COLLECTIVE_MESSAGES: tuple[type[Message], ...] = (
    CollectiveInit, CollectiveCommence, CollectiveDone, CollectiveComplete, CollectiveAbort,
    CollectiveRejected, CollectiveWithdraw, CollectiveBegin,
)

# --- 80–109: shared state (election in master/election.py, votes in master/sync.py, transfer in
# pccl/_peer/sync.py) -----------------------------------------------------------------------------
#
# Every accepted peer of a group sends SyncVote(revision, strategy, entries) — entries sorted by
# key, each with its xxh3-128 digest.  At consensus the master elects the popular state
# (election.py) and sends each peer that must fetch something a SyncPlan: which byte ranges of
# which tensors to fetch from which up-to-date peers (striped), and the hashes to verify.  The
# receiver dials each source's shared-state port (framed handshake with the run token), sends
# StateRequest and receives one data frame per piece straight into its buffers, then answers
# SyncReport.  A failed source → SyncReport(ok=False, failed_sources) → a fresh SyncPlan (next
# attempt) moving only that source's pieces onto the others.  When every receiver is done the
# master sends SyncComplete(revision) to every participant; a peer the sync cannot serve gets
# SyncRejected(code) instead.  Kicks (revision violation, mask mismatch, strategy) use KickNotice.
# A vote carries the voter's Lineage (the history its state belongs to, None before its first
# sync); SyncComplete hands every participant the group's lineage after the sync and tells it why
# it received (SyncReason).


class SyncRejectCode(enum.IntEnum):
    """Why a peer's sync ended without the state (SyncRejected.code)."""

    STRATEGY_MIX = 1  # ENFORCE_POPULAR mixed with another strategy → InvalidUsage for this peer
    NO_SOURCE = 2  # nobody can send (all RECEIVE_ONLY, or every source failed) → SharedStateSyncFailed
    HASH_MISMATCH = 3  # fetched bytes did not match the elected hash → SharedStateSyncFailed
    PHASE_MISMATCH = 4  # the group's other members wait in other calls → PhaseMismatch


class SyncReason(enum.IntEnum):
    """How a participant's state stood to the elected one (SyncComplete.reason)."""

    UP_TO_DATE = 0  # it held the elected state (nothing to fetch, or only its own unequal tensors)
    DIVERGED = 1  # it held the group's lineage at the elected revision, with other bytes
    BEHIND = 2  # it held the group's lineage at an older revision
    NEWCOMER = 3  # it held no lineage of this group: it takes the group's state, whatever it offered
    OUTVOTED = 4  # nobody held a lineage: its state lost the election (less progress, or less popular)


class Lineage(msgspec.Struct, frozen=True, array_like=True):
    """The history a shared state belongs to: the id minted at its run's first sync, and the
    revision and content digest (:func:`pccl.protocol.master.election.content_digest`) of the last sync
    its holder completed."""

    id: bytes
    revision: U64
    digest: bytes


class SharedStateEntry(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of a peer's shared state as voted: name, pccl.types.DType, size, xxh3-128."""

    key: str
    dtype: U32
    nbytes: U64
    hash: bytes
    allow_content_inequality: bool = False


class SyncVote(Message, tag=80):
    """Peer → master: sync my shared state (entries sorted by key, keys unique), which belongs
    to ``lineage`` (None: it never completed a sync, nor was it loaded from a checkpoint)."""

    revision: U64
    strategy: U32  # pccl.types.SyncStrategy
    entries: tuple[SharedStateEntry, ...]
    lineage: Lineage | None = None


class StatePiece(msgspec.Struct, frozen=True, array_like=True):
    """Bytes ``[offset, offset + nbytes)`` of tensor ``key``."""

    key: str
    offset: U64
    nbytes: U64


class SourceFetch(msgspec.Struct, frozen=True, array_like=True):
    """Fetch ``pieces`` from ``source``'s shared-state port."""

    source: PeerEndpoint
    pieces: tuple[StatePiece, ...]


class ExpectedHash(msgspec.Struct, frozen=True, array_like=True):
    key: str
    hash: bytes


class SyncPlan(Message, tag=81):
    """Master → receiver: attempt ``attempt`` of sync ``sync_id``: fetch these pieces, then
    verify every tensor in ``expected`` (all tensors this peer receives in this sync)."""

    sync_id: U64
    attempt: U32
    revision: U64
    expected: tuple[ExpectedHash, ...]
    fetches: tuple[SourceFetch, ...]


class SyncReport(Message, tag=82):
    """Receiver → master: attempt finished.  ``ok``: every piece arrived and every hash matched.
    Otherwise ``failed_sources`` lists the sources that failed (re-plan), or it is empty and the
    received bytes did not match the elected hashes (``detail`` says which)."""

    sync_id: U64
    attempt: U32
    ok: bool
    failed_sources: tuple[U64, ...] = ()
    detail: str = ""


class SyncComplete(Message, tag=83):
    """Master → participant: the sync is complete everywhere; adopt ``revision`` and
    ``lineage`` (the group's, after this sync; its revision equals ``revision``).  ``reason``
    (a SyncReason) says how this participant's state stood to the elected one."""

    sync_id: U64
    revision: U64
    lineage: Lineage
    reason: U32 = 0


class SyncRejected(Message, tag=84):
    """Master → voter: this peer's sync ends without the state (``code`` is a SyncRejectCode)."""

    code: U32
    detail: str = ""


class StateRequest(Message, tag=90):
    """Receiver → source, on the source's shared-state port: send these pieces of sync
    ``sync_id``; the source answers with one data frame per piece (``stream`` = piece index) or
    ``StateRefused``."""

    sync_id: U64
    requester: U64
    pieces: tuple[StatePiece, ...]


class StateRefused(Message, tag=91):
    """Source → receiver: this peer does not serve that request (not a source, unknown key…)."""

    reason: str


SHARED_STATE_MESSAGES: tuple[type[Message], ...] = (
    SyncVote, SyncPlan, SyncReport, SyncComplete, SyncRejected, StateRequest, StateRefused,
)

# --- 200–219: connection handshake and authentication (pccl/net/framed.py) ---------------------
#
# Sent right after the raw preamble (magic + protocol version, pccl/protocol/handshake.py), in this
# order by both sides at once: Hello, then — only when both sides hold a run token — AuthProof and
# AuthResult.  The handshake is symmetric except for ``role``, which the HMAC binds.


class HandshakeRole(enum.IntEnum):
    """Which end of a connection a side is: the one that dialled or the one that accepted."""

    CLIENT = 0
    SERVER = 1


class Hello(Message, tag=200):
    """First frame on every connection: who I am in this connection and my challenge nonce."""

    role: HandshakeRole
    #: Whether this side holds a run token (and therefore requires the other side to prove one).
    has_token: bool
    #: Fresh random challenge; the other side's proof covers it (see ``handshake.auth_proof``).
    nonce: bytes


class AuthProof(Message, tag=201):
    """HMAC-SHA256 over both nonces and the prover's role, keyed by the run token."""

    mac: bytes


class AuthResult(Message, tag=202):
    """Whether the sender accepted the other side's proof; ``reason`` says why not."""

    ok: bool
    reason: str = ""


# --- 110–129: topology optimisation (master side in master/optimize.py, probes in pccl/_peer/probes.py)
#
# Every accepted peer of a group sends VoteOptimize.  At consensus the master sends each member a
# ProbeRequest naming the members it has no measurement from it to (possibly none); each probes
# them over their p2p ports (ProbeHello/ProbeAck, data frames, ProbeEnd/ProbeEndAck on an
# authenticated connection per stream) and answers ProbeReport.  With every live member's report
# in, the master solves the ring (pccl.protocol.topology) and installs it with an ordinary group
# round: ConnectToPeers ... TopologyComplete, which ends the voters' optimize_topology().


class VoteOptimize(Message, tag=110):
    """Peer → master: measure the missing links of my group and install the best ring."""


class ProbeRequest(Message, tag=111):
    """Master → voter: probe these peers (in this order; an empty tuple: nothing to measure)."""

    probe: U64
    targets: tuple[PeerEndpoint, ...]


class ProbeResult(msgspec.Struct, frozen=True, array_like=True):
    """One measured directed link, from the prober to ``peer_id``: bytes/s and seconds;
    ``bandwidth`` 0 means the probe failed or timed out (a very slow link)."""

    peer_id: U64
    bandwidth: Annotated[float, msgspec.Meta(ge=0)]
    rtt: Annotated[float, msgspec.Meta(ge=0)]


class ProbeReport(Message, tag=112):
    """Voter → master: the results of ProbeRequest ``probe`` (one per target)."""

    probe: U64
    results: tuple[ProbeResult, ...]


class ProbeHello(Message, tag=113):
    """Peer → peer, first message of a probe connection on the p2p port: stream ``stream`` of
    ``peer_id``'s probe ``probe`` under master ``instance``."""

    peer_id: U64
    probe: U64
    stream: U32
    instance: U64 = 0


class ProbeAck(Message, tag=114):
    """Peer → peer: the probed peer takes the probe stream (the prober times this for the RTT)."""

    peer_id: U64


class ProbeEnd(Message, tag=115):
    """Peer → peer: the prober stops sending on this stream."""


class ProbeEndAck(Message, tag=116):
    """Peer → peer: the probed peer received ``nbytes`` payload bytes on this stream."""

    nbytes: U64


TOPOLOGY_MESSAGES: tuple[type[Message], ...] = (
    VoteOptimize, ProbeRequest, ProbeReport, ProbeHello, ProbeAck, ProbeEnd, ProbeEndAck,
)


ALL_MESSAGES: tuple[type[Message], ...] = (
    *MEMBERSHIP_MESSAGES,
    *COLLECTIVE_MESSAGES,
    *SHARED_STATE_MESSAGES,
    *TOPOLOGY_MESSAGES,
    *CONNECTIVITY_MESSAGES,
    *POINT_MESSAGES,
    *PEER_COMMIT_MESSAGES,
    Hello,
    AuthProof,
    AuthResult,
)
