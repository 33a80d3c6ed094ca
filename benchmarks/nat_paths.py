"""A float32 all-reduce between two peers over a slow link, on each path a pair can take.

    sudo python benchmarks/nat_paths.py [--rate 200mbit] [--mib 32] [--repeat 3]

Two network namespaces joined by a veth pair whose both ends are shaped with ``tc ... tbf``
(``--rate``, :mod:`netns_link`); the master (``--relay``) and peer A in the first, peer B in
the second.  The same 2-peer ring runs three times, each with a fresh master and peers:

* ``direct``: nothing blocks a dial (today's ring);
* ``reversed``: B's namespace drops inbound connection attempts (``iptables ... --syn -j DROP``),
  as a NAT with nothing forwarded would: A's lane to B is dialled back by B;
* ``relayed``: both peers drop inbound attempts (A's namespace lets only the master's port
  through), so neither can dial the other and both lanes go through the master's relay (in A's
  namespace, so every relayed byte crosses the shaped link once, as a direct one does).

``--base DIR`` also runs the direct ring of another checkout of pccl (``DIR`` on ``PYTHONPATH``:
e.g. a ``git worktree`` of the commit before paths existed) first, as ``base``, and every path's
time is then compared with it.

Each peer all-reduces (SUM, in place) a ``--mib`` MiB buffer ``--repeat`` times and reports the
wall time of each call and the path its connection to the other peer took; the table shows the
median of the slower peer's times, the payload rate one way (bytes each peer sent / time) as a
fraction of the link's rate, and each path's time against the direct one's.  Needs root and
iptables.  ``peer`` is the subcommand the namespaced processes run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from netns_link import tbf_namespaces

SUBNET = "10.216.0"  # not the other netns benchmarks', so they can run at once
MODES = ("direct", "reversed", "relayed")
BASE = "base"


async def _peer(args: argparse.Namespace) -> None:
    import trio

    import pccl

    n = int(args.mib * 2**20) // 4
    x = np.random.default_rng(args.seed).standard_normal(n).astype(np.float32)
    config = pccl.Config(peer_timeout=60.0)
    async with pccl.open_communicator(args.master, config=config) as comm:
        if comm.world_size == 1:  # the first peer lets the second in
            while not await comm.are_peers_pending():
                await trio.sleep(0.05)
            await comm.update_topology()
        y = x[:1024].copy()
        await comm.all_reduce(y, tag=1)  # warm up: connections, buffers
        stats = comm.statistics()
        paths = sorted({kind for _peer, port, kind, _via in getattr(stats, "paths", ()) if port == "p2p"})
        for i in range(args.repeat):
            y = x.copy()
            t0 = time.perf_counter()
            info = await comm.all_reduce(y, tag=2)
            print(json.dumps({"i": i, "seconds": time.perf_counter() - t0, "tx_bytes": info.tx_bytes,
                              "paths": paths}), flush=True)


def _rate_bytes(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if match is None:
        raise SystemExit(f"--rate {rate!r}: expected e.g. 200mbit")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)] / 8


def _firewall(ns: str, *, except_port: int | None) -> None:
    rule = ["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-p", "tcp", "--syn"]
    if except_port is not None:
        rule += ["!", "--dport", str(except_port)]
    subprocess.run([*rule, "-j", "DROP"], check=True, capture_output=True, text=True)


def _unfirewall(ns: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "iptables", "-F", "INPUT"], capture_output=True)


def _one_mode(args: argparse.Namespace, mode: str, a: str, b: str) -> list[list[dict]]:
    from pccl.tools.bench import free_port

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if mode == BASE:
        env["PYTHONPATH"] = os.path.abspath(args.base)
    port = free_port()
    address = f"{SUBNET}.1:{port}"
    if mode in ("reversed", "relayed"):
        _firewall(b, except_port=None)
    if mode == "relayed":
        _firewall(a, except_port=port)
    master = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-m", "pccl", "--log-level", "WARNING",
                               "master", "--listen", address, "--peer-timeout", "60",
                               *(["--relay"] if mode != BASE else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        time.sleep(1.0)
        cmd = [sys.executable, __file__, "peer", "--master", address, "--mib", str(args.mib), "--repeat",
               str(args.repeat)]
        peers = [subprocess.Popen(["ip", "netns", "exec", ns_name, *cmd], stdout=subprocess.PIPE, text=True, env=env)
                 for ns_name in (a, b)]
        outputs = [p.communicate(timeout=args.timeout)[0] for p in peers]
        if any(p.returncode for p in peers):
            raise SystemExit(f"{mode}: a peer failed (exit codes {[p.returncode for p in peers]})")
        return [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs]
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
        _unfirewall(a)
        _unfirewall(b)


def _run(args: argparse.Namespace) -> int:
    link = _rate_bytes(args.rate)
    try:
        ns = tbf_namespaces(args.rate, prefix="pn", subnet=SUBNET)
        a, b = ns.__enter__()
    except subprocess.CalledProcessError as exc:
        print(f"cannot set up the namespaces ({exc.cmd}: {exc.stderr.strip()}); needs root", file=sys.stderr)
        return 2
    try:
        results = {}
        for mode in ([BASE] if args.base else []) + args.modes:
            rows = _one_mode(args, mode, a, b)
            slowest = [max(r["seconds"] for peer_rows in rows for r in peer_rows if r["i"] == i)
                       for i in range(args.repeat)]
            results[mode] = (statistics.median(slowest), slowest, rows[0][0]["tx_bytes"],
                             [peer_rows[0]["paths"] for peer_rows in rows])
    except subprocess.CalledProcessError as exc:
        print(f"cannot set up the firewall ({exc.cmd}: {exc.stderr.strip()}); needs iptables", file=sys.stderr)
        return 2
    finally:
        ns.__exit__(None, None, None)
    print(f"# {args.mib:g} MiB float32 SUM all-reduce, 2 peers, {args.rate} tbf link; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    yardstick = BASE if args.base else "direct"
    print(f"| path | paths seen (A; B) | median s | runs | one-way payload rate / link | {yardstick} time / this |")
    print("|---|---|---|---|---|---|")
    direct = results.get(yardstick, (None,))[0]
    for mode, (median, slowest, tx, paths) in results.items():
        share = tx / median / link
        ratio = f"{direct / median:.3f}" if direct else "-"
        print(f"| {mode} | {', '.join(paths[0]) or '-'}; {', '.join(paths[1]) or '-'} | {median:.3f} | "
              f"{[round(s, 3) for s in slowest]} | {share:.3f} | {ratio} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--rate", default="200mbit", help="tbf rate of each end of the link")
    parser.add_argument("--mib", type=float, default=32.0, help="float32 buffer size (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="all-reduces per path")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="paths to measure")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    parser.add_argument("--base", metavar="DIR", help="also run the direct ring of the pccl checkout at DIR")
    p = sub.add_parser("peer")
    p.add_argument("--master", required=True)
    p.add_argument("--mib", type=float, required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "peer":
        import trio

        trio.run(_peer, args)
        return 0
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
