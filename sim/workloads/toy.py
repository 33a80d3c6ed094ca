"""A toy echo service: the simulator's own test workload (not pccl).

It exercises everything the simulator does on the engine's own network and errors
(:mod:`pccl_sim.engine.errors`; it imports nothing of pccl), the smallest scenario for benchmarks and
for testing the simulator itself:

* ``master`` listens on ``master:7000`` and echoes: for each ``PING seq n`` control frame followed
  by a data frame of ``n`` bytes it answers ``PONG seq n`` and the payload reversed;
* each ``peer`` connects (retrying with backoff), says ``HELLO``, then pings every ~0.2 s with a
  random payload (its RNG), waits for the echo with a timeout, and reconnects on any failure.

Frames are ``length:u32 | kind:u8 | body`` (kind 1 control, 2 data), so the simulator's frame
sniffer reads them with :class:`pccl_sim.engine.tap.LengthKindFrames` and message triggers
("kill peer1 after it sends PING for the 3rd time") work.

Checkers: :class:`EchoIntegrity` (safety: every echo is the reversed payload),
:class:`EchoProgress` (liveness: after the quiet window's grace, every live peer got an echo).

Deliberate bugs for testing the simulator's teeth (``bug=`` parameter): ``"give_up"`` — a peer
whose session with the master ends (reset, timeout) never reconnects (a liveness failure after
any master restart); ``"no_timeout"`` — peers wait for an echo without a timeout (wedged while
the master is frozen or off, rescued only by TCP: when the machine comes back, its kernel answers
the retransmissions with RST); ``"corrupt_after:N"`` — the master flips a byte in every echo
after the N-th (a safety failure).
"""

from __future__ import annotations

import struct
from typing import Any

import trio

from ..engine.errors import SimNetworkError
from ..engine.runner import Checker, HostContext, Scenario, Simulation
from ..engine.trace import TraceEvent
from ..faults.generate import generate
from ..engine.schedule import Schedule
from ..engine.tap import LengthKindFrames

__all__ = ["EchoScenario", "EchoIntegrity", "EchoProgress", "toy_schedule", "MESSAGES"]

PORT = 7000
CONTROL, DATA = 1, 2
MESSAGES = ("HELLO", "PING", "PONG")
#: Default recovery window after the faults (virtual seconds): longer than ``grace``.
QUIET = 15.0
_PREFIX = struct.Struct(">IB")


def _name(body: bytes) -> str | None:
    word = body.split(b" ", 1)[0]
    try:
        text = word.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text in MESSAGES else None


async def _send(stream: Any, kind: int, body: bytes) -> None:
    await stream.send_all(_PREFIX.pack(len(body), kind) + body)


async def _receive(stream: Any, max_body: int = 1 << 20) -> tuple[int, bytes]:
    length, kind = _PREFIX.unpack(await stream.receive_exactly(_PREFIX.size))
    if length > max_body or kind not in (CONTROL, DATA):
        raise ValueError(f"bad frame: kind {kind}, length {length}")
    return kind, bytes(await stream.receive_exactly(length))


class EchoIntegrity(Checker):
    name = "echo-integrity"

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "corrupt":
            sim.fail("safety", f"{event.source} got a wrong echo for ping {event.data.get('seq')}", self.name)


class EchoProgress(Checker):
    """After the quiet window started and ``grace`` passed, each live peer must get an echo."""

    name = "echo-progress"

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.last_pong: dict[str, float] = {}
        self.started: dict[str, float] = {}

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "pong":
            self.last_pong[event.source] = event.t
        elif event.kind == "start":
            self.started[event.source] = event.t
            self.last_pong.pop(event.source, None)

    def at_end(self, sim: Simulation) -> None:
        deadline = sim.quiet_at + self.grace
        for name in sim.alive("peer"):
            since = max(deadline, self.started.get(name, 0.0) + self.grace)
            if since > sim.now:
                continue  # started too late to be judged
            last = self.last_pong.get(name)
            if last is None or last < sim.quiet_at:
                sim.fail("liveness", f"{name} got no echo after the faults stopped (last: {last})", self.name)


class EchoScenario(Scenario):
    """Parameters: ``peers`` (initial), ``interval`` (between pings), ``timeout`` (echo wait),
    ``max_payload``, ``grace`` (liveness bound), ``bug`` (see the module docstring)."""

    name = "toy-echo"

    def __init__(
        self,
        *,
        peers: int = 3,
        interval: float = 0.2,
        timeout: float = 1.0,
        max_payload: int = 16 * 1024,
        grace: float = 10.0,
        bug: str | None = None,
    ) -> None:
        params: dict[str, Any] = dict(peers=peers, interval=interval, timeout=timeout, max_payload=max_payload, grace=grace)
        if bug is not None:
            params["bug"] = bug
        super().__init__(**params)
        self.peers = peers
        self.interval = interval
        self.timeout = timeout
        self.max_payload = max_payload
        self.grace = grace
        self.bug = bug

    @classmethod
    def generate_schedule(
        cls, seed: int, *, profile: str = "chaos", peers: int = 3, duration: float = 20.0, quiet: float | None = None,
        **params: Any,
    ) -> tuple[EchoScenario, Schedule]:
        return toy_schedule(seed, profile=profile, peers=peers, duration=duration,
                            quiet=QUIET if quiet is None else quiet, **params)

    def frame_format(self) -> LengthKindFrames:
        return LengthKindFrames(_name, control_kind=CONTROL)

    def checkers(self) -> list[Checker]:
        return [EchoIntegrity(), EchoProgress(self.grace)]

    def on_quiet(self, sim: Simulation) -> None:
        if "master" not in sim.hosts:
            sim.spawn("master", "master")

    # -- roles --

    async def master(self, host: HostContext) -> None:
        listener = await host.network.listen(f"{host.name}:{PORT}")
        served = 0

        async def serve(stream: Any) -> None:
            nonlocal served
            try:
                async with stream:
                    while True:
                        kind, body = await _receive(stream)
                        if kind != CONTROL:
                            return
                        words = body.split()
                        if words[0] == b"PING":
                            _, payload = await _receive(stream)
                            served += 1
                            echo = bytearray(payload[::-1])
                            corrupt_after = self.bug.split(":")[1] if self.bug and self.bug.startswith("corrupt_after:") else None
                            if corrupt_after is not None and served > int(corrupt_after) and echo:
                                echo[0] ^= 0xFF
                            await _send(stream, CONTROL, b"PONG " + words[1] + b" " + words[2])
                            await _send(stream, DATA, bytes(echo))
            except (SimNetworkError, ValueError):
                pass  # the peer went away or spoke garbage: drop the connection

        async with trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                nursery.start_soon(serve, stream)

    async def peer(self, host: HostContext) -> None:
        rng = host.rng
        seq = 0
        backoff = 0.1
        while True:
            try:
                stream = await host.network.connect(f"master:{PORT}", timeout=2.0)
            except SimNetworkError as exc:
                host.record("connect_error", error=type(exc).__name__)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            try:
                async with stream:
                    await _send(stream, CONTROL, b"HELLO " + host.name.encode())
                    while True:
                        seq += 1
                        payload = rng.randbytes(rng.randint(0, self.max_payload))
                        await _send(stream, CONTROL, b"PING %d %d" % (seq, len(payload)))
                        await _send(stream, DATA, payload)
                        start = trio.current_time()
                        if self.bug == "no_timeout":
                            reply = await self._await_echo(stream)
                        else:
                            reply = None
                            with trio.move_on_after(self.timeout):
                                reply = await self._await_echo(stream)
                            if reply is None:
                                host.record("timeout", seq=seq)
                                break
                        if reply != payload[::-1]:
                            host.record("corrupt", seq=seq)
                        else:
                            host.record("pong", seq=seq, rtt=trio.current_time() - start)
                        await trio.sleep(self.interval * (0.5 + rng.random()))
            except (SimNetworkError, ValueError) as exc:
                host.record("disconnected", error=type(exc).__name__)
            if self.bug == "give_up":
                host.record("gave_up")
                await trio.sleep_forever()
            await trio.sleep(backoff)

    async def _await_echo(self, stream: Any) -> bytes:
        kind, body = await _receive(stream)
        if kind != CONTROL or not body.startswith(b"PONG"):
            raise ValueError("expected PONG")
        _, payload = await _receive(stream)
        return payload


def toy_schedule(
    seed: int,
    *,
    profile: str = "chaos",
    peers: int = 3,
    duration: float = 20.0,
    quiet: float = QUIET,
    **scenario: Any,
) -> tuple[EchoScenario, Schedule]:
    """A generated schedule for the toy, and the scenario it describes."""
    toy = EchoScenario(peers=peers, **scenario)
    schedule = generate(
        seed, profile=profile, peers=peers, duration=duration, quiet=quiet, scenario=toy.to_json(), messages=MESSAGES
    )
    return toy, schedule
