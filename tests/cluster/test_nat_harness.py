"""The real-NAT harness (``nat.py``) does what it documents, shown with plain TCP sockets: tiny
servers and clients (``nat_probe.py``) run inside the namespaces.

Each test builds its own topology (well under a second).  "Dropped" is asserted as a connect
timeout of ``DROP_WAIT`` seconds; wherever a test expects a drop it also shows, in the same
topology, that the same server *is* reachable another way, so a drop never passes for a server
that is simply not there.  Needs root: skipped, saying why, where namespaces or iptables cannot
be used."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator, Sequence

import pytest
from nat import (
    PREFIX,
    PUBLIC_NETWORK,
    Host,
    NatTopology,
    NetnsCommandError,
    ip_batch,
    list_namespaces,
    netns_unavailable_reason,
    require_root_netns,
    tool,
)

PROBE = str(pathlib.Path(__file__).resolve().parent / "nat_probe.py")
#: A connect inside one machine takes well under a millisecond; no answer in this long is a drop.
DROP_WAIT = 1.5
PORT = 5000


@pytest.fixture
def net() -> Iterator[NatTopology]:
    require_root_netns()
    with NatTopology() as topology:
        yield topology


def serve(net: NatTopology, host: Host, port: int = PORT) -> subprocess.Popen[str]:
    """A probe server in ``host`` on all its addresses, ``port``; returns once it listens."""
    proc = net.popen(host, [sys.executable, "-S", PROBE, "serve", "0.0.0.0", str(port), host.name],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening"):
        proc.kill()
        raise AssertionError(f"the probe server in {host.name} did not start: {line!r} {proc.communicate()[1]}")
    return proc


def dial(net: NatTopology, host: Host, *targets: str) -> list[dict[str, str]]:
    """Dial every ``HOST:PORT`` from ``host`` at once; one result per target, in order:
    ``outcome`` (connected/timeout/refused/unreachable), ``server`` (the name of the host that
    answered), ``seen`` (the source address it saw), ``local`` (the dialler's own address)."""
    (results,) = dial_all(net, [(host, targets)])
    return results


def dial_all(net: NatTopology, plan: Sequence[tuple[Host, Sequence[str]]]) -> list[list[dict[str, str]]]:
    """Several hosts dialling at the same time (drops cost DROP_WAIT once, not once each)."""
    procs = [net.popen(host, [sys.executable, "-S", PROBE, "dial", str(DROP_WAIT), *targets],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for host, targets in plan]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        one = []
        for r in json.loads(out):
            server, seen_ip, seen_port = r["seen"].split() if r["seen"] else (None, None, None)
            local_ip, local_port = r["local"].split() if r["local"] else (None, None)
            one.append({"target": r["target"], "outcome": r["outcome"], "server": server, "seen": seen_ip,
                        "seen_port": seen_port, "local": local_ip, "local_port": local_port})
        results.append(one)
    return results


def outcomes(results: list[dict[str, str]]) -> list[str]:
    return [r["outcome"] for r in results]


def test_a_host_behind_nat_reaches_a_public_host_from_the_routers_address(net: NatTopology) -> None:
    server = net.add_public_host("server")
    home = net.add_router("home")
    alice = net.add_private_host("alice", home)
    serve(net, server)
    (result,) = dial(net, alice, f"{server.address}:{PORT}")
    assert result["outcome"] == "connected"
    assert result["server"] == "server"
    assert result["local"] == alice.address  # alice dials from her private address ...
    assert result["seen"] == home.address  # ... and the server sees the router's public one
    assert home.address != alice.address


@pytest.mark.parametrize("random_ports", [True, False])
def test_outbound_ports_are_random_or_preserved(random_ports: bool) -> None:
    require_root_netns()
    with NatTopology() as net:
        server = net.add_public_host("server")
        home = net.add_router("home", random_ports=random_ports)
        alice = net.add_private_host("alice", home)
        serve(net, server)
        results = dial(net, alice, *[f"{server.address}:{PORT}"] * 3)
    assert outcomes(results) == ["connected"] * 3
    assert {r["seen"] for r in results} == {home.address}
    preserved = [r["seen_port"] == r["local_port"] for r in results]
    if random_ports:
        # --random-fully: the chance that all three land on their own port by luck is ~1e-14
        assert not all(preserved), results
    else:
        assert all(preserved), results


def test_a_public_host_reaches_neither_a_private_address_nor_an_unmapped_router_port(net: NatTopology) -> None:
    server = net.add_public_host("server")
    home = net.add_router("home")  # inbound="drop", the default
    alice = net.add_private_host("alice", home)
    bob = net.add_private_host("bob", home)
    serve(net, alice)
    from_outside, from_lan = dial_all(net, [
        (server, [f"{alice.address}:{PORT}", f"{home.address}:{PORT}", f"{home.lan_address}:{PORT}"]),
        (bob, [f"{alice.address}:{PORT}"]),
    ])
    # alice's server is there (bob reaches it), yet from the internet every way in is dropped
    assert outcomes(from_lan) == ["connected"]
    assert from_lan[0]["server"] == "alice"
    assert outcomes(from_outside) == ["timeout", "timeout", "timeout"]


def test_a_refusing_router_and_core_fail_at_once() -> None:
    require_root_netns()
    with NatTopology(unroutable="refuse") as net:
        server = net.add_public_host("server")
        home = net.add_router("home", inbound="refuse")
        alice = net.add_private_host("alice", home)
        serve(net, alice)
        net.map_port(home, 40000, alice, PORT)
        results = dial(net, server, f"{alice.address}:{PORT}", f"{home.address}:{PORT}", f"{home.address}:40000")
    # the private address is unroutable (ICMP from the core), the unmapped port is refused by
    # the router (alice listens on PORT, but the RST is the router's), the mapped one works
    assert outcomes(results) == ["unreachable", "refused", "connected"]
    assert results[2]["server"] == "alice"


def test_a_mapped_port_with_another_number_reaches_the_inside_host(net: NatTopology) -> None:
    server = net.add_public_host("server")
    home = net.add_router("home")
    alice = net.add_private_host("alice", home)
    serve(net, alice)
    net.map_port(home, 40000, alice, PORT)
    mapped, unmapped = dial(net, server, f"{home.address}:40000", f"{home.address}:{PORT}")
    assert mapped["outcome"] == "connected"
    assert mapped["server"] == "alice"
    assert mapped["seen"] == server.address  # DNAT keeps the true source
    assert unmapped["outcome"] == "timeout"  # the inside port number itself is not open
    with pytest.raises(ValueError, match="already maps port 40000"):
        net.map_port(home, 40000, alice, PORT + 1)


def test_hosts_behind_the_same_nat_reach_each_other_on_private_addresses(net: NatTopology) -> None:
    home = net.add_router("home")
    alice = net.add_private_host("alice", home)
    bob = net.add_private_host("bob", home)
    serve(net, bob)
    (result,) = dial(net, alice, f"{bob.address}:{PORT}")
    assert result["outcome"] == "connected"
    assert result["server"] == "bob"
    assert result["seen"] == alice.address  # no NAT on the LAN


def test_hosts_behind_different_nats_meet_only_through_a_mapping(net: NatTopology) -> None:
    home = net.add_router("home")
    office = net.add_router("office")
    alice = net.add_private_host("alice", home)
    carol = net.add_private_host("carol", office)
    dave = net.add_private_host("dave", office)
    serve(net, carol)
    with pytest.raises(ValueError, match="not behind router home"):
        net.map_port(home, 40000, carol, PORT)
    before, control = dial_all(net, [
        (alice, [f"{carol.address}:{PORT}", f"{office.address}:{PORT}", f"{office.address}:40000"]),
        (dave, [f"{carol.address}:{PORT}"]),
    ])
    assert outcomes(control) == ["connected"]
    assert outcomes(before) == ["timeout", "timeout", "timeout"]
    net.map_port(office, 40000, carol, PORT)
    (after,) = dial(net, alice, f"{office.address}:40000")
    assert after["outcome"] == "connected"
    assert after["server"] == "carol"
    assert after["seen"] == home.address


def test_two_routers_may_use_the_same_private_subnet() -> None:
    require_root_netns()
    with NatTopology() as net:
        home = net.add_router("home", subnet="192.168.1.0/24")
        office = net.add_router("office", subnet="192.168.1.0/24")
        alice = net.add_private_host("alice", home)
        carol = net.add_private_host("carol", office)
        assert alice.address == carol.address == "192.168.1.2"
        serve(net, alice)
        serve(net, carol)
        from_alice, from_carol = dial_all(net, [(alice, [f"{carol.address}:{PORT}"]),
                                               (carol, [f"{alice.address}:{PORT}"])])
    # the same address names a different host behind each router: each dials itself
    assert [r["server"] for r in from_alice + from_carol] == ["alice", "carol"]


def test_hairpin_is_off_by_default_and_on_when_asked(net: NatTopology) -> None:
    home = net.add_router("home")
    loop = net.add_router("loop", hairpin=True)
    alice, bob = net.add_private_host("alice", home), net.add_private_host("bob", home)
    carol, dave = net.add_private_host("carol", loop), net.add_private_host("dave", loop)
    serve(net, bob)
    serve(net, dave)
    net.map_port(home, 40000, bob, PORT)
    net.map_port(loop, 40000, dave, PORT)
    (without,), (with_,) = dial_all(net, [(alice, [f"{home.address}:40000"]), (carol, [f"{loop.address}:40000"])])
    # without NAT loopback the router's own (closed) port answers; with it, the mapping does,
    # and the inside server sees the router's LAN address
    assert without["outcome"] == "refused"
    assert with_["outcome"] == "connected"
    assert with_["server"] == "dave"
    assert with_["seen"] == loop.lan_address


def test_a_rate_limit_shapes_both_ends_of_the_link(net: NatTopology) -> None:
    server = net.add_public_host("server")
    home = net.add_router("home")
    alice = net.add_private_host("alice", home, rate="20mbit")
    for netns, device in ((alice.netns, alice.device), (alice.peer_netns, alice.peer_device)):
        qdiscs = json.loads(subprocess.run([tool("ip"), "netns", "exec", netns, tool("tc"), "-j", "qdisc", "show",
                                            "dev", device], capture_output=True, text=True, check=True).stdout)
        assert [(q["kind"], q["options"]["rate"]) for q in qdiscs] == [("tbf", 2_500_000)]  # bytes/s
    serve(net, server)
    out = net.run(alice, [sys.executable, "-S", PROBE, "blast", f"{server.address}:{PORT}", str(1_250_000)])
    result = json.loads(out)
    assert result["bytes"] == 1_250_000
    # 10 Mbit past a 256 KiB burst at 20 Mbit/s take >= 0.4 s (a lower bound: load only adds)
    assert result["seconds"] >= 0.35, result


def test_addresses_are_read_from_the_kernel_and_names_are_tagged() -> None:
    require_root_netns()
    with NatTopology() as net:
        hosts = [net.add_public_host("server"), net.add_public_host("relay")]
        routers = [net.add_router("home"), net.add_router("office")]
        hosts += [net.add_private_host(name, router) for router in routers for name in (f"{router.name}a",
                                                                                         f"{router.name}b")]
        for host in hosts:
            assert net.addresses(host) == [host.address]
        for router in routers:
            assert sorted(net.addresses(router)) == sorted([router.address, router.lan_address])
            assert ipaddress_in_public(router.address)
        ours = [name for name in list_namespaces() if name.startswith(net.tag + "-")]
        assert len(ours) == 9  # the internet, 2 public hosts, 2 routers, 4 behind them
        for host in hosts + routers:
            assert host.netns.startswith(f"{PREFIX}{os.getpid()}t")
            for device in (host.device, host.peer_device):
                assert device.startswith(f"pn{os.getpid()}") and len(device) <= 15
        print(f"\n9 namespaces built in {net.build_seconds:.3f} s")
    print(f"torn down in {net.teardown_seconds:.3f} s")


def ipaddress_in_public(address: str) -> bool:
    import ipaddress

    return ipaddress.IPv4Address(address) in PUBLIC_NETWORK


def _gone(pid: int) -> bool:
    """No such process, or a zombie waiting for its parent (it holds no namespace)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_teardown_leaves_nothing_behind_even_after_a_failure() -> None:
    require_root_netns()
    topology = NatTopology()
    with pytest.raises(ZeroDivisionError):
        with topology as net:
            home = net.add_router("home", rate="100mbit")
            alice = net.add_private_host("alice", home)
            server = serve(net, alice)
            # a process the harness did not start itself: a daemon left behind inside alice
            orphan = int(net.run(alice, ["/bin/sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]))
            assert not _gone(orphan)
            1 / 0
    assert server.poll() is not None
    assert _gone(orphan)
    assert [name for name in list_namespaces() if name.startswith(topology.tag + "-")] == []
    root_devices = subprocess.run([tool("ip"), "-o", "link", "show"], capture_output=True, text=True, check=True)
    assert f"pn{os.getpid()}" not in root_devices.stdout  # no device ever lived in the root namespace
    with pytest.raises(RuntimeError, match="inside the `with"):
        topology.add_public_host("late")


def test_stale_namespaces_of_a_dead_run_are_removed_and_live_ones_kept() -> None:
    require_root_netns()
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()  # its pid is now free: the owner of a run killed before it could tear down
    stale, live = f"{PREFIX}{child.pid}t0-old", f"{PREFIX}{os.getpid()}t999-live"
    ip_batch([f"netns add {stale}", f"netns add {live}"])
    try:
        with NatTopology():
            names = list_namespaces()
            assert stale not in names
            assert live in names  # its owner (this process) is alive
    finally:
        ip_batch([f"netns del {name}" for name in (stale, live) if name in list_namespaces()], force=True)


def test_failures_show_the_command_and_its_stderr(net: NatTopology) -> None:
    server = net.add_public_host("server")
    with pytest.raises(NetnsCommandError, match=r"`.*ip link set nosuchdev up` exited with status 1: "
                                                r"Cannot find device \"nosuchdev\""):
        net.run(server, ["ip", "link", "set", "nosuchdev", "up"])
    with pytest.raises(NetnsCommandError) as batch:
        ip_batch(["link set lo up", "link set nosuchdev up"], netns=server.netns)
    assert "Cannot find device" in str(batch.value)
    assert "2: link set nosuchdev up" in str(batch.value)  # the batch, numbered
    with pytest.raises(NetnsCommandError, match="illegal value for \"rate\""):
        net.limit_rate(server, "fast")
    with pytest.raises(ValueError, match="host name"):
        net.add_public_host("Bad_Name")
    with pytest.raises(ValueError, match="already a host"):
        net.add_public_host("server")
    with pytest.raises(ValueError, match="not a router"):
        net.add_private_host("alice", server)


def test_without_root_the_tests_skip_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    netns_unavailable_reason.cache_clear()
    try:
        with pytest.raises(pytest.skip.Exception, match=r"needs root and iproute2/iptables: not root \(euid 1000\)"):
            require_root_netns()
    finally:
        netns_unavailable_reason.cache_clear()  # the next test probes again, as root
