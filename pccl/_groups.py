"""Keeping ExceptionGroups away from pccl's users (SPEC §2: never an ExceptionGroup)."""

from __future__ import annotations

import trio

__all__ = ["leaf_exceptions", "single_exception"]


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


def single_exception(group: BaseExceptionGroup) -> BaseException:
    """The one meaningful exception in a nursery's ``group``: the first leaf that is not a
    ``trio.Cancelled`` (background tasks of pccl never raise; the leaf is the caller's own
    exception or the error that ended the block), else the first ``Cancelled``."""
    leaves = leaf_exceptions(group)
    for exc in leaves:
        if not isinstance(exc, trio.Cancelled):
            return exc
    return leaves[0]
