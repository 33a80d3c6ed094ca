"""``Communicator.all_reduce_many``: many arrays all-reduced in buckets, retried on the survivors.

The call runs rounds: each round starts every pending bucket's op in order, op ``j`` once op
``j - max_in_flight`` has finished here (a rule that does not depend on when this peer learns of
a failure, so every peer starts the same ops); when the round is over, the ops that aborted or
met a stale ring are retried after one re-wire of the group.  The buckets are
:mod:`pccl.collectives.buckets`'.

What this needs of the collectives around it is passed in, not reached for: the peer ``host``,
the kernel ``runner`` that packs and unpacks buckets, ``attempt(plan)`` (one attempt of one
all-reduce: its result, or ``StaleRing``, or the call's error) and ``rewire()`` (re-wire the
group once no collective of this peer holds a tag).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import trio

from .._groups import single_exception
from ..arrays import as_array, is_torch_tensor
from ..collectives.buckets import DEFAULT_BUCKET_BYTES, Bucket, plan_buckets
from ..errors import CollectiveAborted, InvalidArgument, PCCLError, PhaseMismatch
from ..types import ReduceInfo, ReduceOp
from .collective_plans import Plan, StaleRing, phase_mismatch_abort
from .host import MasterLost, PeerHost
from ..collectives.buffers import KernelRunner

__all__ = ["reduce_many", "MANY_FIRST_TAG"]

log = logging.getLogger(__name__)

#: ``all_reduce_many`` gives array ``i`` the tag ``MANY_FIRST_TAG + i`` (unless told otherwise):
#: far above the small tags training loops pick for their own concurrent all-reduces.
MANY_FIRST_TAG = 1 << 62


@dataclasses.dataclass(eq=False)
class _Many:
    """One ``all_reduce_many`` call: its buckets, their plans once packed, their results."""

    buckets: list[Bucket]
    op: Any
    quantization: Any
    first_tag: int
    #: The master epoch the call began in (a call never spans two masters).
    epoch: int = 0
    plans: dict[int, Plan] = dataclasses.field(default_factory=dict)
    results: dict[int, ReduceInfo] = dataclasses.field(default_factory=dict)


#: One attempt of one all-reduce (``StaleRing`` on a stale ring).
Attempt = Callable[[Plan], Awaitable[object]]


async def reduce_many(
    arrays: Sequence[Any],
    *,
    host: PeerHost,
    runner: KernelRunner,
    attempt: Attempt,
    rewire: Callable[[], Awaitable[None]],
    op: Any = ReduceOp.SUM,
    quantization: Any = None,
    max_in_flight: int = 4,
    first_tag: int = MANY_FIRST_TAG,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ReduceInfo:
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidArgument(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise InvalidArgument(f"bucket_bytes must be a non-negative integer, got {bucket_bytes!r}")
    if isinstance(arrays, np.ndarray) or is_torch_tensor(arrays):
        raise InvalidArgument("all_reduce_many takes a sequence of arrays; use all_reduce for one array")
    # Every array is checked (and viewed) before any op starts.
    views = [as_array(a, name=f"arrays[{i}]", writable=False) for i, a in enumerate(arrays)]
    for i, view in enumerate(views):
        Plan.all_reduce(view, None, op, first_tag + i, quantization)
    buckets = plan_buckets(views, bucket_bytes)
    if not buckets:
        return ReduceInfo(host.world_size, 0, 0)
    many = _Many(buckets, op, quantization, first_tag)
    pending = list(range(len(buckets)))
    try:
        await host.ready()
        many.epoch = host.master_epoch
        while True:
            pending = await _round(runner, attempt, many, pending, max_in_flight)
            if not pending:
                break
            # Every failure left the group's ring stale; re-wire once for the whole batch.
            host.counters.retries += len(pending)
            log.info("peer %x: retrying %d all-reduce(s) on the survivors", host.peer_id, len(pending))
            await rewire()
    except MasterLost as exc:
        raise CollectiveAborted(f"all_reduce_many aborted: {exc}") from exc
    except PhaseMismatch as exc:  # the re-wire before the retry was ended
        raise phase_mismatch_abort("all_reduce_many", exc) from exc
    finally:
        for bucket in buckets:
            bucket.release()
    results = many.results
    infos = list(results.values())
    return ReduceInfo(
        world_size=min(i.world_size for i in infos),
        tx_bytes=sum(i.tx_bytes for i in infos),
        rx_bytes=sum(i.rx_bytes for i in infos),
    )


async def _round(runner: KernelRunner, attempt: Attempt, many: _Many, pending: list[int],
                 max_in_flight: int) -> list[int]:
    """Run the op of every bucket of ``pending`` once; return the ones that aborted (or met a
    stale ring).

    Op ``pending[j]`` starts once ``pending[j - max_in_flight]`` (and so every op before it)
    has finished here.  Which ops start must not depend on when this peer learns of a
    failure — other peers learn it at other moments, and an op that one peer starts and
    another does not would wait for that peer's vote forever — so every op is started;
    after an abort the later ones are refused quickly with ``STALE_RING``.  Every op has
    finished when this returns; the first error other than an abort is raised then.  A
    packed bucket is packed when its op first starts, and its result copied into its
    members (and its scratch given back) as soon as its op completed; a segmented one is
    reduced in place over its members, restored from the op's backup if it aborts.
    """
    failed: list[int] = []
    errors: list[PCCLError] = []
    finished = [trio.Event() for _ in pending]

    async def one(position: int, i: int) -> None:
        bucket = many.buckets[i]
        try:
            plan = many.plans.get(i)
            if plan is None:
                if bucket.packed:
                    send, recv = await runner.run(bucket.nbytes, bucket.buffers)
                else:
                    send, recv = bucket.buffers()
                plan = many.plans[i] = Plan.all_reduce(send, recv, many.op, many.first_tag + i,
                                                       many.quantization).at(many.epoch)
            result = await attempt(plan)
            assert isinstance(result, ReduceInfo)
            many.results[i] = result
            if bucket.packed:
                assert plan.args is not None and isinstance(plan.args.dst, np.ndarray)  # the packed result
                # Shielded: the op completed on every peer, so its members take the result even
                # when this call was cancelled meanwhile (a completed op's call may return after
                # its cancellation, op_attempt.await_verdict).  A worker thread's start would
                # otherwise raise the Cancelled before the copy ran, leaving the inputs here
                # while the others unpacked the reduction.  Bounded CPU work; the cancellation
                # is raised at the next checkpoint.
                with trio.CancelScope(shield=True):
                    await runner.run(bucket.nbytes, bucket.unpack, plan.args.dst)
            bucket.release()
        except (CollectiveAborted, StaleRing) as exc:
            if isinstance(exc, CollectiveAborted) and isinstance(exc.__cause__, PhaseMismatch):
                errors.append(exc)  # retrying would meet the same mismatch: the caller's loop decides
            else:
                log.debug("all_reduce_many: tag %d failed (%r); it will be retried", many.first_tag + i, exc)
                failed.append(i)
        except PCCLError as exc:
            errors.append(exc)
        finally:
            finished[position].set()

    try:
        async with trio.open_nursery() as nursery:
            for position, i in enumerate(pending):
                if position >= max_in_flight:
                    await finished[position - max_in_flight].wait()
                nursery.start_soon(one, position, i)
    except BaseExceptionGroup as group:
        raise single_exception(group) from None
    if errors:
        raise errors[0]
    return sorted(failed)
