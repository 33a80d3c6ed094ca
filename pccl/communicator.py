"""The peer side's public face: :func:`open_communicator` and :class:`Communicator`.

A communicator is a peer's membership in a run.  It delegates: the connection to the master, the
votes, the ring set-up, the failure state and the counters are the peer session
(:mod:`pccl._peer`); the all-reduce is :mod:`pccl._peer.collective_service`; the shared-state sync
is :mod:`pccl._peer.sync`.  The services reach the session only through its
:class:`~pccl._peer.host.PeerHost` interface, and the session's phase rule
(:mod:`pccl._peer.phase`) decides which calls may run together.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._groups import single_exception
from ._peer.host import MasterLost
from ._peer.collective_service import MANY_FIRST_TAG, CollectiveService
from ._peer.session import PeerSession
from ._peer.sync import StateSyncService
from .collectives.buckets import DEFAULT_BUCKET_BYTES
from .config import ADVERTISE_ENV, Config
from .errors import PhaseMismatch, SharedStateSyncFailed
from .net.base import Network
from .protocol import messages as m
from .protocol.paths import describe_port, parse_advertise
from .shared_state import SharedState
from .types import CollectiveInfo, Gathered, Quantization, ReduceInfo, ReduceOp, Shard, SyncInfo, SyncStrategy

__all__ = ["Communicator", "CommunicatorStatistics", "open_communicator"]

log = logging.getLogger(__name__)

#: The environment variable :func:`open_communicator` (over real TCP) and ``pccl master`` read
#: the run token from when none is given.
TOKEN_ENV = "PCCL_TOKEN"


@dataclasses.dataclass(frozen=True)
class CommunicatorStatistics:
    """A snapshot of one communicator (``Communicator.statistics()``)."""

    peer_id: int
    peer_group: int
    world_size: int
    global_world_size: int
    num_peer_groups: int
    largest_peer_group_size: int
    #: This group's ring (peer ids in order) as of the last topology update.
    ring: tuple[int, ...]
    topology_updates: int
    p2p_rounds: int
    #: Ring lanes this peer dialled afresh, and lanes it kept from the previous round (same
    #: successor, connection at rest) by sending the new round's hello on them.  Partner links
    #: are not counted here but in ``p2p_partner_dials``.
    p2p_dials: int
    p2p_lanes_kept: int
    #: Partner links this peer dialled (to its partners at higher ring positions; never kept):
    #: halving-doubling partners, every topology round from 8 peers up or with an algorithm
    #: forced, and the hierarchical all-reduce's site partners when the round has sites.
    p2p_partner_dials: int
    p2p_connections: int
    collectives_completed: int
    collectives_aborted: int
    #: All-reduce attempts repeated after an abort or a stale ring.
    retries: int
    #: Payload bytes of completed all-reduces.
    tx_bytes: int
    rx_bytes: int
    syncs_completed: int
    #: Sync attempts beyond the first (a source failed mid-transfer and the master re-planned).
    sync_replans: int
    #: Shared-state payload bytes served to / received from other peers over all syncs.
    sync_tx_bytes: int
    sync_rx_bytes: int
    #: The last completed sync: revision adopted (None before the first) and the bytes this peer
    #: served and received in it (what its heartbeats report to the master's status page).
    last_sync_revision: int | None = None
    last_sync_tx_bytes: int = 0
    last_sync_rx_bytes: int = 0
    #: Paths this peer decided for its connections to other peers (direct, dialled back by the
    #: other peer, relayed; a path decided again after its old one failed counts again), and
    #: connections it dialled back for others and relay rendezvous it answered.
    paths_direct: int = 0
    paths_reversed: int = 0
    paths_relayed: int = 0
    dial_backs: int = 0
    relay_joins: int = 0
    #: Payload bytes of completed point-to-point sends and receives.
    p2p_tx_bytes: int = 0
    p2p_rx_bytes: int = 0
    #: Collectives committed among their participants (``Config.peer_commit``: every participant
    #: known ready, without waiting for the master's verdict; the master's own ``Complete`` may
    #: beat the acks, which is as good), and those this peer fell in doubt about once ready (a
    #: neighbour silent for ``peer_timeout``, a differing ack, the master's query after a death)
    #: and so waited for the master's verdict.
    peer_commits: int = 0
    peer_commit_doubts: int = 0
    #: The paths this peer's connections to each other peer take now, as
    #: ``(peer_id, port, path, via)``: ``port`` one of ``"p2p"``, ``"shared_state"``,
    #: ``"benchmark"``; ``path`` one of ``"direct"``, ``"reversed"``, ``"relayed"``; ``via`` the
    #: address dialled or the relay (see "Firewalls, NAT and relays" in the operating guide).
    paths: tuple[tuple[int, str, str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Internals:
    """A communicator's parts, for pccl's own tests (:mod:`pccl.testing`): no compatibility
    promise, not part of the public face."""

    session: PeerSession
    all_reduce: CollectiveService
    sync: StateSyncService


#: Communicator -> its parts (read by :func:`internals_of`; the communicator keeps no public
#: handle on them).
_INTERNALS: weakref.WeakKeyDictionary[Communicator, Internals] = weakref.WeakKeyDictionary()


def internals_of(comm: Communicator) -> Internals:
    """The parts of ``comm`` (see :class:`Internals`)."""
    return _INTERNALS[comm]


class Communicator:
    """A peer's membership in a run.  Obtain one from :func:`open_communicator`.

    Every async method is a Trio checkpoint.  When the master kicks this peer every pending and
    later call raises :class:`~pccl.errors.Kicked`; when the master is lost (closed connection,
    or silent for ``config.peer_timeout``) they raise :class:`~pccl.errors.MasterUnreachable`.
    """

    def __init__(self, session: PeerSession, all_reduce: CollectiveService, sync: StateSyncService) -> None:
        self._session = session
        self._all_reduce = all_reduce
        self._sync = sync
        _INTERNALS[self] = Internals(session, all_reduce, sync)

    # --- attributes (accepted peers only; identical on every peer after each change) -----------

    @property
    def peer_id(self) -> int:
        """This peer's id, drawn by the master at registration."""
        return self._session.peer_id

    @property
    def peer_group(self) -> int:
        return self._session.peer_group

    @property
    def master_address(self) -> str:
        return self._session.master_address

    @property
    def world_size(self) -> int:
        """Accepted peers in this peer's group."""
        return self._session.membership.world_size

    @property
    def global_world_size(self) -> int:
        """Accepted peers in all groups (pending peers are not counted)."""
        return self._session.membership.global_world_size

    @property
    def num_peer_groups(self) -> int:
        return self._session.membership.num_peer_groups

    @property
    def largest_peer_group_size(self) -> int:
        return self._session.membership.largest_peer_group_size

    @property
    def ring(self) -> tuple[int, ...]:
        """This group's ring (peer ids, in order) as of the last topology update."""
        return tuple(e.peer_id for e in self._session.ring_endpoints)

    @property
    def sites(self) -> tuple[int, ...]:
        """The site (datacenter) of each position of this peer's current ring, as the master's
        link measurements show them (``optimize_topology``; :mod:`pccl.protocol.sites`): sites
        numbered along the ring from 0, ``()`` when unknown (links unmeasured or alike)."""
        return self._session.links.sites

    @property
    def ring_endpoints(self) -> tuple[m.PeerEndpoint, ...]:
        return self._session.ring_endpoints

    def statistics(self) -> CommunicatorStatistics:
        counters = self._session.counters
        return CommunicatorStatistics(
            peer_id=self.peer_id, peer_group=self.peer_group, world_size=self.world_size,
            global_world_size=self.global_world_size, num_peer_groups=self.num_peer_groups,
            largest_peer_group_size=self.largest_peer_group_size, ring=self.ring,
            p2p_connections=len(self._session.links.connections()), **dataclasses.asdict(counters),
            paths=tuple(sorted((peer, describe_port(port), path.kind.name.lower(), path.via)
                               for (peer, port), path in self._session.connector.paths.items())))

    # --- membership ---------------------------------------------------------------------------

    async def update_topology(self) -> None:
        """Vote to accept pending peers and re-wire the ring; return when every accepted peer of
        every group voted and the new ring is connected (p2p failures are retried internally).

        ``InvalidUsage`` while a collective or a sync of this peer is in flight (a cancelled
        all-reduce whose vote is still being withdrawn is waited for instead).  Cancellation
        leaves the vote standing: the next call waits for the same vote instead of voting again.
        Raises ``Kicked``, ``MasterUnreachable``, ``PhaseMismatch`` (every other peer of the
        group waits in another call — an all-reduce or a sync — so this vote could never
        complete; the master ended them all).
        """
        await self._session.topology_vote(accept_new_peers=True)

    async def optimize_topology(self) -> None:
        """Vote to optimise this group's ring; return once every accepted peer of the group
        voted, each measured the links to the peers it had no measurement for (bandwidth and
        RTT, ``Config.probe_streams`` parallel streams for ``Config.probe_seconds``, bounded in
        time; a failed probe counts as a very slow link), and the master installed the ring with
        the best bottleneck (:mod:`pccl.protocol.topology`) — the next all-reduce uses it, and
        :attr:`ring` shows it.  Measurements are kept while both ends stay, so a later call
        measures only the newcomers' links.

        Errors and cancellation as for :meth:`update_topology` (``PhaseMismatch`` when another
        peer of the group waits in another call, ``update_topology`` included).  After the
        master restarted it returns without measuring until this peer's next
        ``update_topology`` (where the group's loops realign), as collectives abort until then.
        """
        await self._session.optimize_vote()

    async def are_peers_pending(self) -> bool:
        """Whether ``update_topology()`` has something to do: a registered peer waits to be
        accepted.  Answered once every accepted peer (of every group) asked — or, ``True``, as
        soon as every one that did not ask waits in ``update_topology()`` (that vote waits for
        this peer's); ``True`` too after a master restart, until this peer's next
        ``update_topology()``, where its group meets again.  Legal while collectives run.  Cancellation leaves the vote standing (the next
        call waits for its answer).  Raises ``Kicked``, ``MasterUnreachable``."""
        return await self._session.are_peers_pending()

    async def aclose(self) -> None:
        """Leave the run: tell the master (best effort, bounded), close every connection (the
        point-to-point ones gracefully: up to 5 s for each peer to close its end, so that the
        acknowledgements of receives that returned reach their senders) and stop the background
        tasks.  Idempotent; closes even when cancelled."""
        if not self._session.begin_close():
            return
        with trio.CancelScope(shield=True):
            await self._session.leave()
            await self._sync.aclose()
        self._session.stop()

    # --- collectives (pccl._peer.collective_service) -----------------------------------------------

    async def all_reduce(self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM,
                         tag: int = 0, quantization: Quantization | None = None) -> ReduceInfo:
        """Ring all-reduce of ``send`` into ``recv`` (``None``: in place) over the group's accepted
        peers.  Arrays are C-contiguous numpy arrays or CPU torch tensors, used without a copy
        (the result lands in their memory); returns ``ReduceInfo(world_size, tx_bytes, rx_bytes)`` — the peers it ran over and
        the payload bytes this peer moved.

        Every peer of the group must call it with the same ``tag``, element count, dtype, ``op``
        and ``quantization`` (else ``InvalidUsage`` on every peer).  f16/bf16 accumulate in f32;
        AVG divides by the number of participants; MIN_MAX quantization leaves every peer with
        bit-identical results.  Several calls with distinct tags may run at once.

        Raises ``InvalidArgument`` (bad buffer: unsupported dtype, size/dtype mismatch between
        ``send`` and ``recv``, non-contiguous, read-only output, NaN/Inf under quantization),
        ``InvalidUsage`` (``tag`` already in flight here, a topology vote or sync outstanding, or
        the peers' parameters disagree), ``TooFewPeers`` (alone in the group; the buffers are
        untouched), ``CollectiveAborted`` (a participant failed: an in-place buffer holds its
        input again; retry — a stale ring is re-wired automatically by the next call; caused by
        ``PhaseMismatch`` when every other peer of the group waits in ``update_topology`` or a
        sync instead, or every peer waits on tags not all of them started: go on to the next
        step, where the loops meet, or call again on the tag the others use), ``Kicked``,
        ``MasterUnreachable``.  Cancellation restores an in-place buffer and makes the other
        participants abort; cancelled before the master answered, the vote is withdrawn (the
        next call on the tag, or a topology update or sync, waits for that one round trip).
        Cancelled after this peer reported its success to the master, the call ends as the
        master says, as the others' do: the result if the op completed (the cancellation came
        too late and is not raised), else the input restored and ``Cancelled``; it waits for
        that word (shielded) for at most ``Config.peer_timeout``, past which it gives up
        undecided (input restored, ``Cancelled``).  Closing the communicator (or cancelling a
        scope around ``open_communicator``) meanwhile ends it at once the latter way, since the
        master's word can no longer be read: the others may complete the op
        (docs/reference/errors.rst).
        """
        return await self._all_reduce.all_reduce(send, recv, op=op, tag=tag, quantization=quantization)

    async def all_reduce_many(self, arrays: Sequence[Any], *, op: ReduceOp = ReduceOp.SUM,
                              quantization: Quantization | None = None, max_in_flight: int = 4,
                              first_tag: int = MANY_FIRST_TAG, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReduceInfo:
        """All-reduce each array of ``arrays`` (numpy arrays or CPU torch tensors) in place.

        Arrays of one dtype share buckets of at most ``bucket_bytes`` (512 MiB by default; 0:
        one op per array), each reduced by one op, so a model's hundreds of tensors cost a few
        ops' fixed costs, not hundreds.  Arrays of 1 MiB or more share buckets reduced in place
        over the arrays themselves, without a copy; smaller ones are packed into buckets of their
        own of at most 25 MiB (copied in, and out once the op completed); an array of ``bucket_bytes`` or more is
        reduced on its own, in place.  Up to ``max_in_flight`` ops run at once (op ``k`` uses
        tag ``first_tag + k``).  Ops that abort are retried on the survivors — after every
        running op has settled — until all succeeded; an aborted bucket's arrays hold their
        inputs again (restored, or never written).  Every peer must pass arrays of the same dtypes
        and sizes in the same order.  Returns the smallest world size any op ran over and the
        summed payload bytes of the successful ops.

        Raises ``TooFewPeers`` once alone (buckets reduced before keep their results, the
        others their inputs); ``CollectiveAborted`` only when the master was lost (it restarted)
        or the group's loops diverged (caused by ``PhaseMismatch``), not for a peer's death;
        and the other errors of :meth:`all_reduce`.  Every array is checked before any op
        starts, and no op is left running when it raises.  Cancellation cancels every running op
        and the call raises ``Cancelled``, even when every op ended by completing (an op whose
        peer had reported its success ends as the master says, as in :meth:`all_reduce`): each
        bucket's arrays hold either its reduction (its op completed) or their inputs.
        """
        return await self._all_reduce.all_reduce_many(arrays, op=op, quantization=quantization,
                                                      max_in_flight=max_in_flight, first_tag=first_tag,
                                                      bucket_bytes=bucket_bytes)

    async def broadcast(self, x: Any, *, root: int, tag: int = 0,
                        quantization: Quantization | None = None) -> CollectiveInfo:
        """Overwrite ``x`` (a numpy array or CPU torch tensor, used without a copy) on every
        participant with the root's ``x``.  ``root`` is the sender's ``peer_id``; every
        participant passes the same ``root``, ``tag``, element count, dtype and quantization
        (else ``InvalidUsage`` on every peer).  With quantization the root's own ``x`` also ends
        holding the dequantized values, so every participant ends bit-identical.  Returns
        ``CollectiveInfo(world_size, peers, tx_bytes, rx_bytes)`` (``peers``: the participants in
        ring order).

        Runs as a pipelined chain along the ring from the root, or, where partner links are
        wired for the halving-doubling family (8 peers and more, unless
        ``Config.all_reduce_algorithm`` is ``"ring"`` or ``"hierarchical"``) and the op is
        unquantized, as a binomial tree (small buffers) or a scatter + all-gather (mid-size
        ones) over them: a pure choice by size and world, the same on every peer
        (docs/collectives.rst, "Which algorithm a broadcast runs"); unquantized, every one of
        them leaves the root's bytes exactly.  A root that is not an accepted member of the
        group, or that dies during the op, ends the call on every other
        participant with ``CollectiveAborted`` naming the root (retry-safe: a receiver's ``x``
        holds its input again).  Otherwise the errors, cancellation and the phase rule are
        those of :meth:`all_reduce`.
        """
        return await self._all_reduce.broadcast(x, root=root, tag=tag, quantization=quantization)

    async def all_gather(self, x: Any, *, tag: int = 0, quantization: Quantization | None = None) -> Gathered:
        """Gather every participant's ``x`` (same dtype on all; element counts may differ, 0
        allowed) into one buffer, in ring order, on every participant; ``x`` is not modified.
        Returns ``Gathered``: ``peers`` (the participants' peer ids in ring order, identical
        everywhere), ``arrays`` (one flat array per participant in that order, views into
        ``buffer``; torch tensors when ``x`` was one), ``buffer``, ``world_size``, ``tx_bytes``,
        ``rx_bytes``.  With quantization every contribution is quantized once by its owner, so
        every participant's result — its own slot included — is bit-identical.

        Every participant passes the same ``tag``, dtype and quantization (else
        ``InvalidUsage``); the master sends every participant's count with the start, so the
        layout is known before a byte moves.  Errors, cancellation and the phase rule are those
        of :meth:`all_reduce` (nothing to restore: only the result buffer is written).
        """
        return await self._all_reduce.all_gather(x, tag=tag, quantization=quantization)

    async def reduce_scatter(self, x: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0,
                             quantization: Quantization | None = None) -> Shard:
        """Reduce ``x`` over the participants, in place, each keeping one slice: the participant
        at ring position ``i`` of ``n`` owns the ``i``-th of ``n`` contiguous slices of the flat
        ``x`` (the first ``len % n`` one element longer), and ``x[shard.start:shard.stop]`` holds
        that slice's reduction.  The rest of ``x`` is unspecified after success and holds its
        input again after an abort.  Returns ``Shard(start, stop, index, world_size, peers,
        tx_bytes, rx_bytes)``.

        Every participant passes the same ``tag``, element count, dtype, ``op`` and
        quantization (else ``InvalidUsage``).  f16/bf16 accumulate in f32; AVG divides by the
        number of participants.  Runs as the first half of the ring all-reduce, in about half
        its time.  Errors, cancellation and the phase rule are those of :meth:`all_reduce`.
        """
        return await self._all_reduce.reduce_scatter(x, op=op, tag=tag, quantization=quantization)

    # --- point to point (pccl._peer.point) -------------------------------------------------------

    async def send(self, x: Any, *, to: int, tag: int = 0, timeout: float | None = None,
                   quantization: Quantization | None = None) -> None:
        """Send ``x`` (a C-contiguous numpy array or CPU torch tensor, not modified) to the peer
        whose ``peer_id`` is ``to``, which receives it with ``recv(y, from_=<this peer_id>,
        tag=tag)``.  Returns once the receiver has the whole payload (it acknowledges: a
        rendezvous).  Both peers are accepted members of the same group; a peer's ids are in
        :attr:`ring` (as of the last topology update).  No master round trip: the message goes
        over a peer-to-peer connection (direct, dialled back or relayed), kept for the pair's
        later messages.

        Matching is by (sender, receiver, tag), in order: two sends to one peer on one tag are
        received by that peer's receives on the tag in call order.  Independent of the phase
        rule: legal alongside collectives, votes and syncs.

        Raises ``InvalidArgument`` (a bad array; ``to`` is not a member of the group, or is this
        peer; the receiver's dtype or element count differs — both calls fail, naming both
        shapes; ``quantization`` given: not supported yet), ``PeerDisconnected`` (the receiver
        died, closed its connections or fell silent for ``Config.peer_timeout``: retry-safe, the
        next call dials afresh), ``PeerUnreachable`` (no path to it), ``TransferTimeout``
        (``timeout`` seconds passed), ``Kicked``/``MasterUnreachable``/``InvalidUsage`` once the
        communicator failed or closed.  Cancellation (or ``timeout``) before the receiver took
        the message withdraws it; after, the connections with that peer are closed and its
        other pending calls fail with ``PeerDisconnected``.
        """
        await self._session.points.send(x, to=to, tag=tag, timeout=timeout, quantization=quantization)

    async def recv(self, x: Any, *, from_: int, tag: int = 0, timeout: float | None = None,
                   quantization: Quantization | None = None) -> None:
        """Receive the next message peer ``from_`` sends to this peer on ``tag`` into ``x`` (a
        writable C-contiguous numpy array or CPU torch tensor of the sender's dtype and element
        count; the shapes may differ).  Returns once the whole payload is in ``x``.  A receive
        waits for its sender as long as it takes (``timeout`` bounds it), watching that the
        sender is alive meanwhile.

        Raises what :meth:`send` raises (a dtype or count mismatch fails both calls, naming both
        shapes).  On any error or cancellation ``x`` holds its old values: the payload is
        received into a staging buffer and copied into ``x`` once complete.
        """
        await self._session.points.recv(x, from_=from_, tag=tag, timeout=timeout, quantization=quantization)

    # --- shared state (pccl._peer.sync) ----------------------------------------------------------

    async def sync_shared_state(self, state: SharedState,
                                strategy: SyncStrategy = SyncStrategy.ENFORCE_POPULAR) -> SyncInfo:
        """Make ``state`` bit-identical to the group's popular state and adopt its revision
        (written back into ``state.revision``).  Returns once every peer of the group is done.

        Raises ``InvalidArgument``/``InvalidUsage`` (bad state or strategy, a collective, a
        topology vote or another sync outstanding, ENFORCE_POPULAR mixed with another strategy),
        ``RevisionViolation`` (this peer took part in the group's last sync and offers more
        than that revision + 1: it jumped without syncing; it is kicked), ``Kicked`` (key set, dtype or size differs from the popular state; SEND_ONLY
        without the popular state), ``SharedStateSyncFailed`` (no source could deliver, hash
        mismatch), ``MasterUnreachable``.  Cancelled before its vote went out, nothing stands;
        after, the sync goes on in the background (the group waits for it) and the next call with
        the same state resumes it, returning its ``SyncInfo`` (or raising its error).
        """
        return await self._sync.sync(state, strategy)

    async def steps(self, state: SharedState, *,
                    strategy: SyncStrategy = SyncStrategy.ENFORCE_POPULAR) -> AsyncGenerator[SyncInfo, None]:
        """The recommended training loop, as an async iterator yielding each step's ``SyncInfo``.

        Each step: ``update_topology()`` (skipped on the first step — a newcomer's
        ``open_communicator`` returned exactly when the others' update returned, so it already
        stands at this line), then while this peer is alone in its group, wait for a newcomer
        (``update_topology()`` again every ``config.heartbeat_interval``: it accepts a peer that
        waits, and in a run of several groups it is the vote the other groups' updates wait
        for), then ``sync_shared_state(state, strategy)``.  The caller all-reduces, updates the
        state and increments ``state.revision`` in the loop body.  Errors as for the calls it
        makes; cancellation as for them.  Close it (``aclose``) or break out of the loop.  When
        the master is lost mid-sync the step starts over once it is back; a
        ``CollectiveAborted`` in the body should ``continue`` the loop likewise.
        A ``PhaseMismatch`` (this peer's update or sync could never complete because the
        group's other peers wait in another call) starts the step over likewise: the
        others' calls ended too, and the loops meet again at ``update_topology()``.
        """
        first = True
        while True:
            try:
                if not first:
                    await self.update_topology()
                first = False
                if self.world_size < 2:
                    log.info("peer %x is alone in group %d: waiting for another peer to join", self.peer_id,
                             self.peer_group)
                while self.world_size < 2:
                    # Not are_peers_pending(): its vote waits for every accepted peer of every
                    # group, and the other groups' loops wait in update_topology(), whose accept
                    # vote is global too.  Alone in one group, this returns at once.
                    await trio.sleep(self._session.config.heartbeat_interval)
                    await self.update_topology()
                info = await self.sync_shared_state(state, strategy)
            except PhaseMismatch as exc:
                # The group's other peers waited elsewhere (their all-reduce, say, ended too and
                # their loop goes on to its next step): meet them at update_topology.
                log.info("peer %x: %s; starting the step again", self.peer_id, exc)
                continue
            except SharedStateSyncFailed as exc:
                if isinstance(exc.__cause__, MasterLost):
                    continue  # the master was lost mid-sync: the next step waits until it is back
                raise
            yield info


@asynccontextmanager
async def open_communicator(
    master_address: str,
    *,
    peer_group: int = 0,
    token: str | bytes | None = None,
    config: Config | None = None,
    network: Network | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[Communicator]:
    """Connect to the master, register in ``peer_group`` and wait until accepted.

    A master that is not up yet (nothing answers at ``master_address``) is waited for, up to
    ``config.master_wait_timeout`` (60 s by default; 0: fail at once), logging "waiting for the
    master at HOST:PORT" once at INFO, so the master and its peers can start in any order.

    The first peer is accepted at once; later ones when the accepted peers next call
    ``update_topology()`` — this returns at the same moment theirs does.  ``token``: the run
    token the master requires (``str`` or ``bytes``); when it is None and ``network`` is too,
    the ``$PCCL_TOKEN`` environment variable is used if it is set and not empty, as ``pccl
    master`` does — so one exported variable serves the master and its peers.  ``network``
    defaults to real TCP; a caller that passes its own network (the simulator, a test's memory
    network) passes its token explicitly too, and the environment is not read.  ``rng`` (when
    given) draws the handshake nonces and the jitter of the waits for the master (the simulator
    seeds it).
    Raises ``MasterUnreachable`` (cannot connect within ``master_wait_timeout``, or lost while
    waiting to be accepted), ``AuthenticationFailed``
    (wrong or missing run token), ``Kicked``, ``ProtocolError``.  Cancellation while waiting
    leaves the run.  Leaving the block closes the communicator (``aclose``).
    """
    config = config or Config()
    if network is None:
        from .net.tcp import TcpNetwork

        if config.advertise is None and os.environ.get(ADVERTISE_ENV):
            advertise = os.environ[ADVERTISE_ENV]
            parse_advertise(advertise, source=f"${ADVERTISE_ENV}")  # InvalidArgument naming the variable
            config = dataclasses.replace(config, advertise=advertise)
        network = TcpNetwork(config)
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
    try:
        async with trio.open_nursery() as nursery:
            session = PeerSession(master_address, peer_group=peer_group, token=token, config=config,
                                  network=network, rng=rng, nursery=nursery)
            sync = StateSyncService(session)
            comm = Communicator(session, CollectiveService(session), sync)
            try:
                await session.connect()
                await session.register(shared_state_port=await sync.listen())
                session.spawn(sync.serve)
                await session.wait_accepted()
                yield comm
            finally:
                await comm.aclose()
    except BaseExceptionGroup as group:
        raise single_exception(group) from None
