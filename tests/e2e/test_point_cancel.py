"""Cancelling ``recv``/``send`` (Trio cancel scopes), in one process on real TCP: a receive
withdrawn before its message came changes nothing; one cancelled mid-message closes the pair's
connections — the sender's call fails retry-safe, the receiver's array keeps its old values —
and the next message goes over fresh connections."""

from __future__ import annotations

import numpy as np
import trio

import pccl
import pccl.testing
from pccl.testing import open_test_cluster

# Both peers share this test's event loop, which fills and copies 256 MiB arrays: beside a second
# default run that blocked it for 2.4 s, and a 2 s peer_timeout took the pair for dead.  Nothing
# here waits for a timeout (a cancelled receive closes the connections).
CFG = pccl.Config(peer_timeout=10.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)
NBYTES = 256 << 20


async def test_cancelled_receives_withdraw_or_close_the_connections() -> None:
    async with open_test_cluster(2, token=None, config=CFG) as (_, (a, b), _networks):
        payload = np.full(NBYTES, 3, np.uint8)
        target = np.zeros(NBYTES, np.uint8)
        # withdrawn: nobody sends yet; the next receive on the tag gets the next message
        with trio.move_on_after(0.2):
            await a.recv(target, from_=b.peer_id, tag=1)
        small = np.zeros(4, np.int32)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: b.send(np.arange(4, dtype=np.int32), to=a.peer_id, tag=1))
            await a.recv(small, from_=b.peer_id, tag=1)
        assert small.tolist() == [0, 1, 2, 3]

        # cancelled mid-message: the data is moving when the receive is cancelled
        failures: list[BaseException] = []

        async def send() -> None:
            try:
                await b.send(payload, to=a.peer_id, tag=2)
            except pccl.PCCLError as exc:
                failures.append(exc)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                with trio.CancelScope() as scope:
                    nursery.start_soon(lambda: _cancel_when_moving(a, scope))
                    await a.recv(target, from_=b.peer_id, tag=2)
                assert scope.cancelled_caught, "the receive completed before it could be cancelled"
        assert len(failures) == 1 and isinstance(failures[0], pccl.PeerDisconnected), failures
        assert not target.any(), "a cancelled receive wrote into the caller's array"

        # fresh connections carry the next message
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: b.send(payload, to=a.peer_id, tag=2))
            await a.recv(target, from_=b.peer_id, tag=2)
        assert int(target[0]) == int(target[-1]) == 3


async def _cancel_when_moving(comm: pccl.Communicator, scope: trio.CancelScope) -> None:
    while not pccl.testing.points_under_way(comm):
        await trio.sleep(0)
    scope.cancel()
