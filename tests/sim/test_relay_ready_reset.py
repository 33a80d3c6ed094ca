"""A relay's splice when a side resets before its ``RelayReady``, reached in the simulator and
replayed (the master's own relay, ``relay=True``).

The hub sends ``RelayReady`` to both sides of a pair at once, in a nursery.  When one side is
gone by then (here peer3, killed while its pair met at the master's relay), the send fails with
``PeerDisconnected``, which left the nursery as an ExceptionGroup; the hub's handlers catch
transport errors, not groups, so it escaped ``RelayHub.serve`` (which promises never to raise a
pccl error).  In the master it was counted as an internal error of a connection handler; in a
relay process it would escape the connection's handler.  Now the group becomes its one error,
logged and the pair dropped, as any transport error of a splice is.
"""

from __future__ import annotations

import pathlib

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import Schedule
from pccl_sim.tools.scenarios import scenario_from_json

SCHEDULES = pathlib.Path(__file__).parent / "schedules"


def test_a_side_reset_before_relay_ready_is_not_an_internal_error() -> None:
    """``relay_ready_reset_shrunk.json``: seed 239 of the ``chaos`` profile (PCCL's stress
    pattern of every collective; 8 peer hosts behind NAT, one relay host and the master's own
    relay), shrunk by ``pccl-sim shrink`` from 21 faults to 2: the master and peer3 are cut off
    from the rest at t = 1.687 for 0.964 s, and peer3 is killed at t = 2.541; the fault window
    then cut from 20 s to 4 s by hand (it still failed so).

    Before the fix this run failed: ``crash failure (no-master-internal-errors): the master
    contained 1 internal error(s)`` (``PeerDisconnected: connection to nat3:32770 was reset``
    from the hub's ``RelayReady``), at t = 9.48 with the 4 s window."""
    schedule = Schedule.load(SCHEDULES / "relay_ready_reset_shrunk.json")
    assert [e.kind for e in schedule.events] == ["partition", "kill"]
    scenario = scenario_from_json(schedule.scenario)
    assert scenario.params["master_relay"]
    trace = run(scenario, schedule)
    assert trace.ok, [str(f) for f in trace.failures]
