"""Renderings of one status snapshot (:mod:`pccl.protocol.status`): the HTML page the master
serves at ``/`` and the terminal table of ``pccl status``.  Pure functions of the dict: what the
page shows is exactly what ``/status.json`` says.

The page reloads itself with ``<meta http-equiv="refresh">`` (no JavaScript); each group's ring
is an inline SVG drawing.
"""

from __future__ import annotations

import html
import math
from typing import Any

__all__ = ["render_html", "render_table", "format_bytes", "format_age"]


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def format_age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _or_dash(value: object) -> object:
    return "-" if value is None else value


# --- HTML ----------------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.92em; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.meta { color: #555; } .stale { color: #b35900; } .kick, .lost, .abort { color: #b00020; }
.accept, .join, .rejoin { color: #1b6e20; } code { font-size: 0.95em; }
.group { display: flex; gap: 2em; flex-wrap: wrap; align-items: flex-start; }
"""


def _ring_svg(group: dict[str, Any]) -> str:
    ring: list[str] = group["ring"]
    names = {p["peer_id"]: p["short_id"] for p in group["peers"]}
    size, radius = 260, 90
    cx = cy = size / 2
    if not ring:
        return (f'<svg class="ring" width="{size}" height="60" role="img" aria-label="no ring yet">'
                '<text x="10" y="30">no ring yet</text></svg>')
    points = {}
    for i, pid in enumerate(ring):
        angle = -math.pi / 2 + 2 * math.pi * i / len(ring)
        points[pid] = (cx + radius * math.cos(angle), cy + radius * math.sin(angle))
    parts = [f'<svg class="ring" width="{size}" height="{size}" viewBox="0 0 {size} {size}" role="img" '
             f'aria-label="ring of group {group["group"]}">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" markerHeight="6" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>']
    for edge in group["edges"]:
        (x1, y1), (x2, y2) = points[edge["from"]], points[edge["to"]]
        dx, dy = x2 - x1, y2 - y1
        length = math.hypot(dx, dy) or 1.0
        shrink = 20 / length  # stop the arrow at the node's circle
        parts.append(f'<line x1="{x1 + dx * shrink:.1f}" y1="{y1 + dy * shrink:.1f}" x2="{x2 - dx * shrink:.1f}" '
                     f'y2="{y2 - dy * shrink:.1f}" stroke="#555" stroke-width="1.5" marker-end="url(#arrow)"/>')
        if edge["bandwidth_bps"] is not None:
            parts.append(f'<text x="{(x1 + x2) / 2:.1f}" y="{(y1 + y2) / 2:.1f}" font-size="10" fill="#333">'
                         f'{_e(format_bytes(int(edge["bandwidth_bps"] / 8)))}/s</text>')
    for i, pid in enumerate(ring):
        x, y = points[pid]
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="18" fill="#e8f0fe" stroke="#3366cc"/>'
                     f'<text x="{x:.1f}" y="{y + 4:.1f}" font-size="10" text-anchor="middle">'
                     f'{_e(names.get(pid, pid[:6]))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _reach(peer: dict[str, Any]) -> str:
    """Whether other peers reach it directly: "yes", "no" (dialled back or relayed), "?"."""
    return {True: "yes", False: "no", None: "?"}[peer["reachable"]]


def _path_text(path: dict[str, Any], names: dict[str, str]) -> str:
    to = names.get(path["to"], path["to"][:6])
    return f"{path['port']}\u2192{to} {path['path']}" + (f" ({path['via']})" if path["via"] else "")


def _peer_rows(peers: list[dict[str, Any]], names: dict[str, str] | None = None) -> str:
    rows = []
    names = names or {}
    for p in peers:
        sync = p["last_sync"]
        paths = "<br>".join(_e(_path_text(x, names)) for x in p["paths"]) or "-"
        rows.append(
            f'<tr class="peer" data-peer="{_e(p["peer_id"])}"><td><code title="{_e(p["peer_id"])}">'
            f'{_e(p["short_id"])}</code></td><td>{_e(p["address"])}</td><td>{_e(p["state"])}</td>'
            f'<td>{_e(p["activity"])}</td><td class="num revision">{_e(_or_dash(p["revision"]))}</td>'
            f'<td class="num">{_e(format_age(p["heartbeat_age_s"]))}</td>'
            f'<td class="num">{_e(_or_dash(p["ring_position"]))}</td>'
            f'<td class="num">{_e(format_bytes(sync["rx_bytes"]) if sync else "-")}</td>'
            f'<td class="num">{_e(format_bytes(sync["tx_bytes"]) if sync else "-")}</td>'
            f'<td class="num">{_e(format_bytes(p["tx_bytes"]))} / {_e(format_bytes(p["rx_bytes"]))}</td>'
            f'<td class="reach">{_e(_reach(p))}</td><td>{_e(", ".join(p["advertised"]) or "-")}</td>'
            f'<td class="paths">{paths}</td></tr>')
    return "".join(rows)


_PEER_HEADER = ("<tr><th>peer</th><th>address</th><th>state</th><th>doing</th><th>revision</th>"
                "<th>last heartbeat</th><th>ring position</th><th>last sync rx</th><th>last sync tx</th>"
                "<th>payload tx / rx</th><th>reachable</th><th>advertised</th><th>paths</th></tr>")


def _group_html(group: dict[str, Any]) -> str:
    stale = ' <span class="stale">(ring stale: re-wired at the next topology update)</span>' \
        if group["ring_stale"] else ""
    sync, transfer = group["last_sync"], group["last_transfer"]
    sync_text = (f'revision {sync["revision"]}, {format_bytes(sync["bytes"])} moved, '
                 f'{format_age(sync["age_s"])} ago' if sync else "none yet")
    if transfer and transfer is not sync and transfer != sync:
        sync_text += (f'; last transfer: revision {transfer["revision"]}, {format_bytes(transfer["bytes"])}, '
                      f'{format_age(transfer["age_s"])} ago')
    if group["sync_running"]:
        sync_text += "; a sync is running"
    ops = group["collectives"]
    op_rows = "".join(
        f'<tr><td class="num">{op["tag"]}</td><td class="num">{_e(_or_dash(op["seq"]))}</td><td>{op["state"]}</td>'
        f'<td class="num">{op["voters"]}</td><td class="num">{op["done"]}/{op["participants"]}</td></tr>'
        for op in ops)
    ops_html = (f'<table class="collectives"><tr><th>tag</th><th>seq</th><th>state</th><th>voters</th>'
                f'<th>done</th></tr>{op_rows}</table>' if ops else "<p>no collective in flight</p>")
    pending = group["pending"]
    names = {p["peer_id"]: p["short_id"] for p in group["peers"] + pending}
    pending_html = (f'<h3>pending ({len(pending)})</h3><table class="pending">{_PEER_HEADER}'
                    f'{_peer_rows(pending, names)}</table>' if pending else "<p>no peer pending</p>")
    return (f'<section class="group" id="group-{group["group"]}"><div>'
            f'<h2>group {group["group"]}: world size {group["world_size"]}{stale}</h2>'
            f'<table class="peers">{_PEER_HEADER}{_peer_rows(group["peers"], names)}</table>{pending_html}'
            f'<p>last sync: {_e(sync_text)}</p><h3>collectives in flight</h3>{ops_html}</div>'
            f'<div>{_ring_svg(group)}</div></section>')


def _relays_html(status: dict[str, Any]) -> str:
    relays = status.get("relays", [])
    counts = status.get("paths", {})
    summary = ", ".join(f"{kind} {n}" for kind, n in counts.items())
    if not relays:
        return f'<h2>relays</h2><p class="relays">none (paths: {_e(summary or "none")})</p>'
    rows = "".join(
        f'<tr><td class="num">{r["relay_id"]}</td><td>{_e(r["address"] or "this master")}</td>'
        f'<td class="num">{r["pairs"]}</td><td class="num">{r["waiting"]}</td>'
        f'<td class="num">{r["pairs_assigned"]}</td><td class="num">{_e(format_bytes(r["forwarded_bytes"]))}</td></tr>'
        for r in relays)
    return (f'<h2>relays</h2><p class="meta">paths: {_e(summary)}</p><table class="relays"><tr><th>relay</th>'
            f'<th>address</th><th>pairs</th><th>waiting</th><th>assigned</th><th>forwarded</th></tr>{rows}</table>')


def render_html(status: dict[str, Any], *, refresh: float = 2.0) -> str:
    """The status page for one snapshot; it asks the browser to reload after ``refresh`` s."""
    master = status["master"]
    counters = status["counters"]
    removals = ", ".join(f"{k} {v}" for k, v in counters["removals"].items()) or "none"
    votes = status["votes_in_progress"]
    groups = "".join(_group_html(g) for g in status["groups"]) or "<p>no peer has registered yet</p>"
    events = "".join(
        f'<tr class="event {_e(e["kind"])}"><td class="num">{_e(format_age(e["age_s"]))} ago</td>'
        f'<td>{_e(e["kind"])}</td><td><code>{_e(e["peer_id"][:6] if e["peer_id"] else "-")}</code></td>'
        f'<td class="num">{_e(_or_dash(e["group"]))}</td><td>{_e(e["detail"])}</td></tr>'
        for e in status["events"])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{refresh:g}">
<title>pccl master {_e(master["address"])}</title><style>{_STYLE}</style></head>
<body>
<h1>pccl master {_e(master["address"])}</h1>
<p class="meta">up {_e(format_age(master["uptime_s"]))} · instance <code>{_e(master["instance"])}</code> ·
token {"required" if master["token_required"] else "none"} · TLS {"on" if master["tls"] else "off"} ·
{status["connections"]["total"]} connections ({status["connections"]["unregistered"]} not registered) ·
schema {status["schema"]} (<a href="status.json">status.json</a>, <a href="metrics">metrics</a>)</p>
<p class="meta">collectives completed {counters["ops_completed"]}, aborted {counters["ops_aborted"]} ·
syncs {counters["syncs_completed"]} · joins {counters["joins"]} · removals: {_e(removals)} ·
votes in progress: topology {votes["topology"]}, collective {votes["collective"]}, sync {votes["sync"]},
rounds {votes["rounds"]}</p>
{groups}
{_relays_html(status)}
<h2>recent events</h2>
<table class="events"><tr><th>when</th><th>what</th><th>peer</th><th>group</th><th>detail</th></tr>{events}</table>
</body></html>
"""


# --- terminal -----------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return out


def render_table(status: dict[str, Any], *, events: int = 10) -> str:
    """``pccl status``'s text: a summary line, a table per group and the latest ``events``."""
    master = status["master"]
    c = status["counters"]
    lines = [f"pccl master {master['address']}  up {format_age(master['uptime_s'])}  "
             f"ops {c['ops_completed']} completed / {c['ops_aborted']} aborted  syncs {c['syncs_completed']}  "
             f"joins {c['joins']}"]
    if not status["groups"]:
        lines.append("no peer has registered yet")
    for g in status["groups"]:
        sync = g["last_sync"]
        lines += ["", f"group {g['group']}: world size {g['world_size']}"
                      f"{' (ring stale)' if g['ring_stale'] else ''}, revision {_or_dash(g['revision'])}, "
                      f"last sync {format_bytes(sync['bytes']) + ' moved' if sync else 'none'}, "
                      f"{len(g['collectives'])} collective(s) in flight"]
        names = {p["peer_id"]: p["short_id"] for p in g["peers"] + g["pending"]}
        rows = [[p["short_id"], p["address"], p["state"], p["activity"], str(_or_dash(p["revision"])),
                 format_age(p["heartbeat_age_s"]), str(_or_dash(p["ring_position"])), _reach(p),
                 ",".join(p["advertised"]) or "-", "; ".join(_path_text(x, names) for x in p["paths"]) or "-"]
                for p in g["peers"] + g["pending"]]
        lines += _table(["PEER", "ADDRESS", "STATE", "DOING", "REVISION", "HEARTBEAT", "RING", "REACHABLE",
                         "ADVERTISED", "PATHS"], rows)
    relays = status.get("relays", [])
    if relays:
        lines += ["", "relays:"]
        lines += _table(["RELAY", "ADDRESS", "PAIRS", "WAITING", "FORWARDED"],
                        [[str(r["relay_id"]), r["address"] or "this master", str(r["pairs"]), str(r["waiting"]),
                          format_bytes(r["forwarded_bytes"])] for r in relays])
    if status["events"]:
        lines += ["", "recent events:"]
        lines += _table(["AGO", "WHAT", "PEER", "GROUP", "DETAIL"],
                        [[format_age(e["age_s"]), e["kind"], (e["peer_id"] or "-")[:6], str(_or_dash(e["group"])),
                          e["detail"]] for e in status["events"][:events]])
    return "\n".join(lines) + "\n"
