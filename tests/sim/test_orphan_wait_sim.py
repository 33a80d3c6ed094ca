"""A restarted master's documented wait for a reported peer-agreed op is no hang; a longer one is.

docs/protocol.rst, "A master restart while peers are in doubt": the new master declares dead a
participant of a reported op (``Register.undecided``) that has not registered within
``master_reconnect_timeout`` (60 s) of the first report, and the reporters wait for its verdict.
The liveness bound (29.6 s) did not count that wait: seed 16 (2 peers, peer commit) failed
``no-hung-call`` and ``full-membership`` on it, the other participant of the reported op having
died across the restart (it came back as a new process, under a new id).  The checkers now read
the wait off the wire (:mod:`pccl_sim.workloads.pccl.orphan_waits`) and start their clocks
where it ends; a master that waits ten times as long still fails both.
"""

from __future__ import annotations

import pathlib

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import Schedule
from pccl_sim.engine.trace import Trace
from pccl_sim.tools.scenarios import scenario_from_json

SCHEDULES = pathlib.Path(__file__).parent / "schedules"


def _run(master: str) -> Trace:
    """``orphan_wait_seed16_shrunk.json``: ``pccl-sim replay --seed 16 --peers 2 --phases
    '["compute",{"name":"all_reduce","n":1000}]' --fast-commit --peer-commit``, shrunk by
    ``pccl-sim shrink`` from 17 faults to 12 with the checkers before the fix; its quiet window
    then set to the default of a peer-commit scenario now (1.2 x (29.6 + 60) s).  The master
    restarts at t = 17.7 as it arms peer1 and peer2's op with old peer6, and peer6 restarts as it
    comes back: peer1 and peer2 report the op, and nobody registers as old peer6.

    Before the fix the real master failed: ``liveness failure at t=49.000000 (no-hung-call):
    peer1: call #60 on tag 0 still runs 30.0 s after it began (bound 29.6 s; ...)`` and
    ``full-membership``: full membership only 59.97 s after the faults stopped."""
    schedule = Schedule.load(SCHEDULES / "orphan_wait_seed16_shrunk.json")
    schedule.scenario = dict(schedule.scenario, master=master)
    return run(scenario_from_json(schedule.scenario), schedule)


def test_a_restarted_masters_documented_wait_for_a_reported_op_is_no_hang() -> None:
    trace = _run("real")
    assert trace.ok, [str(f) for f in trace.failures]
    # The run really waited: the reporters' calls end on the new master's verdict, a
    # master_reconnect_timeout after the first report, and the cluster recovers only then.
    ended = [e for e in trace.of_kind("all_reduce_aborted") if "left before finishing" in e.data["error"]
             and e.t > 70.0]
    assert {e.source for e in ended} == {"peer1", "peer2"}, ended
    assert 55.0 < trace.stats["converged_after"] < 65.0


def test_a_master_that_outwaits_its_rule_still_fails_the_liveness_checkers() -> None:
    trace = _run("orphan-wait-tenfold")
    assert [(f.kind, f.source) for f in trace.failures] == [("liveness", "no-hung-call"),
                                                            ("liveness", "full-membership")]
