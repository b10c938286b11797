"""Every decision of the ddp control plane, pure: no process, socket, store, thread or clock
(time comes in with each event). :mod:`.coordinator` is the state machine of the slots and
generations, :mod:`.roster` what it knows, :mod:`.book` the failures it decided,
:mod:`.actions` what it asks for, :mod:`.nodeplan` the rules about other nodes,
:mod:`.hangs` finding the hung worker, :mod:`.panel` the worker panel's events. Imports only
:mod:`..wire` and :mod:`..timing`; every rule has a table test."""
