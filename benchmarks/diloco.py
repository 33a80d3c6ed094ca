"""DiLoCo figures a user can believe: convergence under churn, and communication hidden by async.

    .venv/bin/python benchmarks/diloco.py churn [--outer-steps 30 --kill-every 4 --out diloco-churn.png]
    .venv/bin/python benchmarks/diloco.py bandwidth [--rate 200mbit --outer-steps 8]   # as root
    .venv/bin/python benchmarks/diloco.py streaming [--outer-steps 20 --inner-steps 30 --fragments 3]   # as root

``churn`` runs ``examples/diloco.py`` three ways on this host and plots the evaluation loss
against the outer step (PNG, kills and joins marked):

* three peers (a master and three processes) without faults;
* three peers, one of them SIGKILLed ``--kill-every`` outer steps after the last newcomer joined
  (wherever in its step that lands) and a fresh process started in its place, which joins and
  downloads the state;
* one process alone (``--solo``), the same number of inner steps per outer step.

It prints the final evaluation loss of each and the churn run's relative to the fault-free one.

``bandwidth`` puts two peers in network namespaces joined by a veth pair whose both ends are
shaped with ``tc ... tbf`` (``--rate``, for example 200mbit), runs a model big enough that its
pseudo-gradients take a good part of a second on that link, and reports the median wall time
per outer step (measured by this driver from the peers' reports, so the syncs and votes are
counted) of: compute only (each peer ``--solo``, in its namespace, at the same time), sync
DiLoCo (``diloco.py``: compute, then the all-reduce) and async DiLoCo (``async_diloco.py``: the
all-reduce overlaps the next inner steps).  Needs root (``ip netns``); the namespaces are
removed afterwards.  Traffic goes only between the namespaces this command creates.

``streaming`` compares Streaming DiLoCo (``streaming_diloco.py``: ``--fragments`` F fragments,
each all-reduced every ``--inner-steps`` H inner steps at offset f*H/F, overlapping ``--overlap``
inner steps, low-bit on the wire: ``--quant``) with plain DiLoCo at float32 (``diloco.py --quant
none``) at the same inner steps, ``--peers`` peers each on this host: the final evaluation loss
of each and their ratio, and the bytes one peer's all-reduces sent per outer step (the peak:
the largest outer step's; and per H inner steps, the average).  Then, unless ``--no-link``, the
``bandwidth`` comparison with the same H on the tbf-shaped link between two namespaces, for sync
DiLoCo, async DiLoCo and Streaming DiLoCo (needs root).

This is a measurement tool: it uses wall-clock time, processes and signals freely.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from netns_link import tbf_namespaces

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
_STEP = re.compile(r"outer step (\d+): world (\d+), .*inner steps ([0-9.]+) s")
#: Streaming DiLoCo evaluates once per H inner steps, not every outer step.
_EVAL = re.compile(r"eval loss ([0-9.]+)")
_SENT = re.compile(r"sent (\d+) B")


@dataclasses.dataclass
class _Peer:
    name: str
    popen: subprocess.Popen[str]
    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    step: int = 0

    def read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            found = _STEP.match(line)
            if found:
                self.step = int(found.group(1))

    @property
    def done(self) -> bool:
        return any(line.startswith("done:") for _, line in self.lines)


@dataclasses.dataclass
class RunResult:
    label: str
    #: outer step -> evaluation loss (every peer reports the same outer weights), where evaluated
    eval_loss: dict[int, float]
    #: outer step -> the earliest time any peer reported it
    reported_at: dict[int, float]
    #: outer step -> inner-step seconds (median over the peers that reported it)
    compute: dict[int, float]
    events: list[tuple[int, str]]
    #: outer step -> bytes the all-reduce sent (median over the peers that reported it)
    sent: dict[int, float] = dataclasses.field(default_factory=dict)


def _collect(label: str, peers: list[_Peer], events: list[tuple[int, str]]) -> RunResult:
    losses: dict[int, float] = {}
    at: dict[int, float] = {}
    compute: dict[int, list[float]] = {}
    sent: dict[int, list[int]] = {}
    for peer in peers:
        for t, line in peer.lines:
            found = _STEP.match(line)
            if found:
                step = int(found.group(1))
                evaluated = _EVAL.search(line)
                if evaluated:
                    losses.setdefault(step, float(evaluated.group(1)))
                at[step] = min(at.get(step, t), t)
                compute.setdefault(step, []).append(float(found.group(3)))
                sent_bytes = _SENT.search(line)
                if sent_bytes and int(found.group(2)) > 1:
                    sent.setdefault(step, []).append(int(sent_bytes.group(1)))
    return RunResult(label, dict(sorted(losses.items())), at, {k: statistics.median(v) for k, v in compute.items()},
                     events, {k: statistics.median(v) for k, v in sent.items()})


@contextlib.contextmanager
def _master(port: int, prefix: list[str], host: str) -> Iterator[str]:
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "pccl", "--log-level", "WARNING", "master",
                             "--listen", f"{host}:{port}", "--peer-timeout", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # the master binds at once; peers retry their connection anyway
        yield f"{host}:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(name: str, cmd: list[str]) -> _Peer:
    peer = _Peer(name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    threading.Thread(target=peer.read, daemon=True).start()
    return peer


def run_peers(label: str, script: str, args: list[str], *, peers: int, outer_steps: int,
              prefixes: list[list[str]] | None = None, master_prefix: list[str] | None = None,
              host: str = "127.0.0.1", kill_every: int = 0, seed: int = 0, timeout: float = 1800) -> RunResult:
    """A master and ``peers`` processes of ``script``; with ``kill_every``, SIGKILL a random
    peer that many outer steps after the start or after the last replacement joined, and start
    a new replacement (no kill in the last two steps)."""
    from pccl.tools.bench import free_port

    prefixes = prefixes or [[] for _ in range(peers)]
    rng = random.Random(seed)
    with _master(free_port(), master_prefix or [], host) as address:
        cmd = [sys.executable, str(EXAMPLES / script), "--master", address, "--outer-steps", str(outer_steps), *args]
        live = [_start(f"peer{i}", [*prefixes[i], *cmd]) for i in range(peers)]
        everyone = list(live)
        events: list[tuple[int, str]] = []
        joining: list[_Peer] = []
        next_kill = kill_every
        deadline = time.monotonic() + timeout
        try:
            while not any(p.done for p in live):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{label}: no peer finished within {timeout:g} s")
                for p in live:
                    if p.popen.poll() is not None and not p.done:
                        tail = "\n".join(line for _, line in p.lines[-20:])
                        raise RuntimeError(f"{label}: {p.name} exited with {p.popen.returncode}:\n{tail}")
                current = max(p.step for p in live)
                for p in list(joining):  # accepted: its open_communicator returned
                    if any(line.startswith("joined:") for _, line in p.lines):
                        events.append((current, "join"))
                        joining.remove(p)
                        next_kill = current + kill_every
                if kill_every and current >= next_kill and current < outer_steps - 2 and not joining:
                    victim = rng.choice([p for p in live if p.step])
                    victim.popen.send_signal(signal.SIGKILL)
                    victim.popen.wait()
                    live.remove(victim)
                    events.append((current, "kill"))
                    newcomer = _start(f"peer{len(everyone)}", cmd)
                    live.append(newcomer)
                    everyone.append(newcomer)
                    joining.append(newcomer)
                time.sleep(0.05)
            # the others finish the same step; a newcomer still joining is stopped
            grace = time.monotonic() + 60
            while any(p.popen.poll() is None for p in live if p.step) and time.monotonic() < grace:
                time.sleep(0.05)
        finally:
            for p in everyone:
                if p.popen.poll() is None:
                    p.popen.kill()
                p.popen.wait()
    return _collect(label, everyone, events)


def _plot(results: list[RunResult], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot(list(r.eval_loss), list(r.eval_loss.values()), marker=".", label=r.label)
    marked: set[str] = set()
    for r in results:
        for step, kind in r.events:
            style = {"kill": ("tab:red", "--", "SIGKILL"), "join": ("tab:green", ":", "newcomer joins")}[kind]
            ax.axvline(step, color=style[0], linestyle=style[1], alpha=0.6,
                       label=None if style[2] in marked else style[2])
            marked.add(style[2])
    ax.set_xlabel("outer step")
    ax.set_ylabel("evaluation loss (held-out bytes)")
    ax.set_title("DiLoCo, character-level transformer: 3 peers with and without churn, 1 process")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def churn(args: argparse.Namespace) -> int:
    model = ["--inner-steps", str(args.inner_steps), "--peer-timeout", "5"]
    print(f"# DiLoCo churn: {args.outer_steps} outer steps x {args.inner_steps} inner steps, 3 peers, "
          f"kill every {args.kill_every} outer steps; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    results = [
        run_peers("3 peers", "diloco.py", model, peers=3, outer_steps=args.outer_steps),
        run_peers("3 peers, churn", "diloco.py", model, peers=3, outer_steps=args.outer_steps,
                  kill_every=args.kill_every, seed=args.seed),
    ]
    solo = _start("solo", [sys.executable, str(EXAMPLES / "diloco.py"), "--solo", "--outer-steps",
                           str(args.outer_steps), *model])
    solo.popen.wait()
    time.sleep(0.2)
    results.append(_collect("1 process", [solo], []))
    for r in results:
        final = r.eval_loss.get(args.outer_steps)
        print(f"{r.label:>16}: final eval loss {final if final is None else round(final, 4)}"
              f"  ({sum(k == 'kill' for _, k in r.events)} kills, {sum(k == 'join' for _, k in r.events)} joins"
              f" at outer steps {[s for s, _ in r.events]})")
    no_kill, with_churn = results[0].eval_loss[args.outer_steps], results[1].eval_loss[args.outer_steps]
    print(f"churn / no-kill final eval loss: {with_churn / no_kill:.4f}")
    _plot(results, args.out)
    print(f"plot: {os.path.abspath(args.out)}")
    return 0


def _per_step(r: RunResult, skip: int) -> float:
    """Median wall seconds between consecutive outer-step reports, past the first ``skip`` and
    before the last (async DiLoCo's last step only drains the all-reduce in flight)."""
    steps = sorted(r.reported_at)[:-1]
    gaps = [r.reported_at[b] - r.reported_at[a] for a, b in zip(steps, steps[1:]) if a > skip]
    return statistics.median(gaps)


def _model_bytes(width: int, layers: int) -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("diloco_example", EXAMPLES / "diloco.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.CharTransformer(width, layers, 4, 64)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _overhead(r: RunResult, skip: int) -> float:
    """Median over outer steps of wall time / the same step's inner-step time."""
    steps = sorted(r.reported_at)[:-1]
    return statistics.median((r.reported_at[b] - r.reported_at[a]) / r.compute[b]
                             for a, b in zip(steps, steps[1:]) if a > skip)


def bandwidth(args: argparse.Namespace) -> int:
    model = ["--inner-steps", str(args.inner_steps)]
    return _link(args, args.outer_steps, args.inner_steps,
                 [("diloco.py", "diloco.py", model, args.outer_steps, 1),
                  ("async_diloco.py", "async_diloco.py", model, args.outer_steps, 1)])


def _link(args: argparse.Namespace, outer_steps: int, inner_steps: int,
          runs: list[tuple[str, str, list[str], int, int]]) -> int:
    """Two peers in namespaces joined by a tbf link: compute only (``--solo``, ``outer_steps`` x
    ``inner_steps``), then each run ``(label, script, arguments, outer steps, outer steps per
    ``inner_steps``)``."""
    model = ["--width", str(args.width), "--layers", str(args.layers), "--peer-timeout", "10", "--eval-batches", "1"]
    try:
        ns = tbf_namespaces(args.rate, prefix="pccl", subnet="10.213.0")
        a, b = ns.__enter__()
    except subprocess.CalledProcessError as exc:
        print(f"cannot set up the namespaces ({exc.cmd}: {exc.stderr.strip()}); needs root", file=sys.stderr)
        return 2
    try:
        prefixes = [["ip", "netns", "exec", a], ["ip", "netns", "exec", b]]
        print(f"# two peers in namespaces joined by a {args.rate} tbf link; {outer_steps} outer steps x "
              f"{inner_steps} inner steps, width {args.width}, {args.layers} layers; "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
        solos = [_start(f"solo{i}", [*prefixes[i], sys.executable, str(EXAMPLES / "diloco.py"), "--solo",
                                     "--outer-steps", str(outer_steps), "--inner-steps", str(inner_steps),
                                     *model]) for i in range(2)]
        for s in solos:
            s.popen.wait()
        time.sleep(0.2)
        compute_only = statistics.median(_per_step(_collect(s.name, [s], []), 1) for s in solos)
        results = {}
        for label, script, extra, outer_steps, per_h in runs:
            r = run_peers(label, script, [*extra, *model], peers=2, outer_steps=outer_steps, prefixes=prefixes,
                          master_prefix=prefixes[0], host="10.213.0.1")
            skip = 2 * per_h
            results[label] = (_per_step(r, skip) * per_h, statistics.median(r.compute.values()) * per_h,
                              _overhead(r, skip), max(r.sent.values(), default=0))
            steps = sorted(r.reported_at)
            print(f"  {label}: wall s per outer step {[round(r.reported_at[b] - r.reported_at[a], 2) for a, b in zip(steps, steps[1:])]}"
                  f"; inner steps s {[round(r.compute[k], 2) for k in steps[1:]]}", flush=True)
        print(f"pseudo-gradients: {_model_bytes(args.width, args.layers) / 2**20:.1f} MiB float32; "
              f"per H = {inner_steps} inner steps")
        print(f"{'run':>22} {'wall s/H':>9} {'inner s/H':>10} {'wall/inner':>11} {'wall/compute-only':>18} "
              f"{'peak sent B':>12}")
        print(f"{'compute only':>22} {compute_only:>9.2f} {'':>10} {'':>11} {1.0:>18.3f}")
        for label, (wall, inner, ratio, peak) in results.items():
            print(f"{label.removesuffix('.py'):>22} {wall:>9.2f} {inner:>10.2f} {ratio:>11.3f} "
                  f"{wall / compute_only:>18.3f} {peak:>12.0f}")
        print("wall/inner: median over outer steps of (that step's wall time) / (the same step's inner-step "
              "time), immune to the machine's load drifting during the run")
        return 0
    finally:
        ns.__exit__(None, None, None)


def _quant_args(args: argparse.Namespace) -> list[str]:
    return ["--quant", args.quant, *(["--quant-block", str(args.quant_block)] if args.quant_block else [])]


def streaming(args: argparse.Namespace) -> int:
    f, h = args.fragments, args.inner_steps
    wire = f"{args.quant}" + (f" block {args.quant_block}" if args.quant_block else "")
    stream = ["--fragments", str(f), "--overlap", str(args.overlap), "--alpha", str(args.alpha), *_quant_args(args)]
    common = ["--inner-steps", str(h), "--peer-timeout", "5"]
    print(f"# Streaming DiLoCo ({f} fragments, overlap {args.overlap}, alpha {args.alpha}, {wire} on the wire) vs "
          f"DiLoCo f32: {args.outer_steps} x {h} inner steps, {args.peers} peers; {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    if args.no_loss:
        return _stream_link(args, stream)
    plain = run_peers("DiLoCo f32", "diloco.py", [*common, "--quant", "none"], peers=args.peers,
                      outer_steps=args.outer_steps)
    streamed = run_peers(f"streaming {wire}", "streaming_diloco.py", [*common, *stream], peers=args.peers,
                         outer_steps=args.outer_steps * f)
    print(f"{'run':>26} {'final eval loss':>16} {'peak sent B/outer step':>23} {'sent B per H inner steps':>25}")
    for r, per_h in ((plain, 1), (streamed, f)):
        sent = list(r.sent.values())
        print(f"{r.label:>26} {r.eval_loss[max(r.eval_loss)]:>16.4f} {max(sent):>23.0f} "
              f"{statistics.mean(sent) * per_h:>25.0f}")
    final = streamed.eval_loss[max(streamed.eval_loss)] / plain.eval_loss[max(plain.eval_loss)]
    print(f"streaming / DiLoCo f32 final eval loss: {final:.4f}; peak bytes: "
          f"{max(streamed.sent.values()) / max(plain.sent.values()):.4f}")
    return 0 if args.no_link else _stream_link(args, stream)


def _stream_link(args: argparse.Namespace, stream: list[str]) -> int:
    f, wire = args.fragments, f"{args.quant}" + (f" block {args.quant_block}" if args.quant_block else "")
    n, link = args.link_outer_steps, ["--inner-steps", str(args.link_inner_steps)]
    return _link(args, n, args.link_inner_steps,
                 [("diloco.py f32", "diloco.py", link, n, 1),
                  ("async_diloco.py f32", "async_diloco.py", link, n, 1),
                  (f"streaming_diloco.py {wire}", "streaming_diloco.py", [*link, *stream], n * f, f)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("churn", help="convergence with and without SIGKILLed peers, and alone (PNG plot)")
    c.add_argument("--outer-steps", type=int, default=30)
    c.add_argument("--inner-steps", type=int, default=20)
    c.add_argument("--kill-every", type=int, default=4)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", default="diloco-churn.png")
    b = sub.add_parser("bandwidth", help="sync vs async DiLoCo over a tbf-shaped link between namespaces (root)")
    b.add_argument("--rate", default="200mbit")
    b.add_argument("--outer-steps", type=int, default=10)
    b.add_argument("--inner-steps", type=int, default=10)
    b.add_argument("--width", type=int, default=256)
    b.add_argument("--layers", type=int, default=4)
    st = sub.add_parser("streaming", help="Streaming DiLoCo (low-bit) vs DiLoCo f32: loss, bytes, and on a tbf link")
    st.add_argument("--peers", type=int, default=3)
    st.add_argument("--outer-steps", type=int, default=20, help="plain DiLoCo's (streaming runs F times as many)")
    st.add_argument("--inner-steps", type=int, default=30, help="H")
    st.add_argument("--fragments", type=int, default=3)
    st.add_argument("--overlap", type=int, default=2)
    st.add_argument("--alpha", type=float, default=0.5)
    st.add_argument("--quant", default="u4", help="streaming's wire format (streaming_diloco.py --quant)")
    st.add_argument("--quant-block", type=int, default=128, help="elements per min/max block (0: one per chunk)")
    st.add_argument("--no-link", action="store_true", help="skip the tbf-link comparison (it needs root)")
    st.add_argument("--no-loss", action="store_true", help="only the tbf-link comparison")
    st.add_argument("--rate", default="200mbit")
    st.add_argument("--link-outer-steps", type=int, default=8, help="plain DiLoCo's outer steps on the link")
    st.add_argument("--link-inner-steps", type=int, default=12, help="H on the link (a multiple of --fragments)")
    st.add_argument("--width", type=int, default=256, help="the model on the link (the loss runs use the default)")
    st.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    return {"churn": churn, "bandwidth": bandwidth, "streaming": streaming}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
