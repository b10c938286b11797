"""What crosses a process or machine boundary, and nothing else: the messages workers send
their agent (:mod:`.protocol`), the signed control values in the store (:mod:`.control`),
the authenticated link between the head and each node (:mod:`.link`) and the typed node
messages with their one codec (:mod:`.messages`). Imports nothing of the strategy but
:mod:`..timing`."""
