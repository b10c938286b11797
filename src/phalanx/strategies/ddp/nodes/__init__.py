"""Several machines: the head's side (:mod:`.hub`), a node's agent (:mod:`.node`), what both
share (:mod:`.shared`: the node port's address, the interface check, the run's token, what
must agree), what a node does when the head is lost (:mod:`.headloss`: keep the last
committed step; :mod:`.failover`: a surviving node takes over as the head) and the head's
fencing term in the shared run_dir (:mod:`.fencing`). Builds on :mod:`..agent`,
:mod:`..coordinator` (the pure node rules) and :mod:`..wire`."""
