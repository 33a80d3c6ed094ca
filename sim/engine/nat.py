"""NAT boxes: hosts with private names behind one public name, port maps, and the route a
connect takes through them.

A :class:`Nat` has a public name (``"nat1"``), an address other hosts can dial.  Hosts put behind
it keep their own names, which are now private addresses.  The streams ask :meth:`Nats.route`
where a SYN goes, and :meth:`Nat.source` which address the acceptor sees; the bytes themselves
travel the links between the real hosts (:mod:`pccl_sim.engine.delivery`), so nothing on the data
path knows about NAT.

Rules:

* membership is static per host name for a run: a host is behind the NAT that
  :meth:`Nats.put_behind` (or ``add(..., inside=...)``) named, else behind ``locate(host)``
  (:meth:`Nats.locate_by`), else behind none; once a connect has consulted it, it does not
  change.  One level only: a NAT's public name is never behind another NAT (no carrier-grade
  NAT), and no host is behind two;
* the NAT is not a hop: a connection through it travels the link between the two real hosts,
  with that link's spec, site uplink and partitions, and no latency of its own;
* outbound: a connection from a host behind ``N`` to a host outside ``N`` comes, as the acceptor
  sees it, from ``"N:t"`` (its ``remote_address``); ``t`` is the public port ``N`` gives the
  dialler's (host, source port) — endpoint-independent: the same pair always gets the same ``t``
  while the entry lives — drawn in order from 32768..60999 (Linux's default ephemeral range),
  skipping mapped ports; when the range wraps, the oldest entry gives its port up.  The
  dialler's own ``local_address`` stays private, as on a real host behind NAT;
* inbound: a SYN to ``"N:P"`` with ``P`` mapped (:meth:`Nat.map`) to ``(H, Q)`` goes to ``H:Q``
  (``Q`` may differ from ``P``), and ``H`` answers as it would (nothing listening: refused); the
  dialler's stream shows ``"N:P"`` as its ``remote_address``.  An unmapped port — a translated
  outbound port included: no hole punching, TCP simultaneous open is not modelled — is dropped
  (``inbound="drop"``, the default and what most home routers do: the dialler's connect times
  out) or refused (``inbound="refuse"``: ``N`` answers RST, one round trip over the link between
  the dialler and ``N``'s own name);
* a host behind ``N`` dialled by its private name from outside ``N`` is not routable: the SYN is
  dropped (``ConnectTimeout``).  From inside the same ``N``: direct, no translation;
* hairpin (a host behind ``N`` dialling ``N``'s own public name): off by default, as on many home
  routers, and then the dial is answered as an unmapped port is (per ``inbound``), mapped or not.
  With ``hairpin=True`` the map applies, and the acceptor sees the dialler as ``"N:t"``;
* the map is read when the SYN leaves (the NAT stands next to its hosts: no time passes in
  between).  Maps change at any time (:meth:`Nat.map`, :meth:`Nat.unmap`: a relay or peer
  restarting gets a new mapping); a change affects later connects only — connections made
  through a removed mapping live on, as conntrack keeps them.  NATs and map changes are
  recorded in the trace (source ``"net"``: ``nat``, ``nat_member``, ``nat_map``, ``nat_unmap``);
* a NAT's public name is a host of the world that never runs a process (an *appliance*,
  :meth:`~pccl_sim.engine.hosts.Hosts.appliance`): it cannot boot, and faults on its name touch
  only its own answers (the refusals), not the connections it translates — to cut the hosts
  behind it off, partition or stall those;
* a world without NAT routes exactly as before (the streams check :attr:`Nats.active` first),
  and so does a host behind no NAT talking to another such host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

from .hosts import Hosts
from .trace import Trace

__all__ = ["Nat", "Nats", "Route", "Inbound", "TRANSLATED_PORTS"]

#: What a NAT does with a SYN to one of its unmapped ports.
Inbound = Literal["drop", "refuse"]

#: The public ports outbound connections are translated to (Linux's default ephemeral range).
TRANSLATED_PORTS = range(32768, 61000)


class Route:
    """Where a SYN goes: ``host:port``.  ``shown`` is the address the dialler's stream shows
    as its remote (``None``: ``host:port`` itself); ``nat`` the NAT that translates the
    dialler's source address (``None``: the acceptor sees the dialler's own)."""

    __slots__ = ("host", "port", "shown", "nat")

    def __init__(self, host: str, port: int, shown: str | None = None, nat: Nat | None = None) -> None:
        self.host = host
        self.port = port
        self.shown = shown
        self.nat = nat


class Nat:
    """One NAT box (see the module docstring).  Made by :meth:`Nats.add`."""

    def __init__(self, nats: Nats, name: str, inbound: Inbound, hairpin: bool) -> None:
        self.name = name
        self.inbound: Inbound = inbound
        self.hairpin = hairpin
        self._nats = nats
        self._ports: dict[int, tuple[str, int]] = {}  # public port -> (inside host, port)
        self._out: OrderedDict[tuple[str, int], int] = OrderedDict()  # (host, source port) -> public
        self._out_port: dict[int, tuple[str, int]] = {}  # public -> (host, source port)
        self._next = TRANSLATED_PORTS.start

    def __repr__(self) -> str:
        return f"<Nat {self.name} inbound={self.inbound}{' hairpin' if self.hairpin else ''}>"

    # -- the port map ----------------------------------------------------------------------

    def map(self, public_port: int, host: str, port: int | None = None) -> None:
        """Forward ``public_port`` to ``host:port`` (``port`` ``None``: the same number); ``host``
        must be behind this NAT.  Replaces an earlier mapping of ``public_port``."""
        if not 1 <= public_port <= 65535:
            raise ValueError(f"invalid public port {public_port}")
        to = public_port if port is None else port
        if not 1 <= to <= 65535:
            raise ValueError(f"invalid port {to}")
        if self._nats.of(host) is not self:
            raise ValueError(f"cannot map {self.name}:{public_port} to {host}: {host} is not behind {self.name}")
        self._ports[public_port] = (host, to)
        stale = self._out_port.pop(public_port, None)  # an outbound entry gives the port up
        if stale is not None:
            del self._out[stale]
        self._nats.trace.record("net", "nat_map", nat=self.name, port=public_port, host=host, to=to)

    def unmap(self, public_port: int) -> tuple[str, int] | None:
        """Remove the mapping of ``public_port`` (connections made through it live on); the
        ``(host, port)`` it forwarded to, or ``None`` if it was not mapped."""
        old = self._ports.pop(public_port, None)
        if old is not None:
            self._nats.trace.record("net", "nat_unmap", nat=self.name, port=public_port)
        return old

    def mapping(self, public_port: int) -> tuple[str, int] | None:
        """The ``(host, port)`` that ``public_port`` forwards to, or ``None``."""
        return self._ports.get(public_port)

    @property
    def mappings(self) -> dict[int, tuple[str, int]]:
        """A copy of the port map: public port -> ``(host, port)``."""
        return dict(self._ports)

    # -- outbound translation --------------------------------------------------------------

    def source(self, host: str, port: int) -> str:
        """The address the world outside sees for ``host:port`` behind this NAT: ``"N:t"``,
        allocating ``t`` if the pair has none (see the module docstring)."""
        key = (host, port)
        public = self._out.get(key)
        if public is None:
            public = self._allocate()
            self._out[key] = public
            self._out_port[public] = key
        return f"{self.name}:{public}"

    def translation(self, host: str, port: int) -> int | None:
        """The public port ``host:port`` is translated to now, or ``None`` (nothing allocated)."""
        return self._out.get((host, port))

    def _allocate(self) -> int:
        ports = TRANSLATED_PORTS
        for _ in range(len(ports)):
            public = self._next
            self._next = public + 1 if public + 1 < ports.stop else ports.start
            if public in self._ports:
                continue
            old = self._out_port.pop(public, None)
            if old is not None:  # the range wrapped: the oldest entry gives its port up
                del self._out[old]
            return public
        raise RuntimeError(f"NAT {self.name}: every port of {ports.start}..{ports.stop - 1} is mapped")


class Nats:
    """The world's NAT boxes and who is behind which (see the module docstring)."""

    def __init__(self, *, hosts: Hosts, trace: Trace) -> None:
        self.hosts = hosts
        self.trace = trace
        #: Whether any NAT exists: while false, connects skip routing altogether.
        self.active = False
        self._by_name: dict[str, Nat] = {}
        self._explicit: dict[str, Nat] = {}
        self._member: dict[str, Nat | None] = {}  # decided (consulted) memberships
        self._locate: Callable[[str], str | None] | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Nat:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Nat]:
        """The NATs in the order they were added."""
        return iter(self._by_name.values())

    def add(self, name: str, *, inside: Iterable[str] = (), inbound: Inbound = "drop", hairpin: bool = False) -> Nat:
        """A new NAT box with public name ``name`` (not an existing host's), with the hosts
        ``inside`` behind it."""
        if inbound not in ("drop", "refuse"):
            raise ValueError(f"inbound must be 'drop' or 'refuse', got {inbound!r}")
        if name in self._by_name:
            raise ValueError(f"NAT {name!r} exists already")
        if name in self._explicit or name in self._member:
            raise ValueError(f"{name!r} is a host behind a NAT, it cannot be a NAT's public name")
        members = list(inside)
        for host in members:  # checked before anything is made: a refused NAT leaves no trace
            if host == name:
                raise ValueError(f"NAT {name!r} cannot be behind itself")
            self._check_admit(host, None)
        self.hosts.appliance(name)  # ValueError for an existing host or an invalid name
        nat = self._by_name[name] = Nat(self, name, inbound, hairpin)
        self.active = True
        self.trace.record("net", "nat", name=name, inbound=inbound, hairpin=hairpin, inside=members)
        for host in members:
            self._admit(host, nat)
        return nat

    def put_behind(self, host: str, nat: str) -> None:
        """Put ``host`` behind NAT ``nat`` (before any connect consulted where it stands)."""
        target = self._by_name.get(nat)
        if target is None:
            raise ValueError(f"unknown NAT {nat!r}")
        self._admit(host, target)
        self.trace.record("net", "nat_member", nat=nat, host=host)

    def _check_admit(self, host: str, nat: Nat | None) -> None:
        """``ValueError`` unless ``host`` may go behind ``nat`` (``None``: a NAT not made yet)."""
        if host in self._by_name:
            raise ValueError(f"{host!r} is a NAT's public name; NATs do not nest")
        current = self._explicit.get(host)
        if current is not None and current is not nat:
            raise ValueError(f"{host} is behind {current.name} already")
        if host in self._member and self._member[host] is not nat:
            raise ValueError(f"{host}'s place was consulted already (membership is static for a run)")

    def _admit(self, host: str, nat: Nat) -> None:
        self._check_admit(host, nat)
        self._explicit[host] = nat
        self._member[host] = nat

    def locate_by(self, locate: Callable[[str], str | None]) -> None:
        """Hosts not put behind a NAT explicitly are behind the NAT ``locate(name)`` names
        (``None``: none), hosts that join later included.  Set it before hosts connect."""
        if any(host not in self._explicit for host in self._member):
            raise RuntimeError("locate_by after connects consulted the NAT membership (it is static for a run)")
        self._locate = locate

    def of(self, host: str) -> Nat | None:
        """The NAT ``host`` is behind (``None``: none); deciding it for the run."""
        try:
            return self._member[host]
        except KeyError:
            pass
        nat: Nat | None = None
        if self._locate is not None and host not in self._by_name:
            name = self._locate(host)
            if name is not None:
                nat = self._by_name.get(name)
                if nat is None:
                    raise ValueError(f"host {host!r} located behind unknown NAT {name!r}")
        self._member[host] = nat
        return nat

    def route(self, src: str, dst: str, port: int) -> Route | None:
        """Where a SYN from ``src`` to ``dst:port`` goes (``dst`` a known host, a NAT's public
        name included), or ``None``: nowhere, it is dropped."""
        src_nat = self.of(src)
        box = self._by_name.get(dst)
        if box is not None:
            mapped = box.mapping(port) if box is not src_nat or box.hairpin else None
            if mapped is None:
                # The box answers for itself: it has no listener, so it refuses.
                return Route(dst, port) if box.inbound == "refuse" else None
            return Route(mapped[0], mapped[1], f"{dst}:{port}", src_nat)
        if src == dst:
            return Route(dst, port)
        dst_nat = self.of(dst)
        if dst_nat is not None and dst_nat is not src_nat:
            return None  # a private address, not routable from outside its NAT
        return Route(dst, port, None, src_nat if dst_nat is None else None)
