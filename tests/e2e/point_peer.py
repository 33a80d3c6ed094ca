"""A peer process for the point-to-point tests (tests/e2e/test_point_to_point.py).

``point_peer.py MASTER MODE NBYTES``: join the run (the test's own peer accepts it), print
``{"peer_id": ..., "other": ...}``, then forever either send (MODE ``send``) or receive (MODE
``recv``) messages of NBYTES uint8 bytes to / from the other peer on tag 0, printing
``{"done": i}`` after each.  Message ``i`` holds the byte ``i % 200 + 1`` everywhere (never 0,
so a receiver can tell a payload from its sentinel).  The test SIGKILLs it.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import pccl
import pccl.blocking


def main() -> None:
    master, mode, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = pccl.Config(peer_timeout=2.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)
    with pccl.blocking.open_communicator(master, config=config) as comm:
        other = next(p for p in comm.ring if p != comm.peer_id)
        print(json.dumps({"peer_id": comm.peer_id, "other": other}), flush=True)
        buffer = np.zeros(nbytes, np.uint8)
        i = 0
        while True:
            if mode == "send":
                buffer.fill(i % 200 + 1)
                comm.send(buffer, to=other)
            else:
                comm.recv(buffer, from_=other)
            print(json.dumps({"done": i}), flush=True)
            i += 1


if __name__ == "__main__":
    main()
