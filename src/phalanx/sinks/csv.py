"""Per-epoch metrics as CSV: one row per epoch, ``epoch`` then every metric key seen.

``epoch`` is 1-based (the number shown on screen). Columns appear in first-seen order; when
an epoch brings a key not seen before, the whole file is rewritten with the union of columns
(earlier rows get empty cells), otherwise the row is appended. Each write is flushed.

Resume: rows already in the file are kept. On ``RunStarted`` the rows of epochs the run will
redo (epoch > ``start_epoch``) are dropped, so a fresh run in the same folder starts a clean
table and a resumed run continues the old one; an epoch seen again replaces its row.
"""

from __future__ import annotations

import csv
from pathlib import Path

from phalanx.events import EpochEnded, Event, RunStarted

Row = dict[str, str]


class MetricsCsvSink:
    """Writes one CSV row per :class:`EpochEnded`; see the module docstring for the rules."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.columns: list[str] = ["epoch"]
        self.rows: list[Row] = []
        if self.path.exists():
            with self.path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames and reader.fieldnames[0] == "epoch":
                    self.columns = list(reader.fieldnames)
                    self.rows = [dict(r) for r in reader]

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            kept = [r for r in self.rows if _epoch(r) <= event.start_epoch]
            if len(kept) != len(self.rows):
                self.rows = kept
                self._rewrite()
            return
        if not isinstance(event, EpochEnded):
            return
        row: Row = {"epoch": str(event.epoch + 1)}
        row.update({k: repr(float(v)) for k, v in event.metrics.items()})
        new_columns = [k for k in event.metrics if k not in self.columns]
        replaced = any(r.get("epoch") == row["epoch"] for r in self.rows)
        self.rows = [r for r in self.rows if r.get("epoch") != row["epoch"]] + [row]
        self.rows.sort(key=_epoch)
        self.columns.extend(new_columns)
        if new_columns or replaced or self.rows[-1] is not row or not self.path.exists():
            self._rewrite()
        else:
            with self.path.open("a", newline="", encoding="utf-8") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        tmp.replace(self.path)

    def close(self) -> None:
        """Nothing held open between events."""


def _epoch(row: Row) -> int:
    try:
        return int(row.get("epoch") or 0)
    except ValueError:
        return 0
