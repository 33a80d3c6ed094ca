"""The base of every control message and the field types and structs the groups share.

Import them from :mod:`pccl.protocol.messages`, which re-exports everything.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class Message(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    """Base of all control messages.  Subclasses pass ``tag=<int>``."""


U16 = Annotated[int, msgspec.Meta(ge=0, le=65535)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
# msgspec cannot express le=2**64-1 (bounds must fit an int64); msgpack itself caps ints at 2**64-1.
U64 = Annotated[int, msgspec.Meta(ge=0)]


class Candidate(msgspec.Struct, frozen=True, array_like=True):
    """One address at which a peer may be reached for one kind of connection
    (:mod:`pccl.protocol.paths`): ``kind`` a ``paths.Port``, ``origin`` a
    ``paths.CandidateOrigin`` (advertised by the peer, or one of its local interfaces)."""

    origin: U32
    kind: U32
    host: str
    port: U16


class PeerEndpoint(msgspec.Struct, frozen=True, array_like=True):
    """Where a peer can be reached: the host the master observed plus the ports it bound, and
    the candidates it registered (advertised endpoints first, then local addresses; see
    :func:`pccl.protocol.paths.dial_order` for the order a dialler tries them in)."""

    peer_id: U64
    host: str
    p2p_port: U16
    shared_state_port: U16
    candidates: tuple[Candidate, ...] = ()
