"""``pccl.torch``: pccl inside ``torch.distributed`` (torch's DDP with pccl averaging the gradients).

torch is imported when a name of this package is first used, not by ``import pccl.torch`` (and
the rest of pccl never imports it).  :mod:`pccl.torch.ddp` describes the DDP wrapper and hook.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CommHookState", "DDP_FIRST_TAG", "DistributedDataParallel", "ddp_comm_hook"]

#: Public name -> the submodule that defines it (imported, with torch, on first use).
_WHERE = {"CommHookState": "ddp", "DDP_FIRST_TAG": "ddp", "DistributedDataParallel": "ddp", "ddp_comm_hook": "ddp"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pccl.torch' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
