"""The ``torch.distributed`` backend ``"pccl"``: :func:`register`, and what
``init_process_group("pccl")`` and ``new_group(backend="pccl")`` run (open a communicator within
the group's timeout, vote the peers in, share the first group's communicator)."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from .. import blocking
from ..errors import InvalidArgument, InvalidUsage, TooFewPeers
from ._args import timeout_seconds
from .process_group import BACKEND, MASTER_ENV, PEER_GROUP_ENV, ProcessGroup
from .ranks import given_ranks

__all__ = ["register", "wait_for_peers", "open_within"]

log = logging.getLogger(__name__)


def register() -> None:
    """Register the ``torch.distributed`` backend ``"pccl"`` (idempotent).

    Then ``torch.distributed.init_process_group("pccl", store=..., rank=r, world_size=n)`` (or
    a first ``new_group(backend="pccl")``) opens a :mod:`pccl.blocking` communicator to the master named
    by ``$PCCL_MASTER`` (``host:port``; ``pccl run`` sets it), in the peer group
    ``$PCCL_PEER_GROUP`` (default 0), with the token of ``$PCCL_TOKEN``, waits until the group
    has ``n`` peers (voting them in; the group's timeout bounds the wait: ``TooFewPeers``), and
    returns a :class:`ProcessGroup` that owns the communicator, with the group's timeout as its
    own (collectives still running after it are cancelled: :mod:`pccl.torch.deadlines`).  Its ranks are the ones the
    processes passed (``rank=r``: ``get_rank()`` is ``r``, ``broadcast(t, src=0)`` comes from the
    process that passed 0, ``all_gather`` lists in that order) while the group's members are the
    processes that started it; when one leaves, the ones after it move down, and newcomers
    follow the survivors in ring order (:mod:`pccl.torch.ranks`: rank 0 is always the oldest
    surviving member).  The processes share torch's store (the
    ``init_process_group`` store, or ``init_method``), where they note which peer has which
    rank.  In a group made by ``new_group`` inside another backend's world, name broadcast roots
    with ``group_src=``.
    Raises ``InvalidUsage`` (no ``$PCCL_MASTER``; two live processes passed one rank; the
    others' ranks not in the store within the group's timeout),
    ``TooFewPeers`` (not accepted within the group's timeout) and what opening a communicator
    raises.  A further group of the backend in
    the same process (``new_group()``) runs over the first one's communicator; one over a
    subset of its ranks raises ``InvalidUsage`` at once.
    """
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


#: The open groups the registered backend made in this process, oldest first: a later group
#: (``new_group``) runs over the first one's communicator.
_BACKEND_GROUPS: list[ProcessGroup] = []


def _create(store: Any, rank: int, world_size: int, timeout: datetime.timedelta | None) -> ProcessGroup:
    _BACKEND_GROUPS[:] = [g for g in _BACKEND_GROUPS if not g.closed]
    if _BACKEND_GROUPS:
        return _share(_BACKEND_GROUPS[0], rank, world_size, timeout)
    master = os.environ.get(MASTER_ENV, "")
    if not master:
        raise InvalidUsage(f"the pccl backend connects to the master named by ${MASTER_ENV} (host:port): set it "
                           "(pccl run does), or build pccl.torch.ProcessGroup(comm) over a communicator of yours")
    try:
        peer_group = int(os.environ.get(PEER_GROUP_ENV, "0"))
    except ValueError:
        raise InvalidArgument(f"${PEER_GROUP_ENV} must be an integer, got {os.environ[PEER_GROUP_ENV]!r}") from None
    seconds = timeout_seconds(timeout)
    deadline = None if seconds is None else time.monotonic() + seconds
    comm = open_within(master, peer_group, seconds)
    try:
        wait_for_peers(comm, world_size, None if deadline is None else max(0.0, deadline - time.monotonic()))
    except BaseException:
        comm.close()
        raise
    try:
        ranks = given_ranks(store, rank, world_size, comm.peer_id, comm.ring,
                            None if deadline is None else max(1.0, deadline - time.monotonic()))
    except BaseException:
        comm.close()
        raise
    log.info("pccl backend: peer %x in a group of %d (rank %d)", comm.peer_id, comm.world_size, rank)
    group = ProcessGroup(comm, owns_communicator=True, ranks=ranks, timeout=timeout)
    _BACKEND_GROUPS.append(group)
    return group


def _share(base: ProcessGroup, rank: int, world_size: int, timeout: datetime.timedelta | None) -> ProcessGroup:
    """A further group of the backend (``new_group``) in a process that has one: over the same
    ranks, a group over the same communicator with tags of its own; over other ranks,
    ``InvalidUsage`` at once (a pccl group is a whole peer group).  ``timeout``: the new
    group's own (``new_group(timeout=...)``)."""
    if (world_size, rank) != (base.size(), base.rank()):
        raise InvalidUsage(f"a pccl group spans its whole peer group ({base.size()} peers): new_group over "
                           f"{world_size} of them (this one as rank {rank}) cannot run on pccl; make that group "
                           "with another backend (new_group(ranks, backend=\"gloo\")), or run it as a peer group "
                           f"of its own (${PEER_GROUP_ENV})")
    return ProcessGroup(base.communicator, first_tag=base.next_shared_first_tag(), ranks=base.given_ranks,
                        timeout=timeout)


def open_within(master: str, peer_group: int, timeout: float | None) -> blocking.Communicator:
    """:func:`pccl.blocking.open_communicator` within ``timeout`` seconds: ``TooFewPeers`` once
    they passed without this peer being accepted (the group's peers vote a newcomer in — while
    they run their own ``init_process_group`` or ``new_group``).  An open given up on goes on
    in the background and closes its communicator once accepted."""
    if timeout is None:
        return blocking.open_communicator(master, peer_group=peer_group)
    lock = threading.Lock()
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            comm = blocking.open_communicator(master, peer_group=peer_group)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc
            done.set()
            return
        with lock:
            if outcome.get("abandoned"):
                comm.close()
                return
            outcome["comm"] = comm
        done.set()

    threading.Thread(target=run, name="pccl-torch-open", daemon=True).start()
    done.wait(timeout)
    with lock:
        if "comm" not in outcome and "error" not in outcome:
            outcome["abandoned"] = True
            raise TooFewPeers(f"not accepted into peer group {peer_group} of the master at {master} within "
                              f"{timeout:g} s: the group's peers vote a newcomer in, and none did")
    if "error" in outcome:
        raise outcome["error"]
    comm: blocking.Communicator = outcome["comm"]
    return comm


def wait_for_peers(comm: blocking.Communicator, world_size: int, timeout: float | None = None) -> None:
    """Vote pending peers in (``update_topology``) until ``comm``'s group has ``world_size``
    peers; every accepted peer of the run calls it (or otherwise takes part in the votes).
    Raises ``TooFewPeers`` when ``timeout`` seconds pass first, and the errors of
    :meth:`pccl.blocking.Communicator.update_topology`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while comm.world_size < world_size:
        if deadline is not None and time.monotonic() > deadline:
            raise TooFewPeers(f"the group has {comm.world_size} of the {world_size} peers after {timeout:g} s")
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.05)
