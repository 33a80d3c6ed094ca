"""Fault schedules: the data (:mod:`~pccl_sim.engine.schedule`), drawing one from a seed
(:mod:`~pccl_sim.faults.generate`) and shrinking a failing one (:mod:`~pccl_sim.faults.shrink`)."""
