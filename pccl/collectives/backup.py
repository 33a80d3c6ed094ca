"""An in-place all-reduce's input, kept so that an abort can give it back.

An all-reduce that aborts leaves the caller's buffer holding its input, so that the caller (or
``all_reduce_many``) can run it again on the survivors.  :class:`InputGuard` is the one owner of
what makes that so, for every caller of the data path: it takes what is needed when the op
starts, restores the input when the op aborted, commits a staged result when it completed, and
drops its memory once the op is settled.  The communicator keeps it until the master's final
word (an abort may come after this peer's ring finished); :func:`~pccl.collectives.allreduce.ring_all_reduce`,
given no backup, until its ring ends.  It keeps one of:

* **nothing**, out of place: the input is never written;
* **a staged result** (when asked, for small ops: ``stage_up_to``): the ring reduces into scratch
  memory and the caller's array is written once, by :meth:`InputGuard.commit` — for a small op
  cheaper than saving its slices;
* **a backup** (:class:`InputBackup`): the ring reduces in the caller's buffer and saves each
  slice right before its first overwrite.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from .. import kernels
from .buffers import SCRATCH, ReduceArgs, ScratchArena
from .segments import Segments

__all__ = ["InputBackup", "InputGuard"]


class InputGuard:
    """What keeps one all-reduce's input recoverable (see the module docstring).

    :attr:`args` is what the ring runs on — the op's own arguments, or with the staged output in
    place of the caller's — and :attr:`backup` what it saves slices into (``None`` unless the
    input is backed up).  Made on the Trio thread; :meth:`restore`, :meth:`commit` and
    :meth:`drop` run once the ring has stopped.
    """

    def __init__(self, args: ReduceArgs, *, stage_up_to: int | None = None, arena: ScratchArena = SCRATCH) -> None:
        self.args = args
        self.backup: InputBackup | None = None
        self._arena = arena
        self._storage: np.ndarray | None = None
        #: A staged op's result (flat) until :meth:`commit`, and the caller's array it goes to.
        self._staged: np.ndarray | None = None
        self._output: np.ndarray | None = None
        if not args.in_place:
            return
        output = args.dst
        nbytes = output.nbytes
        if stage_up_to is not None and nbytes <= stage_up_to and isinstance(output, np.ndarray):
            self._storage = arena.take(nbytes)
            self._staged = self._storage[:nbytes].view(output.dtype)
            self._output = output
            self.args = args.into(self._staged)
        else:
            self.backup = InputBackup(output, arena=arena)

    def restore(self) -> None:
        """The op aborted: put the input back (a staged op never wrote it).  Idempotent (until
        :meth:`drop`)."""
        if self.backup is not None:
            self.backup.restore()

    def commit(self) -> None:
        """The op completed: a staged result goes into the caller's array (any other result is
        there already)."""
        if self._staged is not None and self._output is not None:
            np.copyto(self._output, self._staged)

    def drop(self) -> None:
        """The op is settled: give the memory back; :meth:`restore` and :meth:`commit` become
        no-ops."""
        if self.backup is not None:
            self.backup.release()
        if self._storage is not None:
            self._arena.give(self._storage)
        self._storage = self._staged = self._output = None


class InputBackup:
    """The original content of an in-place buffer, saved lazily just before it is overwritten.

    The buffer may be :class:`Segments`: every slice saved or overwritten lies in one of its
    arrays (the schedule's frames never straddle two), and the copy is one flat scratch array.

    Costs at most one copy of the input, made piecewise right before a slice is first written —
    and nothing for slices an aborted op never touched.  Where that first write is a reduction
    (the ring's reduce-scatter), :meth:`overwrite` lets a fused kernel store the copy in the same
    pass that reads the slice for the reduction, so the copy costs no pass of its own; elsewhere
    :meth:`save` copies the slice (with streaming stores: the copy is read back only on abort).  :meth:`restore` puts the
    input back; the communicator keeps the backup until the master has confirmed the op, so an
    abort that arrives after this peer finished its ring still restores the input.
    Thread safety: :meth:`save` / :meth:`overwrite` may be called for one slice from several
    threads (the first copies, the others wait for that copy and return or run the plain
    kernel), and :meth:`restore` runs only after every writer has stopped.
    """

    def __init__(self, buffer: np.ndarray | Segments, *, arena: ScratchArena = SCRATCH) -> None:
        self._buffer = buffer.reshape(-1)
        self._arena = arena
        # Taken now, on the Trio thread; pages already mapped if the arena reuses a buffer.
        self._storage: np.ndarray | None = arena.take(self._buffer.nbytes)
        self._copy: np.ndarray | None = (
            self._storage[: self._buffer.nbytes].view(np.uint8) if self._buffer.nbytes else None
        )
        self._bytes = self._buffer.view(np.uint8) if self._buffer.nbytes else None
        self._itemsize = self._buffer.itemsize
        self._saved: dict[int, int] = {}
        # Slices whose copy a fused kernel is making right now (start -> stop); a save() of one
        # waits on _copied until it is in _saved.
        self._copying: dict[int, int] = {}
        self._lock = threading.Lock()
        self._copied = threading.Condition(self._lock)

    def save(self, start: int, stop: int) -> None:
        """Remember ``buffer[start:stop]`` unless a save starting at ``start`` already happened."""
        if start in self._saved or stop <= start or self._copy is None or self._bytes is None:
            return
        # Locked: on the threaded path a lane's sender saves slices ahead of its receiver, and
        # the receiver must not start overwriting a slice while the sender is still copying it.
        with self._lock:
            while start in self._copying:
                self._copied.wait()
            if start in self._saved:
                return
            a, b = start * self._itemsize, stop * self._itemsize
            kernels.save_copy(self._copy[a:b], self._bytes[a:b])
            self._saved[start] = stop

    def overwrite(self, start: int, stop: int, fused: Callable[[np.ndarray], None],
                  plain: Callable[[], None]) -> None:
        """Run the write of ``buffer[start:stop]`` through a kernel that saves the slice itself.

        If the slice is not saved yet, ``fused(saved)`` runs: it must copy the slice's current
        elements into ``saved`` (a view of the backup with the buffer's dtype) in the same pass
        as it overwrites them (``kernels.reduce_into_saving``).  Otherwise ``plain()`` runs.
        The lock is not held while the kernel runs, so lanes reducing different slices do not
        wait for each other; a concurrent :meth:`save` of this slice waits for the copy.  If
        ``fused`` raises (its argument checks), the slice counts as not saved.
        """
        if self._copy is None or stop <= start:
            plain()
            return
        with self._lock:
            while start in self._copying:
                self._copied.wait()
            claimed = start not in self._saved
            if claimed:
                self._copying[start] = stop
        if not claimed:
            plain()
            return
        a, b = start * self._itemsize, stop * self._itemsize
        saved = False
        try:
            fused(self._copy[a:b].view(self._buffer.dtype))
            saved = True
        finally:
            with self._lock:
                del self._copying[start]
                if saved:
                    self._saved[start] = stop
                self._copied.notify_all()

    def is_saved(self, start: int) -> bool:
        return start in self._saved

    @property
    def saved_elements(self) -> int:
        return sum(b - a for a, b in self._saved.items())

    def restore(self) -> None:
        """Copy every saved slice back.  Idempotent (until :meth:`release`)."""
        if self._copy is None or self._bytes is None:
            return
        for start, stop in self._saved.items():
            a, b = start * self._itemsize, stop * self._itemsize
            np.copyto(self._bytes[a:b], self._copy[a:b])

    def release(self) -> None:
        """Give the copy back to the arena (the op is settled); :meth:`restore` becomes a no-op."""
        if self._storage is not None:
            self._arena.give(self._storage)
        self._storage = self._copy = None
        self._saved.clear()
