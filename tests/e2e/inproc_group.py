"""A master and accepted communicators as Trio tasks in the test's own process, on real TCP."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import trio

import pccl
from pccl import Config
from pccl.net.base import Network


@contextlib.asynccontextmanager
async def in_process_group(
    world: int, *, token: str | None, config: Config, soon: float = 20.0,
    gated: dict[int, Callable[[str], Network]] | None = None, status: str | None = None,
) -> AsyncIterator[tuple[pccl.Master, list[pccl.Communicator], dict[int, Network]]]:
    """A master and ``world`` accepted communicators (peer ``i`` on ``gated[i](master address)``
    if given); everything closes when the block ends.  Joining must finish within ``soon`` s.
    ``status``: the master's status endpoint address, if any."""
    async with pccl.open_master("127.0.0.1:0", token=token, config=config, status=status) as master:
        comms: list[pccl.Communicator] = []
        networks = {i: net(master.address) for i, net in (gated or {}).items()}
        done = trio.Event()
        async with trio.open_nursery() as nursery:

            async def peer(i: int) -> None:
                async with pccl.open_communicator(master.address, token=token, config=config,
                                                  network=networks.get(i)) as comm:
                    comms.append(comm)
                    await done.wait()

            with trio.fail_after(soon):
                for i in range(world):
                    before = master.statistics().registered_peers
                    nursery.start_soon(peer, i)
                    if i > 0:
                        while master.statistics().registered_peers == before:
                            await trio.sleep(0.005)
                        async with trio.open_nursery() as voters:
                            for comm in list(comms):
                                voters.start_soon(comm.update_topology)
                    while len(comms) < i + 1:
                        await trio.sleep(0.005)
            yield master, comms, networks
            done.set()
