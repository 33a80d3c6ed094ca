"""Which peer is which rank of a :class:`pccl.torch.ProcessGroup`.

A group's ranks are its ring positions, except in a group that ``init_process_group("pccl",
rank=r)`` made: there rank ``r`` is the process that passed ``r`` for as long as the group's
members are the processes that started it together.  At the start every process writes its
peer id under its rank into the group's store (``torch.distributed``'s, shared by the run) and
reads the others'; once a member left (or a newcomer came in: peer ids are never reused) the
members differ from the ones the ranks were given to, and every peer of the group turns to ring
positions at the same op.  A replacement process that passes the rank of a process that died
finds its rank taken by that peer in the store and takes the ring positions at once, as the
survivors do.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import CollectiveAborted, InvalidUsage

__all__ = ["GroupRanks", "by_rank", "given_ranks", "peers_by_rank"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The store key of rank ``r``'s peer id (in the group's own prefix of torch's store).
_KEY = "pccl/peer-of-rank/{}"


class GroupRanks(Mapping[int, int]):
    """A group's entry in torch's world (``_world.pg_group_ranks``: global rank -> group rank)
    while torch has not made one of its own: the identity over the group's size now.  torch's
    ``P2POp``, ``dist.recv`` and ``get_global_rank`` look a group up there, and a group built as
    ``ProcessGroup(comm)`` is a world of its own, whose ranks are its global ranks."""

    def __init__(self, size: Callable[[], int]) -> None:
        self._size = size

    def __getitem__(self, rank: int) -> int:
        if isinstance(rank, int) and 0 <= rank < self._size():
            return rank
        raise KeyError(rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._size()))

    def __len__(self) -> int:
        return self._size()


def given_ranks(store: Any, rank: int, world_size: int, peer_id: int, ring: Sequence[int],
                timeout: float | None) -> tuple[int, ...] | None:
    """The peer ids of ranks ``0 .. world_size-1`` as the processes of ``init_process_group``
    gave them (``store``: torch's store of the group; this peer passed ``rank``), or ``None``
    when they are not the group's members ``ring`` (this process replaces one that left) or the
    others' ids are not in the store within ``timeout`` seconds (a store of this process's
    own).  Call it once the group has its ``world_size`` peers.  Raises ``InvalidUsage`` when a
    live member passed the same rank."""
    key = _KEY.format(rank)
    holder = int(store.compare_set(key, "", str(peer_id)))
    if holder != peer_id:
        if holder in ring:
            raise InvalidUsage(f"rank {rank} was passed to init_process_group by two processes of the group (peers "
                               f"{holder:x} and {peer_id:x}): give each process a rank of its own")
        log.info("pccl: rank %d was peer %x's, which left: this process takes its ring position", rank, holder)
        return None
    keys = [_KEY.format(r) for r in range(world_size)]
    try:
        if timeout is None:
            store.wait(keys)
        else:
            store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - torch's store raises its own errors; the ranks fall back
        log.warning("pccl: the other processes' ranks are not in the store (%s): ranks are ring positions", exc)
        return None
    ids = tuple(int(store.get(k)) for k in keys)
    if sorted(ids) != sorted(ring):
        log.info("pccl: the group's members are not the processes that were given its ranks: ranks are ring "
                 "positions")
        return None
    return ids


def peers_by_rank(ring: tuple[int, ...], given: tuple[int, ...] | None) -> tuple[int, ...]:
    """The group's peer ids in rank order: ``given`` while the members are the ones the ranks
    were given to (``ring`` holds the same peers), the ring otherwise."""
    if given is not None and len(given) == len(ring) and sorted(given) == sorted(ring):
        return given
    return ring


def by_rank(peers: Sequence[int], parts: Sequence[T], order: Sequence[int]) -> list[T]:
    """``parts`` (one per peer of ``peers``, an op's participants in its ring order) in the rank
    order ``order`` the caller's tensors were laid out for; ``CollectiveAborted`` when the op
    ran over other peers (the group changed between the call and the op: retry)."""
    if len(parts) != len(order) or sorted(peers) != sorted(order):
        raise CollectiveAborted(f"the group changed: the op ran over {len(parts)} peers, not the {len(order)} the "
                                f"tensors were laid out for; retry")
    if tuple(peers) == tuple(order):
        return list(parts)
    where = {p: i for i, p in enumerate(peers)}
    return [parts[where[p]] for p in order]
