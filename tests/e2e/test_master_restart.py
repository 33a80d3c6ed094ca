"""The master restarts; the run goes on, with real processes.

A master process and three peer processes run the loop of ``examples/hello_world.py``.  The
master is SIGKILLed once while the peers are inside an all-reduce and once while they are inside
a sync, and each time restarted on the same port after a pause.  No peer process restarts: each
reconnects, registers again, and the run finishes with bit-identical weights on every peer at a
revision equal to the number of completed steps (no step lost, none counted twice).
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys

import trio

from pccl.tools.bench import free_port

HERE = pathlib.Path(__file__).resolve().parent
TOKEN = "restart-token"
PEERS = 3
STEPS = 40
N = 2_000_000  # 8 MB of weights: an all-reduce takes a while, so the kill lands inside one
#: The sync at this revision starts late on the last peer: the others wait inside it.
SLOW_SYNC_AT = 12
BOUND = 60.0


class _Lines:
    """Lines of a child's stdout, as they come."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream, self._buffer = stream, b""

    async def next(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some()
            if not chunk:
                raise EOFError("the process closed its output")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


async def _start_master(port: int, nursery: trio.Nursery, log: list[str]) -> trio.Process:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pccl", "master", "--listen", f"127.0.0.1:{port}", "--token", TOKEN,
         "--peer-timeout", "2", "--heartbeat-interval", "0.25"], stderr=subprocess.PIPE)
    lines = _Lines(proc.stderr)  # type: ignore[arg-type]
    while "master listening on" not in (line := await lines.next()):
        log.append(line)
    log.append(line)
    nursery.start_soon(_drain, lines, log)  # a full pipe would stall the master
    return proc


async def _drain(lines: _Lines, sink: list[str]) -> None:
    try:
        while True:
            sink.append(await lines.next())
    except EOFError:
        pass


async def test_peers_survive_master_kills_mid_all_reduce_and_mid_sync() -> None:
    port = free_port()
    logs: list[str] = []
    outputs: list[list[str]] = [[] for _ in range(PEERS)]
    kills: list[str] = []
    procs: list[trio.Process] = []
    try:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                master = await _start_master(port, nursery, logs)
                procs.append(master)
                peers = [await trio.lowlevel.open_process(
                    [sys.executable, str(HERE / "restart_peer_process.py"), f"127.0.0.1:{port}", TOKEN, str(STEPS),
                     str(N), str(index), str(SLOW_SYNC_AT if index == PEERS - 1 else -1)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for index in range(PEERS)]
                procs.extend(peers)
                for p in peers:
                    nursery.start_soon(_drain, _Lines(p.stderr), logs)  # type: ignore[arg-type]
                lines = [_Lines(p.stdout) for p in peers]  # type: ignore[arg-type]
                # peer 0 tells the driver where the run is; the others are just recorded
                for i in range(1, PEERS):
                    nursery.start_soon(_drain, lines[i], outputs[i])

                async def kill_and_restart(moment: str) -> None:
                    nonlocal master
                    master.send_signal(signal.SIGKILL)
                    await master.wait()
                    kills.append(moment)
                    logs.append(f"--- master killed ({moment}) ---")
                    await trio.sleep(1.0)  # a pause: the peers find nobody at the address meanwhile
                    master = await _start_master(port, nursery, logs)
                    procs.append(master)

                while True:
                    line = await lines[0].next()
                    outputs[0].append(line)
                    word, *rest = line.split()
                    if word == "DONE":
                        break
                    if word == "REDUCE" and int(rest[0]) >= 4 and "all-reduce" not in kills:
                        await trio.sleep(0.005)  # inside the 8 MB all-reduce (its vote or its ring)
                        await kill_and_restart("all-reduce")
                    elif word == "SYNCING" and int(rest[0]) == SLOW_SYNC_AT and "sync" not in kills:
                        # peer 0 voted; the last peer starts this sync half a second late
                        await trio.sleep(0.2)
                        await kill_and_restart("sync")
                for p in peers:
                    await p.wait()
                master.kill()
        print("\n".join(logs))  # shown by pytest when an assertion below fails
        assert kills == ["all-reduce", "sync"]
        done = [next(line for line in out if line.startswith("DONE")).split() for out in outputs]
        revisions = {int(d[1]) for d in done}
        digests = {d[2] for d in done}
        assert revisions == {STEPS}, done  # every completed step counted once, none lost
        assert len(digests) == 1, done  # bit-identical weights and optimizer state
        assert all(p.returncode == 0 for p in peers)
        assert any("ABORTED" in out for out in outputs), "the first kill did not land inside an all-reduce"
        # The second kill found peer 0 inside its sync: the sync was started again, not completed.
        syncing = [line for line in outputs[0] if line.startswith(("SYNCING", "SYNC "))]
        at = syncing.index(f"SYNCING {SLOW_SYNC_AT}")
        assert syncing[at + 1] == f"SYNCING {SLOW_SYNC_AT}", syncing[at - 1 : at + 3]
    except BaseException:
        print("\n".join(logs), *(f"peer{i}: {out}" for i, out in enumerate(outputs)), sep="\n")
        raise
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for proc in procs:
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    await pipe.aclose()
