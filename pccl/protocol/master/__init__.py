"""The master's consensus, sans-IO: :mod:`.machine` (``MasterState``: dispatch, settle, timers,
views, and the membership rules — registration, topology votes, rounds, rings, the pending
query) and its sub-machines, each with its rules at the top and a narrow host of callables:
:mod:`.collectives` (collective ops), :mod:`.sync` (shared-state syncs, with :mod:`.election`),
:mod:`.optimize` (probes and the solved ring, with :mod:`.link_store`), :mod:`.mismatch` (phase
mismatches).  :mod:`.events` holds the events the shell feeds the machine and the effects it
returns."""
