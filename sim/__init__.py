"""pccl's deterministic simulator: virtual network, seeded chaos, replay and shrink.

``engine/`` (deterministic trio, the virtual network and its streams, the trace, the runner),
``faults/`` (fault schedules: data, drawn from a seed, shrunk), ``observe/`` (the wire tap and
fault-landing coverage) and ``tools/`` (``pccl-sim``, campaigns, plots, the scenario registry)
are generic and never import pccl; ``workloads/`` holds what runs on the simulated hosts (the toy,
and pccl itself), the only part that does.
"""
