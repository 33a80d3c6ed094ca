"""Keeping ExceptionGroups away from pccl's users (the public API never raises one).

Every nursery in pccl that can end with several exceptions turns them into one with
:func:`single_exception`, so the choice follows one rule everywhere.
"""

from __future__ import annotations

import logging

import trio

from .errors import PCCLError, ProtocolError, TransportError

__all__ = ["leaf_exceptions", "single_exception"]

logger = logging.getLogger(__name__)


def leaf_exceptions(group: BaseExceptionGroup) -> list[BaseException]:
    """Every non-group exception inside ``group``, depth first, in order."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = exc.exceptions
        else:
            leaves.append(exc)
    return leaves


def _rank(exc: BaseException) -> int:
    if isinstance(exc, trio.Cancelled):
        return 5
    if not isinstance(exc, Exception):
        return 0  # KeyboardInterrupt, SystemExit: the process is going down
    if isinstance(exc, ProtocolError):
        return 1  # a misbehaving peer explains the transport errors it causes
    if isinstance(exc, PCCLError) and not isinstance(exc, TransportError):
        return 2
    if isinstance(exc, TransportError):
        return 3
    return 4


def single_exception(group: BaseExceptionGroup) -> BaseException:
    """The one exception to raise for a nursery's ``group``.

    The first leaf of the best kind wins: a non-``Exception`` base exception (KeyboardInterrupt…);
    a ``ProtocolError``; another pccl error that is not a transport error; a transport error;
    any other exception; ``trio.Cancelled`` only if nothing else happened (so the cancel scope
    that caused it catches it).  The leaves not chosen are logged: pccl errors at debug level,
    anything else (a bug must not vanish behind a pccl error) with its traceback.
    """
    leaves = leaf_exceptions(group)
    chosen = min(leaves, key=_rank)
    for other in leaves:
        if other is chosen or isinstance(other, trio.Cancelled):
            continue
        if isinstance(other, PCCLError):
            logger.debug("secondary error, not raised: %r", other)
        else:
            logger.error("secondary error, not raised: %r", other, exc_info=other)
    return chosen
