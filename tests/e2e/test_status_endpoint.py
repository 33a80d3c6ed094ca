"""The master's status endpoint on real TCP: ``/metrics`` parsed by prometheus_client's own
parser with counters that move as operations run, ``/status.json`` showing what the peers
report in their heartbeats, the token check, and ``pccl status`` in a terminal."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import pccl
from pccl import Config

from pccl.testing import open_test_cluster

CONFIG = Config(peer_timeout=10.0, heartbeat_interval=0.1, connect_timeout=10.0)
TOKEN = "status-token"


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


async def get(master: pccl.Master, path: str, token: str | None = TOKEN) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    code, _, body = await trio.to_thread.run_sync(_get, f"http://{master.status_address}{path}", headers)
    assert code == 200, (code, body)
    return body


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, keyed by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def all_reduce_everywhere(comms: list[pccl.Communicator], count: int = 4096) -> None:
    async with trio.open_nursery() as nursery:
        for comm in comms:
            nursery.start_soon(comm.all_reduce, np.ones(count, np.float32))


async def test_metrics_parse_and_their_counters_move_as_ops_run() -> None:
    async with open_test_cluster(3, token=TOKEN, config=CONFIG, status="127.0.0.1:0") as (master, comms, _):
        before = samples((await get(master, "/metrics")).decode())
        assert before[("pccl_master_world_size", (("group", "0"),))] == 3
        assert before[("pccl_master_peers", (("state", "accepted"),))] == 3
        assert before[("pccl_master_joins_total", ())] == 3
        completed = before[("pccl_master_ops_completed_total", ())]
        for _ in range(4):
            await all_reduce_everywhere(comms)
        after = samples((await get(master, "/metrics")).decode())
        assert after[("pccl_master_ops_completed_total", ())] == completed + 4
        assert after[("pccl_master_ops_aborted_total", ())] == 0
        assert after[("pccl_master_uptime_seconds", ())] > 0
        # Payload bytes reach the master with the peers' next heartbeats (every 0.1 s here).
        tx = ("pccl_master_reported_payload_bytes_total", (("direction", "tx"),))
        with trio.fail_after(10):
            while samples((await get(master, "/metrics")).decode())[tx] < 4 * 4096 * 4 * 3 * 2 / 3:
                await trio.sleep(0.05)


async def test_status_json_shows_each_peers_revision_and_sync_bytes_from_its_heartbeats() -> None:
    async with open_test_cluster(3, token=TOKEN, config=CONFIG, status="127.0.0.1:0") as (master, comms, _):
        # peer 0 holds revision 7 and the popular content; the others download it
        states = [pccl.SharedState({"w": np.full(10_000, 1.0 if i == 0 else 100.0 + i, np.float32)},
                                   revision=7 if i == 0 else 0) for i in range(3)]
        async with trio.open_nursery() as nursery:
            for comm, state in zip(comms, states):
                nursery.start_soon(comm.sync_shared_state, state)
        ids = {f"{comm.peer_id:016x}" for comm in comms}
        with trio.fail_after(10):
            while True:
                status = json.loads(await get(master, "/status.json"))
                peers = status["groups"][0]["peers"]
                if all(p["revision"] == 7 for p in peers):
                    break
                await trio.sleep(0.05)
        assert status["schema"] == 1
        assert {p["peer_id"] for p in peers} == ids
        assert sorted(p["ring_position"] for p in peers) == [0, 1, 2]
        assert sum(p["last_sync"]["rx_bytes"] for p in peers) == 2 * 40_000
        assert sum(p["last_sync"]["tx_bytes"] for p in peers) == 2 * 40_000
        group = status["groups"][0]
        assert (group["last_sync"]["revision"], group["last_sync"]["bytes"]) == (7, 2 * 40_000)
        assert group["last_transfer"] == group["last_sync"]
        # a second sync moves nothing: the last sync says so, the last transfer is still the first
        async with trio.open_nursery() as nursery:
            for comm, state in zip(comms, states):
                nursery.start_soon(comm.sync_shared_state, state)
        group = json.loads(await get(master, "/status.json"))["groups"][0]
        assert (group["last_sync"]["revision"], group["last_sync"]["bytes"]) == (7, 0)
        assert (group["last_transfer"]["revision"], group["last_transfer"]["bytes"]) == (7, 2 * 40_000)
        assert [e["kind"] for e in status["events"]].count("accept") == 3
        assert status["counters"]["syncs_completed"] == 1  # (read before the second sync)
        assert all(comm.statistics().last_sync_revision == 7 for comm in comms)


async def test_with_a_token_every_path_refuses_requests_without_it() -> None:
    async with open_test_cluster(2, token=TOKEN, config=CONFIG, status="127.0.0.1:0") as (master, _, _):
        base = f"http://{master.status_address}"
        basic = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
        for path in ("/", "/status.json", "/metrics"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                            {"Authorization": "Basic " + base64.b64encode(b"anyone:wrong").decode()},
                            {"Authorization": "Basic !!!"}, {"Authorization": TOKEN}):
                code, head, body = await trio.to_thread.run_sync(_get, base + path, headers)
                assert code == 401, (path, headers, code)
                assert "peer" not in body.decode()  # nothing of the run leaks
                assert head.get("www-authenticate", "").startswith("Basic")
            for headers in ({"Authorization": f"Bearer {TOKEN}"}, {"Authorization": basic}):
                code, _, body = await trio.to_thread.run_sync(_get, base + path, headers)
                assert code == 200, (path, headers, code)


async def test_without_a_token_the_page_is_open_and_defaults_to_loopback() -> None:
    async with pccl.open_master("127.0.0.1:0", config=CONFIG, status="0") as master:
        assert master.status_address is not None and master.status_address.startswith("127.0.0.1:")
        page = (await get(master, "/", token=None)).decode()
        assert '<meta http-equiv="refresh"' in page and "<script" not in page
        code, _, _ = await trio.to_thread.run_sync(_get, f"http://{master.status_address}/nope", {})
        assert code == 404


async def test_a_status_address_in_use_is_a_pccl_error() -> None:
    async with pccl.open_master("127.0.0.1:0", config=CONFIG, status="127.0.0.1:0") as master:
        with pytest.raises(pccl.errors.AddressInUse, match="status address"):
            async with pccl.open_master("127.0.0.1:0", config=CONFIG, status=master.status_address):
                pass


def _pccl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pccl", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


async def test_pccl_status_prints_the_table_and_says_when_the_token_is_missing() -> None:
    async with open_test_cluster(3, token=TOKEN, config=CONFIG, status="127.0.0.1:0") as (master, comms, _):
        await all_reduce_everywhere(comms)
        address = master.status_address
        assert address is not None
        ok = await trio.to_thread.run_sync(lambda: _pccl("status", address, env={"PCCL_TOKEN": TOKEN}))
        assert ok.returncode == 0, ok.stderr
        lines = ok.stdout.splitlines()
        assert lines[0].startswith(f"pccl master {master.address}") and "ops 1 completed" in lines[0]
        assert "group 0: world size 3" in ok.stdout
        for comm in comms:
            short = f"{comm.peer_id:016x}"[:6]
            row = next(line for line in lines if line.startswith(short))
            assert "accepted" in row
        as_json: dict[str, Any] = json.loads(
            (await trio.to_thread.run_sync(lambda: _pccl("status", address, "--json", "--token", TOKEN))).stdout)
        assert as_json["groups"][0]["world_size"] == 3
        refused = await trio.to_thread.run_sync(lambda: _pccl("status", address, env={"PCCL_TOKEN": ""}))
        assert refused.returncode == 1 and "needs the run's token" in refused.stderr
        assert "Traceback" not in refused.stderr
    gone = await trio.to_thread.run_sync(lambda: _pccl("status", address))
    assert gone.returncode == 1 and "nothing listens on" in gone.stderr and "Traceback" not in gone.stderr


async def test_the_page_answers_while_a_vote_waits_and_shows_who_waits() -> None:
    async with open_test_cluster(2, token=TOKEN, config=CONFIG, status="127.0.0.1:0") as (master, comms, _):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(comms[0].update_topology)  # waits for the other peer's vote
            with trio.fail_after(10):
                while True:
                    status = json.loads(await get(master, "/status.json"))
                    if status["votes_in_progress"]["topology"] == 1:
                        break
                    await trio.sleep(0.02)
            doing = {p["peer_id"]: p["activity"] for p in status["groups"][0]["peers"]}
            assert doing == {f"{comms[0].peer_id:016x}": "topology vote", f"{comms[1].peer_id:016x}": "idle"}
            assert b"topology vote" in await get(master, "/")
            await comms[1].update_topology()


async def test_peers_registering_again_after_a_master_restart_show_as_rejoins() -> None:
    config = Config(peer_timeout=10.0, heartbeat_interval=0.1, master_reconnect_timeout=30.0,
                    master_reconnect_backoff=(0.05, 0.2))
    comms: list[pccl.Communicator] = []
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=config) as first:
            address = first.address

            async def peer() -> None:
                async with pccl.open_communicator(address, token=TOKEN, config=config) as comm:
                    comms.append(comm)
                    await done.wait()

            nursery.start_soon(peer)
            with trio.fail_after(20):
                while not comms:
                    await trio.sleep(0.01)
        # the first master is gone (listener closed); the peer keeps trying to reconnect
        async with pccl.open_master(address, token=TOKEN, config=config, status="127.0.0.1:0") as second:
            with trio.fail_after(20):
                while not (events := json.loads(await get(second, "/status.json"))["events"]):
                    await trio.sleep(0.05)
            assert events[-1]["kind"] == "rejoin" and events[-1]["peer_id"] == f"{comms[0].peer_id:016x}"
            assert "after a master restart" in events[-1]["detail"]
            done.set()
