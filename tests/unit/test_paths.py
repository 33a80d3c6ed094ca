"""The sans-IO rules of pccl.protocol.paths: advertisements, local candidates, the dial order."""

from __future__ import annotations

import pytest

import pccl
from pccl.errors import InvalidArgument
from pccl.protocol import messages as m
from pccl.protocol.paths import (
    CandidateOrigin,
    Port,
    advertised_candidates,
    dial_order,
    local_candidates,
    parse_advertise,
    resolve_candidates,
)

BOUND = {Port.P2P: 48150, Port.SHARED_STATE: 48149}
ADV, LOC = int(CandidateOrigin.ADVERTISED), int(CandidateOrigin.LOCAL)


def test_a_bare_host_advertises_every_bound_port_there() -> None:
    adv = parse_advertise("203.0.113.5")
    assert advertised_candidates(adv, BOUND) == (
        m.Candidate(ADV, int(Port.P2P), "203.0.113.5", 48150),
        m.Candidate(ADV, int(Port.SHARED_STATE), "203.0.113.5", 48149),
    )


def test_endpoints_by_kind_with_other_numbers_and_hosts() -> None:
    adv = parse_advertise("p2p=203.0.113.5:40150, shared_state=gpu7.example.net:40149,benchmark=[2001:db8::7]:40151")
    cands = advertised_candidates(adv, BOUND)
    assert {(c.kind, c.host, c.port) for c in cands} == {
        (Port.P2P, "203.0.113.5", 40150), (Port.SHARED_STATE, "gpu7.example.net", 40149),
        (Port.BENCHMARK, "2001:db8::7", 40151)}


def test_a_port_alone_means_the_observed_host_which_the_master_fills_in() -> None:
    cands = advertised_candidates(parse_advertise("p2p=40150,shared_state=:40149"), BOUND)
    assert all(c.host == "" for c in cands)
    resolved = resolve_candidates(cands, "198.51.100.9")
    assert {(c.kind, c.host, c.port) for c in resolved} == {(Port.P2P, "198.51.100.9", 40150),
                                                            (Port.SHARED_STATE, "198.51.100.9", 40149)}


@pytest.mark.parametrize("text, says", [
    ("p2p=1.2.3.4", "no port"),
    ("p2p=1.2.3.4:0", "valid port"),
    ("p2p=1.2.3.4:70000", "valid port"),
    ("ring=1.2.3.4:5", "KIND=HOST:PORT"),
    ("p2p=1.2.3.4:5,p2p=1.2.3.4:6", "given twice"),
    ("1.2.3.4,5.6.7.8", "need their kinds"),
    ("host with space", "not a host"),
    ("p2p=[::1:5", "malformed IPv6"),
])
def test_malformed_advertisements_are_refused_naming_the_source(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as info:
        parse_advertise(text, source="$PCCL_ADVERTISE")
    assert "$PCCL_ADVERTISE" in str(info.value)


def test_config_refuses_a_bad_advertisement_at_once() -> None:
    with pytest.raises(InvalidArgument, match="Config.advertise"):
        pccl.Config(advertise="p2p=nowhere")
    assert pccl.Config(advertise="").advertise == ""


def test_local_candidates_leave_out_loopback_link_local_and_duplicates() -> None:
    cands = local_candidates(["127.0.0.1", "10.1.0.2", "fe80::1", "::1", "0.0.0.0", "10.1.0.2", "fd00::2", "peer3"],
                             {Port.P2P: 5})
    assert [c.host for c in cands] == ["10.1.0.2", "fd00::2", "peer3"]
    assert all(c.origin == LOC for c in cands)


def _endpoint(host: str, candidates: tuple[m.Candidate, ...] = ()) -> m.PeerEndpoint:
    return m.PeerEndpoint(7, host, 48150, 48149, candidates)


def test_a_public_dialler_tries_advertised_then_observed_then_local() -> None:
    target = _endpoint("198.51.100.9", (m.Candidate(ADV, int(Port.P2P), "203.0.113.5", 40150),
                                        m.Candidate(LOC, int(Port.P2P), "10.1.0.2", 48150),
                                        m.Candidate(LOC, int(Port.SHARED_STATE), "10.1.0.2", 48149)))
    order = dial_order(target, Port.P2P, own_public_host="192.0.2.1")
    assert [(d.origin, d.address) for d in order] == [
        (CandidateOrigin.ADVERTISED, "203.0.113.5:40150"), (CandidateOrigin.OBSERVED, "198.51.100.9:48150"),
        (CandidateOrigin.LOCAL, "10.1.0.2:48150")]
    state = dial_order(target, Port.SHARED_STATE, own_public_host="192.0.2.1")
    assert [d.address for d in state] == ["198.51.100.9:48149", "10.1.0.2:48149"]


def test_peers_behind_one_public_address_try_the_private_one_first() -> None:
    target = _endpoint("198.51.100.9", (m.Candidate(ADV, int(Port.P2P), "198.51.100.9", 40150),
                                        m.Candidate(LOC, int(Port.P2P), "10.1.0.2", 48150)))
    order = dial_order(target, Port.P2P, own_public_host="198.51.100.9")
    assert [d.address for d in order] == ["10.1.0.2:48150", "198.51.100.9:40150", "198.51.100.9:48150"]


def test_a_probe_uses_the_benchmark_endpoint_or_else_the_p2p_ones() -> None:
    plain = _endpoint("198.51.100.9", (m.Candidate(LOC, int(Port.P2P), "10.1.0.2", 48150),))
    assert [d.address for d in dial_order(plain, Port.BENCHMARK)] == ["198.51.100.9:48150", "10.1.0.2:48150"]
    own = _endpoint("198.51.100.9", (m.Candidate(ADV, int(Port.BENCHMARK), "203.0.113.5", 40151),
                                     m.Candidate(ADV, int(Port.P2P), "203.0.113.5", 40150)))
    assert [d.address for d in dial_order(own, Port.BENCHMARK)] == ["203.0.113.5:40151", "198.51.100.9:48150"]


def test_duplicates_are_tried_once_at_their_first_place() -> None:
    target = _endpoint("198.51.100.9", (m.Candidate(ADV, int(Port.P2P), "198.51.100.9", 48150),))
    assert [(d.origin, d.address) for d in dial_order(target, Port.P2P)] == [
        (CandidateOrigin.ADVERTISED, "198.51.100.9:48150")]
