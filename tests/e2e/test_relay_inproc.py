"""Relays on real TCP in one process: peers that nobody may dial (every listener behind the
test's firewall, :class:`Firewalled`) meet at the master's own relay (``relay=True``) or at a
separate relay (:func:`pccl.relay.serve_relay`); a relay that dies mid-all-reduce aborts the op
retryably and the pair moves to another relay; a relay under a flood of idle and half-sent
connections still joins a pair.  The real-NAT versions (OS processes, SIGKILL) are in
``tests/cluster/``."""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import tracemalloc
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio

import pccl
from pccl import Config
from pccl.relay import Relay, serve_relay
from pccl.protocol import codec, handshake
from pccl.protocol import messages as m
from pccl.protocol.paths import PathKind
from pccl.testing import admit, each
from test_hostile_network import MIB, connect_from, flood_source_works, idle_flood  # noqa: F401 (a fixture)
from test_paths_inproc import CFG, TOKEN, Firewalled, opener, sum_everywhere


@contextlib.asynccontextmanager
async def relay_process(master: pccl.Master, config: Config = CFG) -> AsyncIterator[tuple[Relay, trio.CancelScope]]:
    """A relay of ``master``'s run on loopback, registered; cancelling the scope kills it (its
    splices end with resets, as a relay process's death ends them)."""
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        started: list[Relay] = []

        async def run(task_status: trio.TaskStatus[None]) -> None:
            with scope:
                async with trio.open_nursery() as inner:
                    relay = await inner.start(lambda task_status: serve_relay(
                        master.address, "127.0.0.1:0", token=TOKEN, config=config, task_status=task_status))
                    started.append(relay)
                    task_status.started()

        await nursery.start(run)
        relay = started[0]
        with trio.fail_after(10):
            await relay.wait_registered()
        yield relay, scope
        scope.cancel()


def _relayed_paths(master: pccl.Master) -> dict[tuple[int, int], str]:
    return {(p.initiator, p.target): p.via for p in pccl.testing.master_snapshot(master).paths if p.kind is PathKind.RELAYED}


async def test_walled_peers_reduce_sync_and_probe_through_the_masters_relay() -> None:
    closed: set[int] = set()
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG, relay=True) as master:
        async with trio.open_nursery() as nursery:
            comms: list[pccl.Communicator] = []
            scopes = []
            for _ in range(2):
                comm, scope = await admit(nursery, master, comms, opener(master, Firewalled(CFG, closed, mine=True)),
                                          soon=30)
                comms.append(comm)
                scopes.append(scope)
            await sum_everywhere(comms)
            # A walled newcomer downloads the shared state through the relay.
            arrays = [np.full(20_000, 3.0, np.float32), np.full(20_000, 3.0, np.float32), np.zeros(20_000, np.float32)]
            late, scope = await admit(nursery, master, comms, opener(master, Firewalled(CFG, closed, mine=True)),
                                      soon=30)
            comms.append(late)
            scopes.append(scope)
            states = [pccl.SharedState({"w": a}, revision=4 if i < 2 else 0) for i, a in enumerate(arrays)]
            infos = await each(comms, lambda i, c: c.sync_shared_state(states[i]))
            assert [info.revision for info in infos] == [4, 4, 4]
            np.testing.assert_array_equal(arrays[2], arrays[0])
            await sum_everywhere(comms)
            await each(comms, lambda i, c: c.optimize_topology(), within=60)
            await sum_everywhere(comms)

            relayed = _relayed_paths(master)
            ids = {c.peer_id for c in comms}
            # Every pair that connected went through relay 1, the master's own.
            assert relayed and all(a in ids and b in ids for a, b in relayed), relayed
            assert all(via.startswith("relay 1 at ") for via in relayed.values()), relayed
            assert not [p for p in pccl.testing.master_snapshot(master).paths if p.kind is not PathKind.RELAYED]
            (own,) = master.status()["relays"]
            assert own["relay_id"] == 1 and own["address"] == ""
            assert own["forwarded_bytes"] > 3 * 20_000 * 4  # the download alone moved that much
            assert sum(c.statistics().relay_joins for c in comms) >= 2
            for scope in scopes:
                scope.cancel()


async def test_a_relay_that_dies_mid_all_reduce_aborts_it_and_the_pair_moves_to_another() -> None:
    closed: set[int] = set()
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        async with relay_process(master) as (first, first_scope), relay_process(master) as (second, second_scope):
            async with trio.open_nursery() as nursery:
                comms: list[pccl.Communicator] = []
                scopes = []
                for _ in range(2):
                    comm, scope = await admit(nursery, master, comms,
                                              opener(master, Firewalled(CFG, closed, mine=True)), soon=30)
                    comms.append(comm)
                    scopes.append(scope)
                await sum_everywhere(comms)
                relays = {first.relay_id: (first, first_scope), second.relay_id: (second, second_scope)}
                # The master spreads the pair's connections (one per direction of the ring) over
                # the relays with the fewest pairs: each relay carries one.
                used = {int(via.split(" at ")[0].removeprefix("relay ")) for via in _relayed_paths(master).values()}
                assert used <= set(relays) and used, used
                victim_id = min(used)
                victim, victim_scope = relays[victim_id]
                assert victim.statistics().pairs >= 1

                # A large all-reduce; the relay dies once it forwarded part of it.
                n = 4_000_000
                inputs = [np.arange(n, dtype=np.float32) % 1000 * (i + 1) for i in range(2)]
                originals = [x.copy() for x in inputs]
                expected = originals[0] + originals[1]
                before = victim.statistics().forwarded_bytes
                outcomes: list[object] = [None, None]

                async def reduce(i: int) -> None:
                    try:
                        await comms[i].all_reduce(inputs[i])
                        outcomes[i] = "done"
                    except pccl.PCCLError as exc:
                        outcomes[i] = exc

                async with trio.open_nursery() as op:
                    for i in range(2):
                        op.start_soon(reduce, i)
                    with trio.fail_after(30):
                        while victim.statistics().forwarded_bytes - before < n:  # a quarter of one buffer
                            await trio.sleep(0)
                    victim_scope.cancel()
                assert all(isinstance(o, pccl.CollectiveAborted) for o in outcomes), outcomes
                for x, original in zip(inputs, originals):
                    np.testing.assert_array_equal(x, original)  # an aborted op leaves the buffers as they were

                # The retry (on the same two peers) goes through the relay that is left.
                for _attempt in range(5):
                    results = await each(comms, lambda i, c: c.all_reduce(inputs[i]), within=60)
                    if not any(isinstance(r, pccl.PCCLError) for r in results):
                        break
                    for x, original in zip(inputs, originals):
                        np.testing.assert_array_equal(x, original)
                else:
                    raise AssertionError(f"the all-reduce never succeeded after the relay's death: {results}")
                for x in inputs:
                    np.testing.assert_array_equal(x, expected)
                (survivor_id,) = set(relays) - {victim_id}
                vias = set(_relayed_paths(master).values())
                assert vias and all(v.startswith(f"relay {survivor_id} at ") for v in vias), vias
                assert [r.relay_id for r in pccl.testing.master_snapshot(master).relays] == [survivor_id]
                assert relays[survivor_id][0].statistics().pairs == 2
                for scope in scopes:
                    scope.cancel()


async def _announce_big_join_frame(address: str, source: str) -> trio.SocketStream:
    """A connection that sends a hello and then announces a 16 MiB frame, of which it sends 1,000
    bytes."""
    stream = await connect_from(source, address)
    hello = m.Hello(role=m.HandshakeRole.CLIENT, has_token=False, nonce=bytes(handshake.NONCE_SIZE))
    await stream.send_all(handshake.encode_preamble() + codec.encode_message(hello, max_frame_size=1024)
                          + struct.pack(">IB", 16 * MIB - 1, codec.FrameKind.CONTROL) + b"\x00" * 1000)
    return stream


async def test_a_relay_under_idle_and_half_sent_floods_still_joins_a_pair(
        flood_source_works: None, caplog: pytest.LogCaptureFixture) -> None:
    """300 idle connections from one host and 60 that announce 16 MiB frames (each from its own
    address, so admission lets all of them in): a pair still meets at the relay, and the relay's
    memory grows by what arrived, not by what was announced.  The connections' timeouts are 30 s:
    only the admission rule lets the pair through within the bound."""
    patient = Config(peer_timeout=4.0, heartbeat_interval=0.25, connect_timeout=30.0, first_bytes_timeout=30.0,
                     direct_connect_timeout=0.6, p2p_base_port=0, shared_state_base_port=0)
    caplog.set_level(logging.WARNING)
    closed: set[int] = set()
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=patient) as master:
        async with relay_process(master, patient) as (relay, _):
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                async with idle_flood(relay.address, 300):
                    half_sent = [await _announce_big_join_frame(relay.address, f"127.0.2.{i + 1}") for i in range(60)]
                    await trio.sleep(1.0)  # let every frame start arriving
                    grown = tracemalloc.get_traced_memory()[0] - before
                    async with trio.open_nursery() as nursery:
                        comms: list[pccl.Communicator] = []
                        scopes = []
                        start = trio.current_time()
                        with trio.fail_after(20):  # far below the 30 s a flood connection may hold a slot
                            for _ in range(2):
                                comm, scope = await admit(nursery, master, comms,
                                                          opener(master, Firewalled(patient, closed, mine=True),
                                                                  patient), soon=20)
                                comms.append(comm)
                                scopes.append(scope)
                        joined_in = trio.current_time() - start
                        await sum_everywhere(comms)
                        assert relay.statistics().pairs_total >= 1
                        for scope in scopes:
                            scope.cancel()
                    for stream in half_sent:
                        await stream.aclose()
            finally:
                tracemalloc.stop()
    # Each half-sent frame costs what arrived: before a join, a relay refuses a frame announcing
    # more than pccl.relay.server.MAX_JOIN_FRAME before reading or allocating it.
    assert grown < 60 * 256 * 1024, f"{grown / MIB:.1f} MiB for 60 half-sent 16 MiB frames"
    print(f"pair joined through the flooded relay in {joined_in:.2f} s; relay memory grew {grown / MIB:.2f} MiB")


async def test_status_json_metrics_table_and_page_show_each_pairs_path_and_the_relay() -> None:
    """A reachable peer and two walled ones, after ``optimize_topology()`` probed every pair:
    the pairs into a walled peer from the reachable one are dialled back, the pairs between the
    walled ones relayed, the rest direct; /status.json, /metrics, ``pccl status``'s table and the
    page say so per peer and for the relay."""
    from pccl.master import render_table
    from pccl.master.status_page import render_html
    from test_status_endpoint import get, samples

    closed: set[int] = set()
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG, relay=True,
                                status="127.0.0.1:0") as master:
        async with trio.open_nursery() as nursery:
            comms: list[pccl.Communicator] = []
            scopes = []
            for network in (Firewalled(CFG, closed), Firewalled(CFG, closed, mine=True),
                            Firewalled(CFG, closed, mine=True)):
                comm, scope = await admit(nursery, master, comms, opener(master, network), soon=30)
                comms.append(comm)
                scopes.append(scope)
            await each(comms, lambda i, c: c.optimize_topology(), within=60)
            await sum_everywhere(comms)
            status = json.loads(await get(master, "/status.json", TOKEN))
            metrics = samples((await get(master, "/metrics", TOKEN)).decode())
            table = render_table(status)
            page = render_html(status)
            for scope in scopes:
                scope.cancel()
    open_id, walled = f"{comms[0].peer_id:016x}", {f"{c.peer_id:016x}" for c in comms[1:]}
    peers = {p["peer_id"]: p for g in status["groups"] for p in g["peers"]}
    assert set(peers) == {open_id} | walled, peers.keys()
    assert peers[open_id]["reachable"] is True
    assert all(peers[w]["reachable"] is False for w in walled)
    expected = {(open_id, w): "reversed" for w in walled}
    expected |= {(w, open_id): "direct" for w in walled}
    expected |= {(a, b): "relayed" for a in walled for b in walled if a != b}
    seen = {(src, x["to"]): x["path"] for src, p in peers.items() for x in p["paths"] if x["port"] == "benchmark"}
    assert seen == expected, seen
    assert status["paths"]["direct"] and status["paths"]["reversed"] and status["paths"]["relayed"]
    (relay,) = status["relays"]
    assert relay["own"] and relay["pairs_assigned"] >= 2 and relay["forwarded_bytes"] > 0
    for kind in ("direct", "reversed", "relayed"):
        assert metrics[("pccl_master_pairs", (("path", kind),))] == status["paths"][kind]
    assert metrics[("pccl_master_relays", ())] == 1
    assert metrics[("pccl_master_relayed_bytes_total", ())] == relay["forwarded_bytes"]
    assert "relays:" in table and "this master" in table
    assert "relayed" in table and "reversed" in table
    assert '<table class="relays">' in page and "relayed" in page
