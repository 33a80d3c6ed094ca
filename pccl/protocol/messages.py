"""Every control message pccl sends, as msgspec Structs in one tagged union.

Tags are small integers and stable on the wire.  Ranges, so that issues can add messages
without colliding:

* 1–49    master ↔ peer (registration, votes, membership, heartbeats, kick)
* 50–79   collectives
* 80–109  shared state
* 110–129 topology / bandwidth probes
* 200–219 connection handshake and authentication

Add every new message class to ``ALL_MESSAGES`` at the bottom.
"""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    """Base of all control messages.  Subclasses pass ``tag=<int>``."""


ALL_MESSAGES: tuple[type[Message], ...] = ()
