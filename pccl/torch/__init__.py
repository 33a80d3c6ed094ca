"""``pccl.torch``: pccl inside ``torch.distributed``.

``pccl.torch.ProcessGroup(comm)`` wraps a :mod:`pccl.blocking` communicator as a
``torch.distributed.ProcessGroup``, so ``torch.distributed.all_reduce(t, group=pg)`` and the other
collectives run over pccl; :func:`register` registers the backend name ``"pccl"``.

Importing this package imports torch; nothing else in pccl does.
"""

from .process_group import ProcessGroup, Work, register

__all__ = ["ProcessGroup", "Work", "register"]
