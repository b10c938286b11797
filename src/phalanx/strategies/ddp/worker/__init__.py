"""One worker process: a device, a slot, a rank in each generation it joins
(:mod:`.worker`), its engine and vote (:mod:`.engine`, :mod:`.ballot`), the group of a
generation (:mod:`.group`), the state hand-over (:mod:`.handover`), preflight, its identity,
and its emergency checkpoint when the head is lost (:mod:`.emergency`). Imports only
:mod:`..wire`, :mod:`..timing` and :mod:`..process`: never the agent or the supervisor."""
