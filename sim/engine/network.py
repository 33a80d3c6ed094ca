"""The simulator's virtual network: one :class:`World` per run, made of parts.

Each simulated host incarnation gets its own network object (a
:class:`~pccl_sim.engine.streams.SimNetwork`, or the subclass the scenario names: for pccl, a
:class:`pccl.net.base.Network`), bound to its identity so that ``connect`` knows the source host;
the code under test cannot tell it from real TCP (both pass ``pccl.testing.conformance``).

The world is the sum of its parts, each in its own module with a public face the others use:

* :mod:`pccl_sim.engine.clock` — the event queue virtual time runs through;
* :mod:`pccl_sim.engine.topology` — link specs, sites and partitions (plain data);
* :mod:`pccl_sim.engine.hosts` — machines, the incarnations of their processes, boot and death;
* :mod:`pccl_sim.engine.delivery` — pipes, links and uplinks moving bytes, and what arrives;
* :mod:`pccl_sim.engine.faults` — kill, power-off, stall and partition;
* :mod:`pccl_sim.engine.nat` — NAT boxes: public names, private hosts behind them, port maps;
* :mod:`pccl_sim.engine.streams` — the hosts' side: ``connect``, ``listen`` and the streams.

Model (TCP connections, not packets; details in :mod:`pccl_sim.engine.delivery`): links have a
latency, bandwidth shared fairly by the connections sending on them, and a per-connection window;
sites (:meth:`World.add_site`, :meth:`World.place`) give the links between their hosts one spec
and share one uplink for everything leaving the site; ``send_all`` copies into a per-connection
send buffer of ``send_buffer`` bytes and blocks while it is full (a sender that loops blocks, so
virtual time advances); SYN and SYN-ACK travel the links (one RTT), so connects obey partitions;
nothing listening → RST → ``ConnectionRefused``; a machine that is down or cut off never answers
→ ``ConnectTimeout``; hosts behind a NAT (:meth:`World.add_nat`) have private names and dial out
from the NAT's public name, which forwards only its mapped ports (:mod:`pccl_sim.engine.nat`); ``aclose`` sends FIN behind the data (or RST when unread data is discarded,
as Linux does); ``abort`` and data arriving at a closed or dead endpoint answer RST.

Every network operation checks the caller's incarnation: an operation of a dead incarnation at a
later virtual instant than its death is recorded as a **zombie** failure (something outlived the
kill).  Nothing polls: the event queue is delivered by the runner's clock when the run goes idle
(:func:`pccl_sim.engine.determinism.sim_clock`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .clock import EventQueue
from .delivery import Delivery
from .faults import Faults
from .hosts import Hosts, Incarnation
from .nat import Inbound, Nat, Nats
from .topology import LinkSpec, SiteSpec, Topology
from .trace import Trace

__all__ = ["World", "LinkSpec", "SiteSpec", "Nat"]


class World:
    """The simulated internet of one run (see the module docstring).

    ``network_class(world, incarnation, **options)`` makes the network object :meth:`boot` hands
    out (:class:`pccl_sim.engine.streams.SimNetwork` or a workload's subclass).  ``trace`` receives
    network-level events (listen, connect, reset, faults).  ``tap``, if set, observes bytes as
    hosts send, read and links carry them (phase triggers and coverage use it; see
    :mod:`pccl_sim.engine.tap`).  All fault methods are synchronous and take effect at the current
    virtual instant.

    The parts are public (``queue``, ``topology``, ``hosts``, ``delivery``, ``faults``, ``nats``); the
    methods below are the ones scenarios and tests use, each a step of one part.
    """

    def __init__(
        self,
        *,
        seed: int,
        network_class: Callable[..., Any],
        trace: Trace | None = None,
        default_link: LinkSpec | None = None,
        send_buffer: int = 256 * 1024,
        segment_size: int = 64 * 1024,
    ) -> None:
        self.seed = seed
        self.network_class = network_class
        self.trace = trace if trace is not None else Trace()
        self.queue = EventQueue()
        self.topology = Topology(default_link or LinkSpec())
        self.hosts = Hosts(self.trace)
        self.delivery = Delivery(seed=seed, queue=self.queue, topology=self.topology, hosts=self.hosts,
                                 send_buffer=send_buffer, segment_size=segment_size)
        self.faults = Faults(hosts=self.hosts, topology=self.topology, delivery=self.delivery, trace=self.trace)
        self.nats = Nats(hosts=self.hosts, trace=self.trace)

    @property
    def tap(self) -> Any:
        """The observer of the bytes (:class:`pccl_sim.engine.tap.Tap`), or ``None``."""
        return self.delivery.tap

    @tap.setter
    def tap(self, tap: Any) -> None:
        self.delivery.tap = tap

    @property
    def default_link(self) -> LinkSpec:
        """The spec of links nothing more specific covers (set it before hosts connect)."""
        return self.topology.default_link

    @default_link.setter
    def default_link(self, spec: LinkSpec) -> None:
        self.topology.default_link = spec

    @property
    def on_zombie(self) -> Callable[[Incarnation, str], None] | None:
        """Called with (incarnation, operation) when a dead incarnation's code runs on; ``None``
        records a zombie failure in the trace."""
        return self.hosts.on_zombie

    @on_zombie.setter
    def on_zombie(self, callback: Callable[[Incarnation, str], None] | None) -> None:
        self.hosts.on_zombie = callback

    # -- hosts ---------------------------------------------------------------------------------

    def boot(self, name: str, **options: Any) -> Any:
        """Power the machine on (if needed) and start a new incarnation; return its network
        (``network_class(self, incarnation, **options)``).

        Raises ``RuntimeError`` if an incarnation of ``name`` is still alive.
        """
        return self.network_class(self, self.hosts.boot(name), **options)

    async def sleep_until(self, when: float) -> None:
        """Sleep until virtual time ``when`` (:meth:`pccl_sim.engine.clock.EventQueue.sleep_until`)."""
        await self.queue.sleep_until(when)

    # -- topology ------------------------------------------------------------------------------

    def set_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        """Give the link a→b (and b→a unless ``both_ways`` is false) ``spec``."""
        self.topology.set_link(a, b, spec, both_ways=both_ways)

    def add_site(self, name: str, spec: SiteSpec) -> None:
        """Declare (or redefine) site ``name``."""
        self.topology.add_site(name, spec)

    def place(self, host: str, site: str) -> None:
        """Put ``host`` in ``site`` (declared with :meth:`add_site`)."""
        self.topology.place(host, site)

    def place_by(self, locate: Callable[[str], str | None]) -> None:
        """Hosts not :meth:`place`-d explicitly are in site ``locate(name)`` (``None``: none),
        hosts that join later included."""
        self.topology.place_by(locate)

    def set_site_link(self, a: str, b: str, spec: LinkSpec, *, both_ways: bool = True) -> None:
        """Links from hosts of site ``a`` to hosts of site ``b`` (and back unless ``both_ways``
        is false) get ``spec``; their bytes also pass ``a``'s uplink."""
        self.topology.set_site_link(a, b, spec, both_ways=both_ways)

    # -- NAT (pccl_sim.engine.nat) ----------------------------------------------------------------

    def add_nat(self, name: str, *, inside: Iterable[str] = (), inbound: Inbound = "drop",
                hairpin: bool = False) -> Nat:
        """A NAT box with public name ``name`` and the hosts ``inside`` behind it; SYNs to its
        unmapped ports are dropped or refused (``inbound``); ``hairpin`` lets hosts behind it use
        its port map too.  Map ports with :meth:`Nat.map` (the rules:
        :mod:`pccl_sim.engine.nat`)."""
        return self.nats.add(name, inside=inside, inbound=inbound, hairpin=hairpin)

    def nat(self, name: str) -> Nat:
        """The NAT whose public name is ``name`` (``KeyError`` if none)."""
        return self.nats[name]

    def put_behind(self, host: str, nat: str) -> None:
        """Put ``host`` behind NAT ``nat`` (before it connects: membership is static)."""
        self.nats.put_behind(host, nat)

    def nat_by(self, locate: Callable[[str], str | None]) -> None:
        """Hosts not put behind a NAT explicitly are behind NAT ``locate(name)`` (``None``:
        none), hosts that join later included; set it before hosts connect."""
        self.nats.locate_by(locate)

    def nat_of(self, host: str) -> Nat | None:
        """The NAT ``host`` is behind, or ``None``."""
        return self.nats.of(host) if self.nats.active else None

    # -- faults (pccl_sim.engine.faults) ------------------------------------------------------------

    def kill(self, name: str) -> Incarnation | None:
        """The host's process dies (kill -9): :meth:`pccl_sim.engine.faults.Faults.kill`."""
        return self.faults.kill(name)

    def power_off(self, name: str) -> Incarnation | None:
        """The machine vanishes without a word: :meth:`pccl_sim.engine.faults.Faults.power_off`."""
        return self.faults.power_off(name)

    def stall(self, name: str) -> None:
        """Freeze the host: :meth:`pccl_sim.engine.faults.Faults.stall`."""
        self.faults.stall(name)

    def unstall(self, name: str) -> None:
        """End one stall of the host: :meth:`pccl_sim.engine.faults.Faults.unstall`."""
        self.faults.unstall(name)

    def partition(self, side: Iterable[str], other: Iterable[str] | None = None, *, both_ways: bool = True) -> int:
        """Hold traffic between host sets: :meth:`pccl_sim.engine.faults.Faults.partition`."""
        return self.faults.partition(side, other, both_ways=both_ways)

    def heal(self, pid: int | None = None) -> None:
        """End partition ``pid`` (all if ``None``): :meth:`pccl_sim.engine.faults.Faults.heal`."""
        self.faults.heal(pid)

    def heal_all(self) -> None:
        """End every partition and stall: :meth:`pccl_sim.engine.faults.Faults.heal_all`."""
        self.faults.heal_all()

    def statistics(self) -> dict[str, int]:
        return {"events": self.queue.events_processed, **self.delivery.statistics()}
