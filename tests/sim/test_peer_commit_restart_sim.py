"""``Config.peer_commit`` across a master restart in the simulator (docs/protocol.rst, "A master
restart while peers are in doubt"): the master dies as a participant reports its success, while
the other participant's acks to it are held up; the other commits on its set.  The first must
end the op as the other did — before, it gave up with its input restored (``all_reduce_aborted``)
while the other had returned the result, and no checker noticed."""

from __future__ import annotations

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec


def _schedule() -> tuple[object, object]:
    spec = CampaignSpec(scenario="pccl", profile="none", peers=2, duration=8.0, quiet=None,
                        params=(("phases", ("compute", {"name": "all_reduce", "n": 70_000})), ("fast_commit", True),
                                ("peer_commit", True)))
    scenario, schedule = spec.build(0)
    # peer1's acks to peer0 are held from its 5th Done on (peer1 still hears peer0's and commits);
    # the master dies as peer0 sends its own 5th Done, and is back 0.5 s later.
    held = Trigger("message", host="peer1", direction="send", message="CollectiveDone", nth=5)
    dies = Trigger("message", host="peer0", direction="send", message="CollectiveDone", nth=5)
    return scenario, schedule.with_events([
        *schedule.events,
        FaultEvent(1.0, "partition", side=("peer1",), other=("peer0",), both_ways=False, duration=3.0, trigger=held),
        FaultEvent(1.0, "master_restart", duration=0.5, trigger=dies),
    ])


def test_a_peer_agreed_op_in_flight_at_a_master_restart_ends_alike_on_both_participants() -> None:
    scenario, schedule = _schedule()
    trace = run(scenario, schedule)  # type: ignore[arg-type]
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [
        "peer1 send CollectiveDone #5", "peer0 send CollectiveDone #5"]
    assert len(trace.of_kind("master_up")) == 2  # it really restarted
    # Nobody gave up on the op: both returned its result (all-reduce-agreement checks that they
    # are the same, and numpy's).
    assert trace.stats["all_reduce_aborted"] == 0, trace.stats
    again = run(*_schedule())  # type: ignore[arg-type]
    assert again.hash() == trace.hash()  # the same seed replays the same run
