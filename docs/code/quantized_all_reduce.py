# docs-test: run
"""A master and two peers in one Trio program, and the error bound of a quantized all-reduce."""

import numpy as np
import trio

import pccl

N, QMAX = 2, 255                                             # two peers, uint8 on the wire


async def peer(address: str, x: np.ndarray, results: list[np.ndarray]) -> None:
    async with pccl.open_communicator(address) as comm:
        if comm.world_size == 1:                             # the first peer: let the second in
            while not await comm.are_peers_pending():
                await trio.sleep(0.01)
            await comm.update_topology()                     # the second's open returns with it
        y = x.copy()
        await comm.all_reduce(y, op=pccl.ReduceOp.SUM, quantization=pccl.Quantization(dtype=np.uint8))
        results.append(y)


async def main() -> None:
    rng = np.random.default_rng(0)
    inputs = [rng.uniform(-1, 1, 100_000).astype(np.float32) for _ in range(N)]
    results: list[np.ndarray] = []
    async with pccl.open_master("127.0.0.1:0") as master:
        async with trio.open_nursery() as nursery:
            for x in inputs:
                nursery.start_soon(peer, master.address, x, results)
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    error = np.abs(results[0].astype(np.float64) - exact).max()
    spread = sum(float(x.max() - x.min()) for x in inputs)   # bounds every partial sum's range
    bound = N * spread / (2 * QMAX)                          # N quantizations per element
    print(f"max error {error:.5f} <= bound {bound:.5f}; peers bit-identical: "
          f"{results[0].tobytes() == results[1].tobytes()}")
    assert error <= bound * (1 + 1e-5) and results[0].tobytes() == results[1].tobytes()


trio.run(main)
