"""A shared-state distributor as a separate OS process (so a test can SIGKILL it mid-transfer).

Usage: ``python state_peer_process.py MASTER_ADDRESS TOKEN STATE_MIB``.  Holds the deterministic
state of ``test_shared_state._big_state(STATE_MIB)`` at revision 0.  Prints ``ACCEPTED`` once
accepted, then per stdin line: ``update`` (prints ``UPDATED <world_size>``), ``sync`` (prints
``SYNCED <revision> <tx> <rx>``), ``exit``; ``ERROR <name>`` if a call fails.
"""

from __future__ import annotations

import sys

import numpy as np
import trio

import pccl


def big_state(mib: int) -> pccl.SharedState:
    n = mib * 1024 * 1024 // 4
    return pccl.SharedState({"a": np.arange(n // 2, dtype=np.float32), "b": np.arange(n // 2, dtype=np.int32) * 3})


async def main(master: str, token: str, mib: int) -> None:
    config = pccl.Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0,
                         shared_state_base_port=0)
    state = big_state(mib)
    stdin = trio.wrap_file(sys.stdin)
    async with pccl.open_communicator(master, token=token, config=config) as comm:
        print("ACCEPTED", flush=True)
        while True:
            line = (await stdin.readline()).strip()
            try:
                if line == "update":
                    await comm.update_topology()
                    print("UPDATED", comm.world_size, flush=True)
                elif line == "sync":
                    info = await comm.sync_shared_state(state)
                    print("SYNCED", info.revision, info.tx_bytes, info.rx_bytes, flush=True)
                elif line in ("exit", ""):
                    return
            except pccl.PCCLError as exc:
                print("ERROR", type(exc).__name__, flush=True)
                return


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
