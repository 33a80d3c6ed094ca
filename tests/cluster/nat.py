"""Real NAT on one machine, for end-to-end tests: network namespaces, veth pairs, bridges and
iptables, built and torn down by a context manager.

What it models
--------------

``NatTopology`` builds a small internet inside one Linux host:

* **The internet** is a namespace of its own (``<tag>-inet``) holding a bridge, the "public"
  network ``198.18.0.0/15`` (RFC 2544's benchmarking range: never routed on the real internet, so
  nothing the tests send can leave the machine by mistake).  The namespace is also the ISP core:
  it has the address ``198.18.0.1`` on the bridge, every public host and router routes its
  default through it, and it drops everything not addressed to the public network (a
  ``blackhole`` default route: a packet to a private address such as ``10.1.0.2`` is dropped
  the way the real internet drops bogons, and the dialler times out).  ``unroutable="refuse"``
  makes the core answer with ICMP host-unreachable instead (the dialler fails at once).
* **Public hosts** are namespaces with one address on the public bridge: reachable by anyone.
* **NAT routers** model a home router (or a CGNAT box): a namespace with a public address on the
  bridge (its WAN side) and a private subnet behind it (its LAN side, a bridge of its own — the
  home switch).  Forwarding is on and ``iptables -t nat -A POSTROUTING -o <wan> -j MASQUERADE``
  rewrites the source of everything leaving for the internet to the router's public address.
  Linux's conntrack then gives *address-and-port-dependent filtering*: replies to connections
  from inside come back in, nothing else does.

  Inbound connections to the router's public address that match no port mapping are **dropped
  by default** (``inbound="drop"``: the SYN is discarded, the dialler sees a connect timeout),
  which is what most home routers do (a "stealth" WAN port).  ``inbound="refuse"`` answers
  with a TCP RST (the dialler sees "connection refused" at once), as some routers and most
  hosts with a closed port do.

  ``random_ports=True`` (the default) uses ``MASQUERADE --random-fully``: every outbound
  connection leaves from a random public port, so the port a remote host observes is *never*
  the port the inside host bound (code that takes an observed source port for a listening port
  fails here, as it does behind a CGNAT or a strict router).  ``random_ports=False`` is plain
  MASQUERADE, which keeps the source port whenever it is free on the public address, as many
  home routers do.

  ``hairpin=False`` (the default): a host behind the router dialling the router's own public
  address reaches the router itself, not the port mapping (no NAT loopback; the connection is
  refused since nothing listens on the router).  ``hairpin=True`` turns NAT loopback on: mapped
  ports work from inside too, and the inside server sees the router's LAN address as the source.
* **Hosts behind a NAT** are namespaces on a router's private subnet, default route via the
  router.  Hosts behind the same router reach each other directly on their private addresses
  (they share the LAN bridge); hosts behind different routers cannot, since private addresses
  are not routed on the internet.  Two routers may use the *same* private subnet (as two homes
  with ``192.168.1.0/24`` do); their hosts then have equal addresses that name different hosts.
* **Port mappings** (``map_port(router, public_port, host, port)``): a TCP DNAT rule on the
  router, ``public_port -> (inside host, port)``; the two numbers may differ.  The inside host
  sees the true public source of the dialler (DNAT does not rewrite the source).
* **Rate limits** (``rate="200mbit"`` or ``limit_rate``): a tbf qdisc on both ends of the
  host's link, so both directions are shaped.  A router's link is its WAN uplink, shared by
  every host behind it; a private host's link is its LAN cable.  (This kernel has tbf but not
  netem: there is no delay or loss model.)

Only TCP port mappings are made (pccl speaks TCP); MASQUERADE itself translates every protocol.

Names and isolation
-------------------

Every name carries a per-process tag: namespaces are ``pnat<pid>t<n>-<host name>`` (``n``
counts the topologies of this process), devices ``pn<pid><letter><k>`` (``k`` counts the links of
this process; at most 15 characters, Linux's limit).  Every device is created directly inside
its namespaces (``ip link add ... netns ...``) and never exists in the root namespace, and every
address lives inside the topology's own namespaces, so concurrent topologies (pytest-xdist
workers, other users of the machine) never see each other: two topologies may even use the same
addresses.  Nothing is configured in the root namespace.

Teardown (``close``, or leaving the ``with`` block, also on an exception) kills the processes
started by ``popen`` and anything else still running inside the namespaces, then deletes the
namespaces; the kernel removes their devices, addresses, routes and iptables rules with them.
At start, namespaces with this module's prefix whose owner pid is no longer alive (a run killed
with SIGKILL, which could not clean up) are removed the same way.

Processes run in a host through ``ip netns exec`` (``popen``/``run``); ``ip netns exec`` execs
the command itself, so a ``Popen``'s pid is the process's own.

Speed: configuration is batched (``ip -batch``, ``iptables-restore``: two or three short
processes per namespace), so a topology of ~9 namespaces builds in well under a second
(``build_seconds``/``teardown_seconds`` record the figures of a topology).

Example::

    require_root_netns()               # in a test: skips, saying why, where this cannot run
    with NatTopology() as net:
        server = net.add_public_host("server")
        home = net.add_router("home")
        alice = net.add_private_host("alice", home)
        net.map_port(home, 40000, alice, 5000)      # home's public port 40000 -> alice:5000
        web = net.popen(alice, [sys.executable, "-m", "http.server", "5000"])
        ...                                          # wait until it listens, then:
        page = net.run(server, [sys.executable, "-c", "import urllib.request; "
                                f"print(urllib.request.urlopen('http://{home.address}:40000/').status)"])
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

#: Every namespace this module makes starts with this (see ``remove_stale_namespaces``).
PREFIX = "pnat"
#: The public network (the bridge in the internet namespace).
PUBLIC_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
#: The ISP core's address on the public network, every public host's default gateway.
CORE_ADDRESS = str(PUBLIC_NETWORK.network_address + 1)
#: Where ``ip netns`` keeps its named namespaces.
NETNS_DIR = "/run/netns"
#: Longest interface name Linux accepts (IFNAMSIZ - 1).
IFNAME_MAX = 15
#: A configuration command that takes longer than this has hung.
COMMAND_TIMEOUT = 30.0

_NAME = re.compile(r"[a-z][a-z0-9]{0,15}\Z")
_OURS = re.compile(re.escape(PREFIX) + r"(\d+)t[a-z0-9]*-")
_topologies = itertools.count()
_links = itertools.count()

Inbound = Literal["drop", "refuse"]


class NetnsCommandError(RuntimeError):
    """A command the harness ran failed: the message shows the command, its exit status, its
    stderr (and, for a batch, the numbered batch it was given)."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str, stdin: str | None = None) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        status = "timed out" if returncode is None else f"exited with status {returncode}"
        message = f"`{shlex.join(self.argv)}` {status}"
        message += f": {stderr.strip()}" if stderr.strip() else " (no stderr)"
        if stdin:
            numbered = "\n".join(f"  {i:3}: {line}" for i, line in enumerate(stdin.splitlines(), 1))
            message += f"\nits input was:\n{numbered}"
        super().__init__(message)


# --- running commands ----------------------------------------------------------------------------


@functools.cache
def tool(name: str) -> str:
    """The absolute path of a system tool (``ip``, ``iptables``, ``tc``), also found where the
    sbin directories are not on ``PATH``; ``FileNotFoundError`` if it is not installed."""
    path = shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        raise FileNotFoundError(f"{name} is not installed (looked on PATH, /usr/sbin and /sbin)")
    return path


def sh(argv: Sequence[str], *, stdin: str | None = None, timeout: float = COMMAND_TIMEOUT) -> str:
    """Run a command, return its stdout; ``NetnsCommandError`` (command and stderr) if it fails."""
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise NetnsCommandError(argv, None, err, stdin) from None
    if proc.returncode != 0:
        raise NetnsCommandError(argv, proc.returncode, proc.stderr, stdin)
    return proc.stdout


def ip_batch(lines: Iterable[str], *, netns: str | None = None, force: bool = False) -> None:
    """Run ``ip`` commands (without the leading ``ip``) in one ``ip -batch`` process, in
    ``netns`` if given.  ``force`` goes on past failing lines (and still reports them)."""
    script = "".join(f"{line}\n" for line in lines)
    if not script:
        return
    argv = [tool("ip")] + (["-n", netns] if netns else []) + (["-force"] if force else []) + ["-batch", "-"]
    sh(argv, stdin=script)


def in_netns(netns: str, argv: Sequence[str]) -> list[str]:
    """``argv`` prefixed to run inside ``netns`` (``ip netns exec``, which execs it)."""
    return [tool("ip"), "netns", "exec", netns, *argv]


def _sysctl_script(settings: dict[str, str], *, optional: Iterable[str] = ()) -> str:
    """A ``sh`` script writing sysctls through /proc/sys (no procps needed); ``optional`` keys
    are skipped where the kernel has no such file (br_netfilter's, say)."""
    optional = set(optional)
    lines = ["set -e"]
    for key, value in settings.items():
        path = "/proc/sys/" + key.replace(".", "/")
        write = f"echo {value} > {path}"
        lines.append(f"if [ -e {path} ]; then {write}; fi" if key in optional else write)
    return "\n".join(lines)


# --- namespaces ----------------------------------------------------------------------------------


def list_namespaces() -> list[str]:
    """The names of all named network namespaces (``ip netns list``, read from /run/netns)."""
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespace_pids(netns: str) -> list[int]:
    """Pids of the processes inside ``netns`` (``ip netns pids``); [] if it is gone."""
    try:
        out = sh([tool("ip"), "netns", "pids", netns])
    except NetnsCommandError:
        return []
    return [int(word) for word in out.split()]


def delete_namespaces(names: Sequence[str]) -> list[str]:
    """Kill every process still inside the namespaces (SIGKILL, by pid), delete them; return
    the names that are still there afterwards (none, normally)."""
    for netns in names:
        for pid in namespace_pids(netns):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    existing = set(list_namespaces())
    present = [netns for netns in names if netns in existing]
    if present:
        try:
            ip_batch((f"netns del {netns}" for netns in present), force=True)
        except NetnsCommandError:
            pass  # a name deleted meanwhile (a concurrent stale clean-up); checked just below
    existing = set(list_namespaces())
    return [netns for netns in names if netns in existing]


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of this module (prefix ``pnat<pid>t<n>-``) whose owner pid is no
    longer alive: the leftovers of a run killed before it could tear down.  Namespaces of live
    processes are left alone (a reused pid only delays the clean-up).  Returns the names
    deleted."""
    stale = [netns for netns in list_namespaces()
             if (m := _OURS.match(netns)) and not _pid_alive(int(m.group(1)))]
    if stale:
        delete_namespaces(stale)
    return stale


# --- root check ----------------------------------------------------------------------------------


@functools.cache
def netns_unavailable_reason() -> str | None:
    """Why namespaces with iptables cannot be used here (not root, a tool missing, not
    permitted), or ``None`` if they can.  Probes once per process: makes a namespace and lists
    its NAT table.  A failure that is not about permissions raises (a broken harness must fail,
    not skip)."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()})"
    for name in ("ip", "iptables", "iptables-restore", "tc"):
        try:
            tool(name)
        except FileNotFoundError as exc:
            return str(exc)
    probe = f"{PREFIX}{os.getpid()}tprobe-probe"
    try:
        sh([tool("ip"), "netns", "add", probe])
        sh(in_netns(probe, [tool("iptables"), "-w", "-t", "nat", "-S"]))
    except NetnsCommandError as exc:
        if any(s in exc.stderr for s in ("Operation not permitted", "Permission denied")):
            return str(exc)
        raise
    finally:
        delete_namespaces([probe])
    return None


def require_root_netns() -> None:
    """In a test: skip it, with the reason, where network namespaces and iptables cannot be
    used (not root, iproute2/iptables missing, not permitted); otherwise return."""
    reason = netns_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(f"needs root and iproute2/iptables: {reason}")


# --- the topology --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Host:
    """A namespace of the topology.  ``address`` is its address on its network: the public
    bridge for public hosts and routers, the router's LAN for hosts behind a NAT."""

    name: str
    netns: str
    kind: Literal["public", "router", "private"]
    address: str
    #: The device of its link inside its own namespace, and the other end (in ``peer_netns``).
    device: str
    peer_device: str
    peer_netns: str
    #: The router it sits behind (hosts behind a NAT only).
    router: str | None = None


@dataclasses.dataclass(frozen=True)
class Router(Host):
    """A NAT router: ``address`` is its public address, ``lan_address`` its address on
    ``subnet`` (the default gateway of the hosts behind it); ``device`` is its WAN side."""

    lan_address: str = ""
    subnet: str = ""
    lan_bridge: str = ""
    inbound: Inbound = "drop"
    random_ports: bool = True
    hairpin: bool = False


HostRef = Host | str
_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(method: _F) -> _F:
    """Adds the time a building method takes to ``build_seconds`` (outermost call only)."""

    @functools.wraps(method)
    def timed(self: NatTopology, *args: Any, **kwargs: Any) -> Any:
        if self._timing:
            return method(self, *args, **kwargs)
        self._timing = True
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._timing = False
            self.build_seconds += time.perf_counter() - start

    return timed  # type: ignore[return-value]


class NatTopology:
    """A small internet of namespaces (see the module's documentation); a context manager
    that builds the internet namespace on entry and deletes everything on exit.

    ``unroutable``: what the core does with packets to addresses off the public network
    (private addresses, anything else): ``"drop"`` (default; the dialler times out) or
    ``"refuse"`` (ICMP host-unreachable; the dialler fails at once)."""

    def __init__(self, *, unroutable: Inbound = "drop") -> None:
        if unroutable not in ("drop", "refuse"):
            raise ValueError(f"unroutable must be 'drop' or 'refuse', not {unroutable!r}")
        self.unroutable = unroutable
        self.pid = os.getpid()
        self.tag = f"{PREFIX}{self.pid}t{next(_topologies)}"
        self.internet = f"{self.tag}-inet"
        self.bridge = self._device("B")
        self.hosts: dict[str, Host] = {}
        self.build_seconds = 0.0
        self.teardown_seconds: float | None = None
        self.stale_removed: list[str] = []
        self._namespaces: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._public = PUBLIC_NETWORK.hosts()
        next(self._public)  # the core's
        self._next_subnet = 1
        self._lan_hosts: dict[str, Any] = {}
        self._mappings: dict[str, dict[int, tuple[str, int]]] = {}
        self._entered = False
        self._closed = False
        self._timing = False

    # -- lifecycle

    def __enter__(self) -> NatTopology:
        if self._entered:
            raise RuntimeError("a NatTopology is entered once")
        self._entered = True
        start = time.perf_counter()
        try:
            self.stale_removed = remove_stale_namespaces()
            self._add_namespace(self.internet)
            ip_batch([
                "link set lo up",
                f"link add {self.bridge} type bridge",
                f"addr add {CORE_ADDRESS}/{PUBLIC_NETWORK.prefixlen} dev {self.bridge}",
                f"link set {self.bridge} up",
                f"route add {'blackhole' if self.unroutable == 'drop' else 'unreachable'} default",
            ], netns=self.internet)
            # The core forwards nothing (public hosts share the bridge) but must route to answer
            # with ICMP unreachable; its ICMP is not rate limited (every dial must see it), and
            # bridged frames do not go through iptables (there are no rules here anyway).
            self._sh_in(self.internet, _sysctl_script(
                {"net.ipv4.ip_forward": "1", "net.ipv4.icmp_ratelimit": "0",
                 "net.bridge.bridge-nf-call-iptables": "0"},
                optional=["net.bridge.bridge-nf-call-iptables"]))
        except BaseException:
            self.close()
            raise
        self.build_seconds += time.perf_counter() - start
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the processes started here and everything else inside the namespaces, delete
        the namespaces (idempotent).  Raises ``RuntimeError`` if a namespace survives."""
        if self._closed:
            return
        self._closed = True
        start = time.perf_counter()
        for proc in self._processes:
            if proc.poll() is None:
                proc.kill()
        for proc in self._processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left = delete_namespaces(list(reversed(self._namespaces)))
        self.teardown_seconds = time.perf_counter() - start
        if left:
            raise RuntimeError(f"could not delete the namespaces {left}")

    # -- building

    @_timed
    def add_public_host(self, name: str, *, rate: str | None = None) -> Host:
        """A host with one address on the public network, reachable by everyone."""
        return self._add_public(name, "public", rate)

    @_timed
    def add_router(self, name: str, *, subnet: str | None = None, inbound: Inbound = "drop",
                   random_ports: bool = True, hairpin: bool = False, rate: str | None = None) -> Router:
        """A NAT router: a public address, and ``subnet`` behind it (default ``10.<n>.0.0/24``,
        ``n`` counting this topology's routers; routers may share a subnet).  ``inbound``: what
        happens to unmapped inbound connections ("drop": the dialler times out; "refuse": TCP
        RST).  ``random_ports``: MASQUERADE ``--random-fully`` (outbound connections leave from
        random ports) rather than port-preserving.  ``hairpin``: NAT loopback for port
        mappings.  ``rate``: tbf on the router's uplink."""
        if inbound not in ("drop", "refuse"):
            raise ValueError(f"inbound must be 'drop' or 'refuse', not {inbound!r}")
        if subnet is None:
            subnet = f"10.{self._next_subnet}.0.0/24"
            self._next_subnet += 1
        network = ipaddress.IPv4Network(subnet)
        if network.num_addresses < 4:
            raise ValueError(f"subnet {subnet} has no room for hosts")
        base = self._add_public(name, "router", rate, create=False)
        lan_bridge = self._device("L")
        lan_address = network.network_address + 1
        router = Router(**dataclasses.asdict(base), lan_address=str(lan_address), subnet=str(network),
                        lan_bridge=lan_bridge, inbound=inbound, random_ports=random_ports, hairpin=hairpin)
        self._create_uplinked(router, rate, extra=[
            f"link add {lan_bridge} type bridge",
            f"addr add {lan_address}/{network.prefixlen} dev {lan_bridge}",
            f"link set {lan_bridge} up",
        ])
        wan, lan = router.device, lan_bridge
        lines = ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]",
                 ":POSTROUTING ACCEPT [0:0]",
                 f"-A POSTROUTING -o {wan} -j MASQUERADE" + (" --random-fully" if random_ports else "")]
        if hairpin:
            # NAT loopback: an inside host's connection DNATed back into the LAN also has its
            # source rewritten (to the router's LAN address), so the reply returns through the
            # router and is translated back.
            lines.append(f"-A POSTROUTING -o {lan} -s {network} -m conntrack --ctstate DNAT -j MASQUERADE")
        lines += ["COMMIT", "*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]",
                  # replies to what the router or its hosts started, and mapped connections
                  f"-A INPUT -i {wan} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                  f"-A FORWARD -i {wan} -m conntrack --ctstate ESTABLISHED,RELATED,DNAT -j ACCEPT"]
        for chain in ("INPUT", "FORWARD"):
            if inbound == "drop":
                lines.append(f"-A {chain} -i {wan} -j DROP")
            else:
                lines += [f"-A {chain} -i {wan} -p tcp -j REJECT --reject-with tcp-reset",
                          f"-A {chain} -i {wan} -j REJECT --reject-with icmp-port-unreachable"]
        lines.append("COMMIT")
        rules = "\n".join(lines) + "\n"
        script = _sysctl_script(
            {"net.ipv4.ip_forward": "1",
             # the router must not tell a LAN host (by ICMP redirect) to bypass it on a hairpin
             "net.ipv4.conf.all.send_redirects": "0", "net.ipv4.conf.default.send_redirects": "0",
             # LAN traffic between hosts is switched, not filtered
             "net.bridge.bridge-nf-call-iptables": "0"},
            optional=["net.bridge.bridge-nf-call-iptables"])
        script += f"\n{shlex.quote(tool('iptables-restore'))} -w <<'RULES'\n{rules}RULES\n"
        self._sh_in(router.netns, script)
        self._mappings[name] = {}
        self._lan_hosts[name] = network.hosts()
        next(self._lan_hosts[name])  # the router's
        return router

    @_timed
    def add_private_host(self, name: str, router: HostRef, *, rate: str | None = None) -> Host:
        """A host on ``router``'s private subnet (the next free address), default route via
        the router."""
        r = self.router(router)
        self._check_new(name)
        try:
            address = str(next(self._lan_hosts[r.name]))
        except StopIteration:
            raise ValueError(f"router {r.name}'s subnet {r.subnet} is full") from None
        prefixlen = ipaddress.IPv4Network(r.subnet).prefixlen
        host = Host(name=name, netns=f"{self.tag}-{name}", kind="private", address=address,
                    device=self._device("h"), peer_device=self._device("l"), peer_netns=r.netns, router=r.name)
        self._add_namespace(host.netns)
        ip_batch([f"link add {host.peer_device} up master {r.lan_bridge} type veth peer name {host.device} "
                  f"netns {host.netns}"], netns=r.netns)
        ip_batch([
            "link set lo up",
            f"addr add {address}/{prefixlen} dev {host.device}",
            f"link set {host.device} up",
            f"route add default via {r.lan_address}",
        ], netns=host.netns)
        self.hosts[name] = host
        if rate is not None:
            self.limit_rate(host, rate)
        return host

    @_timed
    def map_port(self, router: HostRef, public_port: int, host: HostRef, port: int) -> None:
        """Forward TCP connections to ``router``'s public address, port ``public_port``, to
        ``host`` (behind that router), port ``port`` (the numbers may differ)."""
        r, h = self.router(router), self.host(host)
        if h.router != r.name:
            raise ValueError(f"{h.name} is not behind router {r.name}")
        for p in (public_port, port):
            if not 1 <= p <= 65535:
                raise ValueError(f"port {p} is out of range")
        if public_port in self._mappings[r.name]:
            raise ValueError(f"router {r.name} already maps port {public_port} to {self._mappings[r.name][public_port]}")
        rules = ["*nat",
                 f"-A PREROUTING -i {r.device} -p tcp --dport {public_port} -j DNAT --to-destination {h.address}:{port}"]
        if r.hairpin:
            rules.append(f"-A PREROUTING -i {r.lan_bridge} -d {r.address} -p tcp --dport {public_port} "
                         f"-j DNAT --to-destination {h.address}:{port}")
        rules.append("COMMIT")
        sh(in_netns(r.netns, [tool("iptables-restore"), "-w", "--noflush"]), stdin="\n".join(rules) + "\n")
        self._mappings[r.name][public_port] = (h.name, port)

    @_timed
    def limit_rate(self, host: HostRef, rate: str, *, burst: str = "256kb", latency: str = "100ms") -> None:
        """Shape ``host``'s link to ``rate`` (tc syntax: ``200mbit``) both ways: a tbf qdisc on
        both ends (replacing an earlier limit).  At high rates ``burst`` must be at least
        rate/HZ (e.g. 1gbit at HZ=250: 500kb) or tbf falls short of ``rate``."""
        h = self.host(host)
        for netns, device in ((h.netns, h.device), (h.peer_netns, h.peer_device)):
            sh([tool("ip"), "netns", "exec", netns, tool("tc"), "qdisc", "replace", "dev", device, "root", "tbf",
                "rate", rate, "burst", burst, "latency", latency])

    # -- using

    def host(self, ref: HostRef) -> Host:
        """The host of that name (or the host itself, checked to be of this topology)."""
        name = ref.name if isinstance(ref, Host) else ref
        try:
            found = self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r} in this topology (hosts: {sorted(self.hosts)})") from None
        if isinstance(ref, Host) and ref != found:
            raise ValueError(f"{ref!r} is not this topology's host {name!r}")
        return found

    def router(self, ref: HostRef) -> Router:
        found = self.host(ref)
        if not isinstance(found, Router):
            raise ValueError(f"{found.name} is a {found.kind} host, not a router")
        return found

    def popen(self, host: HostRef, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (``ip netns exec``); keyword arguments go to
        ``subprocess.Popen``.  Still running at teardown, it is killed."""
        proc = subprocess.Popen(in_netns(self.host(host).netns, argv), **kwargs)
        self._processes.append(proc)
        return proc

    def run(self, host: HostRef, argv: Sequence[str], *, stdin: str | None = None,
            timeout: float = COMMAND_TIMEOUT) -> str:
        """Run ``argv`` inside ``host`` to completion and return its stdout (text);
        ``NetnsCommandError`` with its stderr if it fails or outlives ``timeout``."""
        return sh(in_netns(self.host(host).netns, argv), stdin=stdin, timeout=timeout)

    def addresses(self, host: HostRef) -> list[str]:
        """The IPv4 addresses configured in ``host``'s namespace, as the kernel reports them
        (``ip -j addr``), loopback excluded; a router has its public and its LAN address."""
        out = sh([tool("ip"), "-n", self.host(host).netns, "-j", "-4", "addr", "show"])
        return [info["local"] for link in json.loads(out) for info in link.get("addr_info", [])
                if info.get("scope") != "host"]

    # -- internals

    def _device(self, letter: str) -> str:
        name = f"pn{self.pid}{letter}{next(_links)}"
        if len(name) > IFNAME_MAX:
            raise RuntimeError(f"device name {name} is longer than {IFNAME_MAX} characters")
        return name

    def _check_new(self, name: str) -> None:
        if not self._entered or self._closed:
            raise RuntimeError("add hosts inside the `with NatTopology() as net:` block")
        if not _NAME.match(name) or name == "inet":
            raise ValueError(f"host name {name!r}: 1-16 characters, [a-z0-9], starting with a letter, not 'inet'")
        if name in self.hosts:
            raise ValueError(f"there is already a host {name!r}")

    def _add_namespace(self, netns: str) -> None:
        self._namespaces.append(netns)  # before: a half-made namespace is deleted too
        ip_batch([f"netns add {netns}"])

    def _add_public(self, name: str, kind: Literal["public", "router"], rate: str | None,
                    *, create: bool = True) -> Host:
        self._check_new(name)
        try:
            address = str(next(self._public))
        except StopIteration:
            raise ValueError("the public network is full") from None
        host = Host(name=name, netns=f"{self.tag}-{name}", kind=kind, address=address,
                    device=self._device("w" if kind == "router" else "p"), peer_device=self._device("i"),
                    peer_netns=self.internet)
        if create:
            self._create_uplinked(host, rate)
        return host

    def _create_uplinked(self, host: Host, rate: str | None, *, extra: Sequence[str] = ()) -> None:
        """A namespace with one address on the public bridge and a default route to the core."""
        self._add_namespace(host.netns)
        ip_batch([f"link add {host.peer_device} up master {self.bridge} type veth peer name {host.device} "
                  f"netns {host.netns}"], netns=self.internet)
        ip_batch([
            "link set lo up",
            f"addr add {host.address}/{PUBLIC_NETWORK.prefixlen} dev {host.device}",
            f"link set {host.device} up",
            f"route add default via {CORE_ADDRESS}",
            *extra,
        ], netns=host.netns)
        self.hosts[host.name] = host
        if rate is not None:
            self.limit_rate(host, rate)

    def _sh_in(self, netns: str, script: str) -> None:
        sh(in_netns(netns, ["/bin/sh", "-c", script]))
