"""Dialling a peer's p2p or shared-state port as the master says so: the peer answers the
registration with ``KickNotice(NOT_A_MASTER)`` (wire-compatible: an older dialler shows the
notice's detail), and ``open_communicator`` raises ``MasterUnreachable`` naming the port."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

import pccl
from pccl import Config, KickReason
from pccl.net.framed import open_framed
from pccl.protocol import messages as m

from pccl.testing import MemoryNetwork

CFG = Config(peer_timeout=30.0, connect_timeout=2.0, p2p_base_port=6100, shared_state_base_port=6200)
OTHER = dataclasses.replace(CFG, p2p_base_port=6300, shared_state_base_port=6400)  # (one memory host)
MASTER = "10.0.0.9:7000"


@pytest.mark.parametrize(("address", "port"), [("0.0.0.0:6100", "p2p"), ("0.0.0.0:6200", "shared-state")])
async def test_a_peer_port_is_named_when_dialled_as_the_master(
        autojump_clock: trio.testing.MockClock, address: str, port: str) -> None:
    network = MemoryNetwork()
    async with pccl.open_master(MASTER, config=CFG, network=network):
        async with pccl.open_communicator(MASTER, config=CFG, network=network) as first:
            with pytest.raises(pccl.MasterUnreachable) as info:
                async with pccl.open_communicator(address, config=OTHER, network=network):
                    pass
            assert str(info.value).startswith(f"{address} is not the master's address: this address is a pccl "
                                              f"peer's {port} port, not a master")
            await first.update_topology()  # the peer that was dialled is unharmed
            assert first.world_size == 1


async def test_a_registration_on_a_peer_port_gets_a_kick_notice(autojump_clock: trio.testing.MockClock) -> None:
    # What a dialler of any version reads: an ordinary KickNotice, then the end of the connection.
    network = MemoryNetwork()
    async with pccl.open_master(MASTER, config=CFG, network=network):
        async with pccl.open_communicator(MASTER, config=CFG, network=network):
            conn = await open_framed(network, "0.0.0.0:6100", config=CFG)
            await conn.send(m.Register(0, 9, 0))
            notice = await conn.receive()
            assert notice == m.KickNotice(int(KickReason.NOT_A_MASTER), "this address is a pccl peer's p2p port, "
                                                                        "not a master")
            with pytest.raises(pccl.PCCLError):  # then it closes
                await conn.receive()
