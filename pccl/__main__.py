"""``python -m pccl``: the same as the ``pccl`` command."""

import sys

from .tools.cli import main

sys.exit(main())
