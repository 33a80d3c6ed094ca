"""Bandwidth probes: the runtime side of ``optimize_topology`` (the master solves the ring).

A prober measures each target the master names (``ProbeRequest``), one target after the other
(the master orders the targets in waves so that probes do not pile onto one peer), and reports
every result at once (``ProbeReport``).  One probe opens ``Config.probe_streams`` connections to
the target's p2p port over the pair's path (:mod:`pccl._peer.connector`: a probe of a relayed
pair measures the relay) — each an authenticated framed connection like a ring lane, so a wrong
run token is refused as anywhere else — sends ``ProbeHello`` on each and times its ``ProbeAck`` (the
least of these times is the RTT), then streams data frames on all of them for
``Config.probe_seconds`` and ends each with ``ProbeEnd``; the target answers ``ProbeEndAck``
with the bytes it received.  The bandwidth is the bytes the target received over the time from
the first data frame to the last acknowledgement less one RTT, so parallel streams, not one
connection's window, set the figure.

Every probe is bounded: ``connect_timeout + 2 * probe_seconds`` for the prober, the same for the
target's side.  A probe that fails or runs out of time reports bandwidth 0, which the master
counts as a very slow link, never as a failed vote.
"""

from __future__ import annotations

import logging
import math

import trio

from .._groups import single_exception
from .host import PeerHost
from ..config import Config
from ..errors import PCCLError, ProtocolError
from ..net.framed import FramedConnection
from ..protocol import messages as m
from ..protocol.codec import DataHeader
from ..protocol.paths import Port

__all__ = ["ProbeService", "probe_bound"]

log = logging.getLogger(__name__)

#: Payload of one probe data frame: large enough that per-frame costs do not cap loopback.
_FRAME_BYTES = 1 << 20
_ZEROS = bytes(_FRAME_BYTES)


def probe_bound(config: Config) -> float:
    """How long one probe may take, on either end."""
    return config.connect_timeout + 2 * config.probe_seconds


class ProbeService:
    """Runs this peer's probes and answers other peers' probes (one per communicator)."""

    def __init__(self, host: PeerHost) -> None:
        self._host = host

    async def run(self, request: m.ProbeRequest) -> m.ProbeReport:
        """Probe every target of ``request`` in order; never raises for a failed probe."""
        results = []
        for target in request.targets:
            results.append(await self._probe(request.probe, target))
        return m.ProbeReport(request.probe, tuple(results))

    async def _probe(self, probe_id: int, target: m.PeerEndpoint) -> m.ProbeResult:
        host = self._host
        failed = m.ProbeResult(target.peer_id, 0.0, 0.0)
        with trio.move_on_after(probe_bound(host.config)) as scope:
            try:
                result = await self._measure(probe_id, target)
            except PCCLError as exc:
                log.info("peer %x: probe of peer %x failed: %s", host.peer_id, target.peer_id, exc)
                return failed
        if scope.cancelled_caught:
            log.info("peer %x: probe of peer %x did not finish within %.3g s", host.peer_id, target.peer_id,
                     probe_bound(host.config))
            return failed
        log.debug("peer %x: probe of peer %x: %.4g MB/s, RTT %.3g ms", host.peer_id, target.peer_id,
                  result.bandwidth / 1e6, result.rtt * 1e3)
        return result

    async def _measure(self, probe_id: int, target: m.PeerEndpoint) -> m.ProbeResult:
        host = self._host
        streams = host.config.probe_streams
        conns: list[FramedConnection | None] = [None] * streams
        rtts = [math.inf] * streams
        received = [0] * streams
        try:
            try:
                async with trio.open_nursery() as nursery:
                    for i in range(streams):
                        nursery.start_soon(self._open, target, probe_id, i, conns, rtts)
                start = trio.current_time()
                async with trio.open_nursery() as nursery:
                    for i, conn in enumerate(conns):
                        assert conn is not None
                        nursery.start_soon(self._stream, conn, probe_id, i, start + host.config.probe_seconds,
                                           received)
            except BaseExceptionGroup as group:
                raise single_exception(group) from None
            elapsed = trio.current_time() - start
        finally:
            for conn in conns:
                if conn is not None:
                    conn.abort()
        rtt = min(rtts)
        return m.ProbeResult(target.peer_id, sum(received) / max(elapsed - rtt, 1e-9), rtt)

    async def _open(self, target: m.PeerEndpoint, probe_id: int, stream: int,
                    conns: list[FramedConnection | None], rtts: list[float]) -> None:
        host = self._host
        conn = await host.open_peer(target, Port.BENCHMARK)
        conns[stream] = conn
        sent = trio.current_time()
        await conn.send(m.ProbeHello(host.peer_id, probe_id, stream, host.master_instance))
        ack = await conn.receive()
        if not isinstance(ack, m.ProbeAck) or ack.peer_id != target.peer_id:
            raise ProtocolError(f"peer {target.peer_id:x} answered a probe hello with {ack!r}")
        rtts[stream] = trio.current_time() - sent

    @staticmethod
    async def _stream(conn: FramedConnection, probe_id: int, stream: int, until: float, received: list[int]) -> None:
        step = 0
        while trio.current_time() < until:
            # op_seq 0: no collective has it, so a probe frame is never taken for one of their frames
            await conn.send_data(DataHeader(0, stream, step, 0, _FRAME_BYTES), _ZEROS)
            step += 1
        await conn.send(m.ProbeEnd())
        end = await conn.receive()
        if not isinstance(end, m.ProbeEndAck):
            raise ProtocolError(f"a probed peer answered ProbeEnd with {end!r}")
        received[stream] = end.nbytes

    async def serve(self, conn: FramedConnection, hello: m.ProbeHello) -> None:
        """Answer one probe stream on an accepted, authenticated connection (the p2p listener
        hands it over after reading ``hello``).  Bounded by :func:`probe_bound`; closes ``conn``."""
        host = self._host
        try:
            with trio.fail_after(probe_bound(host.config)):
                await conn.send(m.ProbeAck(host.peer_id))
                nbytes = 0
                while True:
                    frame = await conn.receive_frame()
                    if isinstance(frame, DataHeader):
                        nbytes += frame.nbytes
                        await conn.discard_data()
                    elif isinstance(frame, m.ProbeEnd):
                        await conn.send(m.ProbeEndAck(nbytes))
                        await conn.aclose()
                        return
                    else:
                        raise ProtocolError(f"unexpected {type(frame).__name__} in a probe stream")
        except (PCCLError, trio.TooSlowError) as exc:
            log.info("peer %x: probe stream from peer %x ended: %s", host.peer_id, hello.peer_id,
                     exc if isinstance(exc, PCCLError) else f"not finished within {probe_bound(host.config):.3g} s")
        finally:
            conn.abort()
