"""The trace of a simulated run: an ordered event log with a stable hash.

Every interesting thing that happens in a run — a host starting or dying, a fault landing, a
connection being reset, a workload step, a checker's verdict — is appended as a
:class:`TraceEvent`.  Two runs of the same schedule must produce the same sequence of events, and
:meth:`Trace.hash` proves it: it is a sha256 chain over a canonical encoding of each event.

Canonical means: only plain data (``None``, ``bool``, ``int``, ``float``, ``str`` and lists,
tuples and str-keyed dicts of those) is accepted, dict keys are sorted, floats are written with
``repr`` (shortest round-trip form, identical on every CPython), and nothing depends on object
addresses or on ``PYTHONHASHSEED``.  :meth:`Trace.record` rejects anything else at once, so a
stray object repr can never make the hash depend on memory layout.

Failures (:class:`Failure`) are part of the trace too: a determinism check therefore also compares
verdicts.  Statistics about the run (wall time, loop iterations) are *not* hashed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from trio import current_time as _trio_time

__all__ = [
    "FAILURE_KINDS",
    "Failure",
    "Trace",
    "TraceEvent",
    "Divergence",
    "canonical_json",
]

#: How a run can fail, after TigerBeetle's VOPR: an unexpected exception in a live host (crash),
#: a broken invariant (safety), no progress once faults stopped (liveness), code of a dead
#: incarnation still running (zombie), two runs of one schedule disagreeing (determinism).
FAILURE_KINDS = ("crash", "safety", "liveness", "zombie", "determinism")

_GENESIS = b"pccl-sim-trace-v1"


#: Exact types accepted without further checks (the common case of every trace field).
_SCALARS = frozenset({type(None), bool, int, float, str})


def _check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` unless ``value`` is plain, canonically encodable data."""
    if type(value) in _SCALARS or value is None or isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)):
        scalars = _SCALARS
        for i, item in enumerate(value):
            if type(item) not in scalars:  # (a list of ids, the common case, builds no names)
                _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"trace field {where}: dict key {key!r} is not a str")
            _check_plain(item, f"{where}.{key}")
        return
    raise TypeError(
        f"trace field {where} has type {type(value).__name__}; only plain data "
        "(None/bool/int/float/str/list/tuple/dict) keeps the trace hash stable"
    )


def canonical_json(value: Any) -> str:
    """Encode plain data canonically: sorted keys, no spaces, floats by ``repr``."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceEvent:
    """One entry of the log.

    ``seq`` is the position in the trace, ``t`` the virtual time, ``source`` who produced it
    (a host name, ``"net"``, ``"faults"``, ``"runner"`` or a checker's name), ``kind`` what
    happened, ``data`` the details (plain data only).
    """

    seq: int
    t: float
    source: str
    kind: str
    data: Mapping[str, Any]

    def encode(self) -> bytes:
        return canonical_json([self.seq, self.t, self.source, self.kind, self.data]).encode("ascii")

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "t": self.t, "source": self.source, "kind": self.kind, "data": dict(self.data)}

    def __str__(self) -> str:
        fields = " ".join(f"{k}={self.data[k]!r}" for k in sorted(self.data))
        return f"#{self.seq} t={self.t:.6f} {self.source} {self.kind} {fields}".rstrip()


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """A verdict against the run: ``kind`` is one of :data:`FAILURE_KINDS`."""

    kind: str
    t: float
    source: str
    message: str

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {self.kind!r}; expected one of {FAILURE_KINDS}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "t": self.t, "source": self.source, "message": self.message}

    def __str__(self) -> str:
        return f"{self.kind} failure at t={self.t:.6f} ({self.source}): {self.message}"


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """Where two traces first disagree (``None`` on a side that has no event there)."""

    index: int
    ours: TraceEvent | None
    theirs: TraceEvent | None

    def __str__(self) -> str:
        return f"traces diverge at event {self.index}:\n  first:  {self.ours}\n  second: {self.theirs}"


def _virtual_now() -> float:
    try:
        return _trio_time()
    except RuntimeError:  # outside trio.run (e.g. verdicts recorded after the run)
        return 0.0


class Trace:
    """An append-only, hashable event log of one simulated run.

    ``listeners`` are called synchronously with every new event (the runner feeds its checkers
    this way, so an invariant is checked right after the event that could break it).
    """

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.failures: list[Failure] = []
        #: Not hashed: wall time, loop iterations, counters. Filled by the runner.
        self.stats: dict[str, Any] = {}
        self.listeners: list[Any] = []
        self._clock = _virtual_now

    # -- recording ---------------------------------------------------------------------------

    def bind_clock(self, clock: Any) -> None:
        """Use ``clock()`` (the virtual time) to stamp events recorded without an explicit ``t``."""
        self._clock = clock

    def record(self, source: str, kind: str, *, t: float | None = None, **data: Any) -> TraceEvent:
        """Append an event and notify the listeners.  ``TypeError`` if ``data`` is not plain."""
        for value in data.values():  # flat fields of scalars: no recursion (most events)
            if type(value) not in _SCALARS:
                _check_plain(data, kind)
                break
        event = TraceEvent(len(self.events), self._clock() if t is None else t, source, kind, data)
        self.events.append(event)
        for listener in self.listeners:
            listener(event)
        return event

    def fail(self, kind: str, source: str, message: str, *, t: float | None = None) -> Failure:
        """Record a failure verdict (also as a ``failure`` event, so it is part of the hash)."""
        failure = Failure(kind, self._clock() if t is None else t, source, message)
        self.failures.append(failure)
        self.record(source, "failure", t=failure.t, failure=kind, message=message)
        return failure

    # -- reading -----------------------------------------------------------------------------

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failure_kinds(self) -> tuple[str, ...]:
        """The distinct failure kinds, in order of first occurrence."""
        seen: list[str] = []
        for failure in self.failures:
            if failure.kind not in seen:
                seen.append(failure.kind)
        return tuple(seen)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def of_kind(self, *kinds: str) -> list[TraceEvent]:
        return [e for e in self.events if e.kind in kinds]

    def chain(self) -> Iterator[str]:
        """The running hash after each event (hex); the last one is :meth:`hash`."""
        digest = hashlib.sha256(_GENESIS).digest()
        for event in self.events:
            digest = hashlib.sha256(digest + event.encode()).digest()
            yield digest.hex()

    def hash(self) -> str:
        """sha256 chain over every event's canonical encoding (hex)."""
        last = hashlib.sha256(_GENESIS).hexdigest()
        for last in self.chain():
            pass
        return last

    def first_divergence(self, other: "Trace | Iterable[TraceEvent]") -> Divergence | None:
        """The first index at which the two logs differ, or ``None`` if they are identical."""
        theirs = list(other.events if isinstance(other, Trace) else other)
        for i in range(max(len(self.events), len(theirs))):
            a = self.events[i] if i < len(self.events) else None
            b = theirs[i] if i < len(theirs) else None
            if a is None or b is None or a.encode() != b.encode():
                return Divergence(i, a, b)
        return None

    # -- persistence -------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "hash": self.hash(),
            "events": [e.to_json() for e in self.events],
            "failures": [f.to_json() for f in self.failures],
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Trace":
        trace = cls()
        for raw in data["events"]:
            trace.events.append(TraceEvent(raw["seq"], raw["t"], raw["source"], raw["kind"], raw["data"]))
        trace.failures = [Failure(f["kind"], f["t"], f["source"], f["message"]) for f in data.get("failures", [])]
        trace.stats = dict(data.get("stats", {}))
        return trace

    def format(self, limit: int | None = None) -> str:
        """Human-readable dump (the last ``limit`` events if given)."""
        events = self.events if limit is None else self.events[-limit:]
        return "\n".join(str(e) for e in events)
