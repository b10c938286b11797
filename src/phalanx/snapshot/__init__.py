"""Snapshots of the committed state in each node's shared memory, outside the workers.

:class:`Snapshots` is the setting (``fit(snapshots=...)``), :class:`SnapshotStore` the
double-buffered folder of one machine (:mod:`.store`), :class:`Snapshotter` the member that
writes it after committed steps, off the step's path (:mod:`.taker`). When every member
that holds the state falls, the replacements restore the newest snapshot and compute the
steps since it again (the step is a pure function of its number), so the run goes on to
the same weights as a run without the failure.
"""

from phalanx.snapshot.config import Snapshots, settings_of
from phalanx.snapshot.store import Snapshot, SnapshotStore, folder_for, sweep
from phalanx.snapshot.taker import Snapshotter, Snapshotting, Taken, every_for, stable_tensors

__all__ = [
    "Snapshot",
    "SnapshotStore",
    "Snapshots",
    "Snapshotter",
    "Snapshotting",
    "Taken",
    "every_for",
    "folder_for",
    "settings_of",
    "stable_tensors",
    "sweep",
]
