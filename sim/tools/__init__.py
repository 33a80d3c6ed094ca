"""What people run: the ``pccl-sim`` command (:mod:`~pccl_sim.tools.cli`), campaigns over many seeds,
timeline plots, and the one scenario registry (:mod:`~pccl_sim.tools.scenarios`).  Workloads are
reached only through the registry, by name, so nothing here imports the code under test."""
