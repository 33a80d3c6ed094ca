"""Collectives over the ring's data lanes: the ring all-reduce and its link layer."""

from .allreduce import reduce_checked, ring_all_reduce
from .backup import InputBackup, InputGuard
from .buffers import KernelRunner, ReduceArgs
from .links import Inbox, RingLinks, SeqRegistry

__all__ = ["InputBackup", "InputGuard", "Inbox", "KernelRunner", "ReduceArgs", "RingLinks", "SeqRegistry",
           "reduce_checked", "ring_all_reduce"]
