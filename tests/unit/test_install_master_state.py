"""``pccl.testing.install_master_state``: a master started with one consensus machine runs another
from then on — accepted while no peer has connected, refused (nothing changed) once one has."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

import pccl
from pccl import Config
from pccl.net.framed import open_framed
from pccl.protocol import messages as m
from pccl.protocol.master import machine as ms
from pccl.testing import install_master_state, master_state

from pccl.testing import MemoryNetwork

CFG = Config(peer_timeout=30.0, connect_timeout=2.0)


class _Counting(ms.MasterState):
    """The real machine, counting the events it handles."""

    def __init__(self) -> None:
        super().__init__(rng=random.Random(1), peer_timeout=CFG.peer_timeout)
        self.handled = 0

    def handle(self, event: ms.Event, now: float) -> list[ms.Effect]:
        self.handled += 1
        return super().handle(event, now)


async def test_a_state_installed_before_any_peer_serves_the_peers(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    async with pccl.open_master("10.0.0.9:7000", config=CFG, network=network) as master:
        planted = _Counting()
        install_master_state(master, planted)
        assert master_state(master) is planted
        conn = await open_framed(network, master.address, config=CFG)
        await conn.send(m.Register(0, 9, 0))
        while not isinstance(msg := await conn.receive(), m.TopologyComplete):
            if isinstance(msg, m.ConnectToPeers):
                await conn.send(m.P2PReport(msg.round, True))
        assert planted.handled > 0 and len(planted.peers()) == 1


async def test_installing_once_a_peer_is_connected_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    async with pccl.open_master("10.0.0.9:7000", config=CFG, network=network) as master:
        await open_framed(network, master.address, config=CFG)
        while master.statistics().connections == 0:
            await trio.sleep(0.01)
        first = master_state(master)
        with pytest.raises(RuntimeError, match="peers are connected"):
            install_master_state(master, ms.MasterState(rng=random.Random(1), peer_timeout=CFG.peer_timeout))
        assert master_state(master) is first
