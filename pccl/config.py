"""Tunable settings of a communicator or master, as one frozen record."""

from __future__ import annotations

import dataclasses
import os
import ssl
from collections.abc import Iterable, Mapping
from typing import Literal

from .errors import InvalidArgument
from .protocol.algorithms import parse_algorithm
from .protocol.paths import parse_advertise
from .protocol.topology import MAX_LANES, lanes_for_link

__all__ = ["Config", "DEFAULT_MASTER_PORT", "MIN_SOCKET_BUFFER_SIZE", "TLS_ENV", "ADVERTISE_ENV", "tls_contexts"]

DEFAULT_MASTER_PORT = 48148
#: The smallest nonzero socket buffer size accepted: loopback's segments are 64 KiB, and a
#: buffer much smaller than a segment makes a 4 MiB transfer take seconds instead of a millisecond.
MIN_SOCKET_BUFFER_SIZE = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings shared by masters and peers.  All durations are in seconds.

    Construct with keyword arguments; ``dataclasses.replace`` derives variants.
    """

    #: A peer that sends nothing (not even a heartbeat) for this long is removed by the master,
    #: and a peer that hears nothing from the master for this long declares it unreachable.
    peer_timeout: float = 10.0
    #: Interval between heartbeats on the master connection.
    heartbeat_interval: float = 1.0
    #: Time allowed to establish a TCP connection (plus handshake).
    connect_timeout: float = 10.0
    #: Time an accepted connection has, once it holds a handshake slot, to deliver the first
    #: bytes of its handshake (the TLS handshake, if any, and the preamble); a dialler sends them
    #: at once, so only an idle or crawling connection misses it.  The rest of the handshake has
    #: until ``connect_timeout`` (the shorter of the two applies).  Keeps a flood of idle
    #: connections from holding the slots that legitimate diallers need (:mod:`pccl.net.serving`).
    first_bytes_timeout: float = 2.0
    #: How long a peer that lost its master keeps trying to reconnect to the same address (a
    #: restarted master) before its calls raise ``MasterUnreachable``; 0: give up at once.
    #: Meanwhile it keeps its state and listeners, and calls wait.
    master_reconnect_timeout: float = 60.0
    #: Bounds of the jittered exponential backoff between reconnection attempts.
    master_reconnect_backoff: tuple[float, float] = (0.1, 2.0)
    #: How long :func:`~pccl.open_communicator` keeps dialling a master that does not answer yet
    #: (connection refused, host unreachable, name not resolvable yet, no answer within
    #: ``connect_timeout``), with the backoff of ``master_reconnect_backoff``, before it raises
    #: ``MasterUnreachable``; 0: fail at once.  A cluster can then start in any order.  A master
    #: that answers and refuses (token, TLS, protocol) ends the wait at once.
    master_wait_timeout: float = 60.0
    #: Largest control frame accepted, in bytes; a larger announced length is refused before
    #: any allocation.
    max_frame_size: int = 16 * 1024 * 1024
    #: The local address a peer's listeners (p2p and shared state) bind to; None: every
    #: interface of the master address's family (``0.0.0.0``, or ``::`` for an IPv6 master).
    #: The master gives the other peers the address it sees this peer's connection come from,
    #: so bind to that one (a warning says when they differ).  See "Ports" in
    #: ``docs/operating.rst``.
    bind_host: str | None = None
    #: What other peers dial to reach this one, when that differs from what it binds (a
    #: rented host whose provider maps its ports to other numbers, a public address in front of
    #: a private interface): a bare host (the bound ports at that host), or
    #: ``"p2p=HOST:PORT,shared_state=HOST:PORT,benchmark=HOST:PORT"`` with any subset of the
    #: kinds (``KIND=PORT`` alone: the host the master sees).  ``None``: ``$PCCL_ADVERTISE`` when
    #: :func:`~pccl.open_communicator` uses real TCP, else nothing.  The peer registers these
    #: and its interface addresses besides the address the master observes; see "Firewalls,
    #: NAT and relays" in ``docs/operating.rst`` (and :mod:`pccl.protocol.paths`).
    advertise: str | None = None
    #: How long a dialler tries another peer's candidates (staggered, the first that answers
    #: wins) before it asks the master to have that peer dial back, and how long a peer asked
    #: to dial back tries before the master moves the pair to a relay.
    direct_connect_timeout: float = 3.0
    #: Base ports for a peer's listeners; when taken, the next free port above is used.
    p2p_base_port: int = 48150
    shared_state_base_port: int = 48149
    benchmark_base_port: int = 48151
    #: How many ports above a base port are tried before giving up.
    port_search_range: int = 512
    #: Connections ("lanes") each peer opens to its ring successor per topology round; an
    #: all-reduce stripes its sub-chunks over them.  Must be the same on every peer of a run.
    #: ``"auto"``: sized per ring edge from its measured bandwidth and RTT so that one
    #: connection's window (``p2p_lane_window``) does not cap the edge
    #: (:func:`pccl.protocol.topology.lanes_for_link`); one lane on an edge not measured yet.
    p2p_lanes: int | Literal["auto"] = 1
    #: Which algorithm every all-reduce runs: ``"auto"`` (chosen per op from its size, the world
    #: and the links: :func:`pccl.protocol.algorithms.choose_all_reduce`, see
    #: ``docs/collectives.rst``), or ``"ring"``, ``"recursive_doubling"``, ``"halving_doubling"``,
    #: ``"hierarchical"`` (forced wherever it can run; quantized and segmented ops always take
    #: the ring, and so does ``"hierarchical"`` on a ring without even sites).  With
    #: ``"ring"`` no partner links are wired.  Must be the same on every peer of a run: ring
    #: neighbours whose settings differ both fail with ``InvalidUsage`` when they connect.
    all_reduce_algorithm: str = "auto"
    #: The bytes one connection keeps in flight (its TCP window), which caps it at
    #: ``window / RTT``; used only by ``p2p_lanes="auto"``.  Linux autotunes receive windows up
    #: to ``net.ipv4.tcp_rmem``'s maximum (6 MiB by default, of which about 4 MiB is window);
    #: with ``socket_buffer_size`` set, about that.
    p2p_lane_window: int = 4 << 20
    #: ``optimize_topology``: how long each bandwidth probe streams data, and over how many
    #: parallel connections (so that one connection's window does not cap the figure).
    probe_seconds: float = 1.0
    probe_streams: int = 8
    #: Socket buffer sizes requested for every connection (bytes, 0 or at least 64 KiB: below
    #: loopback's segment size transfers crawl); 0 (the default) keeps the OS default and its
    #: autotuning (``local_socket_buffer_size`` for same-host connections).
    #: Set it for links whose bandwidth-delay product exceeds the OS's autotuning limit
    #: (``net.ipv4.tcp_rmem``); a fixed size well above that product only costs cache misses.
    socket_buffer_size: int = 0
    #: The socket buffer size for connections between two processes of one host (the remote
    #: address is a loopback address or the socket's own), used while ``socket_buffer_size``
    #: is 0; 0 keeps the OS default there too (else at least 64 KiB).  Such a link's
    #: bandwidth-delay product is tiny, so a small buffer costs no throughput, and it keeps the
    #: bytes in flight in the CPU's caches: Linux's autotuning grows loopback buffers to
    #: megabytes, so the receiver's copy out of them reads memory the sender wrote long before.
    #: 256 KiB (which Linux doubles, up to ``net.core.rmem_max``/``wmem_max``) made 64-256 MiB
    #: all-reduces of 2-4 processes on one 2-core host 15-40% faster than autotuning
    #: (``benchmarks/allreduce.py --local-socket-buffer-size``).
    local_socket_buffer_size: int = 256 * 1024
    #: Optional TLS: a client-side context for outgoing and a server-side one for incoming
    #: connections.  Both or neither; :meth:`with_tls` builds them from PEM files.
    tls_client_context: ssl.SSLContext | None = None
    tls_server_context: ssl.SSLContext | None = None
    #: Whether all-reduce kernels over large slices may run in worker threads (the GIL is
    #: released, so reduction overlaps the transfers).  The simulator sets False: a simulated
    #: run must not start real threads.
    kernel_threads: bool = True
    #: A collective that this peer starts with no other in flight, on a ring no op failed on
    #: since its topology round, begins at once with a one-way ``CollectiveBegin`` instead of
    #: waiting for the master's vote (one master round trip per collective instead of two;
    #: docs/protocol.rst, "Design: one master round trip per collective").  Concurrent calls
    #: and all-gathers still vote.  On by default; off: every collective is voted.  Peers of
    #: one run may differ.
    fast_commit: bool = True
    #: Completion agreed among peers (docs/protocol.rst, "Design: completion agreed among
    #: peers"): a collective that takes the fast path (``fast_commit``) exchanges acks with its
    #: ring neighbours once its result is in and returns as soon as every participant is known
    #: ready, without waiting for the master's verdict; the master is asked only when this peer
    #: is in doubt (a neighbour silent for ``peer_timeout``, a query).  The master must support
    #: it (a master that does not is refused at registration, ``ProtocolError``).  Off by
    #: default; needs ``fast_commit``.  Peers of one run may differ.
    peer_commit: bool = False

    def __post_init__(self) -> None:
        if (self.peer_timeout <= 0 or self.heartbeat_interval <= 0 or self.connect_timeout <= 0
                or self.first_bytes_timeout <= 0 or self.direct_connect_timeout <= 0):
            raise InvalidArgument("timeouts and intervals must be positive")
        if self.advertise is not None:
            parse_advertise(self.advertise)  # InvalidArgument naming what is wrong
        try:
            parse_algorithm(self.all_reduce_algorithm)
        except ValueError as exc:
            raise InvalidArgument(f"Config.{exc}") from None
        if self.peer_commit and not self.fast_commit:
            raise InvalidArgument("peer_commit needs fast_commit: only begun ops commit among their peers")
        if self.master_reconnect_timeout < 0:
            raise InvalidArgument("master_reconnect_timeout must be 0 (no reconnection) or positive")
        if self.master_wait_timeout < 0:
            raise InvalidArgument("master_wait_timeout must be 0 (fail at once) or positive")
        low, high = self.master_reconnect_backoff
        if not 0 < low <= high:
            raise InvalidArgument("master_reconnect_backoff must be (first, longest) delays with 0 < first <= longest")
        if self.heartbeat_interval >= self.peer_timeout:
            raise InvalidArgument("heartbeat_interval must be shorter than peer_timeout")
        lanes = self.p2p_lanes
        if isinstance(lanes, str):
            if lanes != "auto":
                raise InvalidArgument(f'p2p_lanes must be an int between 1 and {MAX_LANES} or "auto", got {lanes!r}')
        elif not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= MAX_LANES:
            raise InvalidArgument(f'p2p_lanes must be an int between 1 and {MAX_LANES} or "auto", got {lanes!r}')
        window = self.p2p_lane_window
        if not isinstance(window, int) or isinstance(window, bool) or window < MIN_SOCKET_BUFFER_SIZE:
            raise InvalidArgument(f"p2p_lane_window must be an int of at least {MIN_SOCKET_BUFFER_SIZE} bytes, "
                                  f"got {window!r}")
        for name in ("socket_buffer_size", "local_socket_buffer_size"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool):
                raise InvalidArgument(f"{name} must be an int (bytes), got {size!r}")
            if size != 0 and size < MIN_SOCKET_BUFFER_SIZE:
                raise InvalidArgument(
                    f"{name} must be 0 (the OS default) or at least {MIN_SOCKET_BUFFER_SIZE} bytes, got {size}"
                )
        if not (isinstance(self.probe_seconds, (int, float)) and 0 < self.probe_seconds <= 60):
            raise InvalidArgument(f"probe_seconds must be in (0, 60], got {self.probe_seconds!r}")
        if not isinstance(self.probe_streams, int) or isinstance(self.probe_streams, bool) or \
                not 1 <= self.probe_streams <= MAX_LANES:
            raise InvalidArgument(f"probe_streams must be an int between 1 and {MAX_LANES}, got {self.probe_streams!r}")
        if self.max_frame_size < 1024:
            raise InvalidArgument("max_frame_size must be at least 1024 bytes")
        for name in ("p2p_base_port", "shared_state_base_port", "benchmark_base_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise InvalidArgument(f"{name} must be a port number, got {port}")
        host = self.bind_host
        if host is not None and (not isinstance(host, str) or not host or any(c in host for c in "[] \t/")):
            raise InvalidArgument(f"bind_host must be None or a host name or IP address without brackets or port, "
                                  f"got {host!r}")
        if (self.tls_client_context is None) != (self.tls_server_context is None):
            raise InvalidArgument("set both tls_client_context and tls_server_context, or neither")

    def lanes_for(self, bandwidth: float | None = None, rtt: float | None = None) -> int:
        """The lanes of a ring edge: ``p2p_lanes`` when fixed; with ``"auto"``, sized from the
        edge's measured ``bandwidth`` (bytes/s) and ``rtt`` (s), one lane when unmeasured.  A
        figure at the probe's own window cap (``probe_streams`` windows per RTT) gets the most."""
        if isinstance(self.p2p_lanes, int):
            return self.p2p_lanes
        if not bandwidth or rtt is None:
            return 1
        return lanes_for_link(bandwidth, rtt, self.p2p_lane_window, probe_streams=self.probe_streams)

    def ring_lanes(self, figures: Iterable[tuple[float, float]]) -> int:
        """The lanes of every edge of a ring whose edges measured ``(bandwidth, rtt)`` each
        (bandwidth 0: unmeasured): the most any edge needs.  The data path stripes each op over
        the same lanes in both directions, and every peer derives the same count from the
        master's figures."""
        return max((self.lanes_for(bw, rtt) for bw, rtt in figures), default=self.lanes_for())

    def with_tls(self, *, cert: str, key: str, ca: str | None = None) -> Config:
        """This config with TLS on every connection, from PEM files (:func:`tls_contexts`).

        Every party of a run needs all three in practice: the master and each peer accept
        connections (with ``cert``/``key``) and dial them (trusting ``ca``).
        """
        client, server = tls_contexts(cert=cert, key=key, ca=ca)
        return dataclasses.replace(self, tls_client_context=client, tls_server_context=server)

    def with_tls_from_env(self, environ: Mapping[str, str] | None = None) -> Config:
        """:meth:`with_tls` from ``$PCCL_TLS_CERT``, ``$PCCL_TLS_KEY`` and ``$PCCL_TLS_CA`` (this
        config unchanged when none is set; ``InvalidArgument`` when only some of CERT/KEY are)."""
        env = os.environ if environ is None else environ
        cert, key, ca = (env.get(name) or None for name in TLS_ENV)
        if cert is None and key is None:
            if ca is not None:
                raise InvalidArgument("$PCCL_TLS_CA is set without $PCCL_TLS_CERT and $PCCL_TLS_KEY: TLS needs all "
                                      "of a run's parties to hold a certificate and its key")
            return self
        if cert is None or key is None:
            raise InvalidArgument("set both $PCCL_TLS_CERT and $PCCL_TLS_KEY (and $PCCL_TLS_CA) to switch TLS on")
        return self.with_tls(cert=cert, key=key, ca=ca)


#: The environment variables :meth:`Config.with_tls_from_env` reads: certificate, key, CA.
TLS_ENV = ("PCCL_TLS_CERT", "PCCL_TLS_KEY", "PCCL_TLS_CA")
#: The environment variable :func:`~pccl.open_communicator` reads for ``Config.advertise`` (real TCP only).
ADVERTISE_ENV = "PCCL_ADVERTISE"


def _readable(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise InvalidArgument(f"TLS {what} file {path!r} does not exist")
    if not os.path.isfile(path):
        raise InvalidArgument(f"TLS {what} file {path!r} is not a file")
    if not os.access(path, os.R_OK):
        raise InvalidArgument(f"TLS {what} file {path!r} is not readable by this user")


def tls_contexts(*, cert: str, key: str, ca: str | None = None) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(client, server) TLS contexts for :class:`Config` from PEM files.

    ``cert`` (this party's certificate chain) and ``key`` (its private key) serve incoming
    connections; outgoing ones verify the other side's certificate and host name against ``ca``
    (the run's CA bundle; None: the system's trusted CAs).  Clients are not asked for
    certificates: the run token authenticates peers.  ``InvalidArgument`` naming the file when
    one is missing, unreadable, not PEM, or the key does not match the certificate.
    """
    _readable(cert, "certificate")
    _readable(key, "key")
    if ca is not None:
        _readable(ca, "CA")
    for path, marker, what in ((cert, b"-----BEGIN CERTIFICATE-----", "a PEM certificate"),
                               (key, b"PRIVATE KEY-----", "a PEM private key")):
        with open(path, "rb") as f:
            if marker not in f.read():
                raise InvalidArgument(f"TLS file {path!r} does not hold {what}")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        server.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise InvalidArgument(f"TLS key {key!r} does not match the certificate {cert!r}") from exc
        raise InvalidArgument(f"cannot load the TLS certificate {cert!r} with the key {key!r} (both must be "
                              f"PEM; is the key encrypted?): {exc.reason or exc}") from exc
    except OSError as exc:
        raise InvalidArgument(f"cannot read the TLS certificate {cert!r} or key {key!r}: {exc}") from exc
    try:
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except ssl.SSLError as exc:
        raise InvalidArgument(f"TLS CA file {ca!r} holds no PEM certificate: {exc.reason or exc}") from exc
    except OSError as exc:
        raise InvalidArgument(f"cannot read the TLS CA file {ca!r}: {exc}") from exc
    return client, server
