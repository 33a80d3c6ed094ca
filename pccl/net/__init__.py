"""Transport layer: the only code in pccl that touches sockets."""

from .base import Listener, Network, Stream, format_address, parse_address

__all__ = ["Listener", "Network", "Stream", "format_address", "parse_address"]
