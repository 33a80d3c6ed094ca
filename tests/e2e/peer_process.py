"""A peer as a separate OS process, driven over stdin/stdout by the e2e tests.

Usage: ``python peer_process.py MASTER_ADDRESS GROUP TOKEN PEER_TIMEOUT HEARTBEAT``.
Prints ``ACCEPTED <world_size> <global_world_size>`` once accepted, then executes one command
per stdin line — ``update`` (prints ``UPDATED <world_size> <global_world_size>``), ``pending``
(prints ``PENDING <bool>``), ``exit`` — and prints ``ERROR <ExceptionName>`` if a call fails.
"""

from __future__ import annotations

import sys

import trio

import pccl


async def main(master: str, group: int, token: str, peer_timeout: float, heartbeat: float) -> None:
    config = pccl.Config(peer_timeout=peer_timeout, heartbeat_interval=heartbeat, connect_timeout=2.0,
                         p2p_base_port=0)
    stdin = trio.wrap_file(sys.stdin)
    async with pccl.open_communicator(master, peer_group=group, token=token or None, config=config) as comm:
        print("ACCEPTED", comm.world_size, comm.global_world_size, flush=True)
        while True:
            line = (await stdin.readline()).strip()
            try:
                if line == "update":
                    await comm.update_topology()
                    print("UPDATED", comm.world_size, comm.global_world_size, flush=True)
                elif line == "pending":
                    print("PENDING", await comm.are_peers_pending(), flush=True)
                elif line in ("exit", ""):
                    return
            except pccl.PCCLError as exc:
                print("ERROR", type(exc).__name__, flush=True)
                return


if __name__ == "__main__":
    address, group, token, timeout, heartbeat = sys.argv[1:6]
    try:
        trio.run(main, address, int(group), token, float(timeout), float(heartbeat))
    except pccl.PCCLError as exc:
        print("ERROR", type(exc).__name__, flush=True)
        sys.exit(1)
