"""Ring lanes that carry on into the next topology round (``pccl._peer.wiring``), on real TCP.

A round re-dials only the edges of the ring it changes: a lane whose two ends stay neighbours
gets the new round's ``P2PHello`` on the old connection.  If either end dropped it (an op left
unread data on it, or it was closed), the dialler learns it from the closed connection and dials
that lane afresh; the all-reduces after the round are exact either way.  Each test runs on plain
TCP and with TLS on every connection.
"""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import pytest
import trio

import pccl
import pccl.testing
from pccl import Config
from pccl.protocol.codec import DataHeader
from pccl.testing import admit, open_test_cluster

TOKEN = "kept-lanes-token"
CFG = Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0, p2p_lanes=2)
BOUND = 20.0


@pytest.fixture(params=["tcp", "tls"])
def cfg(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Config:
    """Plain TCP (lanes with worker-thread I/O), or TLS on every connection (lanes without it:
    the kept lane's hello is then read through the TLS stream)."""
    if request.param == "tcp":
        return CFG
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    return CFG.with_tls(cert=paths["cert"], key=paths["key"], ca=paths["ca"])


def _successor(ring: tuple[int, ...], peer: int) -> int:
    return ring[(ring.index(peer) + 1) % len(ring)]


async def _all_reduce_everywhere(comms: list[pccl.Communicator], n: int) -> None:
    """Every peer reduces its own ramp; each must end with the exact sum (integers far below
    2**24: exact in float32 in any order of addition)."""
    inputs = [(np.arange(n) % 1000).astype(np.float32) * (i + 1) for i in range(len(comms))]
    expected = sum(inputs)
    async with trio.open_nursery() as nursery:
        for comm, x in zip(comms, inputs):
            nursery.start_soon(comm.all_reduce, x)
    for x in inputs:
        np.testing.assert_array_equal(x, expected)


async def test_a_newcomer_redials_only_the_ring_edges_it_changes(cfg: Config) -> None:
    lanes = CFG.lanes_for()
    with trio.fail_after(BOUND):
        async with open_test_cluster(3, token=TOKEN, config=cfg) as (master, comms, _), trio.open_nursery() as nursery:
            ring_before = comms[0].ring
            before = {c.peer_id: (c.statistics(), pccl.testing.ring_lanes(c).to_successor) for c in comms}
            newcomer, newcomer_scope = await admit(
                nursery, master, comms, lambda: pccl.open_communicator(master.address, token=TOKEN, config=cfg))
            ring = comms[0].ring
            assert len(ring) == 4 and all(c.ring == ring for c in [*comms, newcomer])
            changed = 0
            for comm in comms:
                stats, lanes_before = before[comm.peer_id]
                now = comm.statistics()
                same = _successor(ring, comm.peer_id) == _successor(ring_before, comm.peer_id)
                changed += not same
                # An unchanged edge keeps its connections (no dial); a changed one dials its lanes.
                assert now.p2p_lanes_kept - stats.p2p_lanes_kept == (lanes if same else 0), comm.peer_id
                assert now.p2p_dials - stats.p2p_dials == (0 if same else lanes), comm.peer_id
                assert (pccl.testing.ring_lanes(comm).to_successor == lanes_before) is same
            assert changed == 1  # exactly one old peer precedes the newcomer
            assert newcomer.statistics().p2p_dials == lanes
            await _all_reduce_everywhere([*comms, newcomer], 50_000)
            await _all_reduce_everywhere([*comms, newcomer], 3_000_000)  # the worker-thread lanes too (TCP)
            newcomer_scope.cancel()


@pytest.mark.parametrize("how", ["unread_data", "closed"])
async def test_a_lane_the_successor_dropped_is_dialled_afresh(cfg: Config, how: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The acceptor's end of a kept lane is unusable: a data frame of an op it never read waits
    on it (an aborted op leaves that), or it was closed.  The dialler's hello finds the lane
    closed, dials afresh, and the round and the all-reduces after it succeed."""
    lanes = CFG.lanes_for()
    with trio.fail_after(BOUND):
        async with open_test_cluster(3, token=TOKEN, config=cfg) as (_, comms, _):
            await _all_reduce_everywhere(comms, 10_000)
            a = comms[0]
            succ = next(c for c in comms if c.peer_id == _successor(a.ring, a.peer_id))
            if how == "unread_data":
                stray = np.ones(16, dtype=np.float32)
                await pccl.testing.send_data_on_lane(a, 1, DataHeader(10_000, 0, 0, 0, stray.nbytes), stray)
            else:
                pccl.testing.break_lane(succ, a.peer_id, 1)
            stats = {c.peer_id: c.statistics() for c in comms}
            with caplog.at_level(logging.INFO, logger="pccl._peer.wiring"):
                async with trio.open_nursery() as voters:  # a group re-wire: the ring stays the same
                    for comm in comms:
                        voters.start_soon(pccl.testing.force_rewire, comm)
            if how == "unread_data":  # the stray frame is named where the lane is dropped
                assert any("kept lane 1" in r.getMessage() and "data frame" in r.getMessage() for r in caplog.records)
            for comm in comms:
                dials = comm.statistics().p2p_dials - stats[comm.peer_id].p2p_dials
                kept = comm.statistics().p2p_lanes_kept - stats[comm.peer_id].p2p_lanes_kept
                assert (dials, kept) == ((1, lanes - 1) if comm is a else (0, lanes)), comm.peer_id
            await _all_reduce_everywhere(comms, 10_000)
            await _all_reduce_everywhere(comms, 3_000_000)
