"""pccl's deterministic simulator: virtual network, seeded chaos, replay and shrink."""
