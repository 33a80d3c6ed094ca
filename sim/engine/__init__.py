"""The simulation engine: deterministic trio, the virtual network (the world's parts: clock,
topology, hosts, delivery, faults; the hosts' sockets and streams), the trace, and the runner that
plays a scenario under a fault schedule.  It knows no workload (never imports pccl); workloads
plug in through :class:`pccl_sim.engine.runner.Scenario`."""
