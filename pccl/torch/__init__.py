"""``pccl.torch``: pccl inside ``torch.distributed``.

``pccl.torch.ProcessGroup(comm)`` wraps a :mod:`pccl.blocking` communicator as a
``torch.distributed.ProcessGroup``, so ``torch.distributed.all_reduce(t, group=pg)`` and the other
collectives run over pccl; :func:`register` registers the backend name ``"pccl"``.
``pccl.torch.DistributedDataParallel(module, comm)`` is torch's DDP with every gradient bucket
averaged over the peers by :func:`ddp_comm_hook` (:mod:`pccl.torch.ddp` describes both).

torch is imported when a name of this package is first used, not by ``import pccl.torch`` (and
the rest of pccl never imports it).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CollectiveTimeout", "CommHookState", "DDP_FIRST_TAG", "DistributedDataParallel", "ProcessGroup", "Work",
           "ddp_comm_hook", "register"]

#: Public name -> the submodule that defines it (imported, with torch, on first use).
_WHERE = {"CollectiveTimeout": "deadlines", "CommHookState": "ddp", "DDP_FIRST_TAG": "ddp", "DistributedDataParallel": "ddp",
          "ddp_comm_hook": "ddp", "ProcessGroup": "process_group", "Work": "work", "register": "backend"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pccl.torch' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
