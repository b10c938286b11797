"""Several machines: the head's hub of node links and a node's agent (:mod:`.nodes`), and
what a node does when the head is lost (:mod:`.headloss`). Builds on :mod:`..agent`,
:mod:`..coordinator` (the pure node rules) and :mod:`..wire`."""
