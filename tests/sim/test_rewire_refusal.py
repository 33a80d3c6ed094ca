"""The refused-call race of PCCL's stress pattern, reached in the simulator and replayed.

Concurrent collectives launched in tag order with fewer slots than tags; a peer dies while some
of its group's ops run and the survivors have voted later tags it never voted.  The master aborts
the running ops and answers the later votes ``STALE_RING`` at the same instant; a stale call waits
for this peer's other calls to release their tags, then re-wires the group (an internal topology
vote); the aborted calls release theirs and return, and the slots they free start the next tags
while that vote stands.  Before commits 0167215 (such a call joins the peer's own re-wire) and
d3e1fab (the master ends a stale group's vote as ``STALE_RING`` once a non-voter re-wires) those
legal calls were refused with ``InvalidUsage: cannot start a collective while a topology vote
(rewire) is outstanding``, as real processes saw it.
"""

from __future__ import annotations

import pathlib

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import Schedule
from pccl_sim.tools.scenarios import scenario_from_json

SCHEDULES = pathlib.Path(__file__).parent / "schedules"


def test_calls_that_start_while_the_group_rewires_are_not_refused() -> None:
    """``rewire_refusal_collectives_shrunk.json``: the collectives phase (12 uint8-quantized tags
    of every kind, at most 4 in flight, 4 peers) and one fault, shrunk by ``pccl-sim shrink``: peer3
    is killed as it sends its 6th ``CollectiveInit`` (t = 0.55008).

    With both fixes reverted this run failed: at t = 0.560080 peer0 and peer2 crashed with
    ``InvalidUsage: cannot start a collective while a topology vote (rewire) is outstanding``
    (their tags 104 and 107 aborted, 108 and 109 met ``STALE_RING``, and tags 110 and 111
    started in the aborted calls' slots).  Either fix alone makes it pass.
    """
    schedule = Schedule.load(SCHEDULES / "rewire_refusal_collectives_shrunk.json")
    assert [e.kind for e in schedule.events] == ["kill"]
    trace = run(scenario_from_json(schedule.scenario), schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    assert not [e for e in trace.of_kind("corpse_error") if "InvalidUsage" in e.data["error"]]
    # The race's ingredients happened: ops aborted by the death, and the calls launched in their
    # slots (tags 110 and 111 of the first step) ran to an end, none refused.
    aborted = [e for e in trace.of_kind("collective_aborted") if e.t < 1.0]
    assert aborted
    ends = {(e.source, e.data["tag"]) for e in trace.events
            if e.kind in ("collective", "collective_aborted", "collective_alone") and e.data["step"] == 1}
    assert {("peer0", 110), ("peer0", 111), ("peer2", 110), ("peer2", 111)} <= ends
