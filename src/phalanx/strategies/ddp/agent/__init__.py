"""The mechanism on one machine: worker processes, their pipes, the store, stack dumps
(:mod:`.agent`), starting a slot's worker (:mod:`.spawner`) and the one interface through
which the head acts on a slot wherever it is (:mod:`.routing`). Knows nothing of policy.
Imports :mod:`..wire`, :mod:`..timing`, :mod:`..process` and the worker's entry point."""
