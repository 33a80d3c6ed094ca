"""Run a training script once a file appears, with torch already imported.

    python warm_start.py GO_FILE SCRIPT [ARGS...]

A newcomer's interpreter spends seconds importing torch (and torch._dynamo, which torch's
optimizers import when built) before it can train; a test that starts a fresh peer after a kill
starts this one ahead instead (it imports torch and nothing of pccl, connects nowhere) and
creates ``GO_FILE`` when the peer should start: the
script then runs as ``__main__`` with ``SCRIPT ARGS...`` as its argv and its folder on the
path, exactly as ``python SCRIPT ARGS...`` would run it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

import torch._dynamo  # noqa: F401  (the point: imported before the start)

go, script, *args = sys.argv[1:]
print("warm", flush=True)  # torch is in: a test may create GO_FILE now
while not os.path.exists(go):
    time.sleep(0.01)
sys.argv = [script, *args]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
