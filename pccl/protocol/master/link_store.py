"""The master's measured links: what to probe, what the probes found, the ring they give.

Pure bookkeeping for :mod:`pccl.protocol.master.machine`'s optimise vote.  A measurement of the
directed link ``a -> b`` is kept while both ends stay in the run (a newcomer costs only its own
links); a probe that failed counts as :data:`~pccl.protocol.topology.UNREACHABLE` for the solve
at hand but is probed again next time (a failure may be transient).

Probe order.  Every member probes its missing links in waves of a round-robin tournament over
the sorted members: in wave ``k`` member ``i`` probes member ``(i + k) mod n``, so within a wave
every peer sends to one peer and receives from one, and no link is probed by two streams of
different probers at once.  Members probe their lists one target after the other, so the waves
stay roughly in step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..topology import UNREACHABLE, Edge, RingSolution, solve_ring

__all__ = ["LinkStore", "MASTER_SOLVER_BUDGET"]

#: Candidate evaluations the master spends on a heuristic solve (groups above the exact limit):
#: it runs inside the master's event handler, so it must stay well under a heartbeat.
MASTER_SOLVER_BUDGET = 20_000


class LinkStore:
    """Measured directed links between live peers, by ``(sender, receiver)``."""

    def __init__(self) -> None:
        self._measured: dict[tuple[int, int], Edge] = {}
        self._failed: set[tuple[int, int]] = set()

    def __len__(self) -> int:
        return len(self._measured)

    def probe_plan(self, members: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """For each member, the members it must probe, in wave order (see the module docstring)."""
        ids = sorted(members)
        n = len(ids)
        plan: dict[int, tuple[int, ...]] = {}
        for i, prober in enumerate(ids):
            plan[prober] = tuple(ids[(i + k) % n] for k in range(1, n)
                                 if (prober, ids[(i + k) % n]) not in self._measured)
        return plan

    def record(self, prober: int, target: int, bandwidth: float, rtt: float) -> None:
        """A probe's result; ``bandwidth`` 0 (or an unusable figure) is a failed probe."""
        key = (prober, target)
        try:
            edge = Edge(bandwidth, rtt)
        except ValueError:
            self._measured.pop(key, None)
            self._failed.add(key)
            return
        self._failed.discard(key)
        self._measured[key] = edge

    def forget(self, peer_id: int) -> None:
        """``peer_id`` left the run: its links are gone (a peer with its id never comes back)."""
        for key in [k for k in self._measured if peer_id in k]:
            del self._measured[key]
        self._failed = {k for k in self._failed if peer_id not in k}

    def edges(self, members: Iterable[int]) -> dict[tuple[int, int], Edge]:
        """The measurements among ``members``; failed probes as ``UNREACHABLE``."""
        ids = set(members)
        out = {k: e for k, e in self._measured.items() if k[0] in ids and k[1] in ids}
        for k in self._failed:
            if k[0] in ids and k[1] in ids:
                out[k] = UNREACHABLE
        return out

    def measured(self, sender: int, receiver: int) -> Edge | None:
        return self._measured.get((sender, receiver))

    def solve(self, members: Sequence[int], current: Sequence[int] | None = None) -> RingSolution:
        """The best ring over ``members`` from what is known (``current``, if it orders the same
        peers, seeds the heuristic so the result is never worse than it)."""
        start = current if current is not None and sorted(current) == sorted(members) else None
        return solve_ring(members, self.edges(members), budget=MASTER_SOLVER_BUDGET, start=start)

    def snapshot(self) -> Mapping[tuple[int, int], Edge]:
        return dict(self._measured)
