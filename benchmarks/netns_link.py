"""Two network namespaces joined by a veth pair, both ends shaped by tbf: the rate-limited link
the bandwidth benchmarks (diloco.py, quant_wire.py) run their peers over.  Needs root."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def tbf_namespaces(rate: str, *, prefix: str, subnet: str) -> Iterator[tuple[str, str]]:
    """Namespaces ``<prefix><pid>a`` (address ``<subnet>.1``) and ``...b`` (``<subnet>.2``)
    joined by a veth pair shaped to ``rate`` (e.g. ``200mbit``) both ways; yields their names and
    deletes them on exit.  Benchmarks that may run at once pass different prefixes and subnets."""
    tag = f"{prefix}{os.getpid()}"
    a, b = f"{tag}a", f"{tag}b"
    commands = [
        f"ip netns add {a}", f"ip netns add {b}",
        f"ip link add {tag}va type veth peer name {tag}vb",
        f"ip link set {tag}va netns {a}", f"ip link set {tag}vb netns {b}",
        f"ip -n {a} addr add {subnet}.1/24 dev {tag}va", f"ip -n {b} addr add {subnet}.2/24 dev {tag}vb",
        f"ip -n {a} link set {tag}va up", f"ip -n {b} link set {tag}vb up",
        f"ip -n {a} link set lo up", f"ip -n {b} link set lo up",
        f"ip netns exec {a} tc qdisc add dev {tag}va root tbf rate {rate} burst 256kb latency 100ms",
        f"ip netns exec {b} tc qdisc add dev {tag}vb root tbf rate {rate} burst 256kb latency 100ms",
    ]
    try:
        for command in commands:
            subprocess.run(command.split(), check=True, capture_output=True, text=True)
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
