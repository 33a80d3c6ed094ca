"""What people run: the ``pccl-sim`` command (:mod:`~sim.tools.cli`), campaigns over many seeds,
timeline plots, and the one scenario registry (:mod:`~sim.tools.scenarios`).  Workloads are
reached only through the registry, by name, so nothing here imports the code under test."""
