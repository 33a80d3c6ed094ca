"""The simulation engine: deterministic trio, the virtual network and its streams, the trace, and
the runner that plays a scenario under a fault schedule.  It knows no workload (never imports
pccl); workloads plug in through :class:`sim.engine.runner.Scenario`."""
