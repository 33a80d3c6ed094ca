"""A peer's standing with the master, as a state machine (sans-IO).

The peer session (:mod:`pccl._peer.session`) is the shell: it dials, sends, reads and waits;
this module says what each thing that happens to it means.  Rules first, transitions as data
(the model is h11's ``_state.py``).

States
======

================  ===================================================================================
``CONNECTING``    connected to the master (or dialling it), ``Register`` not yet answered
``REGISTERED``    ``Welcome`` came back: this peer has an id and waits for a topology round to
                  accept it (``open_communicator`` returns when one does)
``ACCEPTED``      a member of the run, at the same place of the step loop as its group: every
                  call may start (as the phase rule allows)
``RECONNECTING``  the master was lost (its connection broke, or it fell silent) and
                  ``Config.master_reconnect_timeout`` allows getting it back: dialling again,
                  with backoff; calls wait, what was in flight ends retryably
``REJOINED``      registered again, with its old id, with the master it reconnected to (a new
                  *master epoch*), and waiting for that master to accept it
``REALIGNING``    accepted again, but not at a step boundary: its group may be anywhere in the
                  loop.  Collectives and syncs fail retryably until this peer's next
                  ``update_topology()``, where the loops meet again
``CLOSING``       ``aclose()`` has begun (its ``Leave`` is going out): whatever breaks now is
                  the close, not a failure; new calls are refused
``FAILED``        final: kicked, the master unreachable for good, a protocol error, or closed
================  ===================================================================================

Events
======

================  ===================================================================================
``WELCOMED``      a ``Welcome`` answered this peer's ``Register`` on a fresh master connection
``ACCEPTANCE``    a ``TopologyComplete`` arrived (the first of a master epoch accepts the peer;
                  later ones are topology updates and change nothing here)
``REALIGNED``     an ``update_topology()`` (or ``open_communicator``'s wait for acceptance)
                  returned: this peer stands where its group stands
``MASTER_LOST``   the master connection broke or the master fell silent, and the session may
                  reconnect (if it may not, or is closing, that is ``FAIL``)
``CLOSE``         ``aclose()`` began
``FAIL``          the session failed with an error (final)
================  ===================================================================================

Rules
=====

* ``FAILED`` is final: every event is ignored there.  ``FAIL`` from every other state ends there.
* ``CLOSING`` ignores everything but ``FAIL`` (the close ends in ``InvalidUsage("closed")``):
  a reconnection that succeeds meanwhile changes nothing, and a lost master is the close.
* ``MASTER_LOST`` only counts while this peer holds a master (``REGISTERED``, ``ACCEPTED``,
  ``REJOINED``, ``REALIGNING``); a broken connection of an older epoch is not an event at all.
* Acceptance by a restarted master does not put a peer back in the loop: ``REJOINED`` goes to
  ``REALIGNING``, and only a step boundary (``REALIGNED``) goes on to ``ACCEPTED``.  A step
  boundary reported after the master was lost again (the caller woke late) changes nothing.
* A pair missing from :data:`TRANSITIONS` is a bug in the shell: :meth:`Lifecycle.handle`
  raises ``LifecycleError`` rather than guess.
"""

from __future__ import annotations

import enum

__all__ = ["Event", "Lifecycle", "LifecycleError", "State", "TRANSITIONS"]


class State(enum.Enum):
    CONNECTING = "connecting"
    REGISTERED = "registered"
    ACCEPTED = "accepted"
    RECONNECTING = "reconnecting"
    REJOINED = "rejoined"
    REALIGNING = "realigning"
    CLOSING = "closing"
    FAILED = "failed"


class Event(enum.Enum):
    WELCOMED = "welcomed"
    ACCEPTANCE = "acceptance"
    REALIGNED = "realigned"
    MASTER_LOST = "master lost"
    CLOSE = "close"
    FAIL = "fail"


S, E = State, Event

#: (state, event) -> next state.  Every state handles ``FAIL``; ``FAILED`` and ``CLOSING`` are
#: filled in below (they ignore the rest).
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.CONNECTING, E.WELCOMED): S.REGISTERED,
    (S.CONNECTING, E.CLOSE): S.CLOSING,
    (S.CONNECTING, E.FAIL): S.FAILED,

    (S.REGISTERED, E.ACCEPTANCE): S.ACCEPTED,
    (S.REGISTERED, E.MASTER_LOST): S.RECONNECTING,
    (S.REGISTERED, E.CLOSE): S.CLOSING,
    (S.REGISTERED, E.FAIL): S.FAILED,

    (S.ACCEPTED, E.ACCEPTANCE): S.ACCEPTED,  # a topology update
    (S.ACCEPTED, E.REALIGNED): S.ACCEPTED,  # an update_topology of a peer in the loop
    (S.ACCEPTED, E.MASTER_LOST): S.RECONNECTING,
    (S.ACCEPTED, E.CLOSE): S.CLOSING,
    (S.ACCEPTED, E.FAIL): S.FAILED,

    (S.RECONNECTING, E.WELCOMED): S.REJOINED,
    (S.RECONNECTING, E.REALIGNED): S.RECONNECTING,  # lost again before the caller woke: not aligned
    (S.RECONNECTING, E.CLOSE): S.CLOSING,
    (S.RECONNECTING, E.FAIL): S.FAILED,

    (S.REJOINED, E.ACCEPTANCE): S.REALIGNING,
    (S.REJOINED, E.REALIGNED): S.REJOINED,  # lost and registered again before the caller woke
    (S.REJOINED, E.MASTER_LOST): S.RECONNECTING,
    (S.REJOINED, E.CLOSE): S.CLOSING,
    (S.REJOINED, E.FAIL): S.FAILED,

    (S.REALIGNING, E.ACCEPTANCE): S.REALIGNING,
    (S.REALIGNING, E.REALIGNED): S.ACCEPTED,
    (S.REALIGNING, E.MASTER_LOST): S.RECONNECTING,
    (S.REALIGNING, E.CLOSE): S.CLOSING,
    (S.REALIGNING, E.FAIL): S.FAILED,
}
for _event in Event:
    TRANSITIONS[(S.CLOSING, _event)] = S.FAILED if _event is E.FAIL else S.CLOSING
    TRANSITIONS[(S.FAILED, _event)] = S.FAILED
del _event

#: States in which this peer holds a master (registered with it): losing it is an event.
HOLDS_MASTER = frozenset({S.REGISTERED, S.ACCEPTED, S.REJOINED, S.REALIGNING})
#: States in which the current master has accepted this peer.
ACCEPTED_STATES = frozenset({S.ACCEPTED, S.REALIGNING})


class LifecycleError(RuntimeError):
    """The shell reported an event the current state has no transition for (a pccl bug)."""


class Lifecycle:
    """The current state, the master epoch and when the master was lost.

    ``epoch`` counts registrations (``WELCOMED``): operations remember theirs, and one of an
    older epoch belongs to a master that is gone.  ``lost_at`` is the time ``MASTER_LOST``
    happened (the shell passes its clock in), kept until the next ``WELCOMED`` — also through
    ``CLOSING``, so the close knows whether a master is there to say goodbye to.
    """

    def __init__(self) -> None:
        self.state = State.CONNECTING
        self.epoch = 0
        self.lost_at: float | None = None

    def handle(self, event: Event, *, now: float | None = None) -> State:
        """Apply ``event`` (``now`` is required for ``MASTER_LOST``); return the previous state."""
        previous = self.state
        try:
            self.state = TRANSITIONS[(previous, event)]
        except KeyError:
            raise LifecycleError(f"{event.value!r} cannot happen to a peer that is {previous.value}") from None
        if previous in (S.CLOSING, S.FAILED):
            if event is E.FAIL:
                self.lost_at = None
            return previous
        if event is E.WELCOMED:
            self.epoch += 1
            self.lost_at = None
        elif event is E.MASTER_LOST:
            assert now is not None, "MASTER_LOST needs the time"
            self.lost_at = now
        elif event is E.FAIL:
            self.lost_at = None
        return previous

    # --- what the shell asks ---------------------------------------------------------------------

    @property
    def holds_master(self) -> bool:
        """Registered with a master that has not been lost (losing it now is ``MASTER_LOST``)."""
        return self.state in HOLDS_MASTER

    @property
    def accepted(self) -> bool:
        """The current master has accepted this peer (calls stop waiting in ``ready()``)."""
        return self.state in ACCEPTED_STATES

    @property
    def aligned(self) -> bool:
        """At the same place of the step loop as the group: collectives and syncs may run."""
        return self.state is S.ACCEPTED

    @property
    def rejoined(self) -> bool:
        """Registered again after losing the master, and not yet back at a step boundary."""
        return self.state in (S.REJOINED, S.REALIGNING)

    @property
    def reconnecting(self) -> bool:
        """The master was lost and is not back (also when the close began meanwhile)."""
        return self.lost_at is not None

    @property
    def closing(self) -> bool:
        return self.state is S.CLOSING
