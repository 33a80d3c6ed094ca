"""Ring all-reduce over the data lanes to the ring neighbours.

:func:`ring_all_reduce` runs one operation — reduce-scatter, then all-gather, on the schedule of
:mod:`pccl.protocol.ring` — and returns the payload bytes it sent and received.  The communicator
checks the arguments before its vote (:class:`~pccl.collectives.buffers.ReduceArgs`) and calls
:func:`reduce_checked` on them after the master's ``Commence(tag, seq, ring)``, inside the op's
cancel scope.

Design
------
* **Pipelining.**  Every chunk is cut into sub-chunks (one data frame each).  Frame ``(step, k)``
  is sent as soon as frame ``(step - 1, k)`` was received and processed (reduced or
  dequantized), so receiving, reducing and sending overlap sub-chunk by sub-chunk and across
  steps.  Kernels run inline on the Trio thread up to a size and in a worker thread above it
  (:class:`KernelRunner`; the simulator passes ``threads=False``).
* **Three paths, one op.**  When the lanes offer the blocking fast path (real TCP does:
  :attr:`RingLinks.threaded`), large ops run one sender and one receiver *thread* per lane
  (:mod:`pccl.collectives.threaded`) and the C kernels release the GIL — about twice the
  throughput of Trio tasks on a 2-core loopback box; small ops (≤ 256 KiB) on those lanes run as
  one sequential loop in the calling task (:mod:`pccl.collectives.inline`), for which the threads'
  hand-offs cost more than the transfer.  On lanes without it (the simulator's streams, TLS) the
  calling task walks the ring in arrival order and sends without ever waiting, handing frames the
  connection cannot take at once to a sender task per lane (:mod:`pccl.collectives.trio_ring`).
  All three send the same frames from the same buffers and compute the same results;
  :func:`~pccl.collectives.execute.execute_op` picks one per op, for every kind.
* **Small ops: the exchange.**  An unquantized op whose peers would each send at most 256 KiB
  this way (``(N - 1) × input``: 256 KiB of input at N = 2, 128 KiB at N = 3) runs on
  :class:`~pccl.protocol.ring.ExchangeSchedule`: every input travels around the ring in its own
  dtype (each peer sends its own, then forwards what it received) and every peer reduces all of
  them — N - 1 trips instead of the ring's 2 (N - 1); at N = 2 one trip for the same bytes.
  Every peer folds ``x[0] op x[1] op … op x[N-1]`` in ring order (f16/bf16 widened to f32,
  rounded once) and canonicalises NaN results, so all end bit-identical; in place, the input is
  sent from a copy (the result overwrites the slice being sent).  Every execution path runs it
  (it is just another schedule).  Measured at 16 KiB on the 2-core loopback box: N = 3
  1.91 → 1.55 ms per op, N = 4 2.91 → 2.53 ms; at N = 3 the ring catches up at 128 KiB.
* **Segmented buffers.**  ``all_reduce_many`` reduces a bucket of arrays in place over the
  arrays themselves (:class:`~pccl.collectives.segments.Segments`): the schedule also cuts
  sub-chunks where one array ends, so every frame's slice is a view of one array and every
  path above runs unchanged.  Such ops always take the ring (never the exchange, which sends
  an in-place input from a flat copy).
* **Scratch memory** (the in-place backup, the f32 working array, staging) comes from a
  process-wide :class:`~pccl.collectives.buffers.ScratchArena` that keeps freed buffers: fresh
  pages cost more to fault in than the whole copy.
* **Zero copy.**  Frames are sent from memoryviews of the caller's arrays (or the f32 working
  array).  All-gather payloads are received straight into the output.  Reduce-scatter payloads
  must be combined with what is there, so they land in a small per-lane staging pool and are
  reduced from it.  The processor never waits for the sender, so a full pool only ever waits for
  a kernel: no cycle of waits can form around the ring.
* **f16/bf16** accumulate in f32: reduce-scatter frames carry f32 partial sums (a partial sum
  rounded to 16 bits per hop would gain nothing over 16-bit arithmetic); the owner of a chunk
  rounds the final sum once (RNE) into the output and the all-gather moves those 16-bit values.
* **AVG** is SUM, then the owner divides its chunk by the world size (floats: IEEE division;
  integers: floor division) before the all-gather, so every peer holds the same bytes.
* **MIN_MAX quantization.**  Reduce-scatter frames are quantized by their sender with fresh
  per-frame parameters and dequantize-reduced by the receiver into its full-precision
  accumulator (one fused kernel).  In the all-gather only the owner quantizes: it quantizes its
  final chunk once into the *gather store* (``count × qbytes`` plus 16 bytes per frame), applies
  the dequantized values to its own output, and sends the stored bytes; every other peer
  receives the bytes into its gather store, dequantizes them into its output and forwards them
  verbatim.  Everyone applies the same dequantization to the same bytes: bit-identical.
* **Frames** are stamped ``(op_seq=seq, stream=sub-chunk index, step, offset=byte offset in the
  caller's array)``; the receiver checks every field against its own schedule.  Frames of other
  operations are routed by seq (:mod:`pccl.collectives.links`); frames of an ended seq are
  discarded, so a late frame of an aborted op is never taken for a later op's.
* **Concurrency and striping.**  Several operations run at once over the same
  :class:`~pccl.collectives.links.RingLinks` (frames interleave whole; receivers demultiplex by
  seq).  With ``lanes > 1`` connections per neighbour, sub-chunk ``k`` of every step travels on
  lane ``k mod lanes``, so one operation is striped over all lanes.

Aborts
------
The operation is cancellable at any instant.  Cancellation, a broken lane or a protocol error
stops every task of the operation (kernels in worker threads are waited for, never abandoned)
and :func:`reduce_checked` (so :func:`ring_all_reduce`) raises exactly one exception:
``Cancelled`` when the caller's scope was cancelled and nothing else went wrong, else the first
real error (``PeerDisconnected``, ``StreamClosed``, ``ProtocolError``, ``InvalidArgument`` for
NaN/Inf under quantization…); never an ExceptionGroup.  For an in-place operation every slice is
saved in an :class:`~pccl.collectives.backup.InputBackup` right before its first overwrite — by
the reduce-scatter kernel itself where that overwrite is a reduction (``reduce_into_saving``: the
copy rides along with the reduction's own pass over the slice), by a copy otherwise (the chunk
sent at step 0; f16/bf16 outputs).  Pass your own ``backup`` (an
:class:`~pccl.collectives.backup.InputGuard`'s, as the communicator does) to be able to restore
the input after this function has returned (an abort decided by the master after this peer
finished its ring); otherwise the call keeps the input in a guard of its own and restores it
before the exception propagates.  A lane torn mid-frame is aborted by its connection, so later
operations on it fail fast until the ring is re-wired.
"""

from __future__ import annotations

import numpy as np

from ..protocol.algorithms import AllReduceAlgorithm, choose_all_reduce, partner_positions, site_partners
from ..protocol.ring import DEFAULT_SUBCHUNK_BYTES, EXCHANGE_MAX_BYTES
from ..types import Quantization, ReduceOp
from .backup import InputBackup
from .buffers import KernelRunner, OpBuffers, ReduceArgs
from .execute import Place, execute
from .halving import HalvingDoublingOp
from .hierarchical import HierarchicalOp
from .links import RingLinks
from .ring_op import RingOp
from .segments import Segments

__all__ = ["ring_all_reduce", "reduce_checked", "all_reduce_op", "algorithm_for"]


async def ring_all_reduce(
    send: np.ndarray | Segments,
    recv: np.ndarray | None = None,
    *,
    op: ReduceOp,
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    quantization: Quantization | None = None,
    backup: InputBackup | None = None,
    runner: KernelRunner | None = None,
    max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
    exchange_max_bytes: int = EXCHANGE_MAX_BYTES,
    algorithm: AllReduceAlgorithm | None = None,
) -> tuple[int, int]:
    """All-reduce ``send`` into ``recv`` (``None`` or ``send`` itself: in place) over the ring.

    ``send`` may be a :class:`~pccl.collectives.segments.Segments` (several arrays as one
    buffer, in place only): frames are then also cut at its arrays' boundaries, and every peer
    must pass the same segmentation (the master compares its ``layout`` digest).

    The arguments are checked (:meth:`ReduceArgs.check <pccl.collectives.buffers.ReduceArgs.check>`),
    then the op runs as :func:`reduce_checked` runs it.  ``InvalidArgument`` for bad arguments
    before anything is sent; the seq is retired on exit, whatever the outcome.
    """
    try:
        args = ReduceArgs.check(send, recv, op, quantization)
    except BaseException:
        links.retire(seq)  # as reduce_checked does on every way out
        raise
    return await reduce_checked(
        args, links=links, rank=rank, world=world, seq=seq, backup=backup, runner=runner,
        max_subchunk_bytes=max_subchunk_bytes, exchange_max_bytes=exchange_max_bytes, algorithm=algorithm,
    )


async def reduce_checked(
    args: ReduceArgs,
    *,
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    backup: InputBackup | None = None,
    runner: KernelRunner | None = None,
    max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
    exchange_max_bytes: int = EXCHANGE_MAX_BYTES,
    algorithm: AllReduceAlgorithm | None = None,
) -> tuple[int, int]:
    """Run the all-reduce of ``args`` (checked by :meth:`ReduceArgs.check
    <pccl.collectives.buffers.ReduceArgs.check>`) over the ring: what the communicator calls,
    having checked the arguments before its vote.

    ``rank``/``world``: this peer's position in the ring and the ring size (≥ 2); ``links`` the
    lanes to the successor ``ring[(rank+1) % world]`` and from the predecessor; ``seq`` the
    master's sequence number of this op (unique per group, the same on every peer).  Every peer
    must pass the same ``count``, dtype, ``op``, ``quantization``, ``max_subchunk_bytes``,
    ``exchange_max_bytes`` (which small ops run as an exchange,
    :func:`~pccl.protocol.ring.uses_exchange`; 0: none), ``algorithm`` (``None``: chosen per op
    by :func:`algorithm_for`; else forced where it can run) and number of lanes (the master
    checks the first four; the others are configuration).

    Returns ``(tx_bytes, rx_bytes)``: payload bytes sent and received (quantization metadata
    included, frame headers not).  Errors: see the module docstring; ``InvalidArgument`` for a
    bad ``rank``/``world`` before anything is sent.  The seq is retired on exit, whatever the
    outcome (:func:`~pccl.collectives.execute.execute`).
    """
    op = await execute(
        lambda place: all_reduce_op(args, place, max_subchunk_bytes=max_subchunk_bytes,
                                    exchange_max_bytes=exchange_max_bytes, algorithm=algorithm),
        links=links, rank=rank, world=world, seq=seq, keep=args, backup=backup, runner=runner,
    )
    return op.tx_bytes, op.rx_bytes


def algorithm_for(args: ReduceArgs, place: Place, *, exchange_max_bytes: int = EXCHANGE_MAX_BYTES,
                  forced: AllReduceAlgorithm | None = None) -> AllReduceAlgorithm:
    """The algorithm the all-reduce of ``args`` runs at ``place``
    (:func:`~pccl.protocol.algorithms.choose_all_reduce`; the same on every peer): the
    halving-doubling family needs partner links to every partner of this ring position."""
    src = args.src
    return choose_all_reduce(
        src.nbytes, place.world, itemsize=src.itemsize, acc_itemsize=4 if args.dtype.name in _HALF_NAMES else src.itemsize,
        quantized=args.quant is not None, segmented=isinstance(src, Segments),
        partner_links=place.links.has_partners(partner_positions(place.rank, place.world)),
        exchange_max_bytes=exchange_max_bytes, forced=forced, sites=place.links.sites,
        site_links=len(place.links.sites) == place.world
        and place.links.has_partners(site_partners(place.rank, place.links.sites)),
    )


_HALF_NAMES = ("FLOAT16", "BFLOAT16")


def all_reduce_op(args: ReduceArgs, place: Place, *, max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
                  exchange_max_bytes: int = EXCHANGE_MAX_BYTES,
                  algorithm: AllReduceAlgorithm | None = None) -> RingOp | HalvingDoublingOp:
    """The all-reduce of ``args`` at ``place``, ready to run (its scratch memory taken), on the
    algorithm :func:`algorithm_for` picks (``algorithm``, else the links' own
    :attr:`~pccl.collectives.links.RingLinks.algorithm`: forced where it can run)."""
    forced = algorithm if algorithm is not None else place.links.algorithm
    chosen = algorithm_for(args, place, exchange_max_bytes=exchange_max_bytes, forced=forced)
    bufs = OpBuffers.for_args(args)
    try:
        if chosen is AllReduceAlgorithm.HIERARCHICAL:
            return HierarchicalOp(bufs, links=place.links, rank=place.rank, world=place.world, seq=place.seq,
                                  backup=place.backup, runner=place.runner)
        if chosen is not AllReduceAlgorithm.RING:
            return HalvingDoublingOp(bufs, algorithm=chosen, links=place.links, rank=place.rank, world=place.world,
                                     seq=place.seq, backup=place.backup, runner=place.runner)
        return RingOp(
            bufs, links=place.links, rank=place.rank, world=place.world, seq=place.seq, backup=place.backup,
            runner=place.runner, max_subchunk_bytes=max_subchunk_bytes, exchange_max_bytes=exchange_max_bytes,
        )
    except BaseException:
        bufs.release()
        raise
