"""Deliberately broken masters: the simulator's own teeth test (mutation testing).

A campaign that passes proves little unless the same campaign *fails* when the code under test
is wrong.  Each variant here is a :class:`~pccl.protocol.master.machine.MasterState` subclass with
one classic distributed-systems bug planted in it.  The pccl scenario installs one by name
(``PcclScenario(master="no-recheck-on-disconnect")``) — injected through the scenario with
:func:`pccl.testing.install_master_state`, never through a branch in pccl — and ``tests/sim/test_teeth.py`` shows a campaign finds it and the
shrinker reduces the failing schedule to a handful of events.

``MASTER_VARIANTS`` maps a name to a factory ``(rng, peer_timeout, reconnect_timeout) -> MasterState``; ``"real"``
is pccl's own machine.  Register more with :func:`register_master_variant`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from pccl.protocol.master import machine as ms
from pccl.protocol import messages as m

__all__ = [
    "MASTER_VARIANTS",
    "NoRecheckOnDisconnect",
    "CrashesOnP2PReport",
    "NewcomerRevisionWins",
    "LineageBlind",
    "SplitVerdict",
    "OrphanWaitTenfold",
    "register_master_variant",
    "make_master_state",
]

MasterFactory = Callable[..., ms.MasterState]


class NoRecheckOnDisconnect(ms.MasterState):
    """PCCL's classic bug (reference §3.5): consensus is only re-evaluated when a peer *says*
    something meaningful (a vote, a report, a registration), not when a peer disconnects or times
    out, nor on heartbeats and timer ticks.  A peer dying while the others wait in a vote leaves
    them waiting until some unrelated message happens to arrive — in a quiet cluster, forever."""

    _recheck = True

    def handle(self, event: ms.Event, now: float) -> list[ms.Effect]:
        self._recheck = isinstance(event, ms.MessageReceived) and not isinstance(event.msg, m.Heartbeat)
        return super().handle(event, now)

    def _settle(self) -> None:
        if self._recheck:
            super()._settle()


class CrashesOnP2PReport(ms.MasterState):
    """A plain programming error in the machine: it raises on the first ``P2PReport``.  The
    master's shell contains it (closes that connection, counts ``internal_errors``) and keeps
    serving, so only a checker that reads those statistics notices."""

    def handle(self, event: ms.Event, now: float) -> list[ms.Effect]:
        if isinstance(event, ms.MessageReceived) and isinstance(event.msg, m.P2PReport):
            raise RuntimeError("planted bug: P2PReport handler crashed")
        return super().handle(event, now)


class NewcomerRevisionWins(ms.MasterState):
    """The data-loss defect the lineage rule fixed, planted back: the master believes a joiner's
    claimed progress.  A vote without a lineage that offers more than the group's next revision
    is taken as the group's own lineage at that progress, and the group's memory of its last sync
    is dropped — so, as under the old "highest revision of a non-continuing peer wins" rule, the
    joiner's state replaces the running group's."""

    def handle(self, event: ms.Event, now: float) -> list[ms.Effect]:
        if isinstance(event, ms.MessageReceived) and isinstance(event.msg, m.SyncVote) and event.msg.lineage is None:
            peer = self._roster.by_conn.get(event.conn_id)
            lineage = None if peer is None else self.lineage_of(peer.group)
            if peer is not None and lineage is not None and event.msg.revision > lineage.revision + 1:
                claimed = m.Lineage(lineage.id, event.msg.revision - 1, lineage.digest)
                event = dataclasses.replace(event, msg=msgspec.structs.replace(event.msg, lineage=claimed))
                self._sync_state.forget(peer.group)
        return super().handle(event, now)


class LineageBlind(ms.MasterState):
    """A master that ignores the lineage peers report (as one that predates it would): every
    sync looks like the run's first, mints a new lineage and lets most progress win."""

    def handle(self, event: ms.Event, now: float) -> list[ms.Effect]:
        if isinstance(event, ms.MessageReceived) and isinstance(event.msg, m.SyncVote) and event.msg.lineage:
            event = dataclasses.replace(event, msg=msgspec.structs.replace(event.msg, lineage=None))
        return super().handle(event, now)


class SplitVerdict(ms.MasterState):
    """All-or-nothing broken: the first collective that completes is completed on every
    participant but the last in its ring, which is told it aborted (a master that decides per
    participant instead of once per op)."""

    _split = False

    def handle(self, event: ms.Event, now: float) -> list[ms.Effect]:
        effects = super().handle(event, now)
        if self._split:
            return effects
        completes = [i for i, e in enumerate(effects) if isinstance(e, ms.Send) and isinstance(e.msg, m.CollectiveComplete)]
        if len(completes) >= 2:
            self._split = True
            last = effects[completes[-1]]
            assert isinstance(last, ms.Send) and isinstance(last.msg, m.CollectiveComplete)
            effects[completes[-1]] = ms.Send(last.conn_id, m.CollectiveAbort(last.msg.tag, last.msg.seq, "planted split"))
        return effects


class OrphanWaitTenfold(ms.MasterState):
    """A restarted master that waits ten times ``master_reconnect_timeout`` (its rule:
    docs/protocol.rst, "A master restart while peers are in doubt") for the absent participants
    of an op a peer reported undecided: the reporters' calls hang ten minutes instead of one.
    The liveness checkers allow the documented wait (:mod:`pccl_sim.workloads.pccl.orphan_waits`),
    not this one."""

    def __init__(self, *, reconnect_timeout: float = 60.0, **kwargs: Any) -> None:
        super().__init__(reconnect_timeout=10 * reconnect_timeout, **kwargs)


MASTER_VARIANTS: dict[str, MasterFactory] = {
    "real": ms.MasterState,
    "no-recheck-on-disconnect": NoRecheckOnDisconnect,
    "crashes-on-p2p-report": CrashesOnP2PReport,
    "newcomer-revision-wins": NewcomerRevisionWins,
    "lineage-blind": LineageBlind,
    "split-verdict": SplitVerdict,
    "orphan-wait-tenfold": OrphanWaitTenfold,
}


def register_master_variant(name: str, factory: MasterFactory) -> None:
    MASTER_VARIANTS[name] = factory


def make_master_state(name: str, **kwargs: object) -> ms.MasterState:
    """Build the variant ``name`` (``KeyError`` listing the known ones if unknown)."""
    try:
        factory = MASTER_VARIANTS[name]
    except KeyError:
        raise KeyError(f"unknown master variant {name!r}; known: {sorted(MASTER_VARIANTS)}") from None
    return factory(**kwargs)
