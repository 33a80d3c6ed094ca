"""Campaigns on a Dask cluster: ``pccl-sim campaign --cluster local:N | tcp://HOST:PORT``.

:func:`run_on_cluster` spreads a campaign's seeds over the workers of a ``dask.distributed``
cluster — a :class:`distributed.LocalCluster` of ``N`` worker processes started for the campaign
(``local:N``), or an existing scheduler (``tcp://HOST:PORT``, with workers started as
``dask worker tcp://HOST:PORT --nthreads 1``) — and returns the same :class:`SeedResult` list as
:func:`~pccl_sim.tools.campaign.run_campaign`, in seed order.

* A task runs a *batch* of consecutive seeds (:func:`batch_size`: up to 8 per task, so the
  scheduler's round trip — milliseconds — is small against the seconds a batch takes, with
  enough tasks that every worker stays busy to the end).  At most ``window`` tasks are
  outstanding at once; the rest are submitted as earlier ones finish, so a campaign of
  thousands of seeds never floods the scheduler.
* Results stream back as tasks finish (``as_completed``); ``progress(result)`` is called for
  each seed of a finished batch.
* Each seed is one deterministic ``trio.run`` in the worker (under a process-wide lock: trio's
  scheduler RNG is process-global, so two runs must never overlap in one process, whatever a
  worker's ``--nthreads``).  A seed's trace hash is the same as in a local run.
* Cancellation (Ctrl-C, or any exception from ``progress``): the outstanding tasks are cancelled
  on the scheduler, a cluster started here is shut down, and the exception propagates.  A task
  that raised (a simulator bug, a worker that cannot import the code) cancels the rest too and
  its exception escapes; :class:`ClusterError` for a scheduler that cannot be reached or has no
  worker.

``dask.distributed`` is an optional dependency (``pip install 'pccl-trio[cluster]'``), imported
only here and only when a campaign asks for a cluster; :class:`ClusterUnavailable` says so.  The
workers need ``pccl`` and ``pccl_sim`` importable at the same version as the client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .campaign import CampaignSpec, SeedResult, run_seed

__all__ = ["ClusterError", "ClusterUnavailable", "ClusterAddress", "parse_cluster", "batch_size", "run_on_cluster",
           "run_batch"]

logger = logging.getLogger(__name__)

#: Seconds to wait for a scheduler to answer, and for its first worker.
CONNECT_TIMEOUT = 10.0
WORKER_TIMEOUT = 60.0


class ClusterError(RuntimeError):
    """A cluster campaign cannot run: bad ``--cluster`` value, unreachable scheduler, no worker."""


class ClusterUnavailable(ClusterError):
    """``dask.distributed`` is not installed."""


@dataclasses.dataclass(frozen=True)
class ClusterAddress:
    """A parsed ``--cluster`` value: ``local`` workers, or a scheduler ``address``."""

    local: int | None = None
    address: str | None = None

    def describe(self) -> str:
        return f"local cluster of {self.local} worker processes" if self.local is not None else f"scheduler {self.address}"


def parse_cluster(text: str) -> ClusterAddress:
    """``local:N`` (N >= 1 worker processes) or ``tcp://HOST:PORT``; :class:`ClusterError`
    otherwise."""
    text = text.strip()
    if text.startswith("local:"):
        try:
            n = int(text.removeprefix("local:"))
        except ValueError:
            n = 0
        if n < 1:
            raise ClusterError(f"--cluster {text!r}: local:N needs N >= 1 worker processes")
        return ClusterAddress(local=n)
    if text.startswith("tcp://"):
        host, sep, port = text.removeprefix("tcp://").rpartition(":")
        if not host or not sep or not port.isdigit():
            raise ClusterError(f"--cluster {text!r}: a scheduler address is tcp://HOST:PORT")
        return ClusterAddress(address=text)
    raise ClusterError(f"--cluster {text!r}: give local:N or tcp://HOST:PORT")


def batch_size(seeds: int, workers: int) -> int:
    """Seeds per task: up to 8, but at least 16 tasks per worker while the campaign allows (seeds
    differ in cost — a step body of concurrent collectives costs tens of times a compute-only
    one — and the last tasks of a campaign should be short, or one worker finishes long after
    the others)."""
    return max(1, min(8, seeds // max(1, 16 * workers)))


_RUN_LOCK = threading.Lock()


def run_batch(spec: CampaignSpec, seeds: Sequence[int]) -> list[SeedResult]:
    """The task a worker runs: ``seeds`` one after the other (never two runs at once in one
    process).  pccl's and the simulator's log records are dropped meanwhile (chaos makes pccl
    warn by design); the worker's own logging is left alone.  Exceptions of a run escape (a
    simulator bug)."""
    loggers = [logging.getLogger(name) for name in ("pccl", "pccl_sim")]
    with _RUN_LOCK:
        levels = [lg.level for lg in loggers]
        try:
            for lg in loggers:
                lg.setLevel(logging.CRITICAL + 1)
            return [run_seed(spec, seed) for seed in seeds]
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _distributed() -> Any:
    try:
        import distributed
    except ImportError as exc:
        raise ClusterUnavailable(
            "--cluster needs dask.distributed, an optional dependency: pip install 'pccl-trio[cluster]'"
        ) from exc
    return distributed


@contextlib.contextmanager
def _client(where: ClusterAddress, dask_logs: int) -> Iterator[Any]:
    """A connected client with at least one worker; a local cluster is shut down on exit.
    dask's own loggers are set to ``dask_logs`` meanwhile (its cluster start and shutdown chatter
    is INFO)."""
    distributed = _distributed()
    dask_logger = logging.getLogger("distributed")
    with contextlib.ExitStack() as stack:
        stack.callback(dask_logger.setLevel, dask_logger.level)
        dask_logger.setLevel(dask_logs)
        if where.local is not None:
            cluster = stack.enter_context(distributed.LocalCluster(
                n_workers=where.local, threads_per_worker=1, processes=True, dashboard_address=None,
                silence_logs=logging.ERROR,
            ))
            client = stack.enter_context(distributed.Client(cluster))
        else:
            try:
                client = stack.enter_context(distributed.Client(where.address, timeout=CONNECT_TIMEOUT))
            except OSError as exc:
                raise ClusterError(f"cannot reach the Dask scheduler at {where.address}: {exc}") from exc
        try:
            client.wait_for_workers(1, timeout=WORKER_TIMEOUT)
        except TimeoutError as exc:
            raise ClusterError(f"no Dask worker joined the {where.describe()} within {WORKER_TIMEOUT:g} s") from exc
        yield client


def run_on_cluster(
    spec: CampaignSpec,
    seeds: Sequence[int],
    cluster: str | ClusterAddress,
    *,
    progress: Callable[[SeedResult], None] | None = None,
    batch: int | None = None,
    client: Any = None,
    dask_logs: int = logging.ERROR,
) -> list[SeedResult]:
    """Run every seed on the cluster; return the results sorted by seed (module docstring).

    ``cluster``: ``local:N`` / ``tcp://HOST:PORT`` (or its :func:`parse_cluster` form);
    ``client``: an already connected ``distributed.Client`` to use instead (left open).
    ``batch``: seeds per task (default :func:`batch_size`).  ``dask_logs``: the level of dask's
    loggers in this process during the campaign.  Cancellation and errors: see the
    module docstring."""
    where = cluster if isinstance(cluster, ClusterAddress) else parse_cluster(cluster)
    seeds = list(seeds)
    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(_client(where, dask_logs))
        return _stream(_distributed(), client, spec, seeds, progress, batch)


def _stream(distributed: Any, client: Any, spec: CampaignSpec, seeds: list[int],
            progress: Callable[[SeedResult], None] | None, batch: int | None) -> list[SeedResult]:
    workers = max(1, len(client.nthreads()))  # worker processes (each runs one seed at a time)
    size = batch or batch_size(len(seeds), workers)
    batches = [seeds[i:i + size] for i in range(0, len(seeds), size)]
    window = 2 * workers
    logger.info("%d seeds in %d tasks of up to %d on %d workers", len(seeds), len(batches), size, workers)
    pending = iter(batches)
    outstanding: set[Any] = set()

    def submit() -> Any:
        chunk = next(pending, None)
        if chunk is None:
            return None
        # pure=False: a task's key is unique, so a rerun of the same campaign is not served from
        # a previous one's results.
        future = client.submit(run_batch, spec, chunk, pure=False)
        outstanding.add(future)
        return future

    results: list[SeedResult] = []
    first = [f for f in (submit() for _ in range(window)) if f is not None]
    stream = distributed.as_completed(first)
    try:
        for future in stream:
            outstanding.discard(future)
            chunk = future.result()
            future.release()  # the scheduler may forget the task now
            nxt = submit()
            if nxt is not None:
                stream.add(nxt)
            for result in chunk:
                results.append(result)
                if progress is not None:
                    progress(result)
    except BaseException:
        if outstanding:
            logger.info("cancelling %d outstanding tasks", len(outstanding))
            client.cancel(list(outstanding))
        raise
    return sorted(results, key=lambda r: r.seed)
