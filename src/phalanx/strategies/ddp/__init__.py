"""``strategy="ddp"``: one process per device, gradients synced by torch DDP.

The folder is the design; each layer imports only those below it (``tests/test_layers.py``):

- :mod:`.timing`, :mod:`.process`: leaves (every duration; a process seen through a pidfd).
- :mod:`.wire`: what crosses a boundary: worker messages, signed store values, the node link
  and its typed messages.
- :mod:`.coordinator`: every decision, pure (slots, generations, failures, nodes).
- :mod:`.worker`: one process per device: preflight, its group, DDP, the loop, the vote.
- :mod:`.agent`: the mechanism on one machine (processes, pipes, store) and the routing of
  an action to the agent that holds the slot.
- :mod:`.nodes`: several machines: the head's hub, a node's agent, the head's loss.
- :mod:`.supervisor`: the calling process, glue between the coordinator and the agents.

Nothing here imports the supervisor but this package's :func:`run_ddp`, loaded on first use,
so that a worker process importing its modules never loads the supervisor.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_ddp"]


def __getattr__(name: str) -> Any:
    if name == "run_ddp":
        from phalanx.strategies.ddp.supervisor import run_ddp

        return run_ddp
    raise AttributeError(name)
