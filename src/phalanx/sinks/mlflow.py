"""MLflow: metrics per step and per epoch, the run's configuration as parameters, failures and
notices as tags.

Needs MLflow's client (``pip install "phalanx[mlflow]"``: ``mlflow-skinny``, or the full
``mlflow``). It logs through an ``MlflowClient`` of its own (no ``mlflow.start_run`` global):
the MLflow run is created at the first event of ``fit``, in ``experiment`` (created if
missing), and ended when ``fit`` closes its sinks. Written into it:

- metrics at each committed global step (MLflow's ``step``): ``step/train/loss`` (the
  step's own loss), ``step/train/lr``, ``step/train/samples_per_s`` and the epoch's running
  train metrics (``step/train/accuracy``, ...), and ``step/valid/<metric>`` of a mid-epoch
  validation (``fit(val_every_steps=N)``);
- ``epoch/<key>`` at each epoch end (step = the epoch, counted from 1): every key of the
  epoch's history entry (``epoch/train/loss``, ``epoch/valid/accuracy``, ...);
- ``failures``: the count of failures so far, at the step each failure happened in (numbered
  from 1 as on screen), and a tag ``failure/<n>`` per failure (n from 1), the line the screen
  shows: ``worker 1 (rank 1) on device cpu:1 failed at step 4 (backward): RuntimeError: boom
  -> retried``;
- tags ``notice/<n>``: warnings such as a skipped checkpoint or early stopping;
- parameters: the configuration, nested settings flattened with dots
  (``checkpoint.every_steps``): with a ``run_dir``, ``run_id`` and every ``fit`` setting as
  ``run.json`` keeps it; always ``strategy``, ``devices``, ``epochs``, ``batch_size``,
  ``steps_per_epoch``, ``train_samples``, ``valid_samples``, ``start_epoch``, ``start_step``;
  and the caller's ``params`` (which keep their values where the names meet);
- the tag ``phalanx.run_id`` (with a ``run_dir``) and the run's status: ``FINISHED``,
  ``KILLED`` (interrupted) or ``FAILED``.

NaN values are left out. Every call waits for the tracking server unless
``MLFLOW_ENABLE_ASYNC_LOGGING=true``, which queues them (ending the run waits for the queue).
Recent MLflow refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true``; phalanx's
tests use one, with no network.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from phalanx.events import (
    CheckpointSkipped,
    EpochEnded,
    Event,
    Notice,
    RunEnded,
    RunOpened,
    StepEnded,
    Validated,
    WorkerFailed,
)
from phalanx.sinks.trackers import (
    RunConfig,
    failed_at,
    failure_text,
    finite,
    notice_text,
    step_scalars,
)

MAX_PARAMS = 100  # per log_batch call (MLflow's limit)
MAX_VALUE = 500  # characters of a parameter's value (MLflow's oldest limit)
MAX_TAG = 5000  # characters of a tag's value
_NOT_IN_KEYS = re.compile(r"[^\w\-. /]")  # MLflow's keys: letters, digits, _ - . space /


class MlflowSink:
    """Logs the run to MLflow; see the module docstring. ``tracking_uri`` (None: MLflow's own,
    ``MLFLOW_TRACKING_URI``) and ``experiment`` (a name) say where; ``run_name`` (None: with a
    ``run_dir``, the phalanx run id), ``tags`` and ``params`` (the caller's hyperparameters)
    go with the run. Pass it to ``fit(loggers=[...])`` to keep the terminal and run-folder
    output. ``client`` is its ``MlflowClient``, ``run_id`` the MLflow run's once ``fit`` has
    started. Raises ImportError naming the extra when MLflow is missing."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "phalanx",
        *,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(
                'MlflowSink needs the mlflow package: pip install "phalanx[mlflow]"'
            ) from exc
        self.client: Any = MlflowClient(tracking_uri)
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.params = dict(params or {})
        self.run_id: str | None = None
        self._lock = threading.Lock()  # events may come from several threads
        self._closed = False
        self._config = RunConfig()
        self._step = 0  # the latest committed global step
        self._failures = 0
        self._notices = 0
        self._status = "FINISHED"

    def handle(self, event: Event) -> None:
        with self._lock:
            if self._closed:
                return
            if self.run_id is None:
                self._start(event)
            config = self._config.take(event)
            if config is not None:  # (the caller's params keep their values)
                mine = flatten(self.params)
                self._log_params({k: v for k, v in flatten(config).items() if k not in mine})
            self._take(event)

    def _start(self, event: Event) -> None:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(self.experiment)
            except MlflowException:  # another process created it meanwhile
                experiment_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        tags, name = dict(self.tags), self.run_name
        if isinstance(event, RunOpened):
            tags["phalanx.run_id"] = event.run_id
            name = name or event.run_id
        run = self.client.create_run(experiment_id, tags=tags, run_name=name)
        self.run_id = run.info.run_id
        self._log_params(flatten(self.params))

    def _take(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self._step = event.global_step
            self._metrics("step", step_scalars(event), event.global_step, event.time)
        elif isinstance(event, Validated):
            self._metrics("step", event.metrics, event.global_step, event.time)
        elif isinstance(event, EpochEnded):
            self._metrics("epoch", event.metrics, event.epoch + 1, event.time)
        elif isinstance(event, WorkerFailed):
            self._failures += 1
            at = failed_at(event, self._step)
            self._metrics("", {"failures": self._failures}, at, event.time)
            self._tag(f"failure/{self._failures}", failure_text(event))
        elif isinstance(event, (CheckpointSkipped, Notice)):
            self._notices += 1
            self._tag(f"notice/{self._notices}", notice_text(event))
        elif isinstance(event, RunEnded):
            self._status = (
                "FAILED" if event.failed else "KILLED" if event.interrupted else "FINISHED"
            )

    def _metrics(self, prefix: str, values: dict[str, float], step: int, when: float) -> None:
        from mlflow.entities import Metric

        stamp = int(when * 1000)
        metrics = [
            Metric(safe_key(f"{prefix}/{key}" if prefix else key), value, stamp, step)
            for key, value in finite(values).items()
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def _log_params(self, values: dict[str, str]) -> None:
        from mlflow.entities import Param

        params = [Param(safe_key(k), v[:MAX_VALUE]) for k, v in values.items()]
        for at in range(0, len(params), MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[at : at + MAX_PARAMS])

    def _tag(self, key: str, text: str) -> None:
        self.client.set_tag(self.run_id, key, text[:MAX_TAG])

    def close(self) -> None:
        """End the MLflow run (once) with the status the run's end gave; later events are
        ignored."""
        with self._lock:
            if self.run_id is not None and not self._closed:
                self.client.set_terminated(self.run_id, self._status)
            self._closed = True


def safe_key(key: str) -> str:
    """``key`` with each character MLflow refuses in a key (``(``, ``@``, ...) as ``_``."""
    return _NOT_IN_KEYS.sub("_", key)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"checkpoint": {"every_steps": 5}}`` -> ``{"checkpoint.every_steps": "5"}``."""
    return dict(_flat(values, prefix))


def _flat(values: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, str]]:
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flat(value, f"{name}.")
        else:
            yield name, str(value)
