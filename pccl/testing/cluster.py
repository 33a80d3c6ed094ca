"""Whole runs inside a test's process: a master and accepted communicators as Trio tasks
(:func:`open_test_cluster`, :func:`admit`, :func:`each`), and a master on a loop of its own in a
background thread for tests whose own thread is synchronous (:func:`master_in_thread`).

Everything runs on real loopback TCP unless a network is given (a :class:`MemoryNetwork`, a
gated or counting wrapper, the simulator's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, NamedTuple, TypeVar

import trio

from ..communicator import Communicator, open_communicator
from ..config import Config
from ..errors import InvalidArgument, PCCLError
from ..master import Master, MasterStatistics, open_master
from ..net.base import Network

__all__ = ["TestCluster", "open_test_cluster", "admit", "each", "MasterThread", "master_in_thread"]

T = TypeVar("T")

#: What :func:`open_test_cluster` runs on: one network for the master and every peer, or per
#: peer index a factory that gets the master's address (a wrapper around TCP, say; the master
#: and the peers not named use real TCP).
ClusterNetwork = Network | Mapping[int, Callable[[str], Network]] | None


class TestCluster(NamedTuple):
    """What :func:`open_test_cluster` yields (unpacks as ``master, comms, networks``)."""

    master: Master
    #: The accepted communicators, in the order they joined.
    comms: list[Communicator]
    #: Per peer index, the network it runs on when one was given.
    networks: dict[int, Network]


async def admit(
    nursery: trio.Nursery, master: Master, existing: Sequence[Communicator],
    open_peer: Callable[[], AbstractAsyncContextManager[Communicator]], *, soon: float = 20.0,
) -> tuple[Communicator, trio.CancelScope]:
    """Start a peer task in ``nursery`` on ``open_peer()`` (an ``open_communicator(...)``) and
    have every communicator of ``existing`` vote it in (with none, it is accepted alone).
    Return it once accepted, with the scope that ends its task; ``trio.TooSlowError`` after
    ``soon`` s."""
    holder: list[Communicator] = []
    scope = trio.CancelScope()
    before = master.statistics().registered_peers

    async def peer() -> None:
        with scope:
            async with open_peer() as comm:
                holder.append(comm)
                await trio.sleep_forever()

    with trio.fail_after(soon):
        nursery.start_soon(peer)
        if existing:
            while master.statistics().registered_peers == before:
                await trio.sleep(0.005)
            async with trio.open_nursery() as voters:
                for comm in existing:
                    voters.start_soon(comm.update_topology)
        while not holder:
            await trio.sleep(0.005)
    return holder[0], scope


@contextlib.asynccontextmanager
async def open_test_cluster(
    world: int, *, token: str | None = None, config: Config | None = None, network: ClusterNetwork = None,
    soon: float = 20.0, status: str | None = None,
) -> AsyncIterator[TestCluster]:
    """A master on ``127.0.0.1`` and ``world`` accepted communicators, admitted one by one;
    everything closes when the block ends.  Each join must finish within ``soon`` s (else
    ``trio.TooSlowError``).  ``network``: see :data:`ClusterNetwork`; ``status``: the master's
    status endpoint address, if any."""
    if world < 1:
        raise InvalidArgument(f"a test cluster needs at least one peer, not {world}")
    config = config or Config()
    shared = network if isinstance(network, Network) else None
    factories = {} if network is None or isinstance(network, Network) else network
    async with open_master("127.0.0.1:0", token=token, config=config, status=status, network=shared) as master:
        if shared is not None:
            networks = dict.fromkeys(range(world), shared)
        else:
            networks = {i: make(master.address) for i, make in factories.items()}
        comms: list[Communicator] = []
        scopes: list[trio.CancelScope] = []
        async with trio.open_nursery() as nursery:
            for i in range(world):
                comm, scope = await admit(
                    nursery, master, comms,
                    lambda i=i: open_communicator(master.address, token=token, config=config,  # type: ignore[misc]
                                                  network=networks.get(i)),
                    soon=soon,
                )
                comms.append(comm)
                scopes.append(scope)
            yield TestCluster(master, comms, networks)
            for scope in scopes:
                scope.cancel()


async def each(comms: Sequence[T], call: Callable[[int, T], Awaitable[Any]], *,
               within: float = 30.0) -> list[Any]:
    """``call(i, comm)`` on every communicator at once (``trio.TooSlowError`` after ``within``
    seconds); each one's result or pccl error, in order."""
    out: list[Any] = [None] * len(comms)

    async def one(i: int) -> None:
        try:
            out[i] = await call(i, comms[i])
        except PCCLError as exc:
            out[i] = exc

    with trio.fail_after(within):
        async with trio.open_nursery() as nursery:
            for i in range(len(comms)):
                nursery.start_soon(one, i)
    return out


class MasterThread:
    """A master served on a Trio loop in a background thread (from :func:`master_in_thread`)."""

    def __init__(self, address: str, master: Master, token: trio.lowlevel.TrioToken) -> None:
        self.address = address
        self.master = master
        self.token = token

    def statistics(self) -> MasterStatistics:
        return trio.from_thread.run_sync(self.master.statistics, trio_token=self.token)

    def events(self) -> list[str]:
        """The master's recent status events, oldest first ("kick 3a: TIMEOUT (silent for
        1.5 s)"), for an assertion's message."""
        status = trio.from_thread.run_sync(self.master.status, trio_token=self.token)
        return [f"{e['kind']} {e['peer_id']}: {e['detail']}" for e in reversed(status["events"])]


@contextlib.contextmanager
def master_in_thread(config: Config, token: str | None = None) -> Iterator[MasterThread]:
    """Serve a master on ``127.0.0.1`` in a daemon thread for the block; stop it when the
    block ends.  ``TimeoutError`` if it does not start within 30 s."""
    started: concurrent.futures.Future[MasterThread] = concurrent.futures.Future()
    stop = trio.CancelScope()

    async def serve() -> None:
        with stop:
            async with open_master("127.0.0.1:0", token=token, config=config) as master:
                started.set_result(MasterThread(master.address, master, trio.lowlevel.current_trio_token()))
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    handle = started.result(timeout=30)
    try:
        yield handle
    finally:
        trio.from_thread.run_sync(stop.cancel, trio_token=handle.token)
        thread.join(30)
