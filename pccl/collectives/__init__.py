"""Collectives over the ring's data lanes: the ring all-reduce, reduce-scatter, all-gather and
broadcast, and their link layer."""

from .all_gather import GatherArgs, all_gather_checked
from .allreduce import reduce_checked, ring_all_reduce
from .backup import InputBackup, InputGuard
from .broadcast import broadcast_checked
from .buffers import KernelRunner, ReduceArgs
from .links import Inbox, RingLinks, SeqRegistry
from .reduce_scatter import reduce_scatter_checked, shard_bounds

__all__ = ["GatherArgs", "InputBackup", "InputGuard", "Inbox", "KernelRunner", "ReduceArgs", "RingLinks",
           "SeqRegistry", "all_gather_checked", "broadcast_checked", "reduce_checked", "reduce_scatter_checked",
           "ring_all_reduce", "shard_bounds"]
