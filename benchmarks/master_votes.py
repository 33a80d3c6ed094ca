"""The master's CPU per topology vote, by number of peers (not a test: figures vary with load).

    python benchmarks/master_votes.py [--peers 10,100,1000] [--groups 1] [--rounds 5]

Drives the master's state machine (:class:`pccl.protocol.master.machine.MasterState`, no I/O)
with ``N`` accepted peers, then times ``--rounds`` rounds of ``update_topology()``: every peer
sends ``VoteTopology``, the last one completes the round (nothing changed, so no p2p round).
Prints microseconds per vote and milliseconds per round: what one training step's
``update_topology()`` costs the master; then the same with every message the machine sends
encoded into its frame, as the master's shell does before writing it (the ``TopologyComplete``
each peer gets carries every member's endpoint).
"""

from __future__ import annotations

import argparse
import random
import time

from pccl.protocol import codec
from pccl.protocol import messages as m
from pccl.protocol.master.machine import MasterState, MessageReceived, PeerConnected, PeerStatus, Send


def accepted_cluster(n: int, groups: int) -> tuple[MasterState, list[int]]:
    """A machine with ``n`` accepted peers (connections 1..n), joined through the protocol."""
    ms = MasterState(rng=random.Random(0), peer_timeout=1e9)
    conns = list(range(1, n + 1))

    def answer_rounds(effects: list[object]) -> None:
        todo = [(e.conn_id, e.msg.round) for e in effects if isinstance(e, Send) and isinstance(e.msg, m.ConnectToPeers)]
        while todo:
            conn, round_id = todo.pop()
            more = ms.handle(MessageReceived(conn, m.P2PReport(round_id, True)), 0.0)
            todo += [(e.conn_id, e.msg.round) for e in more if isinstance(e, Send) and isinstance(e.msg, m.ConnectToPeers)]

    for c in conns:
        ms.handle(PeerConnected(c, "10.0.0.1"), 0.0)
        answer_rounds(ms.handle(MessageReceived(c, m.Register(c % groups, 4000, 5000)), 0.0))
    for c in conns:  # the first peer was accepted alone; this vote lets every other one in
        answer_rounds(ms.handle(MessageReceived(c, m.VoteTopology(True)), 0.0))
    accepted = sum(p.status is PeerStatus.ACCEPTED for p in ms.peers())
    if accepted != n:
        raise RuntimeError(f"only {accepted} of {n} peers were accepted")
    return ms, conns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", default="10,100,1000")
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.peers.split(",")]
    except ValueError:
        parser.error(f"--peers wants a comma list of integers, got {args.peers!r}")
    if min(sizes) < 1 or args.groups < 1 or args.rounds < 1:
        parser.error("--peers, --groups and --rounds must be at least 1")
    for n in sizes:
        for encode in (False, True):
            ms, conns = accepted_cluster(n, args.groups)
            for rnd in range(args.rounds + 1):  # round 0 warms up (msgspec builds its encoders on first use)
                if rnd == 1:
                    started = time.perf_counter()
                for c in conns:
                    effects = ms.handle(MessageReceived(c, m.VoteTopology(True)), 0.0)
                    if encode:
                        for effect in effects:
                            if isinstance(effect, Send):
                                codec.encode_message(effect.msg)
            elapsed = time.perf_counter() - started
            print(f"{n:6d} peers, {args.groups} group(s){', frames encoded' if encode else '':16s}: "
                  f"{1e6 * elapsed / (args.rounds * n):8.1f} us per vote, {1e3 * elapsed / args.rounds:8.1f} ms per round")


if __name__ == "__main__":
    main()
