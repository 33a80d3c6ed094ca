"""A receiver that closes its communicator right after its ``recv`` returned, on real TCP in one
process: the sender's ``send`` still completes.

The receiver's ``PointAck`` is the last thing it sends; the sender may not have read it yet
(on a loaded machine its loop comes round late).  Were the receiver's connections reset as it
closes — an abort, or a plain close with unread bytes such as the sender's keepalives — the
sender's kernel would drop the unread answer and its ``send`` fail with ``PeerDisconnected``
although the message was delivered (the split seen once in
test_ported_common_torchft.py::test_under_init_process_group[3], case ``torchft_send_recv``,
whose rank 1 destroys its process group right after its recv).  The receiver ends its
connections gracefully instead: EOF after its last answers, then it waits for the sender to
close them.  Both ways a communicator closes: ``aclose()``, and a cancelled scope around
``open_communicator`` (what the blocking communicator's ``close()`` does), which cancels the
connections' tasks before the close reaches them (forced here: the close waits after its
``Leave`` until they have).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import trio
import trio.testing

import pccl
import pccl.testing
from pccl.testing import admit, open_test_cluster

CFG = pccl.Config(peer_timeout=10.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)


@pytest.mark.parametrize("closing", ["aclose", "cancelled"])
async def test_a_receiver_closing_at_once_leaves_the_senders_call_complete(closing: str) -> None:
    async with open_test_cluster(1, token=None, config=CFG) as (master, (a,), _networks):
        async with trio.open_nursery() as peers:
            b, scope = await admit(peers, master, [a], lambda: pccl.open_communicator(master.address, config=CFG))
            close: Callable[[], Awaitable[None]] = b.aclose
            if closing == "cancelled":
                async def close() -> None:
                    scope.cancel()

                # The close's Leave goes out first; only once the cancelled tasks settled does
                # the close reach the point-to-point links: their tasks end before it does.
                pccl.testing.after_master_link_sends(b, lambda _: trio.testing.wait_all_tasks_blocked())
            x = np.arange(1000, dtype=np.float32)
            y = np.zeros_like(x)
            outcome: list[object] = []

            async def send() -> None:
                try:
                    await a.send(x, to=b.peer_id, tag=5)
                    outcome.append("sent")
                except pccl.PCCLError as exc:
                    outcome.append(exc)

            with trio.fail_after(60), pccl.testing.hold_point_answers(a) as release:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(send)
                    await b.recv(y, from_=a.peer_id, tag=5)
                    # b has the message; a has not read b's PointAck (held): b closes now.
                    nursery.start_soon(close)
                    await trio.testing.wait_all_tasks_blocked()
                    release.set()
            assert np.array_equal(y, x)
            assert outcome == ["sent"], outcome
            scope.cancel()
