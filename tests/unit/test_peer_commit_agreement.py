"""An op's agreement (``Config.peer_commit``): which growths of the known set are worth an ack
to an ack target (pccl._peer.agreement.Agreement.news)."""

from __future__ import annotations

from pccl._peer.agreement import Agreement
from pccl.protocol import messages as m
from pccl.protocol.peer_commit import Event, Phase

INIT = m.CollectiveInit(1, 4, 10, 0)


def test_a_growth_by_the_targets_own_id_alone_is_not_sent() -> None:
    # Two peers: the other's id is all a participant learns, and the other knows it already.
    ag = Agreement.of((10, 11), 10, 1, m.derived_seq(1, 1, 0), INIT)
    ag.machine.handle(Event.RESULT_HELD)
    assert ag.news(1)  # its own readiness: the other has not heard it
    ag.tell(1, ag.machine.known)
    ag.machine.receive_known({1})
    assert ag.machine.phase is Phase.COMMITTED and not ag.news(1)


def test_an_id_is_sent_to_each_target_that_does_not_know_it() -> None:
    ag = Agreement.of((10, 11, 12, 13), 11, 1, m.derived_seq(1, 1, 0), INIT)  # position 1
    ag.machine.handle(Event.RESULT_HELD)
    for target in (0, 2):
        ag.tell(target, ag.machine.known)
    ag.machine.receive_known({0})
    ag.tell(0, frozenset({0}))  # what a target acked, it knows
    assert not ag.news(0) and ag.news(2)  # position 2 hears of position 0 through it
    ag.tell(2, ag.machine.known)
    ag.machine.receive_known({2, 3})
    ag.tell(2, frozenset({2, 3}))
    assert ag.machine.phase is Phase.COMMITTED and ag.news(0) and not ag.news(2)
