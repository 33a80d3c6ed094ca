"""The shared-state step of the pccl workload, and its checker.

:class:`SyncPhase` (phase name ``"sync"``) makes every peer sync a small shared state each step
and then update it with a deterministic rule, exactly as a training loop does::

    info = await comm.sync_shared_state(state)
    update(state)            # the same pure function of the state on every peer
    state.revision += 1

The state lives per *host incarnation*: a peer that is kicked or loses the master keeps its
weights and revision when it joins again (as a real user would), while a freshly spawned host
starts as a joiner — random content from its own RNG, and a revision that is 0 or, for half of
them (``high_joiners``), a revision up to ``joiner_revisions`` beyond any peer's (a joiner that
claims more progress than the group; it must receive the group's state, never replace it).  Besides the compared tensors
it holds an ``allow_content_inequality`` tensor re-randomised after every sync (a per-peer RNG
state): it must reach joiners but never cause a transfer among up-to-date peers.

Trace events (plain data): ``sync_vote`` before each sync (``offered`` revision, ``offered_digest``
of the compared tensors, ``held``: the lineage id the state held, hex, or none), ``sync``
(``revision``, ``tx``/``rx``, ``digest`` of the compared tensors after the sync, ``first``: the
communicator's first successful sync, ``group``, ``held`` and ``lineage``: the lineage id before
and after) and
``sync_failed`` (``error``: the exception class, when a sync could not complete —
``SharedStateSyncFailed`` because every source died, for instance).

:class:`SharedStateAgreement` (**safety**) checks, after every sync:

* every peer that completed the same sync (the ``SyncComplete(sync_id)`` it received, per master
  epoch) holds bit-identical compared tensors — in particular a joiner after its first sync;
* the lineage rule (:mod:`pccl.protocol.master.election`): a *continuing* peer — its previous successful sync was with the
  same master and none of its syncs failed since — moves on by exactly one revision and
  receives nothing, unless a non-continuing peer (a joiner, a peer back after removal, every
  peer after a master restart) took part in the same sync and brought more progress or other
  content; then it may jump ahead and receive, never go back.  (Settled at the end of the run,
  since the peers of one sync report in any order.)
* no progress is lost: a sync never adopts a revision below the one a continuing peer that
  holds the group's lineage offered (a peer without it — a joiner, or a holder of a lineage the
  group gave up after every holder was lost — receives the group's state whatever it offers);
* no participant without the lineage ever changes a lineage holder's state: when a sync ends in a
  lineage somebody already held, the adopted revision and state are exactly what a holder of
  that lineage offered (its vote, before the sync) — never a joiner's, whatever revision the
  joiner claimed — and a sync in which a lineage holder took part never mints a new lineage
  (settled at the end);
* no peer is told ``RevisionViolation`` or kicked for a shared-state reason (this workload
  never deserves it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

import pccl

from ...engine.runner import Checker, Simulation
from ...engine.trace import TraceEvent
from .phases import Phase, StepContext, StepScenario, register_phase

__all__ = ["SyncPhase", "SharedStateAgreement", "state_digest", "update_state"]

_BF16 = pccl.DType.BFLOAT16.numpy_dtype()
_SHARED_STATE_KICKS = ("REVISION_VIOLATION", "SHARED_STATE_MISMATCH", "STRATEGY_VIOLATION")


def new_state(rng: Any, n: int, joiner_revisions: int = 0, high_joiners: float = 0.5, *,
              ahead_of: int = 0) -> pccl.SharedState:
    """A joiner's state: random content (from the host's seeded RNG); revision 0, or for a
    fraction ``high_joiners`` of the joiners (when ``joiner_revisions`` > 0) ``ahead_of`` plus a
    random number in [1, joiner_revisions] — more progress than any peer has."""
    gen = np.random.default_rng(rng.getrandbits(64))
    state = pccl.SharedState({
        "w": gen.standard_normal(n).astype(np.float32),
        "m": gen.standard_normal(n // 4 + 1).astype(_BF16),
        "count": np.array([gen.integers(0, 1000)], np.int64),
        "rng": pccl.Tensor(gen.integers(0, 2**63, 4, dtype=np.uint64), allow_content_inequality=True),
    })
    if joiner_revisions > 0 and gen.random() < high_joiners:
        state.revision = ahead_of + int(gen.integers(1, joiner_revisions + 1))
    return state


def update_state(state: pccl.SharedState, rng: Any) -> None:
    """The deterministic optimizer step (same on every peer), plus a per-peer re-randomised
    ``rng`` tensor (allowed to differ)."""
    w, mom = state["w"], state["m"]
    np.multiply(w, np.float32(0.75), out=w)
    np.add(w, np.float32(state.revision % 7), out=w)
    mom[:] = (mom.astype(np.float32) * np.float32(0.5) + np.float32(1.0)).astype(_BF16)
    state["count"][0] += 1
    state["rng"][:] = np.array([rng.getrandbits(63) for _ in range(state["rng"].size)], np.uint64)
    state.revision += 1


def state_digest(state: pccl.SharedState) -> str:
    """sha256 over the tensors peers must agree on (``allow_content_inequality`` ones excluded)."""
    h = hashlib.sha256()
    for key, tensor in state.tensors().items():
        if not tensor.allow_content_inequality:
            h.update(key.encode())
            h.update(np.ascontiguousarray(tensor.array).view(np.uint8).tobytes())
    return h.hexdigest()[:32]


class SyncPhase(Phase):
    """Sync then update the shared state each step.  Parameters: ``n`` (elements of ``w``,
    default 1000), ``joiner_revisions`` (how far a fresh joiner's random revision may lie
    beyond the furthest peer's, default 1000; 0: every joiner offers revision 0), ``high_joiners`` (the fraction of joiners
    that do, default 0.5), ``diverge`` (host name whose update rule is
    *not* deterministic — for the checker's teeth test only; default none)."""

    name = "sync"
    messages = {
        "SyncVote": ("send",),
        "SyncPlan": ("recv",),
        "StateRequest": ("send", "recv"),  # the fetcher sends it, the source reads it
        "SyncReport": ("send",),
        "SyncComplete": ("recv",),
    }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.n = int(params.get("n", 1000))
        self.joiner_revisions = int(params.get("joiner_revisions", 1000))
        self.high_joiners = float(params.get("high_joiners", 0.5))
        self.diverge = params.get("diverge")
        self._states: dict[int, pccl.SharedState] = {}  # host incarnation -> its state
        self._synced: set[int] = set()  # peer ids (communicators) with a successful sync

    async def run(self, step: StepContext) -> None:
        host, comm = step.host, step.comm
        state = self._states.get(host.incarnation)
        if state is None:
            ahead_of = max((s.revision for s in self._states.values()), default=0)
            state = self._states[host.incarnation] = new_state(host.rng, self.n, self.joiner_revisions,
                                                               self.high_joiners, ahead_of=ahead_of)
        offered = state.revision
        held = None if state.lineage is None else state.lineage.id.hex()
        step.record("sync_vote", offered=offered, offered_digest=state_digest(state), held=held)
        try:
            info = await comm.sync_shared_state(state)
        except pccl.SharedStateSyncFailed as exc:  # RevisionViolation included: the checker judges
            self._synced.discard(comm.peer_id)
            step.record("sync_failed", error=type(exc).__name__, detail=str(exc))
            return
        first = comm.peer_id not in self._synced
        self._synced.add(comm.peer_id)
        step.record("sync", group=comm.peer_group, revision=info.revision, offered=offered, tx=info.tx_bytes,
                    rx=info.rx_bytes, digest=state_digest(state), first=first, held=held,
                    lineage=None if state.lineage is None else state.lineage.id.hex())
        update_state(state, host.rng)
        if self.diverge == host.name:
            state["w"][0] += np.float32(host.rng.random())

    def checkers(self, scenario: StepScenario) -> Sequence[Checker]:
        return [SharedStateAgreement()]


register_phase(SyncPhase)


class SharedStateAgreement(Checker):
    """The shared-state invariants of the module docstring."""

    name = "shared-state-agreement"

    def __init__(self) -> None:
        self.epoch = 0
        self.sync_of_host: dict[str, tuple[int, int]] = {}  # host -> (epoch, sync_id) last completed
        self.digests: dict[tuple[int, int], tuple[str, str]] = {}  # (epoch, sync_id) -> (digest, host)
        #: peer id -> (master epoch, revision) of its last successful sync
        self.last_sync: dict[int, tuple[int, int]] = {}
        self.failed_since: set[int] = set()  # peer ids whose last sync failed
        #: (epoch, sync_id) -> whether a non-continuing peer took part
        self.newcomers: dict[tuple[int, int], bool] = {}
        #: continuing peers that received or jumped, settled at the end: (key, message)
        self.moved: list[tuple[tuple[int, int], str]] = []
        #: lineage id -> every (revision, digest) a holder of it offered
        self.offers: dict[str, set[tuple[int, str]]] = {}
        #: (epoch, sync_id) -> [its lineage was new at its first report, a reporter held a lineage]
        self.minted: dict[tuple[int, int], list[bool]] = {}
        self.syncs = 0
        self.first_syncs_with_bytes = 0
        self.failed = False

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError("SharedStateAgreement needs the wire (Scenario.sniff)")
        sim.tap.watch(self._wire, names=("SyncComplete",))

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if direction == "recv" and msg is not None:
            self.sync_of_host[host] = (self.epoch, msg.sync_id)

    def _fail(self, sim: Simulation, message: str) -> None:
        if not self.failed:
            self.failed = True
            sim.fail("safety", message, self.name)

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        kind, host, data = event.kind, event.source, event.data
        if kind == "start":
            self.sync_of_host.pop(host, None)
            if host == "master":
                self.epoch += 1
        elif kind == "left" and data.get("reason") in _SHARED_STATE_KICKS:
            self._fail(sim, f"{host} was kicked for {data['reason']}, which this workload never deserves")
        elif kind == "sync_failed":
            self.failed_since.add(data["peer_id"])
            if data["error"] == "RevisionViolation":
                self._fail(sim, f"{host} (peer {data['peer_id']:x}) got RevisionViolation: {data['detail']}")
        elif kind == "sync_vote":
            if data["held"] is not None:
                self.offers.setdefault(data["held"], set()).add((data["offered"], data["offered_digest"]))
        elif kind == "sync":
            self._check_sync(sim, host, data)

    def _check_sync(self, sim: Simulation, host: str, data: dict[str, Any]) -> None:
        self.syncs += 1
        pid, revision = data["peer_id"], data["revision"]
        key = self.sync_of_host.pop(host, None)
        if key is None:
            self._fail(sim, f"{host} (peer {pid:x}) completed a sync without receiving SyncComplete")
            return
        seen = self.digests.setdefault(key, (data["digest"], host))
        if seen[0] != data["digest"]:
            self._fail(sim, f"sync {key[1]} (master epoch {key[0]}): {host} holds state {data['digest']} but "
                            f"{seen[1]} holds {seen[0]} — not bit-identical")
        recovering = pid in self.failed_since
        self.failed_since.discard(pid)
        previous = self.last_sync.get(pid)
        continuing = previous is not None and previous[0] == key[0] and not recovering
        if continuing and data["held"] == data["lineage"] and revision < data["offered"]:
            self._fail(sim, f"{host} (peer {pid:x}) held the group's lineage, offered revision {data['offered']} and "
                            f"its group adopted {revision}: progress was lost")
        lineage = data["lineage"]
        minted = self.minted.setdefault(key, [lineage not in self.offers, False])
        minted[1] = minted[1] or data["held"] is not None
        if lineage in self.offers and (revision, data["digest"]) not in self.offers[lineage]:
            self._fail(sim, f"{host} (peer {pid:x}) adopted revision {revision}, state {data['digest']} in lineage "
                            f"{lineage[:12]}, which no holder of that lineage offered: a participant without the "
                            "lineage changed the holders' state")
        if data["first"]:
            self.first_syncs_with_bytes += data["rx"] > 0
        if not continuing:
            self.newcomers[key] = True
        else:
            self.newcomers.setdefault(key, False)
            last = previous[1]  # type: ignore[index]
            if revision < last + 1:
                self._fail(sim, f"{host} (peer {pid:x}) adopted revision {revision} after {last}: backwards")
            elif data["rx"] or revision != last + 1:
                self.moved.append((key, f"{host} (peer {pid:x}) received {data['rx']} bytes in a sync after its "
                                        f"first (revision {revision} after {last}), although every peer of that "
                                        "sync continued the group's lineage and updates its state deterministically"))
        self.last_sync[pid] = (key[0], revision)

    def at_end(self, sim: Simulation) -> None:
        for key, (new, held) in self.minted.items():
            if new and held:
                self._fail(sim, f"sync {key[1]} (master epoch {key[0]}) minted a new lineage although a peer that "
                                "held a lineage took part: the holders' history was dropped")
                return
        for key, message in self.moved:
            if not self.newcomers.get(key):
                self._fail(sim, message)
                return
