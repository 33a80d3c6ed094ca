"""The shape of the simulated internet: what each directed link is like, where hosts stand, and
which pairs of hosts are cut off from each other.

:class:`Topology` is plain data — no time, no bytes.  The links that carry the bytes
(:mod:`pccl_sim.engine.delivery`) read their :class:`LinkSpec` and uplink from it, are told when it
changes (:meth:`Topology.subscribe`), and ask it whether a partition holds their traffic; the
fault injector (:mod:`pccl_sim.engine.faults`) opens and ends the partitions.

Rules:

* the spec of a link ``a→b``, most specific first: an explicit :meth:`Topology.set_link` for the
  pair; between two hosts of one site, the site's ``inside`` spec; between sites, the site pair's
  spec (:meth:`Topology.set_site_link`, else the default); a host without a site, the default;
* a link between two sites also passes the source site's one uplink (shared by all its outbound
  links), whatever spec wins;
* a partition holds traffic, it loses none: bytes wait and flow again when it ends (TCP
  retransmits), so a partition changes timing, never content;
* a host is in the site :meth:`Topology.place` put it in, else in ``locate(host)``
  (:meth:`Topology.place_by`), else in none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

__all__ = ["LinkSpec", "SiteSpec", "Topology"]


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """Properties of one directed link (the model: :mod:`pccl_sim.engine.delivery`)."""

    latency: float = 0.005
    bandwidth: float = math.inf  # bytes per second, shared by the connections on the link
    window: int = 1 << 20  # bytes in flight per connection: throughput <= window / RTT
    jitter: float = 0.0  # extra one-way delay, uniform in [0, jitter]

    def __post_init__(self) -> None:
        if self.latency < 0 or self.jitter < 0:
            raise ValueError("latency and jitter must not be negative")
        if self.bandwidth <= 0:
            raise ValueError("bandwidth must be positive")
        if self.window < 1:
            raise ValueError("window must be at least one byte")


@dataclasses.dataclass(frozen=True)
class SiteSpec:
    """A datacenter: the links between its own hosts, and the bandwidth (bytes/s) of the one
    uplink all its traffic to other sites shares."""

    inside: LinkSpec = LinkSpec(latency=0.0001)
    uplink: float = math.inf

    def __post_init__(self) -> None:
        if self.uplink <= 0:
            raise ValueError("uplink bandwidth must be positive")


class _Partition:
    def __init__(self, side: frozenset[str], other: frozenset[str] | None, both_ways: bool) -> None:
        self.side = side
        self.other = other  # None: every host not in ``side``
        self.both_ways = both_ways

    def _in_other(self, host: str) -> bool:
        return host not in self.side if self.other is None else host in self.other

    def blocks(self, src: str, dst: str) -> bool:
        if src in self.side and self._in_other(dst):
            return True
        return self.both_ways and dst in self.side and self._in_other(src)


class Topology:
    """Link specs, sites and partitions (see the module docstring).  ``default_link`` is the spec
    of every link nothing more specific covers; setting it affects links made afterwards."""

    def __init__(self, default_link: LinkSpec) -> None:
        self.default_link = default_link
        #: Declared sites by name.
        self.sites: dict[str, SiteSpec] = {}
        self._link_specs: dict[tuple[str, str], LinkSpec] = {}
        self._site_of: dict[str, str] = {}
        self._site_links: dict[tuple[str, str], LinkSpec] = {}
        self._locate: Callable[[str], str | None] | None = None
        self._partitions: dict[int, _Partition] = {}
        self._next_partition = 1
        self._subscribers: list[Callable[[], None]] = []

    def subscribe(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` after every change of a link's spec or uplink."""
        self._subscribers.append(on_change)

    def _changed(self) -> None:
        for on_change in self._subscribers:
            on_change()

    # -- links and sites -------------------------------------------------------------------------

    def set_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        """Give the link a→b (and b→a unless ``both_ways`` is false) ``spec``."""
        for pair in ([(a, b), (b, a)] if both_ways else [(a, b)]):
            self._link_specs[pair] = spec
        self._changed()

    def add_site(self, name: str, spec: SiteSpec) -> None:
        """Declare (or redefine) site ``name``."""
        self.sites[name] = spec
        self._changed()

    def place(self, host: str, site: str) -> None:
        """Put ``host`` in ``site`` (declared with :meth:`add_site`)."""
        if site not in self.sites:
            raise ValueError(f"unknown site {site!r}")
        self._site_of[host] = site
        self._changed()

    def place_by(self, locate: Callable[[str], str | None]) -> None:
        """Hosts not :meth:`place`-d explicitly are in site ``locate(name)`` (``None``: none),
        hosts that join later included."""
        self._locate = locate
        self._changed()

    def site(self, host: str) -> str | None:
        """The site ``host`` is in (``None``: none).  ``ValueError`` if ``locate`` names an
        undeclared one."""
        site = self._site_of.get(host)
        if site is None and self._locate is not None:
            site = self._locate(host)
            if site is not None and site not in self.sites:
                raise ValueError(f"host {host!r} placed in unknown site {site!r}")
        return site

    def set_site_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        """Links from hosts of site ``a`` to hosts of site ``b`` (and back unless ``both_ways``
        is false) get ``spec``; their bytes also pass ``a``'s uplink."""
        for pair in ([(a, b), (b, a)] if both_ways else [(a, b)]):
            self._site_links[pair] = spec
        self._changed()

    def spec_of(self, src: str, dst: str) -> tuple[LinkSpec, str | None]:
        """The spec of the link ``src→dst`` and the site whose uplink it passes (``None``: none)."""
        spec = self._link_specs.get((src, dst))
        if not self._site_of and self._locate is None:
            return spec or self.default_link, None
        s, d = self.site(src), self.site(dst)
        if s is None or d is None:
            return spec or self.default_link, None
        if s == d:
            return spec or self.sites[s].inside, None
        return spec or self._site_links.get((s, d), self.default_link), s

    # -- partitions ------------------------------------------------------------------------------

    def partition(self, side: frozenset[str], other: frozenset[str] | None, *, both_ways: bool) -> int:
        """Hold traffic from ``side`` to ``other`` (``None``: every other host) and, if
        ``both_ways``, back; returns the partition's id."""
        pid = self._next_partition
        self._next_partition += 1
        self._partitions[pid] = _Partition(side, other, both_ways)
        return pid

    def heal(self, pid: int | None = None) -> list[int]:
        """End partition ``pid`` (every partition if ``None``); the ids that ended."""
        if pid is None:
            ended = list(self._partitions)
            self._partitions.clear()
            return ended
        return [pid] if self._partitions.pop(pid, None) is not None else []

    def blocks(self, src: str, dst: str) -> bool:
        """Whether a partition holds traffic from ``src`` to ``dst``."""
        for partition in self._partitions.values():
            if partition.blocks(src, dst):
                return True
        return False
