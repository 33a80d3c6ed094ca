"""Connection reversal on real TCP in one process: peers whose listeners nobody may dial (a
firewall in front of them, modelled by the diallers' networks refusing or dropping connections
to their ports) still join rings, serve and fetch shared state and measure links, over
dial-backs; a pair with no path at all fails with an error that says what each step met.  The
real-NAT versions of these cases are in ``tests/cluster/``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import trio

import pccl
from pccl import Config
from pccl.errors import ConnectionRefused, ConnectTimeout
from pccl.net.tcp import TcpNetwork
from pccl.protocol.paths import PathKind
from pccl.testing import admit, each

TOKEN = "paths-token"
CFG = Config(peer_timeout=4.0, heartbeat_interval=0.25, connect_timeout=3.0, direct_connect_timeout=0.6,
             p2p_base_port=0, shared_state_base_port=0, probe_seconds=0.2, probe_streams=2)


class Firewalled(TcpNetwork):
    """Real TCP, except that connections to the ports in ``closed`` never get through: they are
    refused (``drop=False``) or dropped (the dialler waits for its timeout).  With ``mine``, the
    ports this network listens on join ``closed`` (a host behind a firewall)."""

    def __init__(self, config: Config, closed: set[int], *, mine: bool = False, drop: bool = False) -> None:
        super().__init__(config)
        self.closed = closed
        self.mine = mine
        self.drop = drop

    async def connect(self, address: str, *, timeout: float | None = None):  # type: ignore[no-untyped-def]
        port = int(address.rpartition(":")[2])
        if port in self.closed:
            if self.drop:
                await trio.sleep(self.config.connect_timeout if timeout is None else timeout)
                raise ConnectTimeout(f"no connection to {address} (dropped by the test's firewall)")
            await trio.lowlevel.checkpoint()
            raise ConnectionRefused(f"cannot connect to {address}: refused by the test's firewall")
        return await super().connect(address, timeout=timeout)

    async def listen(self, address: str, *, port_range: int = 1):  # type: ignore[no-untyped-def]
        listener = await super().listen(address, port_range=port_range)
        if self.mine:
            self.closed.add(listener.port)
        return listener


def opener(master: pccl.Master, network: TcpNetwork, config: Config = CFG):
    return lambda: pccl.open_communicator(master.address, token=TOKEN, config=config, network=network)


async def sum_everywhere(comms: list[pccl.Communicator]) -> None:
    inputs = [np.arange(50_000, dtype=np.float32) * (i + 1) for i in range(len(comms))]
    expected = sum(inputs)
    await each(comms, lambda i, c: c.all_reduce(inputs[i]))
    for x in inputs:
        np.testing.assert_array_equal(x, expected)


@pytest.mark.parametrize("drop", [False, True], ids=["refused", "dropped"])
async def test_firewalled_peers_join_reduce_sync_and_probe_over_dial_backs(drop: bool) -> None:
    closed: set[int] = set()
    open_net = Firewalled(CFG, closed, drop=drop)
    walled = Firewalled(CFG, closed, mine=True, drop=drop)
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        async with trio.open_nursery() as nursery:
            comms: list[pccl.Communicator] = []
            scopes = []
            # Two reachable peers and one behind a firewall: every connection into the
            # firewalled peer (its ring predecessor's lanes, state fetches and probes from the
            # others) needs a dial-back.
            for network in (open_net, walled, open_net):
                comm, scope = await admit(nursery, master, comms, opener(master, network), soon=30)
                comms.append(comm)
                scopes.append(scope)
            state_arrays = [np.full(10_000, float(i), np.float32) for i in range(3)]
            states = [pccl.SharedState({"w": a}, revision=5 if i == 0 else 0) for i, a in enumerate(state_arrays)]
            infos = await each(comms, lambda i, c: c.sync_shared_state(states[i]))
            assert [info.revision for info in infos] == [5, 5, 5]
            for a in state_arrays:
                np.testing.assert_array_equal(a, state_arrays[0])
            await sum_everywhere(comms)
            # A newcomer that is reachable fetches from all three, the firewalled ones included.
            late_arr = np.zeros(10_000, np.float32)
            late, scope = await admit(nursery, master, comms, opener(master, open_net), soon=30)
            comms.append(late)
            scopes.append(scope)
            states.append(pccl.SharedState({"w": late_arr}))
            for s, c in zip(states, comms):
                s.revision = 6 if c is not late else 0
            await each(comms, lambda i, c: c.sync_shared_state(states[i]))
            np.testing.assert_array_equal(late_arr, state_arrays[0])
            await sum_everywhere(comms)
            await each(comms, lambda i, c: c.optimize_topology(), within=60)
            await sum_everywhere(comms)

            kinds = {(p.initiator, p.target): p.kind for p in pccl.testing.master_snapshot(master).paths}
            walled_ids = {comms[1].peer_id}
            assert kinds, "nobody reported a path"
            for (initiator, target), kind in kinds.items():
                assert kind is (PathKind.REVERSED if target in walled_ids else PathKind.DIRECT), (initiator, target)
            assert any(k is PathKind.REVERSED for k in kinds.values())
            stats = [c.statistics() for c in comms]
            assert sum(s.paths_reversed for s in stats) >= 2
            assert sum(s.dial_backs for s in stats) >= 2
            for s in stats:
                for peer, _port, kind, _via in s.paths:
                    assert kind == ("reversed" if peer in walled_ids else "direct")
            for scope in scopes:
                scope.cancel()


async def test_two_firewalled_peers_without_a_relay_fail_clearly(caplog: pytest.LogCaptureFixture) -> None:
    closed: set[int] = set()
    bad = Config(peer_timeout=4.0, heartbeat_interval=0.25, connect_timeout=2.0, direct_connect_timeout=0.5,
                 p2p_base_port=0, shared_state_base_port=0, advertise="p2p=127.0.0.1:9")
    caplog.set_level(logging.INFO)
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        async with trio.open_nursery() as nursery:
            first, scope = await admit(nursery, master, [], opener(master, Firewalled(CFG, closed, mine=True)))
            errors: list[BaseException] = []

            async def second() -> None:
                try:
                    async with pccl.open_communicator(master.address, token=TOKEN, config=bad,
                                                      network=Firewalled(bad, closed, mine=True)):
                        pass
                except pccl.PCCLError as exc:
                    errors.append(exc)

            nursery.start_soon(second)
            with trio.fail_after(60):
                while master.statistics().registered_peers == 0:
                    await trio.sleep(0.01)
                try:
                    await first.update_topology()
                except pccl.PCCLError as exc:
                    errors.append(exc)
                while len(errors) < 1 or master.statistics().registered_peers:
                    await trio.sleep(0.05)
            scope.cancel()
    text = " ".join(str(e) for e in errors)
    assert "P2P_UNREACHABLE" in text or "unreachable" in text, text
    # What each step met is on record: the advertised endpoint that refused, the dial-back that
    # failed, and what to do (a relay).
    logged = caplog.text
    assert "advertised 127.0.0.1:9" in logged
    assert "could not dial back" in logged or "cannot dial peer" in logged
    assert "no relay serves this run" in logged


async def test_a_wrong_advertisement_is_named_to_its_peer_which_is_dialled_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer advertises a port where nothing listens and is firewalled otherwise: the others
    cannot reach it, it dials them back (the run works), and it logs a warning naming its
    advertisement."""
    closed: set[int] = set()
    wrong = Config(peer_timeout=4.0, heartbeat_interval=0.25, connect_timeout=3.0, direct_connect_timeout=0.6,
                   p2p_base_port=0, shared_state_base_port=0, advertise="p2p=127.0.0.1:9,shared_state=127.0.0.1:9")
    caplog.set_level(logging.INFO)
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        async with trio.open_nursery() as nursery:
            a, sa = await admit(nursery, master, [], opener(master, Firewalled(CFG, closed)))
            b, sb = await admit(nursery, master, [a], opener(master, Firewalled(wrong, closed, mine=True), wrong),
                                soon=30)
            await sum_everywhere([a, b])
            sa.cancel()
            sb.cancel()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "Config.advertise" in r.getMessage()]
    assert warnings and "advertised 127.0.0.1:9" in warnings[0].getMessage()
