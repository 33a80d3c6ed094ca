"""The operator's tools behind the ``pccl`` command: the CLI (:mod:`.cli`), the local demo
cluster (:mod:`.demo`), the side-by-side benchmark (:mod:`.bench`) and the status client
(:mod:`.status_client`)."""
