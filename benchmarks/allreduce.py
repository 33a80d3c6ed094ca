"""nccl-tests-style all-reduce table: a master and N peers as OS processes on loopback.

    python benchmarks/allreduce.py --peers 2 3 4 --sizes 16K 64M 256M [--quant u8] [--concurrency 2]

Same as ``pccl bench`` (the machinery is :mod:`pccl.tools.bench`; see its docstring for what is timed).
"""

import sys

from pccl.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
