"""Which peer is which rank of a :class:`pccl.torch.ProcessGroup`.

A group's ranks are its ring positions, except in a group that ``init_process_group("pccl",
rank=r)`` made: there the processes that started the group together keep the order of the ranks
they passed, and the others (newcomers) follow in ring order.  While the members are the
processes that started the group, rank ``r`` is the one that passed ``r``; when one leaves, the
ones after it move down (rank 0 is always the oldest surviving member, so "broadcast from rank
0" — torch's DDP does it as it builds — never comes from a newcomer); a newcomer that replaces
the last rank gets that rank again.

At the start every process writes its peer id under its rank into the group's store
(``torch.distributed``'s, which the processes of a run share) and reads the others'.  A process
that replaces one that died, passing its rank, finds the dead peer's id there and reads the
same table, so every member derives the same order from it and the ring.
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
                timeout: float | None) -> tuple[int, ...]:
    """The peer ids of ranks ``0 .. world_size-1`` as the processes that started the group gave
    them (``store``: torch's store of the group; this peer passed ``rank``).  Call it once the
    group has its ``world_size`` peers.  A process whose rank is held by a peer that left
    (a replacement) reads the table as it stands.  Raises ``InvalidUsage`` when a live member
    passed the same rank, or when the table is not complete in the store within ``timeout``
    seconds (the processes of a group must share torch's store)."""
    key = _KEY.format(rank)
    holder = int(store.compare_set(key, "", str(peer_id)))
    if holder != peer_id:
        if holder in ring:
            raise InvalidUsage(f"rank {rank} was passed to init_process_group by two processes of the group (peers "
                               f"{holder:x} and {peer_id:x}): give each process a rank of its own")
        log.info("pccl: rank %d was peer %x's, which left: this process follows the group's members", rank, holder)
    keys = [_KEY.format(r) for r in range(world_size)]
    try:
        if timeout is None:
            store.wait(keys)
        else:
            store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - torch's store raises its own errors
        raise InvalidUsage(f"the other processes' ranks are not in torch's store ({exc}): the processes of a pccl "
                           "group share the store (init_process_group's store or init_method)") from exc
    return tuple(int(store.get(k)) for k in keys)


def peers_by_rank(ring: tuple[int, ...], given: tuple[int, ...] | None) -> tuple[int, ...]:
    """The group's peer ids in rank order: the members among ``given`` in its order, then the
    others in ring order (all of ``ring`` when nothing was given)."""
    if given is None:
        return ring
    members = set(ring)
    kept = tuple(p for p in given if p in members)
    if len(kept) == len(ring):
        return kept
    old = set(kept)
    return kept + tuple(p for p in ring if p not in old)


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
