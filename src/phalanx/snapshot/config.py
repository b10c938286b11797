"""How often the committed state is snapshotted into host memory: the user-facing setting."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.errors import InvalidSettingError
from phalanx.events import Notice

# The cost budget of snapshots chosen by measurement: their time (copying included, as if it
# were all on the step's critical path) over the training time.
DEFAULT_BUDGET = 0.005
# However cheap the steps make a snapshot look, never fewer than one in this many steps.
MAX_EVERY = 1000


@dataclass(frozen=True)
class Snapshots:
    """Snapshots of the committed state in each node's shared memory (ddp): when every
    worker that holds the state falls, the replacements start from the newest snapshot and
    compute the steps since it again, the same steps with the same samples, so the run
    ends with the same weights as without the failure. One snapshot costs two copies of the
    model's and optimizer's state in host memory per node (the newest whole one, and the
    buffer the next one is written into).

    - ``every_steps``: a snapshot after every N-th committed step (global count); None
      (default): chosen by measurement, as often as ``budget`` allows: the first two after
      the second and third committed steps (each makes one of the two buffers), then every
      K steps where K keeps the measured time of a snapshot under ``budget`` of the step
      time (at most every :data:`MAX_EVERY` steps).
    - ``budget``: the share of training time snapshots may take when ``every_steps`` is
      None (default 0.5%).

    ``fit(snapshots=False)`` takes none: the disk checkpoint (``run_dir``) is then the only
    state that outlives the workers. In-process strategies (single, threads) take none: a
    worker's loss there is the caller's.
    """

    every_steps: int | None = None
    budget: float = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        every = self.every_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)):
            raise InvalidSettingError(
                f"Snapshots(every_steps={every!r}): use a whole number >= 1, or None to "
                "let phalanx choose by measurement."
            )
        if every is not None and every < 1:
            raise InvalidSettingError(
                f"Snapshots(every_steps={every}): use a whole number >= 1, or None to let "
                "phalanx choose by measurement (fit(snapshots=False) takes none)."
            )
        if isinstance(self.budget, bool) or not isinstance(self.budget, int | float):
            raise InvalidSettingError(f"Snapshots(budget={self.budget!r}): use a number")
        if not 0 < self.budget <= 1:
            raise InvalidSettingError(
                f"Snapshots(budget={self.budget}): use a share of the training time above 0 "
                "and at most 1 (0.005 is half a percent)."
            )


def settings_of(value: object) -> Snapshots | None:
    """``fit(snapshots=...)`` as settings: True -> the defaults, False or None -> off."""
    if value is True:
        return Snapshots()
    if value is False or value is None:
        return None
    if isinstance(value, Snapshots):
        return value
    raise InvalidSettingError(
        f"fit(snapshots={value!r}): use px.Snapshots(...), True (the default) or False"
    )


def snapshots_off(why: str | None) -> Notice:
    """The warning of a machine whose snapshot folder could not be made."""
    return Notice(
        f"snapshots in shared memory are off on this machine: its folder could not be made "
        f"({why}); when every worker falls, only a run_dir's checkpoints can restart the run",
        level="warning",
    )
