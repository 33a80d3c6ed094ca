"""One collective's life on one peer, as a state machine (sans-IO).

The collective service (:mod:`pccl._peer.collective_service`) is the shell: it sends the vote,
runs the ring, waits and restores; this module says what each thing that happens to one
attempt of a collective means, and what the shell must do about it.  Rules first, transitions
as data (the model is h11's ``_state.py``; :mod:`pccl.protocol.lifecycle` is the peer's own).

States
======

===============  ====================================================================================
``VOTING``       the ``CollectiveInit`` is out; the master's ``Commence`` or ``Rejected`` is awaited
``REFUSED``      final: the master rejected the vote (the shell raises what the code means)
``WITHDRAWING``  the caller was cancelled during the vote; a background task withdraws it
``RECALLING``    the caller was cancelled in a begun op before the master's ``Commence`` said every
                 participant began; a background task withdraws the Begin (the master ends the op)
``RUNNING``      commenced: this peer's ring runs and nothing has stopped it
``BEGUN``        begun without a vote (the fast path: a ``CollectiveBegin`` is out): the ring runs,
                 unwatched, until the master's one-way ``Commence`` says every participant began
``STALLED``      the watchdog stopped the ring (no byte moved on its connections); it unwinds, and
                 this peer will report the abort
``ABORTING``     the master's ``Abort`` (or a ``Complete`` the watchdog overruled) came while the
                 ring ran; the ring unwinds, and the master needs no ``Done`` any more
``COMPLETING``   the master's ``Complete`` came while this peer's ring still ran (the master
                 spoke first); the ring's own end decides
``CUT_OFF``      the master was lost while the ring ran; it unwinds, with nobody to report to
``REPORTED``     this peer's ring finished and its ``Done`` went out; the master's final word is
                 awaited
``GAVE_UP``      this peer's ring failed (or stalled) and it reported the abort; the call ends
                 without waiting, but the master's word or its loss may still come in meanwhile
``FAILING``      a begun op's ring failed and this peer reported the abort; the master's word is
                 awaited (the peers may have disagreed: every one must raise the same error)
``COMPLETED``    final: the master completed the op and this peer's ring finished (the result)
``ABORTED``      final: the op aborted (by the master, the watchdog or this peer's ring)
``LOST``         final: the master was lost before its final word
``LEFT``         final: the call ended with an exception (cancelled, or the communicator failed);
                 the input is restored
``ABANDONED``    the caller was cancelled after reporting success and the master said nothing
                 within the shell's bounded wait for its word; a background task awaits that
                 word, so that the tag is free for the next call
``RELEASED``     final: a background task settled the op with the master (or lost the master)
===============  ====================================================================================

Events
======

================  ===================================================================================
``COMMENCE``      the master's ``Commence`` for this vote arrived (for a begun op: every participant began)
``REJECT``        the master's ``Rejected`` for this vote (also ``WITHDRAWN``) or Begin arrived
``COMPLETE``      the master's ``Complete`` for this op's seq arrived
``ABORT``         the master's ``Abort`` for this op's seq arrived
``MASTER_LOST``   the tag's message route closed: the master is gone or the communicator failed
``STALL``         the watchdog saw no byte move on the ring's connections for ``peer_timeout``
``RING_DONE``     this peer's ring returned its result
``RING_FAILED``   this peer's ring ended without a result (its error, or it was stopped)
``CANCEL``        the call was cancelled (``trio.Cancelled`` left it)
``FAIL``          another exception left the call (the communicator failed, say)
================  ===================================================================================

Effects
=======

The shell runs them in order, after the transition.

=================  ==================================================================================
``CANCEL_RING``    cancel the ring's cancel scope
``SETTLE``         the master's final word (or its loss) is in: wake a call waiting for it
``REPORT_DONE``    send ``Done(seq, aborted=False)``
``REPORT_ABORT``   send ``Done(seq, aborted=True)``
``RESTORE_INPUT``  restore an in-place input (the op's ``InputGuard``)
``WITHDRAW``       hand the tag to a background task that withdraws the vote (or the Begin)
``AWAIT_FINAL``    hand the tag to a background task that waits for the master's final word
``ARM_WATCHDOG``   put a begun op's ring under the watchdog
=================  ==================================================================================

Rules
=====

* The master hears exactly one ``Done`` per commenced op from this peer, unless it spoke its
  final word first or is gone: a ring that ends, a watchdog stall and a call that leaves before
  its ``Done`` each report, exactly once.
* An ``Abort``, a lost master and a stall cancel the ring at once; a ``Complete`` never does
  (the ring's own end decides, and a stall after it overrules it).
* A cancellation after this peer reported success does not decide the op: the shell first
  waits for the master's final word, shielded and bounded (``peer_timeout``), and the call ends
  as that word says (``COMPLETED``: the result; ``ABORTED``/``LOST``: ``CANCEL`` leaves with the
  input restored).  Only if the bound runs out first does the shell feed ``CANCEL`` in
  ``REPORTED``, the one case whose final word is awaited in the background (``ABANDONED``);
  before the ``Done`` the call reports the abort itself.
* Once the master spoke (or is gone), its later messages for the op are ignored, a
  ``Rejected`` among them (it names no seq: a Begin refused on a stale ring whose op every
  participant still committed on its acks has its refusal reach the tag's next begun op, which
  it aborts; that op's own refusal then finds it over).  So is its
  ``Commence`` of a begun op that completed here first (``Config.peer_commit``: the acks can
  commit it before the ``Commence``, sent once every ``Begin`` is in, reaches this peer).
* A begun op is a running one with two differences: its ring is watched only once every
  participant began (nobody waits on a neighbour that is still computing), and a ring failure
  waits for the master's word, which may name a disagreement rather than a fault.
* A caller cancelled in a begun op that is not known to be armed withdraws the Begin, as a
  cancelled voter withdraws its vote: reported as a failure, it would be held until the last
  participant began (a disagreement may still show) and keep the tag in flight meanwhile.  The
  master ends the op (every participant retries the use: docs/protocol.rst), or, if every
  participant had begun, takes the withdrawal as this peer's abort.
* A pair missing from :data:`TRANSITIONS` is a bug in the shell: :meth:`OpLifecycle.handle`
  raises :class:`OpLifecycleError` rather than guess.
"""

from __future__ import annotations

import enum

from . import transition_table

__all__ = ["Effect", "Event", "OpLifecycle", "OpLifecycleError", "State", "TRANSITIONS",
           "TERMINAL_STATES", "render_table"]


class State(enum.Enum):
    VOTING = "voting"
    REFUSED = "refused"
    WITHDRAWING = "withdrawing"
    RECALLING = "recalling"
    RUNNING = "running"
    BEGUN = "begun"
    STALLED = "stalled"
    ABORTING = "aborting"
    COMPLETING = "completing"
    CUT_OFF = "cut off"
    REPORTED = "reported"
    GAVE_UP = "gave up"
    FAILING = "failing"
    COMPLETED = "completed"
    ABORTED = "aborted"
    LOST = "lost"
    LEFT = "left"
    ABANDONED = "abandoned"
    RELEASED = "released"


class Event(enum.Enum):
    COMMENCE = "commence"
    REJECT = "reject"
    COMPLETE = "complete"
    ABORT = "abort"
    MASTER_LOST = "master lost"
    STALL = "stall"
    RING_DONE = "ring done"
    RING_FAILED = "ring failed"
    CANCEL = "cancel"
    FAIL = "fail"


class Effect(enum.Enum):
    CANCEL_RING = "cancel ring"
    SETTLE = "settle"
    REPORT_DONE = "report done"
    REPORT_ABORT = "report abort"
    RESTORE_INPUT = "restore input"
    WITHDRAW = "withdraw"
    AWAIT_FINAL = "await final"
    ARM_WATCHDOG = "arm watchdog"


S, E, X = State, Event, Effect
_NONE: tuple[Effect, ...] = ()
#: The master's word once it has spoken (or once it is gone): ignored.  A ``Rejected`` too: it
#: carries no seq, and the refusal of an earlier begun op's Begin can reach the tag's next op.
_LATE_WORDS = (E.COMPLETE, E.ABORT, E.MASTER_LOST, E.REJECT)

#: (state, event) -> (next state, effects).  The ignored late words and the ways out of a call
#: (``CANCEL``/``FAIL`` after the commence) are filled in below.
TRANSITIONS: dict[tuple[State, Event], tuple[State, tuple[Effect, ...]]] = {
    (S.VOTING, E.COMMENCE): (S.RUNNING, _NONE),
    (S.VOTING, E.REJECT): (S.REFUSED, _NONE),
    (S.VOTING, E.MASTER_LOST): (S.LOST, _NONE),
    (S.VOTING, E.CANCEL): (S.WITHDRAWING, (X.WITHDRAW,)),

    (S.WITHDRAWING, E.REJECT): (S.RELEASED, _NONE),  # WITHDRAWN, or a rejection that crossed it
    (S.WITHDRAWING, E.COMMENCE): (S.RELEASED, (X.REPORT_ABORT,)),  # crossed the withdrawal
    (S.WITHDRAWING, E.MASTER_LOST): (S.RELEASED, _NONE),
    (S.WITHDRAWING, E.FAIL): (S.RELEASED, _NONE),  # the withdrawal could not be sent

    (S.RECALLING, E.ABORT): (S.RELEASED, _NONE),  # the master ended the op
    (S.RECALLING, E.REJECT): (S.RELEASED, _NONE),  # the Begin met a stale ring (it crossed)
    (S.RECALLING, E.COMMENCE): (S.RECALLING, _NONE),  # armed as it went out: an abort follows
    (S.RECALLING, E.MASTER_LOST): (S.RELEASED, _NONE),
    (S.RECALLING, E.FAIL): (S.RELEASED, _NONE),  # the withdrawal could not be sent

    (S.RUNNING, E.COMPLETE): (S.COMPLETING, (X.SETTLE,)),
    (S.RUNNING, E.ABORT): (S.ABORTING, (X.CANCEL_RING, X.SETTLE)),
    (S.RUNNING, E.MASTER_LOST): (S.CUT_OFF, (X.CANCEL_RING, X.SETTLE)),
    (S.RUNNING, E.STALL): (S.STALLED, (X.CANCEL_RING,)),
    (S.RUNNING, E.RING_DONE): (S.REPORTED, (X.REPORT_DONE,)),
    (S.RUNNING, E.RING_FAILED): (S.GAVE_UP, (X.REPORT_ABORT,)),

    (S.BEGUN, E.COMMENCE): (S.RUNNING, (X.ARM_WATCHDOG,)),  # every participant began
    (S.BEGUN, E.REJECT): (S.ABORTING, (X.CANCEL_RING, X.SETTLE)),  # the Begin met a stale ring
    (S.BEGUN, E.ABORT): (S.ABORTING, (X.CANCEL_RING, X.SETTLE)),
    (S.BEGUN, E.MASTER_LOST): (S.CUT_OFF, (X.CANCEL_RING, X.SETTLE)),
    (S.BEGUN, E.RING_DONE): (S.REPORTED, (X.REPORT_DONE,)),
    (S.BEGUN, E.RING_FAILED): (S.FAILING, (X.REPORT_ABORT,)),

    (S.FAILING, E.ABORT): (S.ABORTED, (X.SETTLE,)),
    (S.FAILING, E.REJECT): (S.ABORTED, (X.SETTLE,)),
    (S.FAILING, E.MASTER_LOST): (S.LOST, (X.SETTLE,)),
    (S.FAILING, E.COMMENCE): (S.FAILING, ()),  # the last participant began as this ring failed

    (S.STALLED, E.COMPLETE): (S.ABORTING, (X.SETTLE,)),  # the stall overrules it
    (S.STALLED, E.ABORT): (S.ABORTING, (X.SETTLE,)),
    (S.STALLED, E.MASTER_LOST): (S.CUT_OFF, (X.SETTLE,)),
    (S.STALLED, E.RING_DONE): (S.GAVE_UP, (X.REPORT_ABORT,)),  # finished as the watchdog fired
    (S.STALLED, E.RING_FAILED): (S.GAVE_UP, (X.REPORT_ABORT,)),

    # The master's word while (or after) the abort went out: the op is over either way, but a
    # lost master is what the caller hears about.
    (S.GAVE_UP, E.COMPLETE): (S.ABORTED, _NONE),
    (S.GAVE_UP, E.ABORT): (S.ABORTED, _NONE),
    (S.GAVE_UP, E.MASTER_LOST): (S.LOST, _NONE),

    (S.ABORTING, E.STALL): (S.ABORTING, _NONE),  # the watchdog fired while the ring unwound
    (S.ABORTING, E.RING_DONE): (S.ABORTED, _NONE),  # the ring finished before the abort reached it
    (S.ABORTING, E.RING_FAILED): (S.ABORTED, _NONE),

    (S.COMPLETING, E.STALL): (S.ABORTING, (X.CANCEL_RING,)),
    (S.COMPLETING, E.RING_DONE): (S.COMPLETED, _NONE),
    (S.COMPLETING, E.RING_FAILED): (S.ABORTED, _NONE),

    (S.CUT_OFF, E.STALL): (S.CUT_OFF, _NONE),
    (S.CUT_OFF, E.RING_DONE): (S.LOST, _NONE),
    (S.CUT_OFF, E.RING_FAILED): (S.LOST, _NONE),

    (S.REPORTED, E.COMPLETE): (S.COMPLETED, (X.SETTLE,)),
    (S.REPORTED, E.ABORT): (S.ABORTED, (X.SETTLE,)),
    (S.REPORTED, E.MASTER_LOST): (S.LOST, (X.SETTLE,)),
    (S.REPORTED, E.CANCEL): (S.ABANDONED, (X.RESTORE_INPUT, X.AWAIT_FINAL)),
    # A begun op: the last participant began after this ring ended (a broadcast's root can
    # finish into socket buffers), or the Begin was refused after it ended.
    (S.REPORTED, E.COMMENCE): (S.REPORTED, _NONE),
    (S.REPORTED, E.REJECT): (S.ABORTED, (X.SETTLE,)),

    (S.ABANDONED, E.COMPLETE): (S.RELEASED, _NONE),
    (S.ABANDONED, E.ABORT): (S.RELEASED, _NONE),
    (S.ABANDONED, E.MASTER_LOST): (S.RELEASED, _NONE),
    (S.ABANDONED, E.COMMENCE): (S.ABANDONED, _NONE),
    (S.ABANDONED, E.REJECT): (S.RELEASED, _NONE),
}
# The master's word after it spoke (or was lost) changes nothing.
for _state in (S.ABORTING, S.COMPLETING, S.CUT_OFF, S.COMPLETED, S.ABORTED, S.LOST):
    for _event in _LATE_WORDS:
        TRANSITIONS[(_state, _event)] = (_state, _NONE)
# A begun op committed on its acks (peer commit) before the master's Commence came: late too.
TRANSITIONS[(S.COMPLETED, E.COMMENCE)] = (S.COMPLETED, _NONE)
# Leaving the call after the commence: the input is restored; the abort is reported unless the
# master has its Done already, spoke first, or is gone.
for _state in (S.RUNNING, S.BEGUN, S.STALLED):
    for _event in (E.CANCEL, E.FAIL):
        TRANSITIONS[(_state, _event)] = (S.LEFT, (X.RESTORE_INPUT, X.REPORT_ABORT))
# ... but a begun op not armed yet withdraws its Begin (see the rules).
TRANSITIONS[(S.BEGUN, E.CANCEL)] = (S.RECALLING, (X.RESTORE_INPUT, X.WITHDRAW))
for _state in (S.ABORTING, S.COMPLETING, S.CUT_OFF, S.GAVE_UP, S.FAILING, S.COMPLETED, S.ABORTED, S.LOST):
    for _event in (E.CANCEL, E.FAIL):
        TRANSITIONS[(_state, _event)] = (S.LEFT, (X.RESTORE_INPUT,))
TRANSITIONS[(S.REPORTED, E.FAIL)] = (S.LEFT, (X.RESTORE_INPUT,))
del _state, _event

#: States that accept no event at all: the attempt is over for the shell.
TERMINAL_STATES = frozenset(set(State) - {s for s, _ in TRANSITIONS})


class OpLifecycleError(RuntimeError):
    """The shell reported an event the current state has no transition for (a pccl bug)."""


class OpLifecycle:
    """The state of one attempt of one collective on this peer (see the module docstring)."""

    __slots__ = ("state",)

    def __init__(self, state: State = State.VOTING) -> None:
        self.state = state

    def handle(self, event: Event) -> tuple[Effect, ...]:
        """Apply ``event``; return the effects the shell must run, in order.

        Raises :class:`OpLifecycleError` (and changes nothing) for a pair missing from
        :data:`TRANSITIONS`.
        """
        try:
            self.state, effects = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise OpLifecycleError(
                f"{event.value!r} cannot happen to a collective that is {self.state.value}") from None
        return effects

    def __repr__(self) -> str:
        return f"OpLifecycle({self.state.name})"


def render_table(fmt: str = "rst") -> str:
    """:data:`TRANSITIONS` as a table for the docs: one row per (state, event) pair, in the
    order the states and events are declared, with the next state and the effects.

    ``fmt`` is ``"rst"`` (a ``list-table`` directive) or ``"markdown"``; anything else is a
    ``ValueError``.
    """
    return transition_table.render(TRANSITIONS, State, Event, ("State", "Event", "Next state", "Effects"), fmt)
