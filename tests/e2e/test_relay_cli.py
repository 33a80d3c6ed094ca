"""``pccl relay`` and ``pccl master --relay`` as OS processes: a relay registers with the master,
registers again with a master restarted after a SIGKILL, keeps retrying (with a clear log line)
a master that refuses its token, stops on SIGTERM; bad arguments end with a one-line error."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from pccl.tools.bench import free_port

TOKEN = "relay-cli-token"
BOUND = 60.0


class Proc:
    """A ``python -m pccl ...`` process whose stderr lines are collected as they come."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "pccl", *args], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate: Callable[[str], bool], what: str, since: int = 0) -> str:
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                if predicate(line):
                    return line
            if self.popen.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"exited ({self.popen.returncode}) before {what}:\n" + "\n".join(self.lines))
            time.sleep(0.05)
        raise AssertionError(f"no {what} within {BOUND} s:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(5)
        return self.popen.returncode


def test_a_relay_registers_again_with_a_restarted_master_and_stops_on_sigterm(tmp_path: pathlib.Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {"PCCL_TOKEN": TOKEN}
    master = Proc("master", "--listen", address, "--relay", "--peer-timeout", "3", "--heartbeat-interval", "0.25",
                  env=env)
    relay = None
    try:
        master.wait_for(lambda line: "master listening on" in line, "the master's listening line")
        relay = Proc("relay", "--master", address, "--listen", "127.0.0.1:0", "--token-file", str(token_file),
                     "--peer-timeout", "3", "--heartbeat-interval", "0.25")
        relay.wait_for(lambda line: "relay listening on 127.0.0.1:" in line, "the relay's listening line")
        # The master's own relay is relay 1: a relay process gets 2.
        relay.wait_for(lambda line: f"registered with master {address}" in line and "as relay 2" in line,
                       "the registration")
        master.wait_for(lambda line: "relay 2 registered at 127.0.0.1:" in line, "the master's log of it")

        mark = len(relay.lines)
        master.popen.send_signal(signal.SIGKILL)
        master.popen.wait(10)
        relay.wait_for(lambda line: f"master {address}" in line and "registering again" in line,
                       "the relay noticing the master is gone", since=mark)
        master = Proc("master", "--listen", address, "--peer-timeout", "3", "--heartbeat-interval", "0.25", env=env)
        # A restarted master without --relay: the relay process is relay 2 again (ids start after
        # the master's own, whether it runs one or not).
        relay.wait_for(lambda line: f"registered with master {address}" in line, "the registration again",
                       since=mark)
        master.wait_for(lambda line: "relay 2 registered at 127.0.0.1:" in line, "the new master's log of it")
        assert relay.stop() == 0
        assert any("received SIGTERM, shutting down" in line for line in relay.lines)
    finally:
        if relay is not None:
            relay.stop()
        master.stop()


def test_a_relay_with_the_wrong_token_keeps_trying_and_says_why() -> None:
    address = f"127.0.0.1:{free_port()}"
    master = Proc("master", "--listen", address, "--token", TOKEN)
    relay = None
    try:
        master.wait_for(lambda line: "master listening on" in line, "the master's listening line")
        relay = Proc("relay", "--master", address, "--listen", "127.0.0.1:0", "--token", "not-the-token")
        line = relay.wait_for(lambda line: f"master {address}" in line and "registering again" in line,
                              "the failed registration")
        assert "WARNING" in line and "token" in line.lower(), line
        time.sleep(1.0)
        assert relay.popen.poll() is None, "the relay gave up"
        assert not any("registered with master" in line for line in relay.lines)
    finally:
        if relay is not None:
            relay.stop()
        master.stop()


@pytest.mark.parametrize("args, expected, code", [
    (["relay"], "the following arguments are required: --master", 2),
    (["relay", "--master", "127.0.0.1:1", "--listen", "127.0.0.1:0", "--advertise", ":0"],
     "relay advertise port must be 1-65535, got 0", 1),
    (["relay", "--master", "no-port-here", "--listen", "127.0.0.1:0"], "no-port-here", 1),
], ids=["no-master", "advertise-port-0", "bad-master-address"])
def test_bad_relay_arguments_end_with_one_clear_line(args: list[str], expected: str, code: int) -> None:
    done = subprocess.run([sys.executable, "-m", "pccl", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
