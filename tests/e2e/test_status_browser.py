"""The status page in a real headless browser (Debian's ``chromium``, which ``.ci/system-deps`` installs)
during a live run of three peer processes on real TCP: every peer is listed with its revision;
after one is SIGKILLed, the next load of the page shows it removed."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
import trio

import pccl
from pccl.tools.demo import DEMO_CONFIG

PEERS = 3


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless chromium is needed for this test and is not installed: `apt-get install chromium` "
                "(`bash .ci/system-deps` installs it)")


async def dump_dom(url: str) -> str:
    # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start.
    result = await trio.run_process(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--timeout=10000", "--dump-dom", url],
        capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")[-2000:]
    return result.stdout.decode()


def _status(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/status.json", timeout=10) as response:
        return json.loads(response.read())


async def status(master: pccl.Master) -> dict[str, Any]:
    assert master.status_address is not None
    return await trio.to_thread.run_sync(_status, master.status_address)


def peer_rows(dom: str) -> dict[str, str]:
    """peer id → the revision cell of its row, from the rendered DOM."""
    rows = {}
    for peer, row in re.findall(r'<tr class="peer" data-peer="([0-9a-f]{16})">(.*?)</tr>', dom, re.S):
        cell = re.search(r'<td class="num revision">([^<]*)</td>', row)
        assert cell is not None, row
        rows[peer] = cell.group(1)
    return rows


@pytest.mark.timeout(240)
async def test_the_page_in_a_browser_lists_every_peer_with_its_revision_and_shows_a_kill() -> None:
    chromium()  # fail before starting anything when the browser is missing
    async with pccl.open_master("127.0.0.1:0", config=DEMO_CONFIG, status="127.0.0.1:0") as master:
        url = f"http://{master.status_address}/"
        procs: list[trio.Process] = []
        try:
            for i in range(PEERS):
                # The demo's training loop (sync every step, all-reduce, revision += 1), as real processes.
                procs.append(await trio.lowlevel.open_process(
                    [sys.executable, "-P", "-m", "pccl", "--log-level", "WARNING", "demo-peer", "--master",
                     master.address, "--name", f"p{i}", "--steps", "1000000", "--size", "1000",
                     "--step-time", "0.05"], stdout=subprocess.DEVNULL))
            with trio.fail_after(120):
                while True:
                    before = await status(master)
                    peers = before["groups"][0]["peers"] if before["groups"] else []
                    if len(peers) == PEERS and all(p["revision"] for p in peers):
                        break
                    await trio.sleep(0.2)

            dom = await dump_dom(url)
            rows = peer_rows(dom)
            assert set(rows) == {p["peer_id"] for p in peers}
            for p in peers:
                # the page was rendered after the JSON was read: the same revision or a later one
                assert rows[p["peer_id"]].isdigit() and int(rows[p["peer_id"]]) >= p["revision"], (rows, p)
            assert "group 0: world size 3" in dom
            assert dom.count("<svg") >= 1 and "<circle" in dom  # the ring picture

            procs[0].send_signal(signal.SIGKILL)
            with trio.fail_after(60):
                while True:
                    after = await status(master)
                    lost = [e for e in after["events"] if e["kind"] in ("lost", "kick")]
                    if lost and len(after["groups"][0]["peers"]) == PEERS - 1:
                        break
                    await trio.sleep(0.1)
            killed = lost[0]["peer_id"]
            assert killed in rows and killed not in {p["peer_id"] for p in after["groups"][0]["peers"]}

            dom = await dump_dom(url)  # what the page's next refresh shows
            assert killed not in peer_rows(dom)
            events = re.findall(r'<tr class="event (\w+)">(.*?)</tr>', dom, re.S)
            assert any(kind in ("lost", "kick") and killed[:6] in row for kind, row in events), events
            assert "CONNECTION_LOST" in dom or "TIMEOUT" in dom
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
            for proc in procs:
                await proc.wait()
