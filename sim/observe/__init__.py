"""Watching a run from the wire: the frame-sniffing tap that fires phase triggers and tracks each
host's phase (:mod:`~pccl_sim.engine.tap`), and where faults landed (:mod:`~pccl_sim.observe.coverage`)."""
