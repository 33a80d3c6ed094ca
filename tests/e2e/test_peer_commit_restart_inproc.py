"""``Config.peer_commit`` across a master restart (docs/protocol.rst, "A master restart while
peers are in doubt"), with peers as Trio tasks in this process on real TCP loopback: the master
is stopped while one participant is in doubt and another has committed, and a new master comes
up at the same address; both must end the op alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

import pccl
from pccl import Config
from pccl.communicator import internals_of, open_communicator
from pccl.master import open_master
from pccl.protocol import messages as m
from pccl.protocol.master.events import MessageReceived
from pccl.testing import admit, each

TOKEN = "peer-commit-restart"
CFG = Config(peer_timeout=1.0, heartbeat_interval=0.2, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0, fast_commit=True, peer_commit=True, master_reconnect_timeout=20.0,
             master_reconnect_backoff=(0.05, 0.2))
SOON = 30.0


async def _serve(address: str, scope: trio.CancelScope, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with scope:
        async with open_master(address, token=TOKEN, config=CFG) as master:
            task_status.started(master)
            await trio.sleep_forever()


async def test_a_participant_in_doubt_across_a_master_restart_ends_as_the_one_that_committed() -> None:
    # Q commits on its set; P never hears Q (Q's acks are lost), falls in doubt and asks; the
    # master has neither Q's Done(ok) nor P's ask when it stops.  P must not give up with its
    # input restored while Q returned the result: it reports the op in doubt to the new master,
    # which queries Q (committed) and completes it on P.
    with trio.fail_after(2 * SOON):
        async with trio.open_nursery() as nursery:
            first = trio.CancelScope()
            master = await nursery.start(_serve, "127.0.0.1:0", first)
            comms: list[pccl.Communicator] = []
            scopes = []
            for _ in range(2):
                comm, scope = await admit(nursery, master, comms, lambda: open_communicator(
                    master.address, token=TOKEN, config=CFG), soon=SOON)
                comms.append(comm)
                scopes.append(scope)
            await each(comms, lambda i, c: c.all_reduce(np.ones(10, np.float32), tag=1))  # fast path from here
            p, q = comms
            state = pccl.testing.master_state(master)
            p_conn, q_conn = state.conn_of(p.peer_id), state.conn_of(q.peer_id)
            real = state.handle
            asked = trio.Event()

            def handle(event: Any, now: float) -> list[Any]:
                if isinstance(event, MessageReceived) and (
                        (event.conn_id == q_conn and isinstance(event.msg, m.CollectiveDone))
                        or (event.conn_id == p_conn and isinstance(event.msg, m.CollectiveAsk))):
                    if isinstance(event.msg, m.CollectiveAsk):
                        asked.set()
                    return []  # lost with the master
                return real(event, now)

            state.handle = handle  # type: ignore[method-assign]

            async def no_ack(*args: Any) -> None:
                pass  # Q's acks are lost: P never hears that Q is ready

            internals_of(q).all_reduce.peer_commits.send_ack = no_ack  # type: ignore[method-assign,assignment]

            async def restart() -> None:
                await asked.wait()
                first.cancel()  # the master stops with P in doubt and Q committed
                await trio.sleep(0.3)
                await nursery.start(_serve, master.address, trio.CancelScope())

            nursery.start_soon(restart)
            xs = [np.full(1000, i + 1.0, np.float32) for i in range(2)]
            outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=5), within=SOON)
            assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
            assert all(np.array_equal(x, np.full(1000, 3.0, np.float32)) for x in xs)
            assert q.statistics().peer_commits >= 1 and p.statistics().peer_commit_doubts == 1
            nursery.cancel_scope.cancel()
