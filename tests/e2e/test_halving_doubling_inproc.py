"""The halving-doubling all-reduce in a real TCP cluster (peers as Trio tasks in this process):
the topology round wires the partner links, ``Config.all_reduce_algorithm`` forces an algorithm
(or ``"auto"`` picks one per op), results are bit-identical and equal to the algorithm's model."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import Config, ReduceOp
from pccl.collectives.reference import halving_reference
from pccl.protocol.algorithms import (
    AllReduceAlgorithm,
    fold_partner,
    partner_positions,
    power_of_two_below,
    virtual_rank,
)
from pccl.errors import ConnectionRefused
from pccl.master import open_master
from pccl.net.base import Listener, Network, Stream
from pccl.net.tcp import TcpNetwork
from pccl.testing import admit, each, open_test_cluster

TOKEN = "halving-inproc"
SOON = 30.0


def _config(algorithm: str) -> Config:
    return Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                  shared_state_base_port=0, all_reduce_algorithm=algorithm)


def _expected_tx(algorithm: AllReduceAlgorithm, world: int, position: int, nbytes: int) -> int:
    """Payload bytes a peer sends (f32: the wire's dtype is the buffer's)."""
    size = power_of_two_below(world)
    steps = size.bit_length() - 1
    if virtual_rank(position, world) is None:
        return nbytes
    fold = nbytes if fold_partner(position, world) is not None else 0
    if algorithm is AllReduceAlgorithm.RECURSIVE_DOUBLING:
        return steps * nbytes + fold
    return 2 * (size - 1) * nbytes // size + fold


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("algorithm", [AllReduceAlgorithm.RECURSIVE_DOUBLING, AllReduceAlgorithm.HALVING_DOUBLING],
                         ids=lambda a: a.value)
async def test_forced_algorithm_runs_over_partner_links_bit_identical(world: int,
                                                                      algorithm: AllReduceAlgorithm) -> None:
    async with open_test_cluster(world, token=TOKEN, config=_config(algorithm.value), soon=SOON) as (_, comms, _):
        ring = comms[0].ring
        by_id = {c.peer_id: c for c in comms}
        rng = np.random.default_rng(world)
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            for dtype in (np.float32, np.float16):
                inputs = {pid: (rng.standard_normal(1024) * 10).astype(dtype) for pid in ring}
                buffers = {pid: x.copy() for pid, x in inputs.items()}

                async def reduce(i: int, comm: pccl.Communicator) -> Any:
                    return await comm.all_reduce(buffers[comm.peer_id], op=op, tag=7)

                infos = await each(comms, reduce)
                expected = halving_reference([inputs[pid] for pid in ring], op, algorithm)
                for pid in ring:
                    assert buffers[pid].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes(), (op, dtype)
                if dtype is np.float32:  # the bytes say which algorithm ran
                    for info, comm in zip(infos, comms):
                        position = ring.index(comm.peer_id)
                        assert info.tx_bytes == _expected_tx(algorithm, world, position, 4096), (position, info)
        assert set(by_id) == set(ring)


async def test_auto_picks_recursive_doubling_for_a_small_op_at_eight_peers() -> None:
    async with open_test_cluster(8, token=TOKEN, config=_config("auto"), soon=SOON) as (_, comms, _):
        ring = comms[0].ring
        inputs = {c.peer_id: np.full(1024, float(i + 1), np.float32) for i, c in enumerate(comms)}

        async def reduce(i: int, comm: pccl.Communicator) -> Any:
            return await comm.all_reduce(inputs[comm.peer_id])

        infos = await each(comms, reduce)
        for info in infos:
            assert info.tx_bytes == 3 * 4096  # three doubling steps; the exchange would send 7 x 4096
        for x in inputs.values():
            assert np.array_equal(x, np.full(1024, 36.0, np.float32))
        assert len(ring) == 8


async def test_auto_wires_no_partner_links_below_eight_peers() -> None:
    async with open_test_cluster(4, token=TOKEN, config=_config("auto"), soon=SOON) as (_, comms, _):
        inputs = {c.peer_id: np.full(1024, float(i + 1), np.float32) for i, c in enumerate(comms)}

        async def reduce(i: int, comm: pccl.Communicator) -> Any:
            return await comm.all_reduce(inputs[comm.peer_id])

        infos = await each(comms, reduce)
        for info, comm in zip(infos, comms):
            assert info.tx_bytes == 3 * 4096  # the ring's exchange
            assert comm.statistics().p2p_connections == 2  # a lane out, a lane in: no partner links


async def test_peers_with_different_algorithm_settings_both_fail_at_once_naming_both() -> None:
    # Config.all_reduce_algorithm must be the same on every peer (different settings run
    # different schedules, and a "ring" peer dials no partner links): the ring hello carries it
    # and a peer meeting another setting refuses the connection; both leave the run with
    # InvalidUsage instead of retrying the round (or, at 8 peers and more, hanging).
    async with open_master("127.0.0.1:0", token=TOKEN, config=_config("auto")) as master:
        async with trio.open_nursery() as nursery:
            first, scope = await admit(nursery, master, [],
                                       lambda: pccl.open_communicator(master.address, token=TOKEN,
                                                                      config=_config("auto")))
            errors: dict[str, BaseException] = {}

            async def second() -> None:
                try:
                    async with pccl.open_communicator(master.address, token=TOKEN, config=_config("ring")):
                        await trio.sleep_forever()
                except pccl.PCCLError as error:
                    errors["second"] = error

            with trio.fail_after(8):  # well below the master's retries of a failing round
                nursery.start_soon(second)
                while master.statistics().registered_peers == 0:  # the second is pending
                    await trio.sleep(0.01)
                with pytest.raises(pccl.InvalidUsage) as vote:
                    await first.update_topology()
                while "second" not in errors:
                    await trio.sleep(0.01)
            scope.cancel()
    for error in (vote.value, errors["second"]):
        assert isinstance(error, pccl.InvalidUsage), repr(error)
        assert "Config.all_reduce_algorithm" in str(error) and "'ring'" in str(error) and "'auto'" in str(error)


async def test_partner_dials_are_counted_apart_from_ring_lane_dials() -> None:
    # A re-wire of the same ring keeps every lane (p2p_dials unchanged, p2p_lanes_kept + lanes)
    # and dials the partner links afresh: each peer its partners at higher ring positions.
    world = 4
    config = _config(AllReduceAlgorithm.RECURSIVE_DOUBLING.value)
    async with open_test_cluster(world, token=TOKEN, config=config, soon=SOON) as (_, comms, _):
        ring = comms[0].ring
        before = {c.peer_id: c.statistics() for c in comms}
        with trio.fail_after(SOON):
            async with trio.open_nursery() as voters:
                for comm in comms:
                    voters.start_soon(pccl.testing.force_rewire, comm)
        assert comms[0].ring == ring
        for comm in comms:
            now, then = comm.statistics(), before[comm.peer_id]
            me = ring.index(comm.peer_id)
            owed = sum(p > me for p in partner_positions(me, world))
            assert now.p2p_dials - then.p2p_dials == 0, comm.peer_id
            assert now.p2p_lanes_kept - then.p2p_lanes_kept == config.lanes_for(), comm.peer_id
            assert now.p2p_partner_dials - then.p2p_partner_dials == owed, comm.peer_id
        assert [sum(p > me for p in partner_positions(me, world)) for me in range(world)] == [2, 1, 1, 0]


class _RefusingNetwork(Network):
    """Real TCP whose dials to anything but the master are refused while ``refusals[0]`` (shared
    by every peer's network) is above zero; each refusal counts it down.  The count, not a
    task watching it, ends the refusals: a watcher could be late by the master's three attempts
    at the round on a loaded box, and the peer would be kicked."""

    def __init__(self, master: str, refusals: list[int]) -> None:
        self._tcp = TcpNetwork(_config("auto"))
        self._master = master
        self._refusals = refusals
        self.refused = 0

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        if self._refusals[0] > 0 and address != self._master:
            self._refusals[0] -= 1
            self.refused += 1
            raise ConnectionRefused(f"refused by the test: {address}")
        return await self._tcp.connect(address, timeout=timeout)

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        return await self._tcp.listen(address, port_range=port_range)

    def local_addresses(self, family: str = "ipv4") -> list[str]:
        return self._tcp.local_addresses(family)


async def test_partner_links_failing_together_fail_the_round_quietly_and_it_is_retried(
        caplog: pytest.LogCaptureFixture) -> None:
    # Position 0 dials two partners; when both dials fail at once the round fails (reported to
    # the master, retried) with a pccl error, not an ERROR traceback of the one not raised.
    world = 4
    refusals = [0]
    nets: dict[int, _RefusingNetwork] = {}

    def make(i: int) -> Any:
        def factory(master: str) -> Network:
            nets[i] = _RefusingNetwork(master, refusals)
            return nets[i]
        return factory

    config = _config(AllReduceAlgorithm.RECURSIVE_DOUBLING.value)
    network = {i: make(i) for i in range(world)}
    async with open_test_cluster(world, token=TOKEN, config=config, network=network, soon=SOON) as (_, comms, _):
        refusals[0] = world + 4  # every lane and partner dial of the round once; the retry succeeds
        with caplog.at_level(logging.INFO), trio.fail_after(SOON):
            async with trio.open_nursery() as voters:
                for comm in comms:
                    voters.start_soon(pccl.testing.force_rewire, comm)
        assert sum(n.refused for n in nets.values()) == world + 4
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records
                                                                              if r.levelno >= logging.ERROR]
        assert any("cannot connect to partner" in r.getMessage() for r in caplog.records)
        await each(comms, lambda i, comm: comm.all_reduce(np.ones(256, np.float32)))
