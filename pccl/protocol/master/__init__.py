"""The master's consensus, sans-IO.  :mod:`.machine` (``MasterState``) keeps dispatch, the peer
registry, settle, timers and views; the rules live in its sub-machines, each with its rules at
the top and a narrow host (a frozen dataclass of callables): :mod:`.votes` (accept, re-wire,
pending query), :mod:`.rounds` (topology rounds and their retries), :mod:`.collectives`
(collective ops), :mod:`.sync` (shared-state syncs, with :mod:`.election`), :mod:`.optimize`
(probes and the solved ring, with :mod:`.link_store`), :mod:`.mismatch` (phase mismatches).
:mod:`.peers` holds the records and the phase table, :mod:`.events` the events the shell feeds
the machine and the effects it returns."""
