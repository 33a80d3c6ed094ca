"""The collective kinds as data: every row of pccl.protocol.master.kinds.KINDS, walked.

Each row names real things (the peer's call, ``CollectiveInit`` fields, the data path's
schedules), and the collective-ops machine does what the row says and nothing kind-specific
besides: voters that agree on the row's fields commence on the row's order, voters that differ
in any one of them get PARAMETER_MISMATCH naming every voter's values, fewer voters than the
row's minimum get TOO_FEW_PEERS, and the call a waiting voter is named in is the row's."""

from __future__ import annotations

import dataclasses
import enum
import string

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pccl
from pccl.protocol import messages as m
from pccl.protocol.master import collectives as co
from pccl.protocol.master import kinds as ko

ROWS = list(ko.KINDS.values())
FIELDS = {f for f in m.CollectiveInit.__struct_fields__}
#: a value of each agreeable field that a real Init may carry (the wire's bounds)
VALUES = {
    "count": st.integers(0, 2**40), "dtype": st.integers(0, 20), "op": st.integers(0, 4),
    "quant_kind": st.integers(0, 1), "quant_dtype": st.integers(0, 20), "layout": st.integers(0, 2**64 - 1),
    "quant_bits": st.sampled_from([0, 4]), "quant_block": st.integers(0, 2**32 - 1),
    "root": st.integers(1, 6),  # a broadcast's root: one of the voters (ids 1..n), or not
}


@dataclasses.dataclass
class _Group:
    """One group of ``n`` accepted peers (ids 1..n) on ring ``ring`` behind an OpsHost."""

    n: int
    ring: tuple[int, ...] = ()
    sent: list[tuple[int, m.Message]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.ring = self.ring or tuple(range(1, self.n + 1))
        self.ops = co.CollectiveOps(co.OpsHost(
            members=lambda group: list(range(1, self.n + 1)),
            ring=lambda group: self.ring,
            is_stale=lambda group: False,
            mark_stale=lambda group: None,
            is_live=lambda pid: True,
            send=lambda pid, msg: self.sent.append((pid, msg)),
            report=lambda fact: None,
            in_topology_vote=lambda pid: False,
        ))

    def vote(self, pid: int, init: m.CollectiveInit) -> None:
        self.ops.on_init(0, pid, init)
        self.ops.check((0, init.tag))


def _init(row: ko.KindRow, tag: int = 7, **fields: int) -> m.CollectiveInit:
    base = m.CollectiveInit(tag, 100, 10, 0, kind=row.kind, root=1)
    assert ko.kind_of(base) is row.kind
    return msgspec.structs.replace(base, **fields)


def test_an_init_without_a_kind_is_an_all_reduce_and_an_unknown_kind_a_protocol_error() -> None:
    assert ko.kind_of(m.CollectiveInit(1, 100, 10, 0)) is ko.CollectiveKind.ALL_REDUCE
    with pytest.raises(ko.PeerFault) as caught:
        ko.kind_of(m.CollectiveInit(1, 100, 10, 0, kind=99))
    assert caught.value.reason is pccl.KickReason.PROTOCOL_ERROR


def test_every_kind_has_one_row_and_the_docstring_shows_it() -> None:
    assert list(ko.KINDS) == list(ko.CollectiveKind)
    for kind, row in ko.KINDS.items():
        assert row.kind is kind
        assert f"``{kind.name}``" in (ko.__doc__ or "")


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kind.name)
def test_a_row_names_real_things(row: ko.KindRow) -> None:
    assert callable(getattr(pccl.Communicator, row.call))  # the call its voters wait in
    assert row.agreed and set(row.agreed) <= FIELDS and "tag" not in row.agreed
    shown = [name for _, name, _, _ in string.Formatter().parse(row.shown) if name]
    assert sorted(shown) == sorted(row.agreed), "a mismatch detail shows exactly the agreed fields"
    assert row.min_voters >= 2
    for schedule in row.schedules:  # every plan builds for the agreed fields at any ring size
        for world in (2, 3, 5):
            for rank in range(world):
                plan = schedule(1000, world, rank, 64)
                assert plan.num_steps >= 1
    ring = (5, 3, 9)
    order = row.order(ring, {pid: _init(row) for pid in ring})
    assert sorted(order) == sorted(ring), "the participants are exactly the ring's members"


@settings(max_examples=150)
@given(data=st.data())
@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kind.name)
def test_the_machine_does_what_the_row_says(row: ko.KindRow, data: st.DataObject) -> None:
    n = data.draw(st.integers(2, 5), label="voters")
    ring = tuple(data.draw(st.permutations(range(1, n + 1)), label="ring"))
    group = _Group(n, ring)
    common = {f: data.draw(VALUES[f], label=f) for f in row.agreed}
    alike = data.draw(st.booleans(), label="every voter sends the common values")
    inits = {}
    for pid in range(1, n + 1):  # otherwise each voter may differ from the others in some agreed fields
        odd = set() if alike else data.draw(st.sets(st.sampled_from(row.agreed)), label=f"fields peer {pid} changes")
        mine = {f: (data.draw(VALUES[f], label=f"{f} of peer {pid}") if f in odd else v) for f, v in common.items()}
        inits[pid] = _init(row, **mine)
    for pid in data.draw(st.permutations(range(1, n + 1)), label="arrival"):
        group.vote(pid, inits[pid])
    agree = len({row.key(i) for i in inits.values()}) == 1
    assert sorted(pid for pid, _ in group.sent) == list(range(1, n + 1)), "one answer per voter"
    answers = {type(msg) for _, msg in group.sent}
    root_absent = "root" in row.agreed and inits[1].root not in inits
    if agree and root_absent:
        assert all(msg.code == m.RejectCode.ROOT_ABSENT and f"root {inits[1].root:x}" in msg.detail  # type: ignore[attr-defined]
                   for _, msg in group.sent)
    elif agree:
        assert answers == {m.CollectiveCommence}
        assert all(msg.ring == row.order(ring, inits) for _, msg in group.sent)  # type: ignore[attr-defined]
        (op,) = group.ops.views()
        assert op.kind is row.kind and op.participants == row.order(ring, inits)
        counts = tuple(inits[pid].count for pid in op.participants) if row.sends_counts else ()
        assert all(msg.counts == counts for _, msg in group.sent)  # type: ignore[attr-defined]
    else:
        assert answers == {m.CollectiveRejected} and not group.ops.views()
        for _, msg in group.sent:
            assert msg.code == m.RejectCode.PARAMETER_MISMATCH  # type: ignore[attr-defined]
            for pid, init in inits.items():
                assert f"peer {pid:x}: {row.describe(init)}" in msg.detail  # type: ignore[attr-defined]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kind.name)
def test_below_the_rows_minimum_is_too_few_peers(row: ko.KindRow) -> None:
    group = _Group(row.min_voters - 1 or 1)
    for pid in range(1, group.n + 1):
        group.vote(pid, _init(row))
    assert [msg.code for _, msg in group.sent] == [m.RejectCode.TOO_FEW_PEERS] * group.n  # type: ignore[attr-defined]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.kind.name)
def test_a_waiting_voter_waits_in_the_rows_call(row: ko.KindRow) -> None:
    group = _Group(3)
    for tag in (4, 2):
        group.vote(1, _init(row, tag=tag))
    assert group.ops.waiting_call(0, 1) == f"{row.call} (tag 2, 4)"
    assert group.ops.waiting_call(0, 2) is None  # in no op
    for pid in (2, 3):
        group.vote(pid, _init(row, tag=2))
    assert group.ops.waiting_call(0, 1) is None  # tag 2 runs: it can still go on


class _Other(enum.Enum):
    """A stand-in second kind (the wire has one kind today), to show the kind rule itself."""

    GATHER = "gather"


def test_voters_must_agree_on_the_kind_and_the_rest_commence_once_the_odd_one_withdraws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    all_reduce = ko.KINDS[ko.CollectiveKind.ALL_REDUCE]
    other = dataclasses.replace(all_reduce, kind=_Other.GATHER, call="all_gather",  # type: ignore[arg-type]
                                order=lambda ring, inits: ring[::-1])
    monkeypatch.setattr(co, "KINDS", {ko.CollectiveKind.ALL_REDUCE: all_reduce, _Other.GATHER: other})
    monkeypatch.setattr(co, "kind_of", lambda init: _Other.GATHER if init.layout == 1 else ko.CollectiveKind.ALL_REDUCE)
    group = _Group(3)
    group.vote(1, _init(all_reduce, layout=1))
    group.vote(2, _init(all_reduce))
    group.vote(3, _init(all_reduce))
    assert [msg.code for _, msg in group.sent] == [m.RejectCode.PARAMETER_MISMATCH] * 3  # type: ignore[attr-defined]
    assert all("peer 1: gather; peer 2: all_reduce; peer 3: all_reduce" in msg.detail  # type: ignore[attr-defined]
               for _, msg in group.sent)
    group.sent.clear()
    # The first voter's kind names the op; it withdraws and votes again, agreeing with the others
    # now: the op commences as the row of their kind says (all-reduce's order, not the other's).
    group.vote(2, _init(all_reduce, tag=8, layout=1))
    group.vote(1, _init(all_reduce, tag=8))
    group.ops.on_withdraw(0, 2, m.CollectiveWithdraw(8))
    group.vote(3, _init(all_reduce, tag=8))
    group.vote(2, _init(all_reduce, tag=8))
    assert [(pid, type(msg)) for pid, msg in group.sent] == [
        (2, m.CollectiveRejected), (1, m.CollectiveCommence), (2, m.CollectiveCommence), (3, m.CollectiveCommence)]
    assert group.sent[1][1].ring == (1, 2, 3)  # type: ignore[attr-defined]
    assert [op.kind for op in group.ops.views()] == [ko.CollectiveKind.ALL_REDUCE]
