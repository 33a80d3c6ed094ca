"""A relay registered with the master gives back its admission slot, as a registered peer does.

Found by the real-NAT runs (``tests/cluster/test_nat_pccl.py``): when a ``pccl relay`` died, the master logged
"master refused ...: connection lost before it registered" — its connection still held the
admission slot of an unproven one, for as long as the relay ran.  Each relay thus took one of
the master's ``max_pending_handshakes`` slots (and of its address's share) for good.

In process (an in-memory network, Trio's autojump clock): a master with one handshake slot, a
relay registering, then a peer that must still get in.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

import pccl
from pccl import Config
from pccl.net.framed import open_framed
from pccl.protocol import messages as m
from pccl.testing import MemoryNetwork

CFG = Config(peer_timeout=30.0, heartbeat_interval=0.5, connect_timeout=2.0)


async def _first_answer(conn, kinds):
    while not isinstance(msg := await conn.receive(), kinds):
        assert isinstance(msg, m.Heartbeat), msg
    return msg


async def test_a_registered_relay_does_not_keep_a_handshake_slot(
        caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    async with pccl.open_master("10.0.0.9:7000", config=CFG, network=network, max_pending_handshakes=1) as master:
        relay = await open_framed(network, master.address, config=CFG)
        await relay.send(m.RelayRegister("10.0.0.5", 48147))
        welcome = await _first_answer(relay, m.RelayWelcome)
        assert welcome.relay_id == 2
        # the only slot must be free again: a peer registers while the relay stays connected
        with trio.fail_after(10 * CFG.connect_timeout):
            peer = await open_framed(network, master.address, config=CFG)
            await peer.send(m.Register(0, 9, 0))
            assert isinstance(await _first_answer(peer, (m.Welcome, m.TopologyComplete, m.ConnectToPeers)),
                              (m.Welcome, m.TopologyComplete, m.ConnectToPeers))
        # a relay that goes away is a relay gone, not a refused stranger
        with caplog.at_level(logging.INFO):
            relay.abort()
            await trio.sleep(0.5)
        assert not [r for r in caplog.records if "before it registered" in r.getMessage()], caplog.text
        peer.abort()
