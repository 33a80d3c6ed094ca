"""pccl behind real NAT: a master, relays and training peers as OS processes inside the network
namespaces of ``nat.py`` (MASQUERADE routers that drop unsolicited inbound connections, DNAT
port maps, a public bridge that drops private addresses), with a run token.

Two topologies cover the cases, each ending with every peer at one revision with one hash of
its weights, and the paths the master reports (``pccl status --json``, from ``master
--status``) checked pair by pair against what the topology allows:

``test_combined_run`` (the acceptance run; cases 1, 3, 4, 5): a master that also relays
(``--relay``) and a ``pccl relay`` on the public network; a public peer; two port-mapped peers
whose routers forward other port numbers to them (``PCCL_ADVERTISE``, with the public host and
with the ports alone); two peers behind separate
NATs with nothing forwarded; a newcomer behind a third NAT joining mid-run and downloading the
shared state.  ``optimize_topology()`` probes every pair, so every pair's path is negotiated and
reported: connections to the mapped peer go direct to its advertised endpoint, to the public
peer direct, from a dialable peer to a NATed one reversed, between NATed peers relayed.

``test_relay_and_peer_killed`` (cases 2, 4, 6, 7): two ``pccl relay`` processes, two peers
behind one NAT (direct over their private addresses) and one behind another NAT with the same
private subnet (relayed; its private address names another peer behind the first NAT), its
uplink shaped so that a large all-reduce takes seconds.  The relay carrying ring traffic is
SIGKILLed once the all-reduce started: it aborts (``CollectiveAborted``), the retry goes
through the other relay.  Then the peer behind the other NAT is SIGKILLed mid-all-reduce and
a new process behind the same NAT takes its place, downloading the state.  Its routers and the
core refuse what they do not forward (the combined run's drop it, as stealth routers do), so
both ways a dial can fail are met.

The peers (``nat_pccl_peer.py``) are steered through a plan file: they hold at a revision until
released, so a newcomer or a replacement joins at a known point.  Needs root: skipped, saying
why, where namespaces or iptables cannot be used.
"""

from __future__ import annotations

import json
import pathlib
import re
import signal
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from e2e.child_process import Child
from nat import Host, NatTopology, in_netns, require_root_netns

HERE = pathlib.Path(__file__).resolve().parent
PEER = str(HERE / "nat_pccl_peer.py")
TOKEN = "nat-cases-token"
MASTER_PORT = 48148
RELAY_PORT = 48147
STATUS = "127.0.0.1:9148"
#: How long any one phase may take on a loaded machine before the test gives up (not a speed
#: assertion: nothing waits this long when things work).
PHASE_TIMEOUT = 120.0


class Proc(Child):
    """A process in a namespace; its JSON lines (the peer's events) parsed into :attr:`events`."""

    def __init__(self, name: str, host: Host, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.host = host
        prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
        super().__init__(name, in_netns(host.netns, [*prefix, *argv]))

    def on_line(self, line: str) -> None:
        if line.startswith("{"):
            try:
                self.events.append(json.loads(line))
            except json.JSONDecodeError:
                pass

    def find(self, event: str, **fields: Any) -> dict[str, Any] | None:
        for e in list(self.events):
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
                return e
        return None

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)


class Run:
    """One topology's pccl run: the processes, the plan file, waiting and reporting."""

    def __init__(self, net: NatTopology, tmp: pathlib.Path) -> None:
        self.net = net
        self.plan_path = tmp / "plan.json"
        self.procs: list[Proc] = []
        self.peers: dict[str, Proc] = {}
        self.master_host: Host | None = None
        self.master = ""

    # -- processes

    def _start(self, name: str, host: Host, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, host, argv, env)
        self.procs.append(proc)
        return proc

    def start_master(self, host: Host, *, relay: bool) -> Proc:
        self.master_host = host
        self.master = f"{host.address}:{MASTER_PORT}"
        proc = self._start("master", host, [sys.executable, "-m", "pccl", "master", "--listen", self.master,
                                            "--status", STATUS, "--peer-timeout", "20", "--heartbeat-interval",
                                            "0.5", *(["--relay"] if relay else [])], {"PCCL_TOKEN": TOKEN})
        self.wait_line(proc, "master listening on")
        return proc

    def start_relay(self, name: str, host: Host) -> Proc:
        proc = self._start(name, host, [sys.executable, "-m", "pccl", "relay", "--master", self.master, "--listen",
                                        f"0.0.0.0:{RELAY_PORT}", "--peer-timeout", "20", "--heartbeat-interval",
                                        "0.25"], {"PCCL_TOKEN": TOKEN})
        return proc

    def start_peer(self, name: str, host: Host, *, advertise: str | None = None, ports: tuple[int, int] | None = None,
                   key: str | None = None) -> Proc:
        env = {"PCCL_TOKEN": TOKEN}
        if advertise:
            env["PCCL_ADVERTISE"] = advertise
        argv = [sys.executable, PEER, "--master", self.master, "--name", name, "--plan", str(self.plan_path)]
        if ports:
            argv += ["--p2p-port", str(ports[0]), "--ss-port", str(ports[1])]
        proc = self._start(name, host, argv, env)
        self.peers[key or name] = proc
        return proc

    # -- steering

    def plan(self, **plan: Any) -> None:
        partial = self.plan_path.with_name(self.plan_path.name + ".partial")
        partial.write_text(json.dumps(plan))
        partial.rename(self.plan_path)

    def release(self, revision: int) -> None:
        self.plan_path.with_name(f"{self.plan_path.name}.go{revision}").touch()

    # -- waiting

    def diagnostics(self) -> str:
        return "\n".join(p.output(60) for p in self.procs)

    def wait(self, what: str, ready: Callable[[], Any], *, watch: Iterable[Proc] = (),
             timeout: float = PHASE_TIMEOUT) -> Any:
        """Poll ``ready`` until it returns something true; fail with every process's output if
        ``timeout`` passes or a process of ``watch`` exits."""
        deadline = time.monotonic() + timeout
        watch = list(watch)
        while True:
            result = ready()
            if result:
                return result
            dead = [p.name for p in watch if p.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:g} s"
                pytest.fail(f"waiting for {what}: {why}\n{self.diagnostics()}")
            time.sleep(0.05)

    def wait_line(self, proc: Proc, text: str) -> str:
        return self.wait(f"{proc.name} to log {text!r}",
                         lambda: next((line for line in list(proc.lines) if text in line), None), watch=[proc])

    def wait_event(self, procs: Iterable[Proc], event: str, **fields: Any) -> list[dict[str, Any]]:
        procs = list(procs)
        return self.wait(f"{event} {fields} from {[p.name for p in procs]}",
                         lambda: (found if all(found := [p.find(event, **fields) for p in procs]) else None),
                         watch=procs)

    def status(self) -> dict[str, Any]:
        assert self.master_host is not None
        out = self.net.run(self.master_host, [sys.executable, "-m", "pccl", "status", STATUS, "--json", "--token",
                                              TOKEN], timeout=60)
        return json.loads(out)

    def wait_status(self, what: str, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        def poll() -> dict[str, Any] | None:
            status = self.status()
            return status if ready(status) else None
        return self.wait(what, poll)

    def finish(self, procs: Iterable[Proc]) -> list[dict[str, Any]]:
        """Wait for every peer's ``done``; they exit cleanly."""
        procs = list(procs)
        done = self.wait_event(procs, "done")
        for p in procs:
            try:
                p.popen.wait(timeout=30)
            except Exception:
                pytest.fail(f"{p.name} did not exit after done\n{self.diagnostics()}")
            assert p.popen.returncode == 0, self.diagnostics()
        return done


# --- what the topology allows ------------------------------------------------------------------


class Placement:
    """Where each peer is: its host, and the endpoints it advertises (kind -> HOST:PORT)."""

    def __init__(self, net: NatTopology) -> None:
        self.net = net
        self.host_of: dict[str, Host] = {}  # peer id (hex) -> host
        self.advertised: dict[str, dict[str, str]] = {}

    def add(self, peer_id: str, host: Host, advertised: dict[str, str] | None = None) -> None:
        self.host_of[peer_id] = host
        if advertised:
            self.advertised[peer_id] = advertised

    def dialable(self, peer_id: str) -> bool:
        return self.host_of[peer_id].kind == "public" or peer_id in self.advertised

    def expected(self, initiator: str, target: str, port: str) -> tuple[str, Callable[[str], bool]]:
        """The path kind ``initiator``'s ``port`` connections to ``target`` must take, and a
        check of its ``via``."""
        src, dst = self.host_of[initiator], self.host_of[target]
        if dst.router is not None and dst.router == src.router:  # one NAT: private candidates
            return "direct", lambda via: via.startswith(f"{dst.address}:")
        if target in self.advertised:  # the mapped endpoint (a probe uses the p2p one)
            endpoint = self.advertised[target]["p2p" if port == "benchmark" else port]
            return "direct", lambda via: via == endpoint
        if dst.kind == "public":
            return "direct", lambda via: via.startswith(f"{dst.address}:")
        if self.dialable(initiator):
            return "reversed", lambda via: via == ""
        return "relayed", lambda via: re.fullmatch(r"relay \d+ at .+", via) is not None

    def check(self, paths: Iterable[tuple[str, str, str, str, str]]) -> dict[str, int]:
        """Every path matches the topology; returns the count of each kind."""
        counts: dict[str, int] = {}
        problems = []
        for initiator, target, port, kind, via in paths:
            want, via_ok = self.expected(initiator, target, port)
            if kind != want or not via_ok(via):
                problems.append(f"{self.host_of[initiator].name} -> {self.host_of[target].name} ({port}): "
                                f"{kind} via {via!r}, expected {want}")
            counts[kind] = counts.get(kind, 0) + 1
        assert not problems, "\n".join(problems)
        return counts


def status_paths(status: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(initiator, target, port, kind, via) of every path the master reports."""
    return [(peer["peer_id"], p["to"], p["port"], p["path"], p["via"])
            for group in status["groups"] for peer in group["peers"] + group["pending"] for p in peer["paths"]]


def group_peers(status: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The accepted and the pending peer ids of group 0."""
    (group,) = status["groups"] or [{"peers": [], "pending": []}]
    return [p["peer_id"] for p in group["peers"]], [p["peer_id"] for p in group["pending"]]


def assert_identical(done: list[dict[str, Any]], revision: int) -> None:
    assert {d["revision"] for d in done} == {revision}, done
    assert len({d["hash"] for d in done}) == 1, done


@pytest.fixture
def run(request: pytest.FixtureRequest, tmp_path: pathlib.Path):
    """A :class:`Run` in a fresh topology (``NatTopology`` options from an indirect parameter)."""
    require_root_netns()
    with NatTopology(**getattr(request, "param", {})) as net:
        r = Run(net, tmp_path)
        try:
            yield r
        finally:
            for p in r.procs:
                if p.popen.poll() is None:
                    p.popen.kill()


# --- the cases ---------------------------------------------------------------------------------


def test_combined_run(run: Run) -> None:
    net = run.net
    master_host = net.add_public_host("master")
    relay_host = net.add_public_host("relay")
    pub_host = net.add_public_host("pub")
    gpu = net.add_router("gpu")
    mapped_host = net.add_private_host("mapped", gpu)
    home1, home2, home3 = net.add_router("home1"), net.add_router("home2"), net.add_router("home3")
    a_host = net.add_private_host("a", home1)
    b_host = net.add_private_host("b", home2)
    c_host = net.add_private_host("c", home3)
    # the provider forwards public 40150 -> 48250 (p2p) and 40149 -> 48249 (shared state)
    net.map_port(gpu, 40150, mapped_host, 48250)
    net.map_port(gpu, 40149, mapped_host, 48249)
    advertised = {"p2p": f"{gpu.address}:40150", "shared_state": f"{gpu.address}:40149"}
    # another provider keeps the host's public address: the ports alone are advertised (the
    # master fills in the address it observes)
    gpu2 = net.add_router("gpu2")
    mapped2_host = net.add_private_host("mapped2", gpu2)
    net.map_port(gpu2, 41150, mapped2_host, 48150)
    net.map_port(gpu2, 41149, mapped2_host, 48149)
    advertised2 = {"p2p": f"{gpu2.address}:41150", "shared_state": f"{gpu2.address}:41149"}

    run.plan(min_world=5, optimize=True, hold=2)
    run.start_master(master_host, relay=True)
    relay = run.start_relay("relay", relay_host)
    run.wait_line(relay, "relay registered with master")
    pub = run.start_peer("pub", pub_host)
    mapped = run.start_peer("mapped", mapped_host, ports=(48250, 48249),
                            advertise=f"p2p={advertised['p2p']},shared_state={advertised['shared_state']}")
    mapped2 = run.start_peer("mapped2", mapped2_host, ports=(48150, 48149),
                             advertise="p2p=41150,shared_state=41149")
    a = run.start_peer("a", a_host)
    b = run.start_peer("b", b_host)
    first = [pub, mapped, mapped2, a, b]
    joined = run.wait_event(first, "joined")
    place = Placement(net)
    for proc, event in zip(first, joined):
        place.add(event["peer_id"], proc.host, {mapped: advertised, mapped2: advertised2}.get(proc))

    # every pair was probed by optimize_topology; all hold at revision 2
    run.wait_event(first, "held", revision=2)
    # case 5: a newcomer behind a third NAT; released once the master has it pending
    c = run.start_peer("c", c_host)
    run.wait_status("the newcomer pending", lambda s: len(group_peers(s)[1]) == 1)
    run.plan(hold=4)
    run.release(2)
    (c_joined,) = run.wait_event([c], "joined")
    place.add(c_joined["peer_id"], c_host)
    everyone = first + [c]
    run.wait_event(everyone, "held", revision=4)
    status = run.status()
    accepted, pending = group_peers(status)
    assert sorted(accepted) == sorted(place.host_of) and pending == []

    # the newcomer joined at revision 2 and downloaded the state
    (synced,) = run.wait_event([c], "synced")
    assert synced["revision"] == 2 and synced["rx_bytes"] > 0, synced

    # every pair's path is what the topology allows, and each way of meeting occurs
    paths = status_paths(status)
    counts = place.check(paths)
    assert counts.get("direct") and counts.get("reversed") and counts.get("relayed"), counts
    ids = {proc.name: e["peer_id"] for proc, e in zip(everyone, joined + [c_joined])}
    reported = {(i, t, port): (kind, via) for i, t, port, kind, via in paths}
    # the status shows a path for every pair of the peers that were there for the probes
    probed = [ids[p.name] for p in first]
    missing = [(place.host_of[x].name, place.host_of[y].name) for x in probed for y in probed
               if x != y and (x, y, "benchmark") not in reported]
    assert not missing, f"no path reported for {missing}: {paths}"
    # case 1: probes to the mapped peer go direct to its advertised endpoint
    for name in ("pub", "a", "b"):
        assert reported[(ids[name], ids["mapped"], "benchmark")] == ("direct", advertised["p2p"]), reported
        assert reported[(ids[name], ids["mapped2"], "benchmark")] == ("direct", advertised2["p2p"]), reported
    # case 3: a NATed peer and a public one: reversed one way, direct the other
    assert reported[(ids["pub"], ids["a"], "benchmark")] == ("reversed", "")
    assert reported[(ids["a"], ids["pub"], "benchmark")][0] == "direct"
    # case 4: two peers behind different NATs meet at a relay
    assert reported[(ids["a"], ids["b"], "benchmark")][0] == "relayed"
    # the newcomer fetched the state over paths the topology allows (checked above)
    assert any(i == ids["c"] and port == "shared_state" for i, _, port, _, _ in paths), paths
    relays = {r["relay_id"]: r for r in status["relays"]}
    assert any(r["own"] for r in relays.values()) and any(not r["own"] for r in relays.values()), relays
    assert sum(r["pairs_assigned"] for r in relays.values()) > 0

    run.plan(stop=5)
    run.release(4)
    done = run.finish(everyone)
    assert_identical(done, 5)
    # the peers' own view of their paths agrees with the topology too
    place.check((d["peer_id"], t, port, kind, via) for d in done for t, port, kind, via in d["paths"])


# Here the routers and the internet's core refuse what they do not forward (a TCP reset, an ICMP
# unreachable) instead of dropping it: a failed dial fails at once rather than timing out.
@pytest.mark.parametrize("run", [{"unroutable": "refuse"}], ids=["refusing"], indirect=True)
def test_relay_and_peer_killed(run: Run) -> None:
    net = run.net
    master_host = net.add_public_host("master")
    relay_hosts = [net.add_public_host("relay1"), net.add_public_host("relay2")]
    # Both homes use 192.168.1.0/24, as most do: the peer behind home2 has the address of one
    # behind home1, so dialling the other's private candidate reaches the wrong peer (or itself)
    # and must be told so by the knock.  home2's uplink is shaped: a large all-reduce through it
    # takes seconds, so a kill lands mid-op.
    home1 = net.add_router("home1", subnet="192.168.1.0/24", inbound="refuse")
    home2 = net.add_router("home2", subnet="192.168.1.0/24", inbound="refuse", rate="30mbit")
    a1_host, a2_host = net.add_private_host("a1", home1), net.add_private_host("a2", home1)
    b_host = net.add_private_host("b", home2)
    assert b_host.address == a1_host.address

    run.plan(min_world=3, hold=2)
    run.start_master(master_host, relay=False)
    relays = [run.start_relay(f"relay{i + 1}", h) for i, h in enumerate(relay_hosts)]
    for r in relays:
        run.wait_line(r, "relay registered with master")
    a1, a2, b = run.start_peer("a1", a1_host), run.start_peer("a2", a2_host), run.start_peer("b", b_host)
    peers = [a1, a2, b]
    joined = run.wait_event(peers, "joined")
    place = Placement(net)
    for proc, event in zip(peers, joined):
        place.add(event["peer_id"], proc.host)
    ids = {proc.name: e["peer_id"] for proc, e in zip(peers, joined)}
    run.wait_event(peers, "held", revision=2)

    status = run.status()
    paths = status_paths(status)
    counts = place.check(paths)  # case 2 (a1/a2 direct on private addresses) and case 4 (relayed)
    p2p = {(i, t): (kind, via) for i, t, port, kind, via in paths if port == "p2p"}
    assert any(kind == "direct" for kind, _ in p2p.values()) and counts.get("relayed"), paths
    # a1 and a2 share a NAT: they met on their private addresses
    for x, y in (("a1", "a2"), ("a2", "a1")):
        if (ids[x], ids[y]) in p2p:
            assert p2p[(ids[x], ids[y])] == ("direct", f"{place.host_of[ids[y]].address}:48150")
    # case 6: the relay carrying ring traffic is SIGKILLed once a large all-reduce is under way
    relay_at = {r["relay_id"]: r["address"] for r in status["relays"]}
    assert len(relay_at) == 2, status["relays"]
    used = {int(m.group(1)) for kind, via in p2p.values() if (m := re.match(r"relay (\d+) at", via))}
    assert used, f"no ring connection goes through a relay: {paths}"
    victim_id = min(used)
    victim_address = relay_at[victim_id].rsplit(":", 1)[0]
    victim = next(r for r in relays if r.host.address == victim_address)
    survivor_id = next(i for i in relay_at if i != victim_id)

    run.plan(bulk=3, bulk_floats=2 << 20, hold=5)  # 8 MiB more in the all-reduce of revision 3
    run.release(2)
    run.wait_event([b], "op_start", revision=3)
    time.sleep(0.5)  # the op's data is flowing through the 30 Mbit/s uplink (it takes seconds)
    victim.kill()
    run.wait_event(peers, "held", revision=5)
    aborted = [p.find("aborted", revision=3) for p in peers]
    assert any(aborted), f"the relay died but no all-reduce aborted\n{run.diagnostics()}"
    assert all(p.find("step", revision=4) for p in peers)  # the retry of revision 3 succeeded
    status = run.status()
    assert [r["relay_id"] for r in status["relays"]] == [survivor_id], status["relays"]
    paths = status_paths(status)
    place.check(paths)
    relayed = [via for _, _, port, kind, via in paths if kind == "relayed" and port == "p2p"]
    assert relayed and all(via.startswith(f"relay {survivor_id} at") for via in relayed), paths

    # case 7: the peer behind the other NAT is SIGKILLed mid-all-reduce; a new process behind the
    # same NAT takes its place and downloads the state
    run.plan(bulk=5, bulk_floats=2 << 20, hold=7)
    run.release(5)
    run.wait_event([b], "op_start", revision=5)
    time.sleep(0.5)
    b.kill()
    b2 = run.start_peer("b2", b_host)
    survivors = [a1, a2]
    run.wait_event(survivors, "held", revision=7)
    assert any(p.find("aborted", revision=5) for p in survivors), run.diagnostics()
    run.wait("the replacement registered or holding",
             lambda: b2.find("held", revision=7) or group_peers(run.status())[1], watch=[b2])
    run.plan(hold=8)
    run.release(7)
    (b2_joined,) = run.wait_event([b2], "joined")
    place.add(b2_joined["peer_id"], b_host)
    everyone = survivors + [b2]
    run.wait_event(everyone, "held", revision=8)
    (synced,) = run.wait_event([b2], "synced")
    assert 5 <= synced["revision"] <= 7 and synced["rx_bytes"] > 0, synced
    status = run.status()
    accepted, _ = group_peers(status)
    assert sorted(accepted) == sorted([ids["a1"], ids["a2"], b2_joined["peer_id"]])
    paths = status_paths(status)
    place.check(paths)
    assert any(b2_joined["peer_id"] in (i, t) and kind == "relayed" for i, t, _, kind, _ in paths), paths
    run.plan(stop=9)
    run.release(8)
    done = run.finish(everyone)
    assert_identical(done, 9)
    place.check((d["peer_id"], t, port, kind, via) for d in done for t, port, kind, via in d["paths"])
