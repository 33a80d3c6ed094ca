"""The pccl workload: the real master and peers running the recommended training loop, its step
phases, the invariants checked against it, deliberately broken masters, the decoding of pccl's
wire, and the simulated network in pccl's terms."""
