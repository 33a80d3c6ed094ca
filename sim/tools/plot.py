"""A PNG timeline of one simulated pccl run: membership and faults (``pccl-sim plot``).

Top panel: one lane per host.  A thin grey bar while the process runs, a thick bar while the
peer is accepted (coloured by its ``world_size``), small ticks at each step, crosses where it
left (kicked / lost the master), and the faults that hit it: red ``x`` kill, black square
power-off, orange span stall, purple span partition/clog, green triangle join.  Bottom panel:
``world_size`` reported by each peer over time, the number of live peers (dashed), the master's
accepted count from the monitor's probes (dotted); the quiet window (faults stopped) is shaded
and failures are marked.

matplotlib is the optional ``plot`` extra (``pip install 'pccl-trio[plot]'``);
:class:`MatplotlibMissing` says so when it is absent.
"""

from __future__ import annotations

import pathlib
from typing import Any

from ..engine.trace import Trace
from ..engine.schedule import Schedule

__all__ = ["plot_trace", "MatplotlibMissing"]


class MatplotlibMissing(RuntimeError):
    """matplotlib is not installed."""


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MatplotlibMissing(
            "matplotlib is not installed; install the plot extra: pip install 'pccl-trio[plot]' "
            "(or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _lanes(trace: Trace) -> list[str]:
    hosts: list[str] = []
    for event in trace:
        if event.kind == "start" and event.source not in hosts:
            hosts.append(event.source)
    return sorted(hosts, key=lambda h: (h != "master", len(h), h))


def plot_trace(trace: Trace, schedule: Schedule, out: str | pathlib.Path) -> pathlib.Path:
    """Draw ``trace`` (a run of ``schedule``) to the PNG ``out``; return its path."""
    plt = _matplotlib()
    end = trace.stats.get("virtual_seconds") or (trace.events[-1].t if trace.events else schedule.horizon)
    hosts = _lanes(trace)
    lane = {h: i for i, h in enumerate(hosts)}
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(13, 2.2 + 0.42 * len(hosts) + 3.2), sharex=True,
        gridspec_kw={"height_ratios": [max(len(hosts), 2) * 0.42 + 0.6, 3.0]},
    )
    max_ws = max([e.data.get("world_size", 1) for e in trace if "world_size" in e.data] + [2])
    # world_size is an integer: one colour per value, bins centred on the integers.
    cmap = plt.get_cmap("viridis", max_ws)
    norm = plt.matplotlib.colors.BoundaryNorm([k + 0.5 for k in range(max_ws + 1)], max_ws)

    alive_since: dict[str, float] = {}
    accepted_since: dict[str, tuple[float, int]] = {}
    series: dict[str, list[tuple[float, int]]] = {}
    live_count: list[tuple[float, int]] = [(0.0, 0)]
    live: set[str] = set()
    probes: list[tuple[float, int]] = []
    shutting_down = False

    def close_accepted(host: str, t: float, *, left: bool = True) -> None:
        if host in accepted_since:
            t0, ws = accepted_since.pop(host)
            top.plot([t0, t], [lane[host]] * 2, color=cmap(norm(ws)), linewidth=7, solid_capstyle="butt")
            if left:  # not accepted any more: its world_size line drops to 0
                series.setdefault(host, []).append((t, 0))

    def set_ws(host: str, t: float, ws: int) -> None:
        current = accepted_since.get(host)
        if current is None or current[1] != ws:
            close_accepted(host, t, left=False)
            accepted_since[host] = (t, ws)
        series.setdefault(host, []).append((t, ws))

    def died(host: str, t: float, *, at_end: bool = False) -> None:
        close_accepted(host, t, left=not at_end)
        if host in alive_since:
            top.plot([alive_since.pop(host), t], [lane[host]] * 2, color="0.75", linewidth=2, zorder=0)
        if host.startswith("peer") and host in live and not at_end:
            live.discard(host)
            live_count.append((t, len(live)))

    for event in trace:
        src, kind, t, data = event.source, event.kind, event.t, event.data
        if kind == "start" and src in lane:
            alive_since[src] = t
            if src.startswith("peer"):
                live.add(src)
                live_count.append((t, len(live)))
        elif src == "runner" and kind == "end":
            shutting_down = True
        elif src == "net" and kind in ("kill", "power_off", "exit") and data.get("host") in lane:
            died(data["host"], t, at_end=kind == "exit" and shutting_down)  # shutdown is no death
        elif kind in ("accepted", "topology", "step") and src in lane:
            set_ws(src, t, int(data["world_size"]))
            if kind == "step":
                top.plot([t], [lane[src] + 0.22], marker="|", color="0.35", markersize=4)
        elif kind == "alone" and src in lane:
            set_ws(src, t, 1)
        elif kind == "left" and src in lane:
            close_accepted(src, t)
            top.plot([t], [lane[src]], marker="o", markerfacecolor="none", color="crimson", markersize=8)
        elif kind == "probe" and data.get("master"):
            probes.append((t, int(data["accepted"])))
        elif kind == "fault" and src == "faults":
            _draw_fault(top, lane, data["event"], t)
    survivors = list(alive_since)
    for host in survivors:
        died(host, end, at_end=True)
    for host in survivors:
        if series.get(host):
            series[host].append((end, series[host][-1][1]))

    scale = plt.cm.ScalarMappable(cmap=cmap, norm=norm)
    fig.colorbar(scale, ax=[top, bottom], label="world_size", pad=0.01, fraction=0.03, ticks=range(1, max_ws + 1))
    top.set_yticks(range(len(hosts)), hosts)
    top.set_ylim(-0.8, len(hosts) - 0.2)
    top.invert_yaxis()
    for ax in (top, bottom):
        ax.axvspan(schedule.duration, end, color="#dff0d8", zorder=-1)
        for failure in trace.failures:
            ax.axvline(failure.t, color="red", linewidth=1.5, linestyle="-")
    verdict = "PASS" if trace.ok else "FAIL: " + "; ".join(f"{f.kind} at t={f.t:.1f}" for f in trace.failures[:3])
    top.set_title(
        f"pccl-sim seed {schedule.seed} ({schedule.profile}, {len(schedule.events)} faults) - {verdict}\n"
        "bars: accepted (colour = world_size), ticks: steps, o: left (kicked / lost master), x: kill, square: power-off, "
        "spans: stall (orange) / partition (purple), triangle: join; green: quiet window",
        fontsize=9,
    )

    for host, points in sorted(series.items()):
        xs, ys = [], []
        for t, ws in points:
            xs.append(t)
            ys.append(ws)
        bottom.step(xs, ys, where="post", linewidth=1, alpha=0.7)
    live_count.append((end, len(live)))
    bottom.step([t for t, _ in live_count], [n for _, n in live_count], where="post", color="black",
                linestyle="--", linewidth=1.5, label="live peers")
    if probes:
        bottom.step([t for t, _ in probes], [n for _, n in probes], where="post", color="tab:red", linestyle=":",
                    linewidth=1.5, label="accepted (master)")
    bottom.set_ylabel("world_size per peer")
    bottom.yaxis.set_major_locator(plt.matplotlib.ticker.MaxNLocator(integer=True))
    bottom.set_xlabel("virtual time (s)")
    bottom.set_xlim(0, end)
    bottom.legend(loc="upper right", fontsize=8)
    path = pathlib.Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_fault(ax: Any, lane: dict[str, int], event: dict[str, Any], t: float) -> None:
    kind = event["kind"]
    host = event.get("host") or ("master" if kind == "master_restart" else None)
    duration = float(event.get("duration", 0.0))
    if kind in ("kill", "restart", "master_restart") and host in lane:
        ax.plot([t], [lane[host]], marker="x", color="red", markersize=9, markeredgewidth=2)
    elif kind == "power_off" and host in lane:
        ax.plot([t], [lane[host]], marker="s", color="black", markersize=7)
    elif kind == "spawn" and host in lane:
        ax.plot([t], [lane[host]], marker="^", color="green", markersize=7)
    elif kind == "stall" and host in lane:
        ax.plot([t, t + duration], [lane[host] - 0.3] * 2, color="orange", linewidth=3)
    elif kind in ("partition", "clog"):
        for h in event.get("side") or [host]:
            if h in lane:
                ax.plot([t, t + duration], [lane[h] - 0.3] * 2, color="purple", linewidth=3)
