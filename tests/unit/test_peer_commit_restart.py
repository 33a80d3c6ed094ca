"""A peer's side of a restarted master resolving the peer-agreed ops of the master before it
(pccl._peer.peer_commit_driver.PeerCommits: ``on_query`` with ``CollectiveQuery.instance``,
``undecided`` for ``Register.undecided``).  Round ids restart with a master, so a later op of
this peer may have the seq of an earlier master's op it committed: the query names that master,
and the answer is that op's, not the later one's."""

from __future__ import annotations

import types
from typing import Any

import trio

from pccl._peer.agreement import Agreement
from pccl._peer.host import Counters
from pccl._peer.peer_commit_driver import PeerCommits
from pccl.protocol import messages as m
from pccl.protocol.op_lifecycle import OpLifecycle, State
from pccl.protocol.peer_commit import Event as E
from pccl.protocol.peer_commit import Phase

RING = (10, 11)
ME = 11
SEQ = m.derived_seq(1, 4, 0)  # round 1 of either master, tag 4, its first use
OLD, NEW = 0x01D, 0x2E3
INIT = m.CollectiveInit(4, 4, 10, 0)


def _service() -> tuple[PeerCommits, Any, list[m.Message]]:
    answers: list[m.Message] = []
    host = types.SimpleNamespace(peer_id=ME, counters=Counters(), on_query=None, master_instance=OLD,
                                 reconnecting=False, config=types.SimpleNamespace(peer_timeout=3600.0),
                                 spawn=lambda fn, *args: answers.append(args[0]) or True)
    return PeerCommits(host, lambda *a, **k: None), host, answers  # type: ignore[arg-type]


def _op(instance: int, state: State) -> Any:
    return types.SimpleNamespace(seq=SEQ, instance=instance, agreement=Agreement.of(RING, ME, 1, SEQ, INIT),
                                 epoch=0, settled=trio.Event(), ring_scope=trio.CancelScope(),
                                 machine=OpLifecycle(state), plan=types.SimpleNamespace(what="all_reduce", tag=4))


async def test_a_query_about_an_earlier_masters_op_is_answered_on_that_op_not_on_a_later_one_of_its_seq() -> None:
    pcs, host, answers = _service()
    earlier = _op(OLD, State.COMPLETED)
    earlier.agreement.machine.handle(E.RESULT_HELD)
    earlier.agreement.machine.receive_known({0, 1})  # committed on its full set
    pcs.track(earlier)
    pcs.untrack(earlier)
    host.master_instance = NEW  # the master restarted; round 1 again, tag 4's first use again
    later = _op(NEW, State.BEGUN)
    pcs.track(later)
    pcs.on_query(m.CollectiveQuery(4, SEQ, OLD), 1)
    assert answers == [m.CollectiveAnswer(4, SEQ, m.CommitPhase.COMMITTED, RING, OLD)]
    assert not later.ring_scope.cancel_called and not pcs.frozen(SEQ)  # the later op runs on
    # An earlier master's op it knows nothing of: never ready here, it answers aborted.
    pcs.on_query(m.CollectiveQuery(4, SEQ + 1, OLD), 1)
    assert answers[-1] == m.CollectiveAnswer(4, SEQ + 1, m.CommitPhase.ABORTED, (), OLD)


async def test_the_ops_a_peer_reports_as_it_registers_again_are_those_it_is_ready_for_or_in_doubt_about() -> None:
    pcs, host, _ = _service()
    doubt, ready, running, reported = (_op(OLD, State.REPORTED) for _ in range(4))
    for op, seq in zip((doubt, ready, running, reported), range(4)):
        op.seq = SEQ + seq
        pcs.track(op)
    doubt.agreement.machine.handle(E.RESULT_HELD)
    doubt.agreement.machine.handle(E.PEER_LOST)
    ready.agreement.machine.handle(E.RESULT_HELD)
    running.machine = OpLifecycle(State.BEGUN)  # its ring still runs: it is not ready
    # ``reported``: its Done(ok) is out, settle() has not fed RESULT_HELD yet: ready, its own id
    assert sorted(pcs.undecided(), key=lambda u: u.seq) == [
        m.UndecidedOp(OLD, 4, SEQ, RING, m.CommitPhase.IN_DOUBT, (ME,)),
        m.UndecidedOp(OLD, 4, SEQ + 1, RING, m.CommitPhase.READY, (ME,)),
        m.UndecidedOp(OLD, 4, SEQ + 3, RING, m.CommitPhase.READY, (ME,)),
    ]
    assert doubt.agreement.reported is Phase.IN_DOUBT
