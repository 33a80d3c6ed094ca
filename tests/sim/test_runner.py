"""The runner: toy scenario under faults, failure classification, watchdog, triggers."""

from __future__ import annotations

import threading

import trio

from pccl_sim.engine.runner import HostContext, RunOptions, Scenario, run
from pccl_sim.engine.schedule import FaultEvent, Schedule, Trigger
from pccl_sim.workloads.toy import EchoScenario, toy_schedule


def _schedule(events: list[FaultEvent], *, seed: int = 1, duration: float = 6.0, quiet: float = 12.0) -> Schedule:
    return Schedule(seed=seed, events=events, duration=duration, quiet=quiet)


def test_toy_chaos_seeds_pass_and_faults_land() -> None:
    kinds_landed: set[str] = set()
    for seed in range(3):
        toy, schedule = toy_schedule(seed, duration=12.0, quiet=12.0)
        trace = run(toy, schedule)
        assert trace.ok, [str(f) for f in trace.failures]
        kinds_landed |= {e.data["event"]["kind"] for e in trace.of_kind("fault")}
        assert trace.of_kind("pong"), "the workload made no progress at all"
    assert {"kill", "spawn"} <= kinds_landed


def test_same_seed_same_trace_different_seed_different_trace() -> None:
    toy, schedule = toy_schedule(11, duration=8.0, quiet=8.0)
    first, second = run(toy, schedule), run(EchoScenario(peers=3), schedule)
    assert first.hash() == second.hash()
    toy2, other = toy_schedule(12, duration=8.0, quiet=8.0)
    assert run(toy2, other).hash() != first.hash()


def test_peer_that_never_reconnects_is_a_liveness_failure_and_fixed_code_passes() -> None:
    schedule = _schedule([FaultEvent(2.0, "master_restart", host="master", duration=1.0)])
    broken = run(EchoScenario(peers=2, bug="give_up"), schedule)
    assert broken.failure_kinds == ("liveness",)
    assert {f.message.split()[0] for f in broken.failures} == {"peer0", "peer1"}
    assert run(EchoScenario(peers=2), schedule).ok


def test_power_off_wedges_peers_without_timeout_until_the_machine_returns() -> None:
    schedule = _schedule([FaultEvent(2.0, "power_off", host="master")])
    trace = run(EchoScenario(peers=2, bug="no_timeout"), schedule)
    # Nothing answers until the quiet window restarts the master; its kernel then resets the
    # old connections (retransmissions meet RST) and the peers recover.
    resets = [e for e in trace.of_kind("reset") if e.source.startswith("peer")]
    assert resets and all(e.t >= schedule.duration for e in resets)
    assert trace.ok, trace.failures


def test_corrupting_master_is_a_safety_failure() -> None:
    trace = run(EchoScenario(peers=2, bug="corrupt_after:5"), _schedule([]))
    assert trace.failure_kinds[0] == "safety"  # (no valid echo is no progress: liveness follows)


class _Crashy(Scenario):
    name = "crashy"

    async def master(self, host: HostContext) -> None:
        await trio.sleep_forever()

    async def peer(self, host: HostContext) -> None:
        await trio.sleep(1.5)
        raise RuntimeError(f"bug in {host.name}")


def test_exception_in_live_host_is_a_crash() -> None:
    trace = run(_Crashy(peers=1), _schedule([]))
    assert trace.failure_kinds == ("crash",)
    failure = trace.failures[0]
    assert failure.source == "peer0" and "RuntimeError: bug in peer0" in failure.message and failure.t == 1.5


def test_exception_in_killed_host_is_not_a_crash() -> None:
    class _RaisesOnCancel(_Crashy):
        async def peer(self, host: HostContext) -> None:
            try:
                await trio.sleep_forever()
            finally:
                raise RuntimeError("unwinding noise")

    trace = run(_RaisesOnCancel(peers=1), _schedule([FaultEvent(1.0, "kill", host="peer0")]))
    assert trace.ok, trace.failures
    assert trace.of_kind("corpse_error")


class _Shielded(_Crashy):
    async def peer(self, host: HostContext) -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # survives the kill: a zombie
                await trio.sleep(0.5)
                try:
                    await host.network.connect("master:1", timeout=1)
                except Exception:
                    pass


def test_code_outliving_a_kill_is_a_zombie() -> None:
    trace = run(_Shielded(peers=1), _schedule([FaultEvent(1.0, "kill", host="peer0")]))
    assert "zombie" in trace.failure_kinds
    messages = " ".join(f.message for f in trace.failures)
    assert "connect by peer0" in messages and "kept running 0.5" in messages


class _Deadlock(_Crashy):
    async def peer(self, host: HostContext) -> None:
        await trio.Event().wait()  # no deadline anywhere: only the watchdog ends the run


class _Spinner(_Crashy):
    async def peer(self, host: HostContext) -> None:
        while True:
            await trio.lowlevel.checkpoint()  # virtual time never advances


def test_watchdog_ends_a_global_deadlock_and_livelock_is_reported() -> None:
    trace = run(_Deadlock(peers=1), _schedule([], duration=1.0, quiet=1.0))
    assert trace.ok and trace.stats["virtual_seconds"] == 2.0  # ended at the horizon, no hang
    spun = run(_Spinner(peers=1), _schedule([]), options=RunOptions(livelock_iterations=2000))
    assert spun.failure_kinds == ("liveness",) and "livelock" in spun.failures[0].message


def test_message_trigger_kills_right_after_the_nth_send() -> None:
    trigger = Trigger("message", host="peer0", direction="send", message="PING", nth=3)
    trace = run(EchoScenario(peers=1), _schedule([FaultEvent(0.0, "kill", host="peer0", trigger=trigger)]))
    assert trace.ok, trace.failures
    (fired,) = trace.of_kind("triggered")
    pongs_before = [e for e in trace.of_kind("pong") if e.source == "peer0" and e.seq < fired.seq]
    assert len(pongs_before) == 2  # PING 3 left, the kill came before its echo


def test_bytes_trigger_and_chained_trigger_fire() -> None:
    after = Trigger("message", host="peer0", direction="recv", message="PONG", nth=2)
    chained = Trigger("bytes", src="master", dst="peer0", bytes=20_000, after=after)
    plain = Trigger("bytes", src="peer1", dst="master", bytes=50_000)
    schedule = _schedule(
        [FaultEvent(0.5, "kill", host="peer0", trigger=chained), FaultEvent(0.5, "kill", host="peer1", trigger=plain)]
    )
    trace = run(EchoScenario(peers=2), schedule)
    assert trace.ok, trace.failures
    killed = [e.data["host"] for e in trace.of_kind("kill") if e.source == "net"]
    assert sorted(killed) == ["peer0", "peer1"]


def test_restart_makes_a_new_incarnation_with_fresh_rng() -> None:
    trace = run(EchoScenario(peers=1), _schedule([FaultEvent(1.0, "restart", host="peer0", duration=0.5)]))
    starts = [e for e in trace.of_kind("start") if e.source == "peer0"]
    assert [e.data["life"] for e in starts] == [1, 2]
    assert starts[0].data["incarnation"] < starts[1].data["incarnation"]
    assert starts[1].t == 1.5 and trace.ok


class _Sleeper(_Crashy):
    """``HostContext.sleep`` in a simulated run (the world's event queue, which the clock
    delivers), and a kill in the middle of one."""

    async def peer(self, host: HostContext) -> None:
        try:
            await host.sleep(-1.0)
        except ValueError:
            host.record("refused")
        await host.sleep(1.5)
        host.record("woke", at=trio.current_time())
        await host.sleep(10.0)  # peer0 is killed meanwhile
        host.record("slept", at=trio.current_time())


def test_host_sleep_wakes_at_its_instant_and_a_kill_ends_it() -> None:
    trace = run(_Sleeper(peers=2), _schedule([FaultEvent(2.0, "kill", host="peer0")]))
    assert trace.ok, trace.failures
    assert len(trace.of_kind("refused")) == 2
    assert sorted((e.source, e.data["at"]) for e in trace.of_kind("woke")) == [("peer0", 1.5), ("peer1", 1.5)]
    assert [(e.source, e.data["at"]) for e in trace.of_kind("slept")] == [("peer1", 11.5)]


class _Threads(_Crashy):
    """Worker threads inside a simulated run: ``trio.to_thread`` and ``run_sync_soon`` from a
    thread, each awaited while another task keeps the loop busy at one virtual instant (the
    loop then polls for their wake-ups only now and then, see ``poll_only_when_idle``)."""

    async def peer(self, host: HostContext) -> None:
        done = trio.Event()

        async def spin() -> None:
            while not done.is_set():
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(spin)
            result = await trio.to_thread.run_sync(lambda: 6 * 7)
            called = trio.Event()
            token = trio.lowlevel.current_trio_token()
            threading.Thread(target=token.run_sync_soon, args=(called.set,)).start()
            await called.wait()
            done.set()
        host.record("threads", result=result)


def test_worker_threads_and_run_sync_soon_complete_in_a_simulated_run() -> None:
    # The watchdog is what fails if the loop never polls while the spinner runs; its bound is
    # in loop iterations (microseconds each), and a real thread may take a while to be scheduled
    # on a loaded machine: 100,000 iterations (~0.3 s) once ran out in a full test run.
    trace = run(_Threads(peers=1), _schedule([], duration=1.0, quiet=1.0),
                options=RunOptions(livelock_iterations=5_000_000))
    assert trace.ok, trace.failures
    (event,) = trace.of_kind("threads")
    assert event.data["result"] == 42 and event.t == 0.0  # no virtual time passed while the threads ran
