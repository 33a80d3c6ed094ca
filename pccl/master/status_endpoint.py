"""The master's status endpoint: ``/`` (HTML), ``/status.json`` and ``/metrics`` (Prometheus).

A small ASGI application served by hypercorn's Trio worker inside the master's nursery.  Every
request reads one snapshot (:func:`pccl.protocol.status.snapshot`, synchronous, a few
microseconds per peer) and renders it; nothing here awaits the master's votes or holds anything
the master's tasks need, so a polled page cannot slow the run down beyond the CPU its requests
cost.

Authentication: when the run has a token, every path — ``/metrics`` included, since it names
groups and counts the run's peers — requires it, as ``Authorization: Bearer <token>`` (what
Prometheus sends with ``authorization: {credentials: <token>}`` or ``bearer_token``) or HTTP
basic auth with the token as the password (what a browser prompts for; any user name).  The
comparison takes constant time.  The endpoint speaks plain HTTP: keep it on loopback (the
default) or a private network, or put it behind an ssh tunnel or a TLS-terminating proxy, since
the token crosses the wire in clear.
"""

from __future__ import annotations

import base64
import errno
import binascii
import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import trio

from ..errors import AddressInUse, InvalidArgument, TransportError
from ..net.base import parse_address
from ..protocol.handshake import normalize_token
from .status_page import render_html

__all__ = ["StatusApp", "serve_status", "DEFAULT_STATUS_HOST", "REFRESH_SECONDS"]

log = logging.getLogger(__name__)

#: Where ``--status PORT`` (no host) binds: loopback, so the page is not public by accident.
DEFAULT_STATUS_HOST = "127.0.0.1"
#: How often the HTML page reloads itself.
REFRESH_SECONDS = 2.0

_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class _Metrics:
    """A prometheus_client collector over one master's status (registered in its own registry,
    so that several masters in one process, and tests, never collide)."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._status()
        yield GaugeMetricFamily("pccl_master_uptime_seconds", "Seconds since this master started",
                                value=s["master"]["uptime_s"])
        peers = GaugeMetricFamily("pccl_master_peers", "Connections by state", labels=["state"])
        accepted = sum(len(g["peers"]) for g in s["groups"])
        registered = sum(len(g["pending"]) for g in s["groups"])
        peers.add_metric(["accepted"], accepted)
        peers.add_metric(["registered"], registered)
        peers.add_metric(["connected"], s["connections"]["unregistered"])
        yield peers
        world = GaugeMetricFamily("pccl_master_world_size", "Accepted peers per group", labels=["group"])
        revision = GaugeMetricFamily("pccl_master_group_revision",
                                     "Shared-state revision adopted at the group's last sync", labels=["group"])
        running = GaugeMetricFamily("pccl_master_collectives_in_flight", "Collectives voting or running per group",
                                    labels=["group"])
        for g in s["groups"]:
            world.add_metric([str(g["group"])], g["world_size"])
            running.add_metric([str(g["group"])], len(g["collectives"]))
            if g["revision"] is not None:
                revision.add_metric([str(g["group"])], g["revision"])
        yield world
        yield revision
        yield running
        votes = GaugeMetricFamily("pccl_master_votes_in_progress", "Votes and rounds in progress by kind",
                                  labels=["kind"])
        for kind, n in s["votes_in_progress"].items():
            votes.add_metric([kind], n)
        yield votes
        c = s["counters"]
        yield CounterMetricFamily("pccl_master_ops_completed", "Collectives completed", value=c["ops_completed"])
        yield CounterMetricFamily("pccl_master_ops_aborted", "Collectives aborted", value=c["ops_aborted"])
        yield CounterMetricFamily("pccl_master_syncs_completed", "Shared-state syncs completed (per group)",
                                  value=c["syncs_completed"])
        yield CounterMetricFamily("pccl_master_joins", "Peer registrations", value=c["joins"])
        removed = CounterMetricFamily("pccl_master_peers_removed",
                                      "Peers removed, by kick reason (or CONNECTION_LOST, LEFT)", labels=["reason"])
        for reason, n in c["removals"].items():
            removed.add_metric([reason], n)
        yield removed
        payload = CounterMetricFamily("pccl_master_reported_payload_bytes",
                                      "All-reduce and shared-state payload bytes the peers reported",
                                      labels=["direction"])
        payload.add_metric(["tx"], c["reported_tx_bytes"])
        payload.add_metric(["rx"], c["reported_rx_bytes"])
        pairs = GaugeMetricFamily("pccl_master_pairs", "Peer pairs (opener, target, port) by the path their "
                                  "connections take", labels=["path"])
        for kind, n in s.get("paths", {}).items():
            pairs.add_metric([kind], n)
        yield pairs
        yield GaugeMetricFamily("pccl_master_relays", "Relays serving the run", value=len(s.get("relays", [])))
        yield CounterMetricFamily("pccl_master_relayed_bytes", "Bytes the run's relays forwarded (as they reported)",
                                  value=sum(r["forwarded_bytes"] for r in s.get("relays", [])))
        yield payload


class StatusApp:
    """The ASGI application.  ``status`` returns the current snapshot (a plain dict)."""

    def __init__(self, status: Callable[[], dict[str, Any]], *, token: str | bytes | None = None,
                 refresh: float = REFRESH_SECONDS) -> None:
        from prometheus_client import CollectorRegistry

        self._status = status
        self._token = normalize_token(token)
        self._refresh = refresh
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(status))  # type: ignore[arg-type]

    @property
    def token_required(self) -> bool:
        return self._token is not None

    def authorized(self, header: bytes | None) -> bool:
        """Whether an ``Authorization`` header value proves the token (always, without one)."""
        if self._token is None:
            return True
        if not header:
            return False
        scheme, _, credentials = header.partition(b" ")
        scheme = scheme.lower()
        credentials = credentials.strip()
        if scheme == b"bearer":
            offered = credentials
        elif scheme == b"basic":
            try:
                offered = base64.b64decode(credentials, validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
        else:
            return False
        return hmac.compare_digest(offered, self._token)

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return  # websockets: nothing here (hypercorn closes the connection)
        status, content_type, body, extra = self._respond(scope)
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                   (b"cache-control", b"no-store"), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    def _respond(self, scope: _Scope) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        text = b"text/plain; charset=utf-8"
        if scope["method"] not in ("GET", "HEAD"):
            return 405, text, b"method not allowed\n", [(b"allow", b"GET, HEAD")]
        path = scope["path"]
        if path not in ("/", "/status.json", "/metrics"):
            return 404, text, b"not found: try /, /status.json or /metrics\n", []
        auth = dict(scope["headers"]).get(b"authorization")
        if not self.authorized(auth):
            log.info("status request for %s from %s refused: %s", path, scope.get("client"),
                     "wrong token" if auth else "no token")
            return 401, text, b"this run requires its token (bearer, or basic auth with the token as password)\n", [
                (b"www-authenticate", b'Basic realm="pccl", charset="UTF-8"')]
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST.encode(), generate_latest(self.registry), []
        snapshot = self._status()
        if path == "/status.json":
            return 200, b"application/json", json.dumps(snapshot, indent=1).encode(), []
        return 200, b"text/html; charset=utf-8", render_html(snapshot, refresh=self._refresh).encode(), []


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def split_status_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (loopback) → (host, port); ``InvalidArgument`` otherwise."""
    if address.isdigit():
        host, port = DEFAULT_STATUS_HOST, int(address)
    else:
        host, port = parse_address(address)
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"status address {address!r}: port out of range")
    return host, port


async def serve_status(address: str, app: StatusApp, *,
                       task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``address`` (``HOST:PORT``, or ``PORT`` for loopback) until cancelled;
    ``nursery.start`` returns the bound ``host:port``.  ``AddressInUse``/``TransportError`` if it
    cannot bind."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve

    host, port = split_status_address(address)
    if not app.token_required and not _is_loopback(host):
        log.warning("the status page on %s needs no token (the run has none): anyone who can reach it sees the run",
                    address)
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.errorlog = logging.getLogger(__name__ + ".http")  # no handlers of its own: cli.py's
    config.accesslog = None
    config.graceful_timeout = 0.5

    class _Started:  # hypercorn reports its bound URLs; the caller wants ``host:port``
        def started(self, binds: list[str]) -> None:
            where = binds[0].partition("://")[2]
            log.info("status page on http://%s/ (also /status.json, /metrics)", where)
            task_status.started(where)

    try:
        await serve(app, config, task_status=_Started(), mode="asgi")  # type: ignore[arg-type]
    except* OSError as group:
        exc: BaseException = group
        while isinstance(exc, BaseExceptionGroup):  # hypercorn's nurseries nest the bind error
            exc = exc.exceptions[0]
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            raise AddressInUse(f"status address {address} is in use") from exc
        raise TransportError(f"cannot serve the status page on {address}: {exc}") from exc
