# docs-test: run
"""Three peers in one Trio program: broadcast, an all-gather of unequal sizes, a reduce-scatter."""

import numpy as np
import trio

import pccl


async def peer(address: str, index: int, report: dict[int, str]) -> None:
    async with pccl.open_communicator(address) as comm:
        while comm.world_size < 3:                           # the accepted peers let the others in
            if await comm.are_peers_pending():
                await comm.update_topology()
            else:
                await trio.sleep(0.01)
        root = min(comm.ring)                                # every peer names the same root
        weights = np.full(4, float(index), np.float32)
        await comm.broadcast(weights, root=root)             # now the root's weights everywhere

        top_k = np.arange(index + 1, dtype=np.int64)         # 1, 2 or 3 values: sizes may differ
        gathered = await comm.all_gather(top_k)              # every peer's, in ring order

        grads = np.full(7, float(index + 1), np.float32)
        shard = await comm.reduce_scatter(grads, op=pccl.ReduceOp.SUM)
        mine = grads[shard.start:shard.stop]                 # this peer's slice of the sum: 1+2+3

        report[index] = (f"weights {weights[0]:.0f}, gathered sizes {[a.size for a in gathered.arrays]}, "
                         f"slice {shard.index} = [{shard.start}, {shard.stop}) holding {set(mine.tolist())}")


async def main() -> None:
    report: dict[int, str] = {}
    async with pccl.open_master("127.0.0.1:0") as master:
        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(peer, master.address, index, report)
    for index in sorted(report):
        print(f"peer {index}: {report[index]}")
    assert len(report) == 3


trio.run(main)
