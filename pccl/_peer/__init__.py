"""The peer session behind :class:`pccl.Communicator` (private).

``session`` holds the master connection, its reader and heartbeat, the votes, the failure state
and the counters; ``wiring`` and ``links`` set up and hold the ring connections of each topology
round; ``phase`` is the sans-IO rule of which call may run when; ``host`` is the one interface
the services (the all-reduce, the shared-state sync) use to reach the session.
"""
