"""``strategy="ddp"``: one process per device, gradients synced by torch DDP.

- :mod:`.supervisor`: the calling process. Hosts the TCPStore, spawns and watches workers,
  detects deaths (process sentinels) and hangs (progress messages), decides, reports.
- :mod:`.worker`: one per device. Preflight, process group, DDP, the training loop; each
  generation ends as an :class:`~.worker.Exit`.
- :mod:`.engine`: a worker's :class:`~.engine.Member` and the
  :class:`~phalanx.loop.Engine` of one rank: local step + vote.
- :mod:`.group`: the process group a generation owns (no default group).
- :mod:`.handover`: the agreed state to the members behind, through torch's pytree.
- :mod:`.preflight`: one isolated step on the worker's real replica.
- :mod:`.protocol`: the messages workers send to the supervisor, and the store keys.
"""

from phalanx.strategies.ddp.supervisor import run_ddp

__all__ = ["run_ddp"]
