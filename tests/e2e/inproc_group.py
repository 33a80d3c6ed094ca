"""A master and accepted communicators as Trio tasks in the test's own process, on real TCP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

import pccl
from pccl import Config
from pccl.net.base import Network


async def admit(
    nursery: trio.Nursery, master: pccl.Master, existing: list[pccl.Communicator],
    open_peer: Callable[[], AbstractAsyncContextManager[pccl.Communicator]], *, soon: float = 20.0,
) -> tuple[pccl.Communicator, trio.CancelScope]:
    """Start a peer task in ``nursery`` on ``open_peer()`` (an ``open_communicator(...)``) and
    have every communicator of ``existing`` vote it in (with none, it is accepted alone).
    Return it once accepted, with the scope that ends its task; ``trio.TooSlowError`` after
    ``soon`` s."""
    holder: list[pccl.Communicator] = []
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
async def in_process_group(
    world: int, *, token: str | None, config: Config, soon: float = 20.0,
    gated: dict[int, Callable[[str], Network]] | None = None, status: str | None = None,
) -> AsyncIterator[tuple[pccl.Master, list[pccl.Communicator], dict[int, Network]]]:
    """A master and ``world`` accepted communicators, admitted one by one (peer ``i`` on
    ``gated[i](master address)`` if given); everything closes when the block ends.  Each join
    must finish within ``soon`` s.  ``status``: the master's status endpoint address, if any."""
    async with pccl.open_master("127.0.0.1:0", token=token, config=config, status=status) as master:
        comms: list[pccl.Communicator] = []
        scopes: list[trio.CancelScope] = []
        networks = {i: net(master.address) for i, net in (gated or {}).items()}
        async with trio.open_nursery() as nursery:
            for i in range(world):
                comm, scope = await admit(
                    nursery, master, comms,
                    lambda i=i: pccl.open_communicator(master.address, token=token, config=config,  # type: ignore[misc]
                                                       network=networks.get(i)),
                    soon=soon,
                )
                comms.append(comm)
                scopes.append(scope)
            yield master, comms, networks
            for scope in scopes:
                scope.cancel()


async def each(comms: Sequence[Any], call: Any, *, within: float = 30.0) -> list[Any]:
    """``call(i, comm)`` on every communicator at once (failing after ``within`` seconds); each
    one's result or pccl error, in order."""
    out: list[Any] = [None] * len(comms)

    async def one(i: int) -> None:
        try:
            out[i] = await call(i, comms[i])
        except pccl.PCCLError as exc:
            out[i] = exc

    with trio.fail_after(within):
        async with trio.open_nursery() as nursery:
            for i in range(len(comms)):
                nursery.start_soon(one, i)
    return out
