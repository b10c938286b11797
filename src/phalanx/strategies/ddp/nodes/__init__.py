"""Several machines: the head's side (:mod:`.hub`), a node's agent (:mod:`.node`), what both
share (:mod:`.shared`: the node port's address, the interface check, the run's token, what
must agree), and what a node does when the head is lost (:mod:`.headloss`). Builds on
:mod:`..agent`, :mod:`..coordinator` (the pure node rules) and :mod:`..wire`."""
