"""One node's part of a multi-node test run: the same script on every node, as a user runs
it (``PHALANX_NNODES``, ``PHALANX_NODE_RANK``, ``PHALANX_HEAD`` set by the test).

    python multinode_script.py OUT DEVICES EPOCHS RUN_DIR|- [shrink]

Writes the final state dict to OUT and prints one JSON line: steps, ledger, failures.
``PHALANX_TEST_NODE_TIMEOUT`` (seconds) sets ``fit(node_timeout=)``; ``PHALANX_TEST_RESUME=1``
passes ``resume=True``; ``PHALANX_TEST_FAULTS`` (``kill:0@15,kill:1@15``, every node the same)
passes ``faults=``; ``PHALANX_TEST_STRATEGY`` (default ``ddp``) the strategy;
``PHALANX_TEST_CHECKPOINT_STEPS`` checkpoints every that many steps,
``PHALANX_TEST_SNAPSHOT_STEPS`` snapshots every that many (``off``: none); ``PHALANX_TEST_GATHER=0``
passes ``gather=False`` (OUT then holds the final sharded checkpoint's model, read whole);
``PHALANX_TEST_STEPS=1``
adds each committed step's (global step, time) to the result (``steps_at``);
``PHALANX_TEST_STREAM`` (a folder of shards written by the test
with ``stream_helpers.write_shards``) trains on them as a ``px.Stream`` instead.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
from datetime import timedelta

import torch

import phalanx as px
from recovery_helpers import env_recording_slow_step, linear, make_data, sgd, slow_step
from stream_helpers import read

DATA = make_data(240)


class Stamps:
    """Each committed step's event: [global step, time]."""

    def __init__(self) -> None:
        self.at: list[list[float]] = []

    def handle(self, event: object) -> None:
        from phalanx.events import StepEnded

        if isinstance(event, StepEnded):
            self.at.append([event.global_step, event.time])

    def close(self) -> None:
        pass


def main() -> None:
    out, devices, epochs, run_dir = (
        sys.argv[1],
        sys.argv[2].split(","),
        int(sys.argv[3]),
        sys.argv[4],
    )
    shrink = len(sys.argv) > 5 and sys.argv[5] == "shrink"
    record = os.environ.get("PHALANX_TEST_ENV_DIR")  # where workers write torchrun's variables
    step = functools.partial(env_recording_slow_step, record) if record else slow_step
    learner = px.Learner(linear, sgd, step)
    stamps = Stamps()
    sinks = None
    if os.environ.get("PHALANX_TEST_STEPS") == "1":
        from phalanx.sinks import default_sinks

        sinks = [*default_sinks(None if run_dir == "-" else run_dir), stamps]
    shards = os.environ.get("PHALANX_TEST_STREAM")
    every = os.environ.get("PHALANX_TEST_CHECKPOINT_STEPS")
    snaps = os.environ.get("PHALANX_TEST_SNAPSHOT_STEPS")
    data = DATA if not shards else px.Stream(sorted(glob.glob(f"{shards}/*.bin")), read, lanes=3)
    result = learner.fit(
        data,
        epochs=epochs,
        batch_size=24,
        seed=5,
        devices=devices,
        strategy=os.environ.get("PHALANX_TEST_STRATEGY", "ddp"),
        checkpoint=px.Checkpoints(every_steps=int(every)) if every else None,
        snapshots=(snaps != "off") and (px.Snapshots(every_steps=int(snaps)) if snaps else True),
        run_dir=None if run_dir == "-" else run_dir,
        hang_timeout=timedelta(seconds=10),
        node_timeout=float(os.environ.get("PHALANX_TEST_NODE_TIMEOUT", "10")),
        on_failure=px.Recovery(mode="shrink") if shrink else None,
        resume=os.environ.get("PHALANX_TEST_RESUME") == "1",
        faults=[
            px.Fault.parse(t) for t in os.environ.get("PHALANX_TEST_FAULTS", "").split(",") if t
        ],
        sinks=sinks,
        gather=os.environ.get("PHALANX_TEST_GATHER") != "0",
    )
    if result.model is None:  # (gather=False: the weights are in the final checkpoint)
        assert result.model_path is not None
        torch.save(px.load_checkpoint(result.model_path)["model"], out)
    else:
        torch.save(result.model.state_dict(), out)
    doc = {
        "steps": result.steps,
        "ledger_ok": result.ledger_ok,
        "failures": [f.to_dict() for f in result.failures],
        "steps_at": stamps.at,
        "model_path": result.model_path,
    }
    print("RESULT " + json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
