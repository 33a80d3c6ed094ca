"""The accept loop of internet-facing ports (pccl.net.serving) over in-memory streams, on a
virtual clock: admission by address, parked connections, and the rate-limited refusal log."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from pccl.testing import MemoryStream

from pccl.errors import PCCLError, StreamClosed, TransportError
from pccl.net import serving
from pccl.net.admission import AdmissionLimits
from pccl.net.base import Listener, Stream
from pccl.net.serving import HandshakeSlot, RefusalLog, admission_for, serve_listener

LOGGER = "test.serving"


class ChannelListener(Listener):
    """Hands out the server ends of in-memory connections dialled with :meth:`dial`."""

    def __init__(self) -> None:
        self.address = "10.9.9.9:1"
        self._send, self._receive = trio.open_memory_channel[Stream](1000)

    def dial(self, source: str) -> MemoryStream:
        a, b = trio.testing.memory_stream_pair()
        client = MemoryStream(a, local=source, remote=self.address)
        self._send.send_nowait(MemoryStream(b, local=self.address, remote=source))
        return client

    async def accept(self) -> Stream:
        try:
            return await self._receive.receive()
        except (trio.ClosedResourceError, trio.EndOfChannel) as exc:
            raise StreamClosed("closed") from exc

    async def aclose(self) -> None:
        await self._send.aclose()


class Recorder:
    """A handler that, like a handshake, waits for the first byte: then the connection proved
    itself (its slot is released); silence for ``patience`` seconds is a refusal."""

    def __init__(self, patience: float) -> None:
        self.patience = patience
        self.started: list[str] = []
        self.proved: list[str] = []

    async def __call__(self, stream: Stream, slot: HandshakeSlot) -> None:
        self.started.append(stream.remote_address)
        try:
            with trio.fail_after(self.patience):
                got = await stream.receive_into(bytearray(1))
            if not got:
                raise StreamClosed("closed before a byte")
        except (trio.TooSlowError, PCCLError) as exc:
            slot.refuse(exc or "silent")
            await stream.aclose()
            return
        self.proved.append(stream.remote_address)
        slot.release()
        await trio.sleep_forever()


async def _closed(client: MemoryStream) -> bool:
    try:
        with trio.move_on_after(0.01):  # virtual time: only says whether EOF is already there
            return await client.receive_into(bytearray(1)) == 0
    except PCCLError:
        return True
    return False


async def test_a_flood_from_one_address_leaves_slots_to_the_others(autojump_clock: trio.testing.MockClock) -> None:
    listener, handler = ChannelListener(), Recorder(patience=60.0)
    limits = AdmissionLimits(pending=8, per_address=3, waiting=500)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: serve_listener(listener, handler, on_error=lambda e: None, admission=admission_for(limits, wait_timeout=60.0)))
        flood = [listener.dial(f"203.0.113.66:{i}") for i in range(300)]  # idle: never a byte
        await trio.testing.wait_all_tasks_blocked()
        assert len(handler.started) == 3  # the flood's share; 297 wait parked, unread
        guest = listener.dial("198.51.100.1:5")
        await guest.send_all(b"x")
        await trio.testing.wait_all_tasks_blocked()
        assert handler.proved == ["198.51.100.1:5"]  # at once, not after the flood's handshakes
        assert not any([await _closed(c) for c in flood])  # parked, not closed: no reconnect churn
        nursery.cancel_scope.cancel()


async def test_the_newest_waiter_of_an_address_goes_first(autojump_clock: trio.testing.MockClock) -> None:
    # A legitimate dialler behind the flooding address is served at the next free slot, not
    # after every idle connection that was opened before it.
    listener, handler = ChannelListener(), Recorder(patience=2.0)
    limits = AdmissionLimits(pending=8, per_address=2, waiting=500)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: serve_listener(listener, handler, on_error=lambda e: None, admission=admission_for(limits, wait_timeout=60.0)))
        for i in range(100):
            listener.dial(f"203.0.113.66:{i}")
        await trio.sleep(0.5)
        guest = listener.dial("203.0.113.66:9999")
        await guest.send_all(b"x")
        start = trio.current_time()
        while "203.0.113.66:9999" not in handler.proved:
            await trio.sleep(0.1)
        assert trio.current_time() - start <= 2.0  # virtual time: one idle handshake's patience
        nursery.cancel_scope.cancel()


async def test_parked_connections_give_up_after_the_wait_timeout(autojump_clock: trio.testing.MockClock,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    listener, handler = ChannelListener(), Recorder(patience=100.0)
    limits = AdmissionLimits(pending=1, per_address=1, waiting=10)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: serve_listener(
                listener, handler, on_error=lambda e: None, admission=admission_for(limits, wait_timeout=5.0),
                refusals=RefusalLog("test port", logger=logging.getLogger(LOGGER))))
            first = listener.dial("203.0.113.1:1")
            parked = listener.dial("203.0.113.1:2")
            await trio.sleep(4.9)
            assert not await _closed(parked)
            await trio.sleep(0.2)
            assert await _closed(parked) and not await _closed(first)
            nursery.cancel_scope.cancel()
    assert [r.getMessage() for r in caplog.records] == [
        "test port refused 203.0.113.1:2: no handshake slot came free within 5 s"]


async def test_refusals_are_logged_once_each_and_rate_limited(autojump_clock: trio.testing.MockClock,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # 500 connections that each send nothing for 1 s: every one is refused once, and the log
    # says so in a dozen lines, not a thousand.
    listener, handler = ChannelListener(), Recorder(patience=1.0)
    limits = AdmissionLimits(pending=100, per_address=100, waiting=1000)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        async with trio.open_nursery() as nursery:
            refusals = RefusalLog("test port", logger=logging.getLogger(LOGGER))
            nursery.start_soon(lambda: serve_listener(listener, handler, on_error=lambda e: None, admission=admission_for(limits, wait_timeout=60.0), refusals=refusals))
            clients = [listener.dial(f"203.0.113.66:{i}") for i in range(500)]
            await trio.sleep(30.0)
            assert refusals.total == 500
            nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records]
    individual = [line for line in lines if " refused 203.0.113.66:" in line]
    summaries = [line for line in lines if "more connections refused" in line]
    assert len(individual) == serving.REFUSALS_LOGGED_PER_WINDOW
    assert summaries == ["test port: and 490 more connections refused in the last 10 s (490 from 203.0.113.66)"]
    assert len(clients) == 500


async def test_refusal_summary_per_window(autojump_clock: trio.testing.MockClock,
                                          caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog("port", logger=logging.getLogger(LOGGER), per_window=2, window=10.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for i in range(5):
            log.refused(f"192.0.2.{i}:1", "idle")
        assert log.flush_at == pytest.approx(trio.current_time() + 10.0)
        await trio.sleep(10.0)
        log.refused("192.0.2.9:1", "idle")  # a new window: the old one's count is written first
        log.flush()
        log.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "port refused 192.0.2.0:1: idle",
        "port refused 192.0.2.1:1: idle",
        "port: and 3 more connections refused in the last 10 s (1 from 192.0.2.2)",
        "port refused 192.0.2.9:1: idle",
    ]
    assert log.total == 6


async def test_a_failed_listener_closes_the_parked_connections(autojump_clock: trio.testing.MockClock) -> None:
    listener, handler = ChannelListener(), Recorder(patience=100.0)
    errors: list[TransportError] = []
    limits = AdmissionLimits(pending=1, per_address=1, waiting=10)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: serve_listener(listener, handler, on_error=errors.append, admission=admission_for(limits, wait_timeout=60.0)))
        listener.dial("203.0.113.1:1")
        parked = listener.dial("203.0.113.1:2")
        await trio.testing.wait_all_tasks_blocked()
        await listener.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert [type(e) for e in errors] == [StreamClosed]
        assert await _closed(parked)
        nursery.cancel_scope.cancel()  # the running handler is the caller's to end
