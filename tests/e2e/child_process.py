"""A child process whose output lines a thread collects, for tests that read them as they come."""

from __future__ import annotations

import subprocess
import threading
from typing import Any


class Child:
    """``cmd`` run with stdout and stderr merged into :attr:`lines` (one string per line); or,
    given ``popen``, that process already started (forked_peers.py's ``ForkedPopen``)."""

    def __init__(self, name: str, cmd: list[str], popen: Any = None) -> None:
        self.name = name
        self.popen = popen or subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self.on_line(line)

    def on_line(self, line: str) -> None:
        """Called on the reader thread for every line (subclasses parse progress here)."""

    def output(self, last: int = 40) -> str:
        return f"--- {self.name} (exit {self.popen.poll()}) ---\n" + "\n".join(self.lines[-last:])
