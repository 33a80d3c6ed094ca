"""This host's interface addresses: what a peer registers as its local candidates
(:mod:`pccl.protocol.paths`), so that peers behind one NAT, or on one private network, find
each other on it.

Linux is read directly (``SIOCGIFADDR`` per interface for IPv4, ``/proc/net/if_inet6`` for
IPv6); elsewhere the addresses the host name resolves to stand in.  Nothing here raises: a
host whose interfaces cannot be read has no local candidates (the observed and advertised
ones remain).
"""

from __future__ import annotations

import logging
import socket
import struct
import sys

__all__ = ["interface_addresses"]

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


def _linux_ipv4() -> list[str]:
    import fcntl

    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on this interface (or it is down)
                continue
            out.append(socket.inet_ntoa(answer[20:24]))
    return out


def _linux_ipv6() -> list[str]:
    out: list[str] = []
    try:
        with open("/proc/net/if_inet6") as table:
            lines = table.read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or len(fields[0]) != 32:
            continue
        packed = bytes.fromhex(fields[0])
        out.append(socket.inet_ntop(socket.AF_INET6, packed))
    return out


def _by_host_name(family: socket.AddressFamily) -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


def interface_addresses(family: socket.AddressFamily = socket.AF_INET) -> list[str]:
    """The addresses of ``family`` on this host's interfaces, in interface order, without
    duplicates (loopback and link-local included: the caller filters)."""
    try:
        if sys.platform.startswith("linux"):
            found = _linux_ipv4() if family == socket.AF_INET else _linux_ipv6()
        else:
            found = _by_host_name(family)
    except OSError as exc:  # pragma: no cover - an exotic platform
        logger.debug("cannot read this host's interface addresses: %s", exc)
        found = []
    seen: set[str] = set()
    return [a for a in found if not (a in seen or seen.add(a))]  # type: ignore[func-returns-value]
