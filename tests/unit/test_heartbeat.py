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
from pccl.testing.units import run_heartbeat
from pccl.errors import MasterUnreachable, PCCLError
from pccl.protocol import messages as m

CFG = Config(peer_timeout=2.0, heartbeat_interval=0.25)


class _State:
    """What :func:`pccl._peer.heartbeat.run_heartbeat` reads and calls (its ``HeartbeatSubject``)."""

    peer_id = 0x5EED
    master_address = "master.invalid:1"

    def __init__(self) -> None:
        self.config = CFG
        self.last_heard = trio.current_time()
        self.last_sent = self.last_heard
        self.failure: PCCLError | None = None
        self.sent: list[m.Message] = []
        self.times: list[float] = []  # when each message went out
        #: What the heartbeats report (the status page's figures).
        self.report = m.Heartbeat()

    def fail(self, error: PCCLError) -> None:
        if self.failure is None:
            self.failure = error

    def heartbeat(self) -> m.Heartbeat:
        return self.report

    async def send(self, msg: m.Message) -> None:
        self.sent.append(msg)
        self.last_sent = trio.current_time()
        self.times.append(self.last_sent)
        await trio.lowlevel.checkpoint()


async def _run_heartbeat(state: Any, body: Any) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_heartbeat, state)
        await body()
        nursery.cancel_scope.cancel()


async def test_a_silent_master_is_declared_unreachable(autojump_clock: trio.testing.MockClock) -> None:
    state = _State()

    async def body() -> None:
        await trio.sleep(CFG.peer_timeout + 2 * CFG.heartbeat_interval)  # the task runs on time

    await _run_heartbeat(state, body)
    assert isinstance(state.failure, MasterUnreachable)
    assert "silent" in str(state.failure)


async def _reader(state: _State) -> None:
    """A master heartbeat every interval, taken in by a reader that needs two scheduler turns."""
    while True:
        await trio.sleep(CFG.heartbeat_interval)
        await trio.lowlevel.checkpoint()
        state.last_heard = trio.current_time()


async def test_a_blocked_event_loop_is_not_blamed_on_the_master(autojump_clock: trio.testing.MockClock,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    # While this peer's loop was blocked, the master's heartbeats (or its kick) piled up unread:
    # the heartbeat task must let the reader take them in before judging the master's silence.
    state = _State()

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, state)
            await trio.sleep(CFG.heartbeat_interval / 2)
            autojump_clock.jump(3 * CFG.peer_timeout)  # time passes, no task runs: a blocked loop
            await trio.sleep(2 * CFG.heartbeat_interval)
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, logger="pccl.communicator"):
        await _run_heartbeat(state, body)
    assert state.failure is None
    assert any(isinstance(msg, m.Heartbeat) for msg in state.sent)
    assert any("event loop was blocked" in r.getMessage() for r in caplog.records)


async def test_a_loop_that_blocks_every_step_keeps_a_live_master(autojump_clock: trio.testing.MockClock) -> None:
    # Steps of 1.2 s that yield once each, shorter than peer_timeout: the grace after a late wake
    # is counted in scheduler turns, so blocking again meanwhile does not cut it short.
    state = _State()

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, state)
            for _ in range(40):
                autojump_clock.jump(1.2)
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()

    await _run_heartbeat(state, body)
    assert state.failure is None


async def test_a_master_silent_across_a_blocked_loop_is_still_declared_unreachable(
        autojump_clock: trio.testing.MockClock) -> None:
    # Nothing arrives after the stall either: the stall is not counted as the master's silence,
    # but peer_timeout of running time after it is.
    state = _State()

    async def body() -> None:
        await trio.sleep(CFG.heartbeat_interval / 2)
        autojump_clock.jump(3 * CFG.peer_timeout)
        await trio.sleep(2 * CFG.heartbeat_interval)
        assert state.failure is None
        await trio.sleep(CFG.peer_timeout)

    await _run_heartbeat(state, body)
    assert isinstance(state.failure, MasterUnreachable)
    assert "while this peer's event loop did not run" in str(state.failure)


async def test_a_master_starved_with_this_peer_is_not_declared_silent(autojump_clock: trio.testing.MockClock) -> None:
    # The master shares this peer's starved CPU (one busy host, or the master in this very
    # process): during the stall it sent nothing, so nothing waits unread, and its next heartbeat
    # comes an interval after the stall ends.  Seen under load as "the master at ... has been
    # silent for 2.02 s; reconnecting" with the master alive in the same process.
    state = _State()

    async def master_after_the_stall() -> None:
        while True:
            await trio.sleep(CFG.heartbeat_interval)
            state.last_heard = trio.current_time()

    async def body() -> None:
        await trio.sleep(CFG.heartbeat_interval / 2)
        autojump_clock.jump(3 * CFG.peer_timeout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(master_after_the_stall)
            await trio.sleep(4 * CFG.heartbeat_interval)
            nursery.cancel_scope.cancel()

    await _run_heartbeat(state, body)
    assert state.failure is None


async def test_a_short_block_gets_a_heartbeat_out_at_once_and_no_warning(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    state = _State()

    async def body() -> None:
        await trio.sleep(CFG.heartbeat_interval / 2)
        state.last_heard = trio.current_time()
        autojump_clock.jump(CFG.peer_timeout / 2 - CFG.heartbeat_interval)  # under the warning threshold
        await trio.lowlevel.checkpoint()
        woke = trio.current_time()
        while not state.sent:
            await trio.lowlevel.checkpoint()
        assert trio.current_time() == woke  # sent in the same instant: no grace wait

    with caplog.at_level(logging.WARNING, logger="pccl.communicator"):
        await _run_heartbeat(state, body)
    assert state.failure is None
    assert not [r for r in caplog.records if "blocked" in r.getMessage()]



async def _busy_loop(state: _State, every: float, steps: int) -> None:
    """A training loop that sends the master a vote every ``every`` seconds."""
    for _ in range(steps):
        await trio.sleep(every)
        await state.send(m.VoteTopology())


async def test_a_busy_peer_sends_no_heartbeat_while_its_report_is_unchanged(
        autojump_clock: trio.testing.MockClock) -> None:
    # Votes every 0.9 intervals reach the master often enough: heartbeats on top would be
    # extra messages for the master to read (about 40% of its messages in a simulated run).
    state = _State()

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, state)  # the master stays alive
            await _busy_loop(state, 0.9 * CFG.heartbeat_interval, 40)
            nursery.cancel_scope.cancel()

    await _run_heartbeat(state, body)
    assert state.failure is None
    assert [type(msg) for msg in state.sent].count(m.Heartbeat) <= 1  # at most the first, before any vote
    gaps = [b - a for a, b in zip(state.times, state.times[1:])]
    assert max(gaps) <= CFG.heartbeat_interval


async def test_an_idle_peer_is_heard_within_every_interval(autojump_clock: trio.testing.MockClock) -> None:
    state = _State()

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, state)
            await _busy_loop(state, 0.3 * CFG.heartbeat_interval, 5)  # busy, then idle
            await trio.sleep(10 * CFG.heartbeat_interval)
            nursery.cancel_scope.cancel()

    await _run_heartbeat(state, body)
    heartbeats = [t for msg, t in zip(state.sent, state.times) if isinstance(msg, m.Heartbeat)]
    assert len(heartbeats) >= 9
    times = [0.0, *state.times]
    assert max(b - a for a, b in zip(times, times[1:])) <= CFG.heartbeat_interval


async def test_a_changed_report_goes_out_within_an_interval_even_from_a_busy_peer(
        autojump_clock: trio.testing.MockClock) -> None:
    state = _State()
    changed_at: list[float] = []

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reader, state)
            nursery.start_soon(_busy_loop, state, 0.2 * CFG.heartbeat_interval, 1000)
            for revision in (1, 2, 3):
                await trio.sleep(3 * CFG.heartbeat_interval)
                state.report = m.Heartbeat(True, revision)
                changed_at.append(trio.current_time())
            await trio.sleep(3 * CFG.heartbeat_interval)
            nursery.cancel_scope.cancel()

    await _run_heartbeat(state, body)
    reports = [(t, msg) for msg, t in zip(state.sent, state.times) if isinstance(msg, m.Heartbeat)]
    for revision, at in zip((1, 2, 3), changed_at):
        sent = [t for t, msg in reports if msg.revision == revision]
        assert len(sent) == 1 and sent[0] - at <= CFG.heartbeat_interval


async def test_a_heartbeat_held_up_in_its_send_gives_what_arrives_meanwhile_an_interval(
        autojump_clock: trio.testing.MockClock) -> None:
    # A stalled network holds the heartbeat's send for longer than peer_timeout; the master's
    # answer (say the notice of a kick during the stall) is read soon after the send returns.
    # The silence verdict must wait an interval from there, not fire at once.
    state = _State()
    released = trio.Event()

    async def held_send(msg: m.Message) -> None:
        state.sent.append(msg)
        if len(state.sent) == 1:
            await trio.sleep(2 * CFG.peer_timeout)
            released.set()
        state.last_sent = trio.current_time()

    state.send = held_send  # type: ignore[method-assign]

    async def body() -> None:
        await released.wait()
        await trio.sleep(0.3 * CFG.heartbeat_interval)
        state.last_heard = trio.current_time()
        await trio.sleep(2 * CFG.heartbeat_interval)

    await _run_heartbeat(state, body)
    assert state.failure is None
