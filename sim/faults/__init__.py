"""Fault schedules: the data (:mod:`~sim.engine.schedule`), drawing one from a seed
(:mod:`~sim.faults.generate`) and shrinking a failing one (:mod:`~sim.faults.shrink`)."""
