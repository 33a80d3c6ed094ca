"""What runs on the simulated hosts: scenarios built on :class:`pccl_sim.engine.runner.Scenario`.  The
only part of ``sim`` that may import the code under test (pccl)."""
