"""Collectives over the ring's data lanes: the ring all-reduce and its link layer."""

from .allreduce import InputBackup, KernelRunner, ring_all_reduce
from .links import Inbox, RingLinks, SeqRegistry

__all__ = ["InputBackup", "Inbox", "KernelRunner", "RingLinks", "SeqRegistry", "ring_all_reduce"]
