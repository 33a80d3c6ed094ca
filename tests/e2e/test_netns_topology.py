"""optimize_topology on real TCP across two "sites" made of network namespaces: links inside a
site unlimited, the link between the sites shaped with tbf.  After
optimize_topology() the ring crosses between the sites exactly twice.  The test asserts the
ring; the all-reduce times before and after are printed for the note (run with ``-s``).

Needs root (``ip netns``, ``tc``): marked slow; skipped, saying why, where namespaces cannot be
made."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TOKEN = "netns-token"
RATE = "200mbit"
MIB = 64

pytestmark = pytest.mark.slow


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_sites():
    tag = f"{os.getpid() % 100000}"
    ns = (f"pcclA{tag}", f"pcclB{tag}")
    dev = (f"pva{tag}", f"pvb{tag}")
    try:
        sh("ip", "netns", "add", ns[0])
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create network namespaces here ({exc}); this test needs root and iproute2")
    try:
        sh("ip", "netns", "add", ns[1])
        sh("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i, address in enumerate(("10.77.0.1/24", "10.77.0.2/24")):
            sh("ip", "link", "set", dev[i], "netns", ns[i])
            sh("ip", "-n", ns[i], "addr", "add", address, "dev", dev[i])
            sh("ip", "-n", ns[i], "link", "set", dev[i], "up")
            sh("ip", "-n", ns[i], "link", "set", "lo", "up")
            # Between the sites: a token bucket (tbf) of RATE.  (netem, for a delay, is not in
            # every kernel; the rate alone separates the sites.)
            sh("ip", "netns", "exec", ns[i], "tc", "qdisc", "add", "dev", dev[i], "root", "tbf", "rate", RATE,
               "burst", "256kb", "latency", "200ms")
        yield ns
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def crossings(ring, site_of):
    return sum(site_of[ring[i]] != site_of[ring[(i + 1) % len(ring)]] for i in range(len(ring)))


def test_optimised_ring_crosses_between_sites_twice(two_sites) -> None:
    ns_a, ns_b = two_sites
    master = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-m", "pccl", "master", "--listen",
                               "10.77.0.1:0", "--token", TOKEN, "--peer-timeout", "20", "--log-level", "INFO"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peers: list[subprocess.Popen] = []
    try:
        address = None
        for line in master.stdout:  # type: ignore[union-attr]
            if "master listening on" in line:
                address = line.strip().rsplit(" ", 1)[-1]
                break
        assert address is not None, "the master did not start"
        for i, ns in enumerate((ns_a, ns_b, ns_a, ns_b)):
            peers.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, str(HERE / "netns_peer.py"), address, TOKEN, "4",
                 str(MIB), "A" if ns == ns_a else "B"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for p in peers:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
        master.kill()
        master.wait()
    site_of = {r["peer_id"]: r["site"] for r in results}
    rings = {tuple(r["ring_after"]) for r in results}
    assert len(rings) == 1
    (ring,) = rings
    assert sorted(ring) == sorted(site_of)
    assert crossings(ring, site_of) == 2
    before = max(r["before"] for r in results)
    after = max(r["after"] for r in results)
    print(f"\n{MIB} MiB all-reduce, 2 sites x 2 peers, {RATE} (tbf) between sites: "
          f"join ring ({crossings(tuple(results[0]['ring_before']), site_of)} crossings) {before:.2f} s, "
          f"optimised ring (2 crossings) {after:.2f} s; optimize_topology {max(r['optimise'] for r in results):.2f} s")
