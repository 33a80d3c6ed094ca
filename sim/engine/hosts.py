"""Simulated hosts and the lives of their processes: machines, incarnations, boot and death.

A :class:`Host` is a machine by name; it lives for the whole run.  Each time a process starts on
it (:meth:`Hosts.boot`: a join, or a restart after a death) it gets a new :class:`Incarnation`
— one life, with its own connections, listeners and connects in flight — which ends exactly once
(:meth:`Hosts.end`): by itself (``"exit"``), by ``"kill"`` or by ``"power_off"``.  What each
ending does to the connections is decided here; when and why a fault strikes is
:mod:`pccl_sim.engine.faults`.

Rules:

* at most one incarnation of a host is alive; a boot while one is alive is refused;
* an ending tears down everything of the incarnation at its instant: ``exit`` closes its
  connections as a kernel does for a process that returned (FIN, or RST when unread data is
  thrown away), ``kill`` resets them, ``power_off`` lets them vanish (the peers keep
  retransmitting into them: when the machine comes back its kernel answers those with RST);
* every incarnation is numbered from one world-wide counter, so numbers never repeat;
* an *appliance* (:meth:`Hosts.appliance`: a NAT box's public side) is a machine that is up from
  the start and never runs a process: it cannot boot;
* code of a dead incarnation that runs on after its death instant is a *zombie*:
  :meth:`Incarnation.zombie` reports it (to ``Hosts.on_zombie``, else as a trace failure).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol

import trio

from .trace import Trace

__all__ = [
    "CURRENT_INCARNATION", "LOOPBACK", "WILDCARD", "Host", "Incarnation", "Hosts", "SocketEnd", "PortEnd",
    "PendingConnect", "Ending",
]

#: The incarnation whose task is running; the runner sets it in each host's root task (child
#: tasks inherit it), and the network's zombie check reads it.
CURRENT_INCARNATION: contextvars.ContextVar["Incarnation | None"] = contextvars.ContextVar(
    "sim_current_incarnation", default=None
)

#: Names by which a host reaches itself.
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
#: Addresses a host may listen on besides its own name.
WILDCARD = frozenset({"0.0.0.0", "::", ""})

#: How an incarnation ends.
Ending = Literal["exit", "kill", "power_off"]


class SocketEnd(Protocol):
    """What an ending needs of one of the incarnation's connection ends
    (:class:`pccl_sim.engine.sockets.Socket`)."""

    def peer_sending(self) -> bool: ...

    def send_rst(self) -> None: ...

    def close(self, *, abortive: bool) -> None: ...

    def die(self, *, reset: bool) -> None: ...


class PortEnd(Protocol):
    """What an ending needs of a bound port (:class:`pccl_sim.engine.sockets.ListenSocket`)."""

    def shutdown(self, *, reset_backlog: bool) -> None: ...


class PendingConnect(Protocol):
    """A connect of the incarnation still waiting for its answer."""

    def abandon(self) -> None: ...


class Host:
    """A machine: up or off, stalled or not, its bound ports and the incarnation running on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.machine_up = False
        self.process: Incarnation | None = None
        #: Stall depth (stalls nest); while positive the host's traffic and operations are held.
        self.stalled = 0
        self.stall_lot = trio.lowlevel.ParkingLot()
        self.listeners: dict[int, Any] = {}  # port -> pccl_sim.engine.sockets.ListenSocket (the handshake looks it up)
        self.next_ephemeral = 49152
        self.incarnations = 0
        self.orphans: list[SocketEnd] = []  # connections of a powered-off incarnation
        #: A box that runs no process (a NAT's public side): it never boots.
        self.appliance = False

    def ephemeral_port(self) -> int:
        port = self.next_ephemeral
        self.next_ephemeral = 49152 + (port - 49152 + 1) % (65536 - 49152)
        return port


class Incarnation:
    """One life of a host's process: its connections and listeners die with it."""

    def __init__(self, host: Host, number: int, born_at: float, hosts: Hosts) -> None:
        self.host = host
        self.number = number
        self.born_at = born_at
        self.alive = True
        self.died_at: float | None = None
        self.death: Ending | None = None
        self.sockets: dict[int, SocketEnd] = {}  # insertion-ordered: deterministic teardown
        self.listeners: dict[int, PortEnd] = {}
        self.attempts: list[PendingConnect] = []
        #: Called once at its death: work of the process that takes time without the network
        #: (a workload's simulated CPU work) stops there, as its threads die with it.
        self.at_death: list[Callable[[], None]] = []
        self._hosts = hosts

    @property
    def name(self) -> str:
        return self.host.name

    def record(self, kind: str, **data: Any) -> None:
        """Append a trace event from this host (network events: connect, listen, reset …)."""
        self._hosts.trace.record(self.host.name, kind, **data)

    def zombie(self, operation: str) -> None:
        """This (dead) incarnation's code ran ``operation`` after its death instant: report it."""
        self._hosts.zombie(self, operation)

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"dead ({self.death} at {self.died_at})"
        return f"<Incarnation {self.host.name}#{self.number} {state}>"


class Hosts:
    """Every host of the world by name, and the lifecycle of their incarnations.  ``trace``
    receives ``boot`` and the endings (source ``"net"``)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._by_name: dict[str, Host] = {}
        self._incarnations = 0
        #: Called with (incarnation, operation) when a dead incarnation's code runs on.
        self.on_zombie: Callable[[Incarnation, str], None] | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Host:
        return self._by_name[name]

    def __iter__(self) -> Iterator[Host]:
        """The hosts in the order they first appeared."""
        return iter(self._by_name.values())

    def get(self, name: str) -> Host | None:
        return self._by_name.get(name)

    def host(self, name: str) -> Host:
        """The host called ``name``, made on first use.  ``ValueError`` for a name that is not a
        host name (empty, with a ``:``, a loopback or wildcard address)."""
        host = self._by_name.get(name)
        if host is None:
            if not name or ":" in name or name in LOOPBACK or name in WILDCARD:
                raise ValueError(f"invalid simulated host name {name!r}")
            host = self._by_name[name] = Host(name)
        return host

    def appliance(self, name: str) -> Host:
        """Make host ``name`` an appliance: up from now on, never running a process (a NAT's
        public side answers for itself).  ``ValueError`` if a host of that name exists already."""
        if name in self._by_name:
            raise ValueError(f"{name!r} is a host already")
        host = self.host(name)
        host.machine_up = True
        host.appliance = True
        return host

    def alive(self, name: str) -> bool:
        host = self._by_name.get(name)
        return host is not None and host.process is not None

    def incarnation(self, name: str) -> Incarnation | None:
        host = self._by_name.get(name)
        return None if host is None else host.process

    def boot(self, name: str) -> Incarnation:
        """Power the machine on (if needed) and start a new incarnation.  ``RuntimeError`` if an
        incarnation of ``name`` is still alive."""
        host = self.host(name)
        if host.appliance:
            raise RuntimeError(f"{name} is an appliance (a NAT's public name): it runs no process")
        if host.process is not None:
            raise RuntimeError(f"host {name} is still running incarnation {host.process.number}")
        self._incarnations += 1
        if not host.machine_up:
            self._answer_orphans(host)
        host.machine_up = True
        host.incarnations += 1
        inc = Incarnation(host, self._incarnations, trio.current_time(), self)
        host.process = inc
        self.trace.record("net", "boot", host=name, incarnation=inc.number)
        return inc

    def _answer_orphans(self, host: Host) -> None:
        """A machine comes back after a power-off: peers still retransmitting into its old
        connections now reach a kernel that knows nothing of them, and it answers RST."""
        for socket in host.orphans:
            if socket.peer_sending():
                socket.send_rst()
        host.orphans.clear()

    def end(self, name: str, how: Ending) -> Incarnation | None:
        """End the running incarnation of ``name`` now (see the module docstring for what each
        ending does); returns it, or ``None`` if nothing was running."""
        host = self._by_name.get(name)
        if host is None or host.process is None:
            if host is not None and how == "power_off":
                self.trace.record("net", how, host=name, incarnation=None)
            return None
        inc = host.process
        inc.alive = False
        inc.died_at = trio.current_time()
        inc.death = how
        host.process = None
        self.trace.record("net", how, host=name, incarnation=inc.number)
        if how == "power_off":
            host.orphans.extend(inc.sockets.values())
        for listener in list(inc.listeners.values()):
            listener.shutdown(reset_backlog=how == "exit")
        for socket in list(inc.sockets.values()):
            if how == "exit":  # the process ended: its kernel closes the sockets (FIN, or RST)
                socket.close(abortive=False)
            else:
                socket.die(reset=how == "kill")
        for attempt in inc.attempts:
            attempt.abandon()
        inc.attempts.clear()
        for stop in list(inc.at_death):
            stop()
        inc.at_death.clear()
        # A stall of a dead process is moot: release waiters so nothing stays parked.  (Without
        # this, a corpse's shielded cleanup — e.g. Communicator.aclose sending Leave — parked in
        # the stall gate stayed parked until the unstall and then ran on: a false zombie.)
        host.stall_lot.unpark_all()
        return inc

    def zombie(self, inc: Incarnation, operation: str) -> None:
        """A dead incarnation's code ran on after its death instant: report it."""
        if self.on_zombie is not None:
            self.on_zombie(inc, operation)
        else:
            message = (
                f"{operation} by {inc.name} incarnation {inc.number}, which died "
                f"({inc.death}) at t={inc.died_at}"
            )
            self.trace.fail("zombie", inc.name, message)
