"""How one peer reaches another: candidates, the order a dialler tries them in, and paths
(sans-IO, both roles).

Rules
=====

Candidates.  A peer is reachable, for each kind of connection (:class:`Port`), at
*candidates*: an address (host and port) with an origin (:class:`CandidateOrigin`).

* **Observed**: the host the master sees the peer's connection come from, with the port the
  peer bound.  The master knows it; nobody registers it.  Behind NAT it is the NAT's public
  address, where nothing of the peer listens unless the ports are forwarded with the same
  numbers.
* **Advertised**: what ``Config.advertise`` (or ``$PCCL_ADVERTISE``) says — a bare host (the
  others dial it at the bound ports), or ``p2p=HOST:PORT,shared_state=HOST:PORT,
  benchmark=HOST:PORT`` with any subset of the kinds (``kind=PORT`` alone means the observed
  host at that port, for a host whose provider maps ports but keeps its address).  Kinds the
  advertisement leaves out keep only the other candidates.
* **Local**: the peer's interface addresses (:meth:`pccl.net.base.Network.local_addresses`)
  with the bound ports, loopback, link-local and unspecified addresses left out; only the
  ``Config.bind_host`` when the listeners are bound to one.  Two peers behind one NAT reach each
  other there.

Dial order (:func:`dial_order`), for a dialler whose own connection the master observed from
``own_public_host``:

1. when the target was observed from the same public host (both behind one NAT, or on one
   machine): the target's local candidates first, then advertised, then observed;
2. otherwise: advertised, then observed, then local.

Duplicates (the same host and port) are tried once, at their first place.  A ``BENCHMARK``
connection (a bandwidth probe) is served by the p2p listener: without a benchmark candidate of
its own it uses the p2p candidates.  The dialler starts the next candidate when the previous
one failed or had a head start of :data:`STAGGER` seconds (Happy Eyeballs, RFC 8305); the first
connection that completes the handshake *and* is answered by the peer it wants (``Knock`` →
``KnockAck``) wins, and the others are closed.

Paths.  The connections one peer opens to another, per kind, take one path, decided the first
time and kept until a connection over it cannot be made (:class:`PathKind`): ``DIRECT`` (a
candidate answered), ``REVERSED`` (none did: the master asked the target to dial the opener's
p2p port, and the connection serves the opener as if it had dialled), ``RELAYED`` (neither
could: both dialled a relay that splices their byte streams).  A path that fails is negotiated
again from the start (direct first); a relay that failed is avoided the next time.  The opener
reports every decision to the master (``PathReport``), which logs it once, shows it on the
status page and counts it in ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections.abc import Iterable, Mapping

from ..errors import InvalidArgument
from . import messages as m

__all__ = ["Port", "PathKind", "CandidateOrigin", "Advertise", "Dial", "STAGGER", "parse_advertise",
           "advertised_candidates", "resolve_candidates", "local_candidates", "dial_order", "is_local_candidate_host", "describe_port",
           "format_host_port", "relayed_via", "relay_of_via"]

#: Head start of one candidate before the next one is tried alongside (RFC 8305 suggests 250 ms).
STAGGER = 0.25


class Port(enum.IntEnum):
    """The kinds of connection between peers (``Knock.port``, ``Candidate.kind``)."""

    P2P = 0  # ring lanes, on the p2p listener
    SHARED_STATE = 1  # shared-state fetches, on the shared-state listener
    BENCHMARK = 2  # bandwidth probes; served by the p2p listener


class PathKind(enum.IntEnum):
    """The path of an opener's connections to a target (``PathReport.kind``)."""

    DIRECT = 1
    REVERSED = 2
    RELAYED = 3


class CandidateOrigin(enum.IntEnum):
    OBSERVED = 0
    ADVERTISED = 1
    LOCAL = 2


#: How the configuration spells each kind (``p2p=...,shared_state=...,benchmark=...``).
_KIND_NAMES = {"p2p": Port.P2P, "shared_state": Port.SHARED_STATE, "benchmark": Port.BENCHMARK}


def format_host_port(host: str, port: int) -> str:
    """``host:port``, IPv6 hosts bracketed (as :func:`pccl.net.base.format_address`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def relayed_via(relay_id: int, address: str) -> str:
    """What a relayed path reports as its ``via``: ``"relay 3 at 198.18.0.3:48147"``."""
    return f"relay {relay_id} at {address}"


def relay_of_via(via: str) -> int | None:
    """The relay id a relayed path's ``via`` names (:func:`relayed_via`), or None."""
    words = via.split(" ", 3)
    if len(words) >= 3 and words[0] == "relay" and words[1].isdigit() and words[2] == "at":
        return int(words[1])
    return None


def describe_port(port: int) -> str:
    """``"p2p"``, ``"shared_state"`` or ``"benchmark"`` (logs and error messages)."""
    for name, kind in _KIND_NAMES.items():
        if kind == port:
            return name
    return f"port kind {port}"


@dataclasses.dataclass(frozen=True)
class Advertise:
    """A parsed advertisement: ``host`` for a bare host (every kind at its bound port), else
    ``endpoints``: kind -> (host or ``None`` for the observed host, port)."""

    host: str | None = None
    endpoints: Mapping[Port, tuple[str | None, int]] = dataclasses.field(default_factory=dict)
    #: Where it came from, for error messages (``Config.advertise``, ``$PCCL_ADVERTISE``).
    source: str = "Config.advertise"

    def describe(self) -> str:
        if self.host is not None:
            return self.host
        return ",".join(f"{describe_port(k)}={h or ''}:{p}" for k, (h, p) in sorted(self.endpoints.items()))


def _check_host(host: str, text: str, source: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c in host for c in " \t/[]=,") or (":" in host and not _is_ip(host)):
        raise InvalidArgument(f"{source}={text!r}: {host!r} is not a host name or IP address")
    return host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _split_host_port(item: str, text: str, source: str) -> tuple[str | None, int]:
    if item.isdigit():
        host: str | None = None
        port_text = item
    elif item.startswith("["):
        inner, sep, rest = item[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise InvalidArgument(f"{source}={text!r}: malformed IPv6 endpoint {item!r}; write [HOST]:PORT")
        host, port_text = _check_host(inner, text, source), rest[1:]
    else:
        head, sep, port_text = item.rpartition(":")
        if not sep:
            raise InvalidArgument(f"{source}={text!r}: {item!r} has no port; write HOST:PORT or PORT")
        host = None if head == "" else _check_host(head, text, source)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise InvalidArgument(f"{source}={text!r}: {item!r} has no valid port (1-65535)")
    return host, int(port_text)


def parse_advertise(text: str, *, source: str = "Config.advertise") -> Advertise:
    """Parse an advertisement (see "Candidates" in the module docstring); ``InvalidArgument``
    naming ``source`` and what is wrong.  An empty string advertises nothing."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{source} must be a string, got {type(text).__name__}")
    text = text.strip()
    if not text:
        return Advertise(source=source)
    if "=" not in text:
        if "," in text:
            raise InvalidArgument(f"{source}={text!r}: several endpoints need their kinds: "
                                  "p2p=HOST:PORT,shared_state=HOST:PORT,benchmark=HOST:PORT")
        return Advertise(host=_check_host(text, text, source), source=source)
    endpoints: dict[Port, tuple[str | None, int]] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        kind = _KIND_NAMES.get(name.strip())
        if not sep or kind is None:
            raise InvalidArgument(f"{source}={text!r}: {item.strip()!r} is not KIND=HOST:PORT with KIND one of "
                                  f"{', '.join(_KIND_NAMES)}")
        if kind in endpoints:
            raise InvalidArgument(f"{source}={text!r}: {name.strip()} is given twice")
        endpoints[kind] = _split_host_port(value.strip(), text, source)
    return Advertise(endpoints=endpoints, source=source)


def advertised_candidates(advertise: Advertise, bound: Mapping[Port, int]) -> tuple[m.Candidate, ...]:
    """The candidates an advertisement gives, for listeners bound at ``bound`` (kind -> port).
    An endpoint without a host (``kind=PORT``) has the empty host: the master fills in the one
    it observes (:func:`resolve_candidates`)."""
    origin = int(CandidateOrigin.ADVERTISED)
    if advertise.host is not None:
        return tuple(m.Candidate(origin, int(kind), advertise.host, port) for kind, port in sorted(bound.items()))
    return tuple(m.Candidate(origin, int(kind), host or "", port)
                 for kind, (host, port) in sorted(advertise.endpoints.items()))


def resolve_candidates(candidates: Iterable[m.Candidate], observed_host: str) -> tuple[m.Candidate, ...]:
    """``candidates`` with an empty host replaced by ``observed_host`` (the master does this
    when it registers a peer)."""
    return tuple(c if c.host else m.Candidate(c.origin, c.kind, observed_host, c.port) for c in candidates)


def is_local_candidate_host(host: str) -> bool:
    """Whether an interface address may serve as a local candidate: not loopback, link-local,
    multicast or unspecified.  A host that is not an IP address (the simulator's host names) may."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return bool(host)
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def local_candidates(hosts: Iterable[str], bound: Mapping[Port, int]) -> tuple[m.Candidate, ...]:
    """Local candidates for the interface addresses ``hosts`` (in their order; unusable ones
    left out, see :func:`is_local_candidate_host`) at the ``bound`` ports."""
    origin = int(CandidateOrigin.LOCAL)
    seen: set[str] = set()
    out: list[m.Candidate] = []
    for host in hosts:
        if host in seen or not is_local_candidate_host(host):
            continue
        seen.add(host)
        out.extend(m.Candidate(origin, int(kind), host, port) for kind, port in sorted(bound.items()))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Dial:
    """One attempt of :func:`dial_order`: ``host:port`` and where the candidate came from."""

    host: str
    port: int
    origin: CandidateOrigin

    @property
    def address(self) -> str:
        return format_host_port(self.host, self.port)

    def describe(self) -> str:
        return f"{self.origin.name.lower()} {self.address}"


def _bound_port(target: m.PeerEndpoint, port: Port) -> int:
    return target.shared_state_port if port is Port.SHARED_STATE else target.p2p_port


def dial_order(target: m.PeerEndpoint, port: Port, *, own_public_host: str = "") -> list[Dial]:
    """The attempts a dialler observed from ``own_public_host`` makes to reach ``target``'s
    listener for ``port``, in order (see "Dial order" in the module docstring)."""
    port = Port(port)
    kinds = [port]
    if port is Port.BENCHMARK and not any(c.kind == Port.BENCHMARK and c.origin == CandidateOrigin.ADVERTISED
                                          for c in target.candidates):
        kinds.append(Port.P2P)
    def of(origin: CandidateOrigin) -> list[Dial]:
        return [Dial(c.host, c.port, origin) for kind in kinds for c in target.candidates
                if c.kind == kind and c.origin == origin and c.host]
    advertised = of(CandidateOrigin.ADVERTISED)
    local = of(CandidateOrigin.LOCAL)
    observed = [Dial(target.host, _bound_port(target, port), CandidateOrigin.OBSERVED)] if target.host else []
    same_public = bool(own_public_host) and own_public_host == target.host
    ordered = local + advertised + observed if same_public else advertised + observed + local
    seen: set[tuple[str, int]] = set()
    out: list[Dial] = []
    for dial in ordered:
        if (dial.host, dial.port) not in seen:
            seen.add((dial.host, dial.port))
            out.append(dial)
    return out
