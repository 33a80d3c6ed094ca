"""The master's paths sub-machine (pccl.protocol.master.paths), driven through MasterState:
dial-backs, relay offers, relays coming and going, reported paths, and what bad input costs."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pccl.errors import KickReason
from pccl.protocol import messages as m
from pccl.protocol.master import machine as ms
from pccl.protocol.master.paths import MAX_ATTEMPTS, OWN_RELAY_ID
from pccl.protocol.paths import CandidateOrigin, PathKind, Port, relay_of_via, relayed_via


class Harness:
    def __init__(self, *, own_relay: bool = False) -> None:
        self.ms = ms.MasterState(rng=random.Random(5), peer_timeout=10.0, own_relay=own_relay)
        self.now = 0.0
        self.out: list[ms.Effect] = []
        self.next_conn = 1

    def feed(self, event: ms.Event) -> list[ms.Effect]:
        self.now += 0.001
        effects = self.ms.handle(event, self.now)
        self.out.extend(effects)
        return effects

    def connect(self, host: str = "10.0.0.1") -> int:
        conn = self.next_conn
        self.next_conn += 1
        self.feed(ms.PeerConnected(conn, host))
        return conn

    def peer(self, host: str = "10.0.0.1", candidates: tuple[m.Candidate, ...] = ()) -> tuple[int, int]:
        conn = self.connect(host)
        effects = self.feed(ms.MessageReceived(conn, m.Register(0, 4000 + conn, 5000 + conn, candidates=candidates)))
        welcome = next(e.msg for e in effects if isinstance(e, ms.Send) and isinstance(e.msg, m.Welcome))
        return conn, welcome.peer_id

    def relay(self, host: str = "10.9.9.9", port: int = 7000) -> tuple[int, int]:
        conn = self.connect(host)
        effects = self.feed(ms.MessageReceived(conn, m.RelayRegister("", port)))
        welcome = next(e.msg for e in effects if isinstance(e, ms.Send) and isinstance(e.msg, m.RelayWelcome))
        return conn, welcome.relay_id

    def sent(self, effects: list[ms.Effect], conn: int, kind: type) -> list:
        return [e.msg for e in effects if isinstance(e, ms.Send) and e.conn_id == conn and isinstance(e.msg, kind)]

    def kicked(self, effects: list[ms.Effect]) -> list[ms.Kick]:
        return [e for e in effects if isinstance(e, ms.Kick)]


def test_registration_keeps_candidates_resolves_empty_hosts_and_tells_the_observed_host() -> None:
    h = Harness()
    conn = h.connect("198.51.100.9")
    cands = (m.Candidate(int(CandidateOrigin.ADVERTISED), int(Port.P2P), "", 40150),
             m.Candidate(int(CandidateOrigin.LOCAL), int(Port.P2P), "10.1.0.2", 4001))
    effects = h.feed(ms.MessageReceived(conn, m.Register(0, 4001, 5001, candidates=cands)))
    welcome = h.sent(effects, conn, m.Welcome)[0]
    assert welcome.observed_host == "198.51.100.9"
    assert [(c.host, c.port) for c in h.ms.candidates_of(welcome.peer_id)] == [("198.51.100.9", 40150),
                                                                             ("10.1.0.2", 4001)]


def test_bad_candidates_kick_only_the_registrant() -> None:
    h = Harness()
    _, other = h.peer()
    for bad in (m.Candidate(int(CandidateOrigin.OBSERVED), 0, "1.2.3.4", 5), m.Candidate(1, 9, "1.2.3.4", 5),
                m.Candidate(1, 0, "1.2.3.4", 0)):
        conn = h.connect()
        effects = h.feed(ms.MessageReceived(conn, m.Register(0, 1, 2, candidates=(bad,))))
        assert [k.reason for k in h.kicked(effects)] == [KickReason.PROTOCOL_ERROR]
    conn = h.connect()
    many = tuple(m.Candidate(2, 0, f"10.0.0.{i}", 5) for i in range(65))
    assert [k.reason for k in h.kicked(h.feed(ms.MessageReceived(conn, m.Register(0, 1, 2, candidates=many))))] == [
        KickReason.PROTOCOL_ERROR]
    assert h.ms.conn_of(other) is not None


def test_a_dial_back_then_its_failure_moves_the_attempt_to_the_least_loaded_relay() -> None:
    h = Harness()
    ca, a = h.peer("10.0.0.1")
    cb, b = h.peer("10.0.0.2")
    r1c, r1 = h.relay("10.9.9.1", 7001)
    r2c, r2 = h.relay("10.9.9.2", 7002)
    effects = h.feed(ms.MessageReceived(ca, m.PathRequest(1, b, int(Port.P2P), detail="direct: refused")))
    [dial] = h.sent(effects, cb, m.DialRequest)
    assert (dial.request, dial.requester.peer_id, dial.port, dial.detail) == (1, a, 0, "direct: refused")
    effects = h.feed(ms.MessageReceived(cb, m.DialFailed(1, a, "timed out")))
    [offer_a] = h.sent(effects, ca, m.RelayOffer)
    [offer_b] = h.sent(effects, cb, m.RelayOffer)
    assert (offer_a.initiator, offer_b.initiator) == (True, False)
    assert offer_a.key == offer_b.key and len(offer_a.key) == 16
    assert (offer_a.partner, offer_b.partner) == (b, a)
    assert offer_a.relay == r1 and offer_a.address == "10.9.9.1:7001"
    # A second attempt goes to the other relay (fewer pairs), a third back to the first.
    h.feed(ms.MessageReceived(ca, m.PathRequest(2, b, int(Port.SHARED_STATE), relay_only=True)))
    second = h.sent(h.out, ca, m.RelayOffer)[-1]
    assert second.relay == r2 and second.port == int(Port.SHARED_STATE)
    # The requester could not meet its partner at relay 2: asking again avoiding it re-offers relay 1.
    effects = h.feed(ms.MessageReceived(ca, m.PathRequest(2, b, int(Port.SHARED_STATE), relay_only=True, avoid=(r2,))))
    assert h.sent(effects, ca, m.RelayOffer)[0].relay == r1
    # A late DialFailed for an attempt already at a relay changes nothing.
    assert h.sent(h.feed(ms.MessageReceived(cb, m.DialFailed(1, a, "late"))), ca, m.RelayOffer) == []
    relays = {r.relay_id: r for r in h.ms.relays()}
    assert set(relays) == {r1, r2} and relays[r1].address == "10.9.9.1:7001"
    assert h.ms.path_counters() == {"dial_back": 1, "relayed": 3}
    del r1c, r2c


def test_without_a_relay_the_requester_hears_what_failed_and_how_to_fix_it() -> None:
    h = Harness()
    ca, a = h.peer()
    cb, b = h.peer()
    h.feed(ms.MessageReceived(ca, m.PathRequest(1, b, int(Port.P2P), detail="direct: advertised 1.2.3.4:9: refused")))
    effects = h.feed(ms.MessageReceived(cb, m.DialFailed(1, a, "timed out")))
    [unavailable] = h.sent(effects, ca, m.PathUnavailable)
    assert "could not dial back: timed out" in unavailable.detail
    assert "pccl relay" in unavailable.detail and "pccl master --relay" in unavailable.detail


def test_the_masters_own_relay_is_offered_at_the_empty_address() -> None:
    h = Harness(own_relay=True)
    ca, a = h.peer()
    cb, b = h.peer()
    effects = h.feed(ms.MessageReceived(ca, m.PathRequest(1, b, int(Port.P2P), relay_only=True)))
    [offer] = h.sent(effects, ca, m.RelayOffer)
    assert (offer.relay, offer.address) == (OWN_RELAY_ID, "")
    assert [r.own for r in h.ms.relays()] == [True]
    h.ms.relay_forwarded(m.RelayStats(1, 0, 12345))
    assert h.ms.relays()[0].forwarded_bytes == 12345


def test_a_target_that_leaves_ends_its_attempts_and_its_paths() -> None:
    h = Harness()
    ca, a = h.peer()
    cb, b = h.peer()
    cc, c = h.peer()
    h.feed(ms.MessageReceived(ca, m.PathRequest(1, b, int(Port.P2P))))
    h.feed(ms.MessageReceived(cc, m.PathReport(b, int(Port.P2P), int(PathKind.DIRECT), "10.0.0.2:4002")))
    h.feed(ms.MessageReceived(ca, m.PathReport(c, int(Port.P2P), int(PathKind.REVERSED))))
    assert {(p.initiator, p.target) for p in h.ms.paths()} == {(c, b), (a, c)}
    effects = h.feed(ms.PeerDisconnected(cb))
    [gone] = h.sent(effects, ca, m.PathUnavailable)
    assert gone.request == 1 and f"{b:x} left" in gone.detail
    assert {(p.initiator, p.target) for p in h.ms.paths()} == {(a, c)}
    # Asking for a peer that is gone, or for oneself, is answered at once.
    assert h.sent(h.feed(ms.MessageReceived(ca, m.PathRequest(2, b, 0))), ca, m.PathUnavailable)
    assert h.sent(h.feed(ms.MessageReceived(ca, m.PathRequest(3, a, 0))), ca, m.PathUnavailable)


def test_a_relay_that_goes_is_no_longer_offered() -> None:
    h = Harness()
    ca, a = h.peer()
    cb, b = h.peer()
    rc, r = h.relay()
    h.feed(ms.PeerDisconnected(rc))
    assert h.ms.relays() == []
    effects = h.feed(ms.MessageReceived(ca, m.PathRequest(1, b, 0, relay_only=True)))
    assert h.sent(effects, ca, m.PathUnavailable)


def test_a_relay_that_goes_takes_the_paths_through_it_with_it() -> None:
    # Seen in the real-NAT run: a pair's path from an earlier ring, through the relay killed
    # later, stayed on the status page as current, since that pair never needed a new one.
    h = Harness()
    ca, a = h.peer()
    cb, b = h.peer()
    cc, c = h.peer()
    r1c, r1 = h.relay("10.9.9.1", 7001)
    _, r2 = h.relay("10.9.9.2", 7002)
    h.feed(ms.MessageReceived(ca, m.PathReport(b, int(Port.P2P), int(PathKind.RELAYED), relayed_via(r1, "10.9.9.1:7001"))))
    h.feed(ms.MessageReceived(cb, m.PathReport(a, int(Port.P2P), int(PathKind.RELAYED), relayed_via(r2, "10.9.9.2:7002"))))
    h.feed(ms.MessageReceived(cc, m.PathReport(a, int(Port.SHARED_STATE), int(PathKind.RELAYED),
                                               relayed_via(r1, "10.9.9.1:7001"))))
    h.feed(ms.MessageReceived(cc, m.PathReport(b, int(Port.P2P), int(PathKind.DIRECT), "10.0.0.2:4002")))
    assert relay_of_via(relayed_via(r1, "10.9.9.1:7001")) == r1 and relay_of_via("10.0.0.2:4002") is None
    h.feed(ms.PeerDisconnected(r1c))
    assert {(p.initiator, p.target, p.port, p.via) for p in h.ms.paths()} == {
        (b, a, Port.P2P, relayed_via(r2, "10.9.9.2:7002")), (c, b, Port.P2P, "10.0.0.2:4002")}


def test_a_relay_must_keep_reporting_or_it_times_out() -> None:
    h = Harness()
    rc, r = h.relay()
    h.now += 5
    h.feed(ms.MessageReceived(rc, m.RelayStats(0, 0, 0)))
    h.now += 9
    h.feed(ms.Tick())
    assert [x.relay_id for x in h.ms.relays()] == [r]
    h.now += 11
    effects = h.feed(ms.Tick())
    assert [k.reason for k in h.kicked(effects)] == [KickReason.TIMEOUT]
    assert h.ms.relays() == []


def test_out_of_phase_and_malformed_path_messages_kick_the_sender_only() -> None:
    h = Harness()
    ca, a = h.peer()
    cb, b = h.peer()
    stranger = h.connect()
    assert [k.reason for k in h.kicked(h.feed(ms.MessageReceived(stranger, m.PathRequest(1, a, 0))))] == [
        KickReason.OUT_OF_PHASE]
    assert [k.reason for k in h.kicked(h.feed(ms.MessageReceived(ca, m.PathRequest(1, b, 99))))] == [
        KickReason.PROTOCOL_ERROR]
    assert [k.reason for k in h.kicked(h.feed(ms.MessageReceived(cb, m.PathReport(a, 0, 42))))] == [
        KickReason.PROTOCOL_ERROR]
    rc, r = h.relay()
    assert [k.reason for k in h.kicked(h.feed(ms.MessageReceived(rc, m.PathRequest(1, a, 0))))] == [
        KickReason.OUT_OF_PHASE]
    assert h.ms.relays() == []


def test_a_requester_keeps_at_most_max_attempts_open() -> None:
    h = Harness()
    ca, a = h.peer()
    cb, b = h.peer()
    for request in range(1, MAX_ATTEMPTS + 50):
        h.feed(ms.MessageReceived(ca, m.PathRequest(request, b, 0)))
    assert h.ms.recheck() == []
    # The oldest were dropped: their DialFailed is ignored; the newest still escalates (to nothing).
    assert h.sent(h.feed(ms.MessageReceived(cb, m.DialFailed(1, a))), ca, m.PathUnavailable) == []
    assert h.sent(h.feed(ms.MessageReceived(cb, m.DialFailed(MAX_ATTEMPTS + 49, a))), ca, m.PathUnavailable)


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["request", "relay_only", "again", "failed", "report", "leave", "relay",
                                           "unrelay"]),
                          st.integers(0, 3), st.integers(0, 3), st.integers(0, 30)), max_size=40))
def test_every_attempt_ends_once_and_nothing_is_sent_to_the_gone(script: list[tuple[str, int, int, int]]) -> None:
    """Whatever the order of requests (fresh ids, as peers draw them; "again" repeats an earlier
    one as a relay-only request), dial-back failures, reports, departures and relays: nobody is
    kicked, every offer names a live partner and a live relay, both ends of an offer get the
    same key, an attempt ends with at most one PathUnavailable, and nothing goes to a closed
    connection."""
    h = Harness()
    peers = [h.peer(f"10.0.0.{i}") for i in range(4)]
    alive = {conn for conn, _ in peers}
    relays: list[int] = []
    issued: list[tuple[int, int, int]] = []  # (requester index, target index, request)
    ended: set[tuple[int, int]] = set()
    next_request = 1
    for action, i, j, pick in script:
        if action == "relay":
            relays.append(h.relay()[0])
            continue
        if action == "unrelay":
            if relays:
                h.feed(ms.PeerDisconnected(relays.pop(0)))
            continue
        if action in ("again", "failed", "report"):
            if not issued:
                continue
            i, j, request = issued[pick % len(issued)]
        (ci, pi), (cj, pj) = peers[i], peers[j]
        if action == "leave":
            if ci not in alive:
                continue
            alive.discard(ci)
            effects = h.feed(ms.PeerDisconnected(ci))
        elif action in ("request", "relay_only"):
            if ci not in alive or i == j:
                continue
            request, next_request = next_request, next_request + 1
            issued.append((i, j, request))
            effects = h.feed(ms.MessageReceived(ci, m.PathRequest(request, pj, 0, relay_only=action == "relay_only")))
        elif action == "again":
            if ci not in alive or (pi, request) in ended:
                continue
            effects = h.feed(ms.MessageReceived(ci, m.PathRequest(request, pj, 0, relay_only=True)))
        elif action == "failed":
            if cj not in alive:
                continue
            effects = h.feed(ms.MessageReceived(cj, m.DialFailed(request, pi)))
        else:
            if ci not in alive:
                continue
            ended.add((pi, request))
            effects = h.feed(ms.MessageReceived(ci, m.PathReport(pj, 0, 1, "x", request)))
        assert not h.kicked(effects)
        live_ids = {pid for conn, pid in peers if conn in alive}
        by_key: dict[bytes, list[m.RelayOffer]] = {}
        for e in effects:
            if isinstance(e, ms.Send):
                assert e.conn_id in alive or e.conn_id in relays
                if isinstance(e.msg, m.RelayOffer):
                    assert e.msg.partner in live_ids
                    assert e.msg.relay in {r.relay_id for r in h.ms.relays()}
                    by_key.setdefault(e.msg.key, []).append(e.msg)
                if isinstance(e.msg, m.PathUnavailable):
                    requester = next(pid for conn, pid in peers if conn == e.conn_id)
                    assert (requester, e.msg.request) not in ended
                    ended.add((requester, e.msg.request))
        for offers in by_key.values():
            assert sorted(o.initiator for o in offers) == [False, True]
        assert h.ms.recheck() == []
