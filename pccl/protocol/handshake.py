"""The connection handshake's pure parts: the preamble and the run-token proofs.

Every pccl connection (master, p2p, shared state, benchmark) opens the same way; both sides run
the same steps at once, so no step waits for the other side's reply before sending its own:

1. **Preamble** (raw bytes, not a frame): ``MAGIC[8] | version:u32``.  A wrong magic means the
   other end is not pccl; a different version is refused naming both versions.
2. **Hello** (a control frame): the side's role (the dialling ``CLIENT`` or the accepting
   ``SERVER``), whether it holds a run token, and a fresh :data:`NONCE_SIZE`-byte nonce.  If one
   side holds a token and the other does not, both fail with ``AuthenticationFailed`` right here;
   if neither does, the handshake is complete.
3. **AuthProof**: ``HMAC-SHA256(token, DOMAIN | prover_role | verifier_nonce | prover_nonce)`` —
   proof of the token that answers the *other* side's challenge.  Binding the prover's role
   means a proof can never be reflected back to the side that issued the challenge (it would
   carry the wrong role); binding both nonces means it cannot be replayed on another connection.
4. **AuthResult**: whether this side accepted the other's proof, and why not.  Both sides send it
   before either closes, so the side whose proof was refused learns why.

The I/O lives in :mod:`pccl.net.framed`; this module only computes and checks.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from ..errors import InvalidArgument, ProtocolError
from .messages import HandshakeRole, Hello

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "PREAMBLE_SIZE",
    "NONCE_SIZE",
    "HANDSHAKE_MAX_FRAME_SIZE",
    "encode_preamble",
    "parse_preamble",
    "normalize_token",
    "check_hello",
    "auth_proof",
    "verify_proof",
]

#: First bytes on every connection.  PNG-style: a high-bit byte and CR LF catch 7-bit and
#: line-ending mangling, and no text protocol starts like this.
MAGIC = b"\x89PCCL\r\n\x1a"
#: Bumped on every incompatible change of the wire format or the message set's meaning,
#: including the ring's frame layout (peers must cut chunks into the same sub-chunks).
#: 2: two sub-chunks per chunk instead of four (``pccl.protocol.ring._PIPELINE_DEPTH``).
#: 3: ``Register`` and ``PeerEndpoint`` lost the benchmark port, which nothing listened on.
#: 4: ``Welcome`` and ``P2PHello`` carry the master's instance id (peers survive master restarts).
#: 5: phase mismatches end with ``TopologyRejected`` / ``PHASE_MISMATCH``; ``CollectiveWithdraw``.
#: 6: ``optimize_topology``: ``VoteOptimize``, probes (``ProbeRequest`` ... ``ProbeEndAck``).
#: 7: every peer connection begins with ``Knock`` (or a dial-back's ``ReverseHello``); candidates,
#:    dial-backs and relays (``pccl.protocol.paths``).
#: 8: peers may begin collectives without a vote (``CollectiveBegin``, ``CollectiveAbort.code``;
#:    ``Config.fast_commit``): an older master would not understand them.
#: 9: fast commit by default: a begun op may be withdrawn (``CollectiveWithdraw`` of a begun op,
#:    ``CollectiveAbort`` code ``WITHDRAWN``), and the lane and partner-link turns of large ops
#:    follow the order ops were commenced or begun on each peer, not their seqs: peers of
#:    versions 8 and 9 would take turns in different orders and wait for each other.
#: 10: the scatter + all-gather broadcast changes the automatic choice of broadcasts on partner
#:    links (a peer of 9 would run the tree or the chain where one of 10 scatters: the tree
#:    refuses the other's frames, the chain waits for the watchdog, every retry alike), and
#:    peer-commit acks go to both ring neighbours and the partner links (a peer of 9 reads
#:    them from its predecessor only and leaves the others in its inbox).
#: 11: a restarted master resolves the peer-agreed ops of the master before it: peers report
#:    their undecided ones in ``Register.undecided``, and ``CollectiveAsk`` / ``CollectiveQuery``
#:    / ``CollectiveAnswer`` name that master (``instance``).  A master of 10 would drop the
#:    reports and only log the asks, leaving a participant in doubt until it gave up with its
#:    input restored while another had returned the result (a split).
PROTOCOL_VERSION = 11

_PREAMBLE = struct.Struct(">8sI")
PREAMBLE_SIZE = _PREAMBLE.size
NONCE_SIZE = 32
#: Limit for control frames before the other side is authenticated: handshake messages are tiny,
#: so an unauthenticated stranger cannot make us allocate ``Config.max_frame_size`` bytes.
HANDSHAKE_MAX_FRAME_SIZE = 1024

_PROOF_DOMAIN = b"pccl-auth-v1\x00"
#: Prefix of the hash that turns a run token into the HMAC key.
_KEY_DOMAIN = b"pccl-run-token-v1\x00"


def encode_preamble(version: int = PROTOCOL_VERSION) -> bytes:
    """The preamble this side sends first."""
    return _PREAMBLE.pack(MAGIC, version)


def parse_preamble(raw: bytes | bytearray | memoryview, *, local_version: int = PROTOCOL_VERSION) -> int:
    """Check the other side's preamble; return its version.

    :class:`ProtocolError` if the magic is wrong (not a pccl peer) or the versions differ (the
    message names both).
    """
    if len(raw) != PREAMBLE_SIZE:
        raise ProtocolError(f"handshake preamble must be {PREAMBLE_SIZE} bytes, got {len(raw)}")
    magic, version = _PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"not a pccl peer: expected magic {MAGIC!r}, got {magic!r}")
    if version != local_version:
        raise ProtocolError(
            f"protocol version mismatch: this side speaks version {local_version}, the peer speaks version {version}"
        )
    return version


def normalize_token(token: str | bytes | None) -> bytes | None:
    """The HMAC key for a run token (``str`` is UTF-8 encoded); ``None`` means no token.

    :class:`InvalidArgument` for an empty token, which would authenticate nothing.
    """
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, (bytes, bytearray)):
        raise InvalidArgument(f"token must be str or bytes, got {type(token).__name__}")
    if not token:
        raise InvalidArgument("token must not be empty (pass None for no authentication)")
    return bytes(token)


def check_hello(hello: Hello, *, local_role: HandshakeRole) -> None:
    """Validate the other side's Hello: opposite role, nonce of the right size."""
    expected = HandshakeRole.SERVER if local_role is HandshakeRole.CLIENT else HandshakeRole.CLIENT
    if hello.role != expected:
        raise ProtocolError(
            f"handshake role conflict: this side is the {local_role.name} and so is the peer "
            f"(it announced {HandshakeRole(hello.role).name})"
        )
    if len(hello.nonce) != NONCE_SIZE:
        raise ProtocolError(f"handshake nonce has {len(hello.nonce)} bytes, expected {NONCE_SIZE}")


def auth_proof(token: bytes, *, prover: HandshakeRole, prover_nonce: bytes, verifier_nonce: bytes) -> bytes:
    """The MAC the ``prover`` side sends to show it holds ``token``.

    Both nonces have the fixed size :data:`NONCE_SIZE`, so the concatenation is unambiguous.
    The HMAC key is a SHA-256 digest of the token, not the token itself: HMAC pads a short key
    with zero bytes, so tokens that differ only in trailing zero bytes (``b"a"``, ``b"a\\0"``)
    would otherwise prove each other.
    """
    if len(prover_nonce) != NONCE_SIZE or len(verifier_nonce) != NONCE_SIZE:
        raise InvalidArgument(f"nonces must be {NONCE_SIZE} bytes")
    message = _PROOF_DOMAIN + bytes([int(prover)]) + verifier_nonce + prover_nonce
    key = hashlib.sha256(_KEY_DOMAIN + token).digest()
    return hmac.new(key, message, hashlib.sha256).digest()


def verify_proof(
    token: bytes, mac: bytes, *, prover: HandshakeRole, prover_nonce: bytes, verifier_nonce: bytes
) -> bool:
    """Whether ``mac`` is the ``prover``'s valid proof; constant-time comparison."""
    expected = auth_proof(token, prover=prover, prover_nonce=prover_nonce, verifier_nonce=verifier_nonce)
    return hmac.compare_digest(expected, bytes(mac))
