"""Relays: processes that join peer pairs which cannot connect to each other either way
(``pccl relay``; the master serves as one too with ``pccl master --relay``).

:mod:`.server` is the relay process (its port, its registration with the master), :mod:`.hub`
the splice of two joined connections; who meets whom is the sans-IO rule of
:mod:`pccl.protocol.relay`, and when a pair is relayed is the master's
(:mod:`pccl.protocol.master.paths`) and the peer's connector's.
"""

from ..protocol.relay import JoinLimits, RELAY_JOIN_LIMITS
from .server import DEFAULT_RELAY_PORT, Relay, RelayStatistics, open_relay, run_relay, serve_relay

__all__ = ["Relay", "RelayStatistics", "serve_relay", "open_relay", "run_relay", "DEFAULT_RELAY_PORT",
           "JoinLimits", "RELAY_JOIN_LIMITS"]
