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

The other way round too: a sender that closes right after its ``send`` returned — it read the
receiver's ``PointAck`` — while the receiver has handed that answer to the connection but not yet
come back to it (its writer was still in the transport's schedule point after the write): the
sender's EOF reached the receiver's reader first, which failed the link and with it the receive
although its answer was out (seen once on CI in the same torchft case, whose rank 0 destroys its
process group right after its send).  A receive whose ``PointAck`` was handed to the transport
completes, whatever the link does after.
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



@pytest.mark.parametrize("then", ["sender closes", "receive cancelled", "receive timed out"])
async def test_a_receive_whose_ack_was_handed_over_keeps_the_message(then: str) -> None:
    """The sender reads the receiver's ``PointAck`` while the receiver's writer has not come back
    from handing it to the transport (held).  Then the sender closes at once, or the receive is
    cancelled (or times out): either way the message stands on both sides — the send succeeded,
    and the receive returns with the message (it is done: the cancellation came too late to stop
    it, and neither raises nor gives old values back over a message its sender was told
    arrived)."""
    async with open_test_cluster(1, token=None, config=CFG) as (master, (a,), _networks):
        async with trio.open_nursery() as peers:
            b, scope = await admit(peers, master, [a], lambda: pccl.open_communicator(master.address, config=CFG))
            x = np.arange(1000, dtype=np.float32)
            y = np.zeros_like(x)
            outcome: list[object] = []
            receiving = trio.CancelScope()

            async def recv() -> None:
                with receiving:
                    try:
                        await b.recv(y, from_=a.peer_id, tag=5, timeout=None if then != "receive timed out" else 1.0)
                        outcome.append("received")
                    except pccl.PCCLError as exc:
                        outcome.append(exc)
                if receiving.cancelled_caught:
                    outcome.append("cancelled")

            with trio.fail_after(60), pccl.testing.hold_point_acks_sent(b) as release:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(recv)
                    await a.send(x, to=b.peer_id, tag=5)
                    # a has b's PointAck; b's writer has not come back from sending it (held).
                    if then == "sender closes":
                        await a.aclose()  # b's links see a's EOF before b's receive completes
                    elif then == "receive cancelled":
                        receiving.cancel()
                    else:
                        await trio.sleep(1.5)  # past the receive's timeout=
                    await trio.testing.wait_all_tasks_blocked()
                    release.set()
            assert outcome == ["received"], outcome
            assert np.array_equal(y, x)
            scope.cancel()
