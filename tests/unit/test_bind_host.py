"""``Config.bind_host``: a peer's listeners bind where it says (every interface when unset), and a
bound IP the master cannot see this peer at is warned about."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import trio
import trio.testing

import pccl
from pccl import Config

from pccl.testing import MemoryNetwork

CFG = Config(peer_timeout=30.0, connect_timeout=2.0, p2p_base_port=6100, shared_state_base_port=6200)
MASTER = "10.0.0.9:7000"


async def _listeners_of_a_peer(config: Config) -> set[str]:
    network = MemoryNetwork()
    async with pccl.open_master(MASTER, config=config, network=network):
        async with pccl.open_communicator(MASTER, config=config, network=network):
            return set(network.listeners) - {MASTER}


async def test_unset_binds_every_interface(autojump_clock: trio.testing.MockClock) -> None:
    assert await _listeners_of_a_peer(CFG) == {"0.0.0.0:6100", "0.0.0.0:6200"}


async def test_set_binds_that_address(autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    # (the memory network's diallers are 10.0.0.1)
    caplog.set_level(logging.WARNING, logger="pccl")
    listeners = await _listeners_of_a_peer(dataclasses.replace(CFG, bind_host="10.0.0.1"))
    assert listeners == {"10.0.0.1:6100", "10.0.0.1:6200"}
    assert "bind_host" not in caplog.text


async def test_an_address_the_master_does_not_see_is_warned_about(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pccl")
    listeners = await _listeners_of_a_peer(dataclasses.replace(CFG, bind_host="192.0.2.7"))
    assert listeners == {"192.0.2.7:6100", "192.0.2.7:6200"}
    assert "Config.bind_host is 192.0.2.7 but this peer reaches the master at 10.0.0.9:7000 from 10.0.0.1" in caplog.text


@pytest.mark.parametrize("bad", ["", "[::1]", "10.0.0.1 ", 5])
def test_a_malformed_bind_host_is_refused(bad: object) -> None:
    with pytest.raises(pccl.InvalidArgument, match="bind_host"):
        Config(bind_host=bad)  # type: ignore[arg-type]
