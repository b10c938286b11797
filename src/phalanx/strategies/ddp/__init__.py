"""``strategy="ddp"``: one process per device, gradients synced by torch DDP.

- :mod:`.supervisor`: the calling process. Hosts the TCPStore, spawns and watches workers,
  detects deaths (process sentinels) and hangs (progress messages), decides, reports.
- :mod:`.worker`: one per device. Preflight, process group, DDP, the training loop.
- :mod:`.engine`: the :class:`~phalanx.loop.Engine` of one rank: local step + vote.
- :mod:`.protocol`: the messages workers send to the supervisor, and the store keys.
"""

from phalanx.strategies.ddp.supervisor import run_ddp

__all__ = ["run_ddp"]
