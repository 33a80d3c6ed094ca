"""Run an example as a newcomer that is ready to join at once: import it (and torch) now, wait
until the file GO exists, then run its ``main()`` with ARGS.

    late_joiner.py GO EXAMPLE.py ARGS...

A test starts it together with the first peers, so that the join after a kill does not wait for
a fresh interpreter to import torch (tens of seconds on a loaded runner).
"""

from __future__ import annotations

import importlib
import pathlib
import sys
import time

go, example, *args = sys.argv[1:]
sys.path.insert(0, str(pathlib.Path(example).resolve().parent))
module = importlib.import_module(pathlib.Path(example).stem)
print("late joiner: ready", flush=True)
while not pathlib.Path(go).exists():
    time.sleep(0.02)
sys.argv = [example, *args]
module.main()
