"""Transport layer: the only code in pccl that touches sockets."""

from .base import Listener, Network, Stream, format_address, parse_address
from .tcp import TcpNetwork

__all__ = ["Listener", "Network", "Stream", "TcpNetwork", "format_address", "parse_address"]
