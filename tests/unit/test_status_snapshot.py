"""The status snapshot (pure, over the sans-IO master) and its two renderings: what the JSON says
about peers, rings, votes and events, and that the page and the table show it — escaped, since
event details and addresses can carry text a peer chose."""

from __future__ import annotations

import json
import random

from pccl.protocol import messages as m
from pccl.protocol import status as st
from pccl.protocol.master.machine import MasterState, MessageReceived, PeerConnected
from pccl.master.status_page import render_html, render_table


def _machine_with_two_accepted_and_one_pending() -> tuple[MasterState, dict[int, int]]:
    ms = MasterState(rng=random.Random(3), peer_timeout=10.0)
    ids: dict[int, int] = {}
    now = 1.0
    for conn in (1, 2):
        ms.handle(PeerConnected(conn, "10.0.0.%d" % conn), now)
        out = ms.handle(MessageReceived(conn, m.Register(0, 4000 + conn, 5000 + conn)), now)
        ids[conn] = next(e.msg.peer_id for e in out if isinstance(getattr(e, "msg", None), m.Welcome))
        if conn == 1:  # the first peer is accepted alone at once: report its p2p round
            round_id = next(e.msg.round for e in out if isinstance(getattr(e, "msg", None), m.ConnectToPeers))
            ms.handle(MessageReceived(1, m.P2PReport(round_id, True)), now)
    out = ms.handle(MessageReceived(1, m.VoteTopology()), now)
    round_id = next(e.msg.round for e in out if isinstance(getattr(e, "msg", None), m.ConnectToPeers))
    for conn in (1, 2):
        ms.handle(MessageReceived(conn, m.P2PReport(round_id, True)), now)
    ms.handle(PeerConnected(3, "<b>evil</b>"), now)
    out = ms.handle(MessageReceived(3, m.Register(0, 4003, 5003)), now)
    ids[3] = next(e.msg.peer_id for e in out if isinstance(getattr(e, "msg", None), m.Welcome))
    ms.handle(MessageReceived(1, m.CollectiveInit(tag=5, count=10, dtype=1, op=0)), 2.0)
    return ms, ids


def test_snapshot_describes_peers_ring_votes_and_events() -> None:
    ms, ids = _machine_with_two_accepted_and_one_pending()
    reports = {1: st.PeerReport(True, 42, 0, 4096, 1000, 5000), 2: st.PeerReport(False, 0, 0, 0, 10, 20)}
    events = [st.StatusEvent(3.0, "kick", 0xABCDEF0123456789, 0, "TIMEOUT: silent for 10 s"),
              st.StatusEvent(2.0, "join", ids[3], 0, "registered")]
    counters = st.RunCounters(ops_completed=7, removals={"TIMEOUT": 1})
    syncs = {0: (st.SyncRecord(9, 0, 3.5), st.SyncRecord(8, 4096, 2.0))}
    snap = st.snapshot(ms, now=4.0, started_at=0.5, address="0.0.0.0:48148", reports=reports, events=events,
                       counters=counters, syncs=syncs, token_required=True)
    assert json.loads(json.dumps(snap)) == snap  # JSON-ready as it is
    assert snap["schema"] == st.SCHEMA == 1
    assert snap["master"]["uptime_s"] == 3.5 and snap["master"]["token_required"]
    (group,) = snap["groups"]
    ring = [f"{pid:016x}" for pid in ms.rings()[0]]
    assert group["ring"] == ring and group["world_size"] == 2
    assert [p["peer_id"] for p in group["peers"]] == ring  # in ring order
    assert [p["ring_position"] for p in group["peers"]] == [0, 1]
    by_id = {p["peer_id"]: p for p in group["peers"]}
    first = by_id[f"{ids[1]:016x}"]
    assert first["revision"] == 42 and first["last_sync"] == {"revision": 42, "tx_bytes": 0, "rx_bytes": 4096}
    assert first["activity"] == "collective" and first["address"] == "10.0.0.1:4001"
    assert first["heartbeat_age_s"] == 2.0
    second = by_id[f"{ids[2]:016x}"]
    assert second["revision"] is None and second["last_sync"] is None and second["rx_bytes"] == 20
    (pending,) = group["pending"]
    assert pending["state"] == "registered" and pending["ring_position"] is None
    assert group["collectives"] == [{"tag": 5, "seq": None, "state": "voting", "voters": 1, "participants": 0,
                                     "done": 0}]
    assert group["last_sync"] == {"revision": 9, "bytes": 0, "age_s": 0.5}
    assert group["last_transfer"] == {"revision": 8, "bytes": 4096, "age_s": 2.0}
    assert not group["sync_running"]
    assert len(group["edges"]) == 2 and group["edges"][0]["bandwidth_bps"] is None
    assert snap["votes_in_progress"]["collective"] == 1
    assert [e["kind"] for e in snap["events"]] == ["kick", "join"] and snap["events"][0]["age_s"] == 1.0
    assert snap["counters"]["ops_completed"] == 7 and snap["counters"]["removals"] == {"TIMEOUT": 1}


def test_page_and_table_render_the_snapshot_and_escape_what_peers_chose() -> None:
    ms, ids = _machine_with_two_accepted_and_one_pending()
    events = [st.StatusEvent(3.0, "kick", ids[3], 0, "PROTOCOL_ERROR: <script>alert(1)</script>")]
    snap = st.snapshot(ms, now=4.0, started_at=0.0, address="127.0.0.1:1", reports={}, events=events,
                       counters=st.RunCounters())
    page = render_html(snap, refresh=3)
    assert '<meta http-equiv="refresh" content="3">' in page
    assert "<script" not in page and "&lt;script&gt;" in page
    assert "<b>evil</b>" not in page and "&lt;b&gt;evil&lt;/b&gt;" in page
    assert page.count('<tr class="peer"') == 3  # two accepted, one pending
    assert "<svg" in page and page.count("<circle") == 2
    table = render_table(snap)
    for pid in ids.values():
        assert f"{pid:016x}"[:6] in table
    assert "group 0: world size 2" in table and "PROTOCOL_ERROR" in table
