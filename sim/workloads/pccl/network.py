"""The simulated network in pccl's terms: a :class:`pccl.net.base.Network` over the engine's model.

:class:`PcclSimNetwork` is the engine's :class:`~pccl_sim.engine.streams.SimNetwork` that also *is* a
``pccl.net.base.Network`` (and its streams and listeners ``Stream`` / ``Listener``) and raises
pccl's transport errors (:data:`PCCL_ERRORS`), so pccl's master and communicators run on it as on
real TCP; ``pccl.testing.conformance`` holds both to one contract.  Nothing is wrapped: the
subclasses add the pccl base classes and a vocabulary, every call goes straight to the engine's
code.  The pccl scenario boots its hosts with it (``PcclScenario.network_class``); tests and
benchmarks that drive hosts by hand pass it to :func:`pccl_sim.engine.runner.simulate`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

import trio

from pccl import errors
from pccl.config import Config
from pccl.net.base import Listener, Network, Stream

from ...engine.errors import TransportErrors
from ...engine.hosts import Incarnation
from ...engine.network import World
from ...engine.streams import SimListener, SimNetwork, SimStream

__all__ = ["KernelCost", "PcclSimNetwork", "PcclSimStream", "PcclSimListener", "PCCL_ERRORS"]

logger = logging.getLogger(__name__)

#: pccl's transport errors, for the simulated network to raise.
PCCL_ERRORS = TransportErrors(
    transport=errors.TransportError,
    peer_disconnected=errors.PeerDisconnected,
    connection_refused=errors.ConnectionRefused,
    connect_timeout=errors.ConnectTimeout,
    address_in_use=errors.AddressInUse,
    stream_closed=errors.StreamClosed,
    invalid_usage=errors.InvalidUsage,
    invalid_argument=errors.InvalidArgument,
)


class PcclSimStream(SimStream, Stream):
    """A simulated connection end that is a :class:`pccl.net.base.Stream`."""

    # pccl's own helpers over receive_into, so the simulated stream behaves as pccl.net.base
    # defines them (the engine's copies serve workloads without pccl); blocking_io is inherited
    # from Stream (None: pccl's bulk paths use the async methods, no threads in a simulation).
    receive_exactly_into = Stream.receive_exactly_into
    receive_exactly = Stream.receive_exactly


class PcclSimListener(SimListener, Listener):
    """A simulated bound port that is a :class:`pccl.net.base.Listener`."""


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What a kernel costs a simulated host in virtual time: ``overhead`` seconds per call (a
    real peer hands the work to a lane or worker thread and is woken when it is done) plus
    ``nbytes / rate``.  pccl runs simulated kernels inline, in no virtual time, and then waits
    this long, shielded, as a real peer waits for its threads (an aborted op included)."""

    rate: float = 1e9
    overhead: float = 20e-6

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.overhead < 0:
            raise ValueError("a kernel cost needs a positive rate and a non-negative overhead")

    def seconds(self, nbytes: int) -> float:
        return self.overhead + nbytes / self.rate


class PcclSimNetwork(SimNetwork, Network):
    """A simulated host's :class:`pccl.net.base.Network`.  ``config.connect_timeout`` is the
    default ``connect`` timeout, as for :class:`pccl.net.tcp.TcpNetwork`.  ``kernel_cost``
    (``None``: kernels take no virtual time) is what :meth:`kernel_wait` charges; a scenario may
    set it before the host's pccl objects are made."""

    errors = PCCL_ERRORS
    stream_class = PcclSimStream
    listener_class = PcclSimListener

    def __init__(self, world: World, incarnation: Incarnation, *, config: Config | None = None,
                 kernel_cost: KernelCost | None = None) -> None:
        config = config if config is not None else Config()
        super().__init__(world, incarnation, connect_timeout=config.connect_timeout)
        self.kernel_cost = kernel_cost

    def local_addresses(self, family: str = "ipv4") -> list[str]:
        """The host's own name, its one interface address (pccl's local candidates; behind a
        simulated NAT it is private, reachable only from hosts behind the same NAT)."""
        return SimNetwork.local_addresses(self, family)

    def kernel_wait(self) -> Callable[[int], Awaitable[None]] | None:
        return None if self.kernel_cost is None else self._kernel_wait

    async def _kernel_wait(self, nbytes: int) -> None:
        """Sleep the kernel's virtual time; the host's death ends it at once (kill -9 takes the
        threads with the process: nothing of a dead incarnation may run on after its death)."""
        assert self.kernel_cost is not None
        incarnation = self.incarnation
        if not incarnation.alive:
            return
        with trio.CancelScope() as scope:  # cancelled by the death even inside pccl's shield
            incarnation.at_death.append(scope.cancel)
            try:
                await trio.sleep(self.kernel_cost.seconds(nbytes))
            finally:
                if scope.cancel in incarnation.at_death:
                    incarnation.at_death.remove(scope.cancel)
