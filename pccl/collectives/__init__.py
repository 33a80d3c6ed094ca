"""Collectives over the ring's data lanes: the ring all-reduce and its link layer."""

from .allreduce import reduce_checked, ring_all_reduce
from .buffers import InputBackup, KernelRunner, ReduceArgs
from .links import Inbox, RingLinks, SeqRegistry

__all__ = ["InputBackup", "Inbox", "KernelRunner", "ReduceArgs", "RingLinks", "SeqRegistry", "reduce_checked",
           "ring_all_reduce"]
