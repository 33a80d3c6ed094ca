"""An op's agreement (``Config.peer_commit``): which growths of the known set are worth an ack
to the ring successor (pccl._peer.agreement.Agreement.news)."""

from __future__ import annotations

from pccl._peer.agreement import Agreement
from pccl.protocol import messages as m
from pccl.protocol.peer_commit import Event, Phase

INIT = m.CollectiveInit(1, 4, 10, 0)


def test_a_growth_by_the_successors_own_id_alone_is_not_sent() -> None:
    # Two peers: the other's id is all a participant learns, and the other knows it already.
    ag = Agreement.of((10, 11), 10, 1, m.derived_seq(1, 1, 0), INIT)
    ag.machine.handle(Event.RESULT_HELD)
    assert ag.news()  # its own readiness: the successor has not heard it
    ag.told = ag.machine.known
    ag.machine.receive_known({1})
    assert ag.machine.phase is Phase.COMMITTED and not ag.news()


def test_an_id_from_before_it_on_the_ring_is_relayed() -> None:
    ag = Agreement.of((10, 11, 12), 11, 1, m.derived_seq(1, 1, 0), INIT)  # position 1, successor 2
    ag.machine.handle(Event.RESULT_HELD)
    ag.told = ag.machine.known
    ag.machine.receive_known({0})
    assert ag.news()  # position 2 hears of position 0 only through it
    ag.told = ag.machine.known
    ag.machine.receive_known({0, 2})
    assert ag.machine.phase is Phase.COMMITTED and not ag.news()
