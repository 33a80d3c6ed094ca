"""The communicator's heartbeat task: when it declares the master unreachable, and when not.

Driven on a mock clock against a stand-in for the communicator's state, so the moments are exact:
``MockClock.jump`` moves time on without letting any task run, which is what user code that
blocks the event loop (a long synchronous step) does to the heartbeat task.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from pccl import Config
from pccl.communicator import Communicator
from pccl.errors import MasterUnreachable, PCCLError
from pccl.protocol import messages as m

CFG = Config(peer_timeout=2.0, heartbeat_interval=0.25)


class _State:
    """What ``Communicator._heartbeat`` reads and calls."""

    peer_id = 0x5EED
    master_address = "master.invalid:1"

    def __init__(self) -> None:
        self._config = CFG
        self._last_heard = trio.current_time()
        self._failure: PCCLError | None = None
        self.sent: list[m.Message] = []

    def _fail(self, error: PCCLError, *, cause: BaseException | None = None) -> None:
        if self._failure is None:
            self._failure = error

    async def _send_master(self, msg: m.Message) -> None:
        self.sent.append(msg)
        await trio.lowlevel.checkpoint()


async def _run_heartbeat(state: Any, body: Any) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Communicator._heartbeat, state)  # type: ignore[arg-type]
        await body()
        nursery.cancel_scope.cancel()


async def test_a_silent_master_is_declared_unreachable(autojump_clock: trio.testing.MockClock) -> None:
    state = _State()

    async def body() -> None:
        await trio.sleep(CFG.peer_timeout + 2 * CFG.heartbeat_interval)  # the task runs on time

    await _run_heartbeat(state, body)
    assert isinstance(state._failure, MasterUnreachable)
    assert "silent" in str(state._failure)


async def test_a_blocked_event_loop_is_not_blamed_on_the_master(autojump_clock: trio.testing.MockClock,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # While this peer's loop was blocked, the master's heartbeats (or its kick) piled up unread:
    # the heartbeat task must let the reader take them in before judging the master's silence.
    state = _State()

    async def body() -> None:
        await trio.sleep(CFG.heartbeat_interval / 2)
        autojump_clock.jump(3 * CFG.peer_timeout)  # time passes, no task runs: a blocked loop
        await trio.sleep(CFG.heartbeat_interval / 4)  # the heartbeat task has woken, late
        state._last_heard = trio.current_time()  # the reader reads a master heartbeat
        await trio.sleep(2 * CFG.heartbeat_interval)

    with caplog.at_level(logging.WARNING, logger="pccl.communicator"):
        await _run_heartbeat(state, body)
    assert state._failure is None
    assert any(isinstance(msg, m.Heartbeat) for msg in state.sent)
    assert any("event loop was blocked" in r.getMessage() for r in caplog.records)


async def test_a_master_silent_across_a_blocked_loop_is_still_declared_unreachable(
        autojump_clock: trio.testing.MockClock) -> None:
    # Nothing arrives after the stall either: after the reader's grace interval, the verdict.
    state = _State()

    async def body() -> None:
        await trio.sleep(CFG.heartbeat_interval / 2)
        autojump_clock.jump(3 * CFG.peer_timeout)
        await trio.sleep(2 * CFG.heartbeat_interval)

    await _run_heartbeat(state, body)
    assert isinstance(state._failure, MasterUnreachable)
