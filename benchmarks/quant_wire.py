"""A float32 all-reduce over a slow link, unquantized against 4-bit blockwise quantization.

    sudo python benchmarks/quant_wire.py [--rate 200mbit] [--mib 64] [--repeat 3] [--block 128]

Two peers in network namespaces joined by a veth pair whose both ends are shaped with
``tc ... tbf`` (``--rate``; this kernel's tc has tbf but no netem), a master in the first
namespace.  Each peer all-reduces (SUM, in place) a ``--mib`` MiB float32 buffer, alternating
unquantized and ``Quantization(dtype="uint4", block=--block)`` ``--repeat`` times each, and
reports the wall time of every call; the table shows the median of the slower peer's times per
mode and the speed-up.  The namespaces are removed on exit.  Needs root (``ip netns``).

``peer`` is the subcommand the namespaced processes run (not meant to be called by hand).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from netns_link import tbf_namespaces

SUBNET = "10.214.0"  # not benchmarks/diloco.py's, so both can run at once


async def _peer(args: argparse.Namespace) -> None:
    import trio

    import pccl

    n = int(args.mib * 2**20) // 4
    x = np.random.default_rng(args.seed).standard_normal(n).astype(np.float32)
    quant = pccl.Quantization(dtype="uint4", block=args.block)
    config = pccl.Config(peer_timeout=60.0)
    async with pccl.open_communicator(args.master, config=config) as comm:
        if comm.world_size == 1:  # the first peer lets the second in
            while not await comm.are_peers_pending():
                await trio.sleep(0.05)
            await comm.update_topology()
        y = x[:1024].copy()
        await comm.all_reduce(y, tag=1)  # warm up: connections, buffers
        for i in range(args.repeat):
            for mode, q in (("f32", None), ("u4", quant)):
                y = x.copy()
                t0 = time.perf_counter()
                info = await comm.all_reduce(y, tag=2, quantization=q)
                print(json.dumps({"mode": mode, "i": i, "seconds": time.perf_counter() - t0,
                                  "tx_bytes": info.tx_bytes, "rx_bytes": info.rx_bytes}), flush=True)


def _run(args: argparse.Namespace) -> int:
    from pccl.tools.bench import free_port

    try:
        ns = tbf_namespaces(args.rate, prefix="pq", subnet=SUBNET)
        a, b = ns.__enter__()
    except subprocess.CalledProcessError as exc:
        print(f"cannot set up the namespaces ({exc.cmd}: {exc.stderr.strip()}); needs root", file=sys.stderr)
        return 2
    master = None
    try:
        address = f"{SUBNET}.1:{free_port()}"
        master = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, "-m", "pccl", "--log-level", "WARNING",
                                   "master", "--listen", address, "--peer-timeout", "60"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        cmd = [sys.executable, __file__, "peer", "--master", address, "--mib", str(args.mib), "--repeat",
               str(args.repeat), "--block", str(args.block)]
        peers = [subprocess.Popen(["ip", "netns", "exec", ns_name, *cmd], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}) for ns_name in (a, b)]
        outputs = [p.communicate(timeout=args.timeout)[0] for p in peers]
        if any(p.returncode for p in peers):
            print(f"a peer failed (exit codes {[p.returncode for p in peers]})", file=sys.stderr)
            return 1
        rows = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs]
        print(f"# {args.mib:g} MiB float32 SUM all-reduce, 2 peers, {args.rate} tbf link; "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
        medians = {}
        for mode in ("f32", "u4"):
            slowest = [max(r["seconds"] for peer_rows in rows for r in peer_rows if r["mode"] == mode and r["i"] == i)
                       for i in range(args.repeat)]
            tx = rows[0][[r["mode"] for r in rows[0]].index(mode)]["tx_bytes"]
            medians[mode] = statistics.median(slowest)
            label = "float32" if mode == "f32" else f"uint4 block {args.block}"
            print(f"{label:>18}: {medians[mode]:7.3f} s (runs {[round(s, 3) for s in slowest]}), "
                  f"tx {tx / 2**20:.2f} MiB per peer")
        print(f"speed-up: {medians['f32'] / medians['u4']:.2f}x")
        return 0
    finally:
        if master is not None:
            master.send_signal(signal.SIGTERM)
            try:
                master.wait(10)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait()
        ns.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    parser.add_argument("--rate", default="200mbit", help="tbf rate of each end of the link")
    parser.add_argument("--mib", type=float, default=64.0, help="float32 buffer size (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="all-reduces per mode")
    parser.add_argument("--block", type=int, default=128, help="elements per (min, max) pair")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    p = sub.add_parser("peer")
    p.add_argument("--master", required=True)
    p.add_argument("--mib", type=float, required=True)
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--block", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "peer":
        import trio

        trio.run(_peer, args)
        return 0
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
