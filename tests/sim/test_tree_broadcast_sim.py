"""The tree broadcast in the simulator: from 8 peers up the production peer sends small
broadcasts down the binomial tree over the partner links its topology rounds wire; the
collectives checker (every completed broadcast holds the root's bytes on exactly its
participants, aborted calls left their input intact) holds when a peer is killed inside one."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import pccl.testing
from pccl.protocol.algorithms import BroadcastAlgorithm, choose_broadcast
from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec


@pytest.mark.parametrize(("peers", "direction", "host"), [(8, "recv", "peer3"), (9, "send", "peer4")],
                         ids=["8-receiver", "9-sender"])
def test_a_peer_killed_inside_a_tree_broadcast(peers: int, direction: str, host: str) -> None:
    n = 1000  # f32, 4 KB: the tree at 8 and 9 peers
    assert choose_broadcast(4 * n, peers, quantized=False, segmented=False,
                            partner_links=True) is BroadcastAlgorithm.TREE
    phase = {"name": "collectives", "kinds": ["broadcast"], "concurrent": 2, "in_flight": 2, "n": n}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=peers, duration=6.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    scenario, schedule = spec.build(0)
    # The kill fires as the host moves its 3rd broadcast data frame: a receiver as it arrives,
    # a sender (an inner node or the root) as it leaves, before its other children have theirs.
    trigger = Trigger("message", host=host, direction=direction, message="data:broadcast", nth=3)
    schedule = schedule.with_events([*schedule.events, FaultEvent(1.0, "kill", host=host, trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    kinds = collections.Counter(e.kind for e in trace.events)
    assert kinds["collective_aborted"] > 0, kinds  # inside the transfer: the survivors' op aborted
    assert all(e.data["restored"] for e in trace.of_kind("collective_aborted"))
    after = trace.of_kind("triggered")[0].t
    done = [e for e in trace.of_kind("collective") if e.t > after + 1]
    assert done and {e.data["world_size"] for e in done} == {peers - 1}


@contextlib.contextmanager
def ops_run() -> Iterator[collections.Counter[tuple[str, int, str]]]:
    """Count the data-path ops every peer of a simulation run in the block, by
    ``(op class name, world, outcome)``: ``"done"``, or the exception's class name (the op
    raised it: a fault landed inside it, or its abort cancelled it)."""
    seen: collections.Counter[tuple[str, int, str]] = collections.Counter()

    def wrap(real: Any) -> Any:
        async def entry(make_op: Any, **kw: Any) -> Any:
            made: list[Any] = []

            def make(place: Any) -> Any:
                made.append(make_op(place))
                return made[-1]

            try:
                op = await real(make, **kw)
            except BaseException as exc:
                if made:
                    seen[type(made[0]).__name__, kw["world"], type(exc).__name__] += 1
                raise
            seen[type(op).__name__, kw["world"], "done"] += 1
            return op

        return entry

    with pccl.testing.plant_execute_fault(wrap):
        yield seen


def chaos_broadcasts(n: int) -> tuple[Any, collections.Counter[tuple[str, int, str]]]:
    """10 peers, concurrent broadcasts of ``n`` float32 and all-reduces (sharing the partner
    links, one op at a time in commence order) under the chaos profile's faults; seed 2: the
    ring stays at 8 peers for a while, where faults land inside broadcasts over the partner
    links (the trace, and the ops that ran)."""
    phase = {"name": "collectives", "kinds": ["broadcast", "all_reduce"], "concurrent": 4, "in_flight": 3, "n": n}
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=10, duration=8.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    with ops_run() as ops:
        trace = run(*spec.build(2))
    assert trace.ok, [f.message for f in trace.failures]
    counts = collections.Counter(e.data["op"] for e in trace.of_kind("collective"))
    assert counts["broadcast"] > 20 and counts["all_reduce"] > 20, counts
    aborted = collections.Counter(e.data["op"] for e in trace.of_kind("collective_aborted"))
    assert aborted["broadcast"] > 0, aborted
    assert all(e.data["restored"] for e in trace.of_kind("collective_aborted"))
    return trace, ops


def test_tree_broadcasts_under_chaos_pass_the_checker() -> None:
    _, ops = chaos_broadcasts(1000)  # 4 KB: the tree from 8 peers up
    done = sum(c for (kind, world, end), c in ops.items() if kind == "TreeBroadcastOp" and world >= 8 and end == "done")
    broken = sum(c for (kind, world, end), c in ops.items()
                 if kind == "TreeBroadcastOp" and world >= 8 and end == "PeerDisconnected")
    assert done > 20 and broken > 0, ops  # the tree ran, and faults landed inside it
