"""The faults the world can suffer, each a synchronous step at the current virtual instant.

The runner's fault injector and phase triggers call these (through
:class:`~pccl_sim.engine.network.World`); generating and shrinking fault *schedules* is the
:mod:`pccl_sim.faults` package.  A fault acts on the other parts only through their public faces:
an incarnation ends through :meth:`~pccl_sim.engine.hosts.Hosts.end`, a partition is the topology's,
and held traffic flows again through :meth:`~pccl_sim.engine.delivery.Delivery.release`.

* :meth:`Faults.kill` — the process dies, the machine stays up: every connection of the
  incarnation is reset at once (RST towards each peer, after the data already on the wire), its
  listeners vanish (later connects are refused).  The runner cancels the host's tasks *after*
  this, so nothing the corpse "sends" afterwards leaves the host.
* :meth:`Faults.power_off` — the machine vanishes: no FIN, no RST; data to it is black-holed and
  never acknowledged, connects time out.  Peers only notice through their own timeouts.
* :meth:`Faults.stall` / :meth:`Faults.unstall` — SIGSTOP-like: every link touching the host is
  held (nothing leaves or enters it; senders block on their windows), its connections stay open,
  and every network operation its tasks make blocks until the stall ends.  Stalls nest.
* :meth:`Faults.partition` / :meth:`Faults.heal` — hold traffic between sets of hosts (one-way or
  both ways); nothing is lost, it flows again on heal (TCP retransmits).

Each fault is recorded in the trace (source ``"net"``) before it takes effect.
"""

from __future__ import annotations

from collections.abc import Iterable

from .delivery import Delivery
from .hosts import Hosts, Incarnation
from .topology import Topology
from .trace import Trace

__all__ = ["Faults"]


class Faults:
    """Kill, power off, stall and partition (see the module docstring)."""

    def __init__(self, *, hosts: Hosts, topology: Topology, delivery: Delivery, trace: Trace) -> None:
        self.hosts = hosts
        self.topology = topology
        self.delivery = delivery
        self.trace = trace

    def kill(self, name: str) -> Incarnation | None:
        """The host's process dies (kill -9); its kernel resets every connection.  Returns the
        dead incarnation, or ``None`` if nothing was running."""
        return self.hosts.end(name, "kill")

    def power_off(self, name: str) -> Incarnation | None:
        """The machine vanishes without a word; returns the dead incarnation (or ``None``)."""
        inc = self.hosts.end(name, "power_off")
        host = self.hosts.get(name)
        if host is not None:
            host.machine_up = False
            self.delivery.silence(name)
        return inc

    def stall(self, name: str) -> None:
        """Freeze the host: its traffic is held both ways and its network operations block."""
        host = self.hosts.host(name)
        host.stalled += 1
        self.trace.record("net", "stall", host=name, depth=host.stalled)

    def unstall(self, name: str) -> None:
        """End one stall of the host (nothing if it is not stalled)."""
        host = self.hosts.host(name)
        if host.stalled == 0:
            return
        host.stalled -= 1
        self.trace.record("net", "unstall", host=name, depth=host.stalled)
        if host.stalled == 0:
            host.stall_lot.unpark_all()
            self.delivery.release()

    def partition(self, side: Iterable[str], other: Iterable[str] | None = None, *, both_ways: bool = True) -> int:
        """Hold all traffic from ``side`` to ``other`` (default: every other host) and, unless
        ``both_ways`` is false, back.  Returns an id for :meth:`heal`."""
        side_set = frozenset(side)
        other_set = None if other is None else frozenset(other)
        pid = self.topology.partition(side_set, other_set, both_ways=both_ways)
        self.trace.record(
            "net", "partition", id=pid, side=sorted(side_set),
            other=None if other_set is None else sorted(other_set), both_ways=both_ways,
        )
        return pid

    def heal(self, pid: int | None = None) -> None:
        """End partition ``pid`` (all partitions if ``None``); held traffic flows again."""
        ended = self.topology.heal(pid)
        if ended:
            self.trace.record("net", "heal", ids=ended)
            self.delivery.release()

    def heal_all(self) -> None:
        """End every partition and stall (the liveness phase starts from a healed network)."""
        for host in self.hosts:
            while host.stalled:
                self.unstall(host.name)
        self.heal()
