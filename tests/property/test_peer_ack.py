"""Acks of completion agreed among peers (pccl.protocol.peer_ack): the wire form, the digest
(exactly the fields the master compares), whom a participant acks, and the argument that a
digest carried in the ack suffices: over random delivery orders, the participants commit when
every digest is equal and nobody commits when one differs."""

from __future__ import annotations

import random

import pytest
from msgspec.structs import replace
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl.errors import InvalidArgument, ProtocolError
from pccl.protocol import messages as m
from pccl.protocol.algorithms import link_partner_positions
from pccl.protocol.master.kinds import KINDS
from pccl.protocol.peer_ack import (DIGEST_SIZE, Ack, Acceptance, accept, ack_hops, ack_targets, decode_ack,
                                    encode_ack, op_digest)
from pccl.protocol.peer_commit import Effect, Event, PeerCommit, Phase

K = m.CollectiveKind
INIT = m.CollectiveInit(tag=3, count=1024, dtype=1, op=2, quant_kind=0, quant_dtype=0, layout=0,
                        kind=int(K.ALL_REDUCE), root=0, quant_bits=0, quant_block=0)


# --- the wire form --------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), seq=st.integers(0, 2**64 - 1), data=st.data())
def test_an_ack_round_trips(n: int, seq: int, data: st.DataObject) -> None:
    known = frozenset(data.draw(st.sets(st.integers(0, n - 1))))
    ack = Ack(seq, bytes(range(DIGEST_SIZE)), known)
    payload = encode_ack(ack, n)
    assert len(payload) == 20 + (n + 7) // 8  # 32 bytes of bitset at 256 participants
    assert decode_ack(payload, n) == ack


def test_an_acks_bitset_is_position_p_at_bit_p_mod_8_of_byte_p_div_8() -> None:
    # The wire form, byte for byte (a round trip alone would pass any self-consistent layout).
    payload = encode_ack(Ack(7, b"d" * DIGEST_SIZE, frozenset({0, 3, 9, 16})), 17)
    assert payload[20:] == bytes([0b1001, 0b10, 0b1])
    assert decode_ack(payload[:20] + bytes([0b10000001, 0, 0b1]), 17).known == {0, 7, 16}


def test_a_bad_ack_is_a_protocol_error() -> None:
    good = encode_ack(Ack(7, b"d" * DIGEST_SIZE, frozenset({0, 2})), 3)
    with pytest.raises(ProtocolError, match="shorter than its 20-byte header"):
        decode_ack(good[:10], 3)
    with pytest.raises(ProtocolError, match="counts 3 participants, this peer 4"):
        decode_ack(good, 4)
    with pytest.raises(ProtocolError, match="2 bitset bytes, not 1"):
        decode_ack(good + b"\0", 3)
    with pytest.raises(ProtocolError, match="names position 7 of an op with 3"):
        decode_ack(good[:-1] + bytes([0x80]), 3)
    with pytest.raises(InvalidArgument, match="not all in 0..2"):
        encode_ack(Ack(7, b"d" * DIGEST_SIZE, frozenset({3})), 3)
    with pytest.raises(InvalidArgument, match="8 bytes"):
        encode_ack(Ack(7, b"d", frozenset()), 3)


# --- the digest -----------------------------------------------------------------------------

def _kind(kind: m.CollectiveKind) -> m.CollectiveInit:
    return replace(INIT, kind=int(kind))


@pytest.mark.parametrize("kind", [K.ALL_REDUCE, K.BROADCAST, K.REDUCE_SCATTER])
def test_the_digest_covers_exactly_the_fields_the_master_compares(kind: m.CollectiveKind) -> None:
    init = _kind(kind)
    base = op_digest(5, 2**63 | 9, init)
    assert op_digest(5, 2**63 | 9, init) == base and len(base) == DIGEST_SIZE
    assert op_digest(6, 2**63 | 9, init) != base and op_digest(5, 2**63 | 10, init) != base
    for name in ("count", "dtype", "op", "quant_kind", "quant_dtype", "quant_bits", "quant_block", "layout",
                 "root", "tag"):
        changed = op_digest(5, 2**63 | 9, replace(init, **{name: getattr(init, name) + 1}))
        assert (changed != base) == (name in KINDS[kind].agreed), name
    others = {op_digest(5, 2**63 | 9, _kind(k)) for k in (K.ALL_REDUCE, K.BROADCAST, K.REDUCE_SCATTER) if k != kind}
    assert base not in others  # two kinds never share a digest
    with pytest.raises(InvalidArgument, match="counts are not agreed"):
        op_digest(5, 2**63 | 9, _kind(K.ALL_GATHER))


def test_accept_merges_only_this_ops_digest() -> None:
    mine = op_digest(1, 2**63 | 4, INIT)
    other = op_digest(1, 2**63 | 4, replace(INIT, count=1))
    assert accept(Ack(2**63 | 4, mine, frozenset({1})), 2**63 | 4, mine) == Acceptance.MERGE
    assert accept(Ack(2**63 | 4, other, frozenset({1})), 2**63 | 4, mine) == Acceptance.MISMATCH
    assert accept(Ack(2**63 | 5, mine, frozenset({1})), 2**63 | 4, mine) == Acceptance.STALE


# --- whom it acks ---------------------------------------------------------------------------

def _partners(n: int) -> list[tuple[int, ...]]:
    return [link_partner_positions(p, n, None) for p in range(n)]


def test_ack_hops_over_the_links_a_round_has() -> None:
    assert ack_hops(1) == 0 and ack_hops(2) == 1 and ack_hops(3) == 1  # the ring links every pair
    assert ack_hops(8) == 4 and ack_hops(64) == 32  # the ring alone: N // 2
    # halving-doubling partner links (wired from 8 peers): a hypercube with the ring, log2 N at most
    assert [ack_hops(n, _partners(n)) for n in (8, 12, 16, 64, 256)] == [2, 3, 3, 5, 7]
    assert [ack_hops(n, _partners(n)) for n in (4, 5, 6, 7)] == [2, 2, 3, 3]  # no partner links below 8
    assert ack_targets(0, 8, _partners(8)[0]) == (1, 2, 4, 7)
    assert ack_targets(1, 2) == (0,)
    with pytest.raises(InvalidArgument):
        ack_targets(8, 8)
    with pytest.raises(InvalidArgument, match=r"\[9\]"):
        ack_targets(0, 8, (9,))
    with pytest.raises(InvalidArgument):
        ack_hops(0)


# --- the digest in the ack suffices ---------------------------------------------------------

def _run(n: int, digests: list[bytes], partners: list[tuple[int, ...]], rng: random.Random) -> list[PeerCommit]:
    """Every participant becomes ready at a random moment; acks are delivered in a random order;
    an ack whose digest differs is not merged (its receiver would ask the master)."""
    seq = 2**63 | 1
    ops = [PeerCommit(p, range(n)) for p in range(n)]
    flight: list[tuple[int, Ack]] = []
    pending = list(range(n))

    def send(p: int) -> None:
        for q in ack_targets(p, n, partners[p]):
            flight.append((q, decode_ack(encode_ack(Ack(seq, digests[p], ops[p].known), n), n)))

    while pending or flight:
        if pending and (not flight or rng.random() < 0.3):
            p = pending.pop(rng.randrange(len(pending)))
            if Effect.SEND_KNOWN in ops[p].handle(Event.RESULT_HELD):
                send(p)
            continue
        q, ack = flight.pop(rng.randrange(len(flight)))
        if accept(ack, seq, digests[q]) != Acceptance.MERGE or ops[q].decided:
            continue
        if Effect.SEND_KNOWN in ops[q].receive_known(ack.known):
            send(q)
    return ops


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
def test_a_full_known_set_proves_equal_parameters(n: int) -> None:
    rng = random.Random(n)
    digests = [op_digest(1, 2**63 | 1, INIT), op_digest(1, 2**63 | 1, replace(INIT, count=7))]
    for trial in range(200):
        partners = _partners(n) if trial % 2 else [()] * n
        same = _run(n, [digests[0]] * n, partners, rng)
        assert all(op.phase is Phase.COMMITTED for op in same)
        odd = [digests[0]] * n
        for p in rng.sample(range(n), rng.randrange(1, n)):
            odd[p] = digests[1]
        assert not any(op.decided for op in _run(n, odd, partners, rng))  # nobody commits
