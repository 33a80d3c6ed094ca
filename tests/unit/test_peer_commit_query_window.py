"""A master's query that reaches a peer between its ``Done(ok)`` and its agreement's
``RESULT_HELD`` (pccl._peer.peer_commit_driver.PeerCommits.on_query, then settle).

The peer answers in doubt with its own id alone, so the master may decide on that answer without
the ids the peer is about to learn from its acks: it must wait for the verdict, not commit on a
full set.  Ring X -> P -> Q: Q acked {Q} to X; X merged, acked {Q, X} to P and died with its
Done lost; the master queries P and Q.  P, in the window, answers {P}; Q answers {Q}; the union
lacks X, so the master aborts Q — and P, reading X's ack, committed (the review's split).

Also the steady path on real (memory) links, ring lanes both ways and partner links: every
participant commits on its acks alone, the last one ready late.  And a restarted master's side
(at the end): a query naming an earlier master is answered on that master's op, and the ops a
peer reports as it registers again (``Register.undecided``)."""

from __future__ import annotations

import logging
import types
from typing import Any

import pytest
import trio
import trio.testing

from pccl._peer.agreement import Agreement
from pccl._peer.host import Counters
from pccl._peer.peer_commit_driver import PeerCommits
from pccl.protocol import messages as m
from pccl.protocol.op_lifecycle import Event, OpLifecycle, State
from pccl.protocol.peer_ack import Ack, encode_ack
from pccl.protocol.peer_commit import Event as E
from pccl.protocol.peer_commit import Phase
from pccl.collectives.links import RingLinks
from pccl.testing.streams import memory_mesh, memory_ring

RING = (10, 11, 12)  # X, P, Q by peer id: P is position 1, its predecessor X position 0
ME = 11
SEQ = m.derived_seq(1, 1, 0)


class _Inbox:
    """Lane 0 from X: its ack naming X and Q ready is already in (it came before the query)."""

    def __init__(self, ag: Agreement) -> None:
        self.ack: bytes | None = encode_ack(Ack(SEQ, ag.digest, frozenset({0, 2})), len(RING))
        self.reads = 0
        self.stopped = False  # a read of it was cancelled
        self.connection = _Lane()  # P's acks back to X

    async def receive_into(self, *, destination: memoryview, **kw: Any) -> int:
        self.reads += 1
        if self.reads > 1 or self.ack is None:
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                self.stopped = True
                raise
        assert self.ack is not None
        destination[:] = self.ack
        return len(self.ack)


class _Lane:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send_data(self, header: Any, payload: bytes) -> None:
        self.sent.append(bytes(payload))


def _window(sent: list[m.Message] | None = None) -> tuple[PeerCommits, Any, list[Any], list[Event]]:
    """P's service with its op reported (``sent``: what it sends the master on its own, such as
    a ``CollectiveAsk``; the answers to queries are in the third item)."""
    answers: list[Any] = []
    steps: list[Event] = []

    async def send_shielded(msg: m.Message, *, epoch: int | None = None) -> None:
        (sent if sent is not None else answers).append(msg)

    host = types.SimpleNamespace(peer_id=ME, counters=Counters(), on_query=None, master_instance=0, reconnecting=False,
                                 config=types.SimpleNamespace(peer_timeout=3600.0),
                                 spawn=lambda fn, *args: answers.append(args[0]) or True,
                                 send_shielded=send_shielded)
    ag = Agreement.of(RING, ME, 1, SEQ, m.CollectiveInit(1, 4, 10, 0))
    silent = _Inbox(ag)  # lane 0 to Q read backwards: Q's acks (none come)
    silent.ack = None
    lane, inbox = _Lane(), _Inbox(ag)
    links = types.SimpleNamespace(to_next=(lane,), inboxes=(inbox,), send_channels=None, retire=lambda seq: None,
                                  ack_links=lambda position, n: {0: (inbox.connection, inbox), 2: (lane, silent)})
    op = types.SimpleNamespace(seq=SEQ, agreement=ag, links=links, epoch=0, instance=0, settled=trio.Event(),
                               ring_scope=trio.CancelScope(), machine=OpLifecycle(State.REPORTED),
                               plan=types.SimpleNamespace(what="all_reduce", tag=1))

    def step(op: Any, event: Event, word: object = None) -> None:
        steps.append(event)
        op.readers_stopped_at_step = silent.stopped

    pcs = PeerCommits(host, step)  # type: ignore[arg-type]
    pcs.track(op)
    return pcs, op, answers, steps


async def test_a_query_after_done_before_ready_waits_for_the_verdict_not_for_a_full_set() -> None:
    pcs, op, answers, steps = _window()
    pcs.on_query(m.CollectiveQuery(1, SEQ), 0)  # Done(ok) is out; settle() has not run yet
    assert [(a.phase, a.known) for a in answers] == [(m.CommitPhase.IN_DOUBT, (ME,))]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pcs.settle, op)
        await trio.testing.wait_all_tasks_blocked()
        # X's ack would complete P's set {P} + {X, Q}: P must not commit on it, nor read it.
        assert Event.COMPLETE not in steps and op.agreement.machine.phase is not Phase.COMMITTED
        assert op.links.inboxes[0].reads == 0 and op.links.to_next[0].sent == []
        assert op.links.inboxes[0].connection.sent == []
        op.settled.set()  # the master's verdict (an abort: Q's answer lacks X)
    assert Event.COMPLETE not in steps and op.agreement.machine.phase is not Phase.COMMITTED
    assert pcs.frozen(SEQ)


async def test_without_a_query_the_same_peer_commits_on_the_full_set() -> None:
    # The control: the same op and the same ack, with no query, commit on the acks alone.
    pcs, op, answers, steps = _window()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pcs.settle, op)
        await trio.testing.wait_all_tasks_blocked()
        assert steps == [Event.COMPLETE] and op.agreement.machine.phase is Phase.COMMITTED
        op.settled.set()  # (the step recorded above would have set it)
    assert answers == [] and not pcs.frozen(SEQ)
    # The op's COMPLETE came once its ack readers had stopped: from there no checkpoint is left
    # before the call returns, where the master's word (its Commence, say) could still reach
    # the op's intercept and meet a completed op.
    assert op.readers_stopped_at_step


INIT = m.CollectiveInit(1, 4, 10, 0)


def _links(n: int) -> list[RingLinks]:
    return memory_mesh(n)[0] if n >= 8 else memory_ring(n)[0]


def _participant(ring: tuple[int, ...], position: int,
                 links: RingLinks) -> tuple[PeerCommits, Any, list[Event], Counters]:
    steps: list[Event] = []
    host = types.SimpleNamespace(peer_id=ring[position], counters=Counters(), on_query=None, master_instance=0,
                                 reconnecting=False,
                                 config=types.SimpleNamespace(peer_timeout=3600.0), spawn=lambda *a: True)
    op = types.SimpleNamespace(seq=SEQ, agreement=Agreement.of(ring, ring[position], 1, SEQ, INIT), links=links,
                               epoch=0, instance=0, settled=trio.Event(), ring_scope=trio.CancelScope(),
                               machine=OpLifecycle(State.REPORTED), plan=types.SimpleNamespace(what="all_reduce", tag=1))
    pcs = PeerCommits(host, lambda op, event, word=None: steps.append(event))  # type: ignore[arg-type]
    pcs.track(op)
    return pcs, op, steps, host.counters


@pytest.mark.parametrize("n", [3, 5, 8, 9, 16])
async def test_every_participant_commits_on_its_acks_alone_over_memory_links(n: int) -> None:
    links = _links(n)
    ring = tuple(range(100, 100 + n))
    parts = [_participant(ring, p, links[p]) for p in range(n)]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for p, (pcs, op, _, _) in enumerate(parts):
                if p != n // 2:
                    nursery.start_soon(pcs.settle, op)
            await trio.testing.wait_all_tasks_blocked()  # everyone else is ready, waiting for one id
            assert all(op.agreement.machine.phase is Phase.READY for _, op, _, _ in parts if op is not parts[n // 2][1])
            pcs, op, _, _ = parts[n // 2]
            nursery.start_soon(pcs.settle, op)
    assert all(steps == [Event.COMPLETE] for _, _, steps, _ in parts)
    assert all(op.agreement.machine.phase is Phase.COMMITTED for _, op, _, _ in parts)
    assert sum(counters.peer_commit_doubts for _, _, _, counters in parts) == 0


class _SilentInbox:
    """An ack link on which no ack comes."""

    def __init__(self) -> None:
        self.reads = 0

    async def receive_into(self, **kw: Any) -> int:
        self.reads += 1
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_a_query_that_ends_a_ready_peers_ack_read_is_no_silence_it_asks_nothing_more(
        caplog: pytest.LogCaptureFixture) -> None:
    # P is ready and waits for an ack from X or Q when the master's query comes: it answers (in
    # doubt) and its wait for the next ack stops.  That stop is not a silent neighbour: P must
    # neither report one nor ask the master on top of the answer it gave (the master is deciding
    # on it), only wait for the verdict.
    caplog.set_level(logging.INFO)
    asks: list[m.Message] = []
    pcs, op, answers, steps = _window(asks)
    from_x, from_q = _SilentInbox(), _SilentInbox()
    op.links.ack_links = lambda position, n: {0: (_Lane(), from_x), 2: (_Lane(), from_q)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pcs.settle, op)
        await trio.testing.wait_all_tasks_blocked()
        assert (from_x.reads, from_q.reads) == (1, 1) and op.agreement.machine.phase is Phase.READY
        pcs.on_query(m.CollectiveQuery(1, SEQ), 0)
        await trio.testing.wait_all_tasks_blocked()
        assert [(a.phase, a.known) for a in answers] == [(m.CommitPhase.IN_DOUBT, (ME,))]
        assert asks == [] and op.agreement.machine.phase is Phase.IN_DOUBT
        op.settled.set()  # the master's verdict
    assert asks == [] and Event.COMPLETE not in steps
    assert not [r for r in caplog.records if "no ack" in r.getMessage()], caplog.text


# --- a restarted master's queries and the reports of Register.undecided -----------------------
# Round ids restart with a master, so a later op of this peer may have the seq of an earlier
# master's op it committed: the query names that master (``CollectiveQuery.instance``), and the
# answer is that op's, not the later one's.

R_RING = (10, 11)
R_SEQ = m.derived_seq(1, 4, 0)  # round 1 of either master, tag 4, its first use
OLD, NEW = 0x01D, 0x2E3
R_INIT = m.CollectiveInit(4, 4, 10, 0)


def _restart_service() -> tuple[PeerCommits, Any, list[m.Message]]:
    answers: list[m.Message] = []
    host = types.SimpleNamespace(peer_id=ME, counters=Counters(), on_query=None, master_instance=OLD,
                                 reconnecting=False, config=types.SimpleNamespace(peer_timeout=3600.0),
                                 spawn=lambda fn, *args: answers.append(args[0]) or True)
    return PeerCommits(host, lambda *a, **k: None), host, answers  # type: ignore[arg-type]


def _restart_op(instance: int, state: State) -> Any:
    return types.SimpleNamespace(seq=R_SEQ, instance=instance, agreement=Agreement.of(R_RING, ME, 1, R_SEQ, R_INIT),
                                 epoch=0, settled=trio.Event(), ring_scope=trio.CancelScope(),
                                 machine=OpLifecycle(state), plan=types.SimpleNamespace(what="all_reduce", tag=4))


async def test_a_query_about_an_earlier_masters_op_is_answered_on_that_op_not_on_a_later_one_of_its_seq() -> None:
    pcs, host, answers = _restart_service()
    earlier = _restart_op(OLD, State.COMPLETED)
    earlier.agreement.machine.handle(E.RESULT_HELD)
    earlier.agreement.machine.receive_known({0, 1})  # committed on its full set
    pcs.track(earlier)
    pcs.untrack(earlier)
    host.master_instance = NEW  # the master restarted; round 1 again, tag 4's first use again
    later = _restart_op(NEW, State.BEGUN)
    pcs.track(later)
    pcs.on_query(m.CollectiveQuery(4, R_SEQ, OLD), 1)
    assert answers == [m.CollectiveAnswer(4, R_SEQ, m.CommitPhase.COMMITTED, R_RING, OLD)]
    assert not later.ring_scope.cancel_called and not pcs.frozen(R_SEQ)  # the later op runs on
    # An earlier master's op it knows nothing of: never ready here, it answers aborted.
    pcs.on_query(m.CollectiveQuery(4, R_SEQ + 1, OLD), 1)
    assert answers[-1] == m.CollectiveAnswer(4, R_SEQ + 1, m.CommitPhase.ABORTED, (), OLD)


async def test_the_ops_a_peer_reports_as_it_registers_again_are_those_it_is_ready_for_or_in_doubt_about() -> None:
    pcs, host, _ = _restart_service()
    doubt, ready, running, reported = (_restart_op(OLD, State.REPORTED) for _ in range(4))
    for op, seq in zip((doubt, ready, running, reported), range(4)):
        op.seq = R_SEQ + seq
        pcs.track(op)
    doubt.agreement.machine.handle(E.RESULT_HELD)
    doubt.agreement.machine.handle(E.PEER_LOST)
    ready.agreement.machine.handle(E.RESULT_HELD)
    running.machine = OpLifecycle(State.BEGUN)  # its ring still runs: it is not ready
    # ``reported``: its Done(ok) is out, settle() has not fed RESULT_HELD yet: ready, its own id
    assert sorted(pcs.undecided(), key=lambda u: u.seq) == [
        m.UndecidedOp(OLD, 4, R_SEQ, R_RING, m.CommitPhase.IN_DOUBT, (ME,)),
        m.UndecidedOp(OLD, 4, R_SEQ + 1, R_RING, m.CommitPhase.READY, (ME,)),
        m.UndecidedOp(OLD, 4, R_SEQ + 3, R_RING, m.CommitPhase.READY, (ME,)),
    ]
    assert doubt.agreement.reported is Phase.IN_DOUBT
