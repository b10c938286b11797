"""Where replicas run: ``single`` (in process), ``threads`` (one thread per device), ``ddp``
(one process per device, a full replica each) and ``fsdp`` (one process per device, the
model's parameters, gradients and optimizer state sharded among them). Each provides an
:class:`~phalanx.loop.Engine`; the training loop is the same for all."""

STRATEGIES = ("single", "threads", "ddp", "fsdp")
# One process per device, under the ddp strategy's supervisor (its agents, coordinator and
# workers): ddp and fsdp differ in the worker's engine only.
PROCESS_BASED = ("ddp", "fsdp")


def process_based(strategy: str) -> bool:
    """Whether ``strategy`` runs one worker process per device."""
    return strategy in PROCESS_BASED
