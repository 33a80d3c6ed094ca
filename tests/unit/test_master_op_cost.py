"""The master's collective-ops machine does O(participants) work per collective, not
O(participants²): each vote, Begin and Done looks at a constant number of members, except the
one that completes the vote (or the op), and a departure makes the next Done count again.

Work is counted, not timed: the members' list the machine scans and the liveness lookups it
makes go through the host (:class:`pccl.protocol.master.collectives.OpsHost`), which counts them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pccl.protocol import messages as m
from pccl.protocol.master.collectives import CollectiveOps, OpsHost

N = 64
TAG = 7
ROUND = 3


class _Members(list[int]):
    """The group's members; counts the elements handed out by iteration."""

    scanned = 0

    def __iter__(self) -> Iterator[int]:
        for pid in super().__iter__():
            _Members.scanned += 1
            yield pid


class _Host:
    def __init__(self, n: int) -> None:
        self.members = _Members(range(1, n + 1))
        self.live = set(self.members)
        self.sent: list[tuple[int, m.Message]] = []
        self.liveness_lookups = 0

    def is_live(self, pid: int) -> bool:
        self.liveness_lookups += 1
        return pid in self.live

    def ops_host(self) -> OpsHost:
        return OpsHost(members=lambda group: self.members, ring=lambda group: tuple(list.__iter__(self.members)),
                       is_stale=lambda group: False, mark_stale=lambda group: None, is_live=self.is_live,
                       send=lambda pid, msg: self.sent.append((pid, msg)), report=lambda fact: None,
                       in_topology_vote=lambda pid: False, round_of=lambda group: ROUND)

    def work(self) -> int:
        return _Members.scanned + self.liveness_lookups

    def finals(self, kind: type[m.Message]) -> set[int]:
        return {pid for pid, msg in self.sent if isinstance(msg, kind)}


def _init() -> m.CollectiveInit:
    return m.CollectiveInit(TAG, 1024, 10, 0)


@pytest.fixture(autouse=True)
def _reset_scans() -> None:
    _Members.scanned = 0


def _every_done(ops: CollectiveOps, host: _Host, seq: int) -> None:
    """Every participant reports success, one check after each: all of them hear Complete."""
    for pid in range(1, N + 1):
        ops.on_done(0, pid, m.CollectiveDone(TAG, seq))
        while ops.check((0, TAG)):
            pass
    assert host.finals(m.CollectiveComplete) == set(range(1, N + 1))


def test_a_voted_all_reduce_costs_linear_work_in_its_participants() -> None:
    host = _Host(N)
    ops = CollectiveOps(host.ops_host())
    for pid in host.members.copy():
        ops.on_init(0, pid, _init())
        while ops.check((0, TAG)):
            pass
    commenced = host.finals(m.CollectiveCommence)
    assert commenced == set(range(1, N + 1))
    seq = next(msg.seq for _, msg in host.sent if isinstance(msg, m.CollectiveCommence))
    _every_done(ops, host, seq)
    # Each message looks at O(1) members; the vote that completes scans the N members, the
    # first Done counts the N live participants and the last one checks them: a few N in all
    # (N² = 4096 here).
    assert host.work() <= 6 * N, host.work()


def test_a_begun_all_reduce_costs_linear_work_in_its_participants() -> None:
    host = _Host(N)
    ops = CollectiveOps(host.ops_host())
    seq = m.derived_seq(ROUND, TAG, 0)
    init = _init()
    for pid in range(1, N + 1):
        ops.on_begin(0, pid, m.CollectiveBegin(TAG, seq, ROUND, init.count, init.dtype, init.op))
        while ops.check((0, TAG)):
            pass
    armed = host.finals(m.CollectiveCommence)  # the one-way Commence once everyone began
    assert armed == set(range(1, N + 1))
    _every_done(ops, host, seq)
    assert host.work() <= 6 * N, host.work()


def test_a_participant_leaving_after_some_dones_is_still_noticed() -> None:
    """The count of live participants is kept between Dones only while nobody leaves: one that
    leaves before its Done aborts the op at the next check, whatever was counted before."""
    host = _Host(4)
    ops = CollectiveOps(host.ops_host())
    for pid in range(1, 5):
        ops.on_init(0, pid, _init())
        ops.check((0, TAG))
    seq = next(msg.seq for _, msg in host.sent if isinstance(msg, m.CollectiveCommence))
    for pid in (1, 2):
        ops.on_done(0, pid, m.CollectiveDone(TAG, seq))
        assert not ops.check((0, TAG))
    host.live.discard(3)
    ops.forget(0, 3)  # what the master does when it removes a peer
    assert ops.check((0, TAG))
    aborts = [(pid, msg) for pid, msg in host.sent if isinstance(msg, m.CollectiveAbort)]
    assert {pid for pid, _ in aborts} == {1, 2, 4}
    assert all("participant 3 left before finishing" in msg.detail for _, msg in aborts)
    assert not host.finals(m.CollectiveComplete)


def test_a_participant_leaving_after_its_done_still_lets_the_op_complete() -> None:
    host = _Host(3)
    ops = CollectiveOps(host.ops_host())
    for pid in range(1, 4):
        ops.on_init(0, pid, _init())
        ops.check((0, TAG))
    seq = next(msg.seq for _, msg in host.sent if isinstance(msg, m.CollectiveCommence))
    ops.on_done(0, 1, m.CollectiveDone(TAG, seq))
    assert not ops.check((0, TAG))
    host.live.discard(1)
    ops.forget(0, 1)
    for pid in (2, 3):
        ops.on_done(0, pid, m.CollectiveDone(TAG, seq))
        ops.check((0, TAG))
    assert host.finals(m.CollectiveComplete) == {2, 3}
