"""Where replicas run: ``single`` (in process), ``threads`` (one thread per device) and
``ddp`` (one process per device). Each provides an :class:`~phalanx.loop.Engine`; the
training loop is the same for all."""

STRATEGIES = ("single", "threads", "ddp")
