"""A master on a Trio loop in a background thread, for tests whose own thread is synchronous."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator

import trio

import pccl


class MasterThread:
    def __init__(self, address: str, master: pccl.Master, token: trio.lowlevel.TrioToken) -> None:
        self.address = address
        self._master = master
        self.token = token

    def statistics(self) -> pccl.MasterStatistics:
        return trio.from_thread.run_sync(self._master.statistics, trio_token=self.token)

    def events(self) -> list[str]:
        """The master's recent status events, oldest first ("kick 3a: TIMEOUT (silent for
        1.5 s)"), for an assertion's message."""
        status = trio.from_thread.run_sync(self._master.status, trio_token=self.token)
        return [f"{e['kind']} {e['peer_id']}: {e['detail']}" for e in reversed(status["events"])]


@contextlib.contextmanager
def master_in_thread(config: pccl.Config, token: str | None = None) -> Iterator[MasterThread]:
    started: concurrent.futures.Future[MasterThread] = concurrent.futures.Future()
    stop = trio.CancelScope()

    async def serve() -> None:
        with stop:
            async with pccl.open_master("127.0.0.1:0", token=token, config=config) as master:
                started.set_result(MasterThread(master.address, master, trio.lowlevel.current_trio_token()))
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    handle = started.result(timeout=30)
    try:
        yield handle
    finally:
        trio.from_thread.run_sync(stop.cancel, trio_token=handle.token)
        thread.join(30)
