"""The documents name what the code has: every field of every artefact in docs/artefacts.md
(events, run.json, failures.json, steps.csv, ledger.json, the checkpoint's keys), and every
argument of ``Learner`` and ``fit`` in the README's reference tables. Read from the code,
so a field added without its line in the docs fails here."""

from __future__ import annotations

import csv
import dataclasses
import functools
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.events import Event, WorkersTick, _event_types
from phalanx.failures import WorkerFailure
from phalanx.ledger import COLUMNS
from phalanx.runinfo import read_run
from phalanx.spec import FitConfig

ROOT = Path(__file__).resolve().parent.parent
ARTEFACTS = (ROOT / "docs" / "artefacts.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    """The body of the ``## <title>`` section (up to the next ``## ``)."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def named(text: str) -> set[str]:
    """Every ``name`` in backticks (a dotted or slashed one gives its parts too)."""
    names = set()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks pair no backticks
    for quoted in re.findall(r"`([^`]+)`", prose):
        names.add(quoted.strip('"'))
        names.update(re.split(r"[./ =(),]+", quoted))
    return names


def fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_event_and_its_fields_are_in_the_events_table() -> None:
    body = section(ARTEFACTS, "`events.jsonl`")
    rows = {}
    for line in body.splitlines():
        if line.startswith("| `"):
            first, rest = line.split("|")[1:3]
            for name in re.findall(r"`(\w+)`", first):
                rows[name] = named(rest)
    for name, cls in _event_types().items():
        if cls is Event:
            continue
        own = fields(cls) - fields(Event)  # time: said once for all
        if cls is WorkersTick:  # not written; described under the table
            assert "`WorkersTick`" in body and "beats" in body
            continue
        assert name in rows, f"{name} is not in the events.jsonl table"
        missing = own - rows[name]
        assert not missing, f"{name}: {sorted(missing)} not documented"
    assert {"event", "time", "run"} <= named(body)


def test_every_failure_field_is_in_failures_json() -> None:
    body = section(ARTEFACTS, "`failures.json`")
    missing = fields(WorkerFailure) - named(body)
    assert not missing, f"failures.json: {sorted(missing)} not documented"
    assert {"root_cause", "failures", "environment"} <= named(body)


def test_every_fit_setting_is_in_run_json_config() -> None:
    body = section(ARTEFACTS, "`run.json`")
    (config_row,) = [line for line in body.splitlines() if line.startswith("| `config`")]
    missing = fields(FitConfig) - named(config_row)
    assert not missing, f"run.json config: {sorted(missing)} not documented"


def test_ledger_columns_are_documented_in_their_order() -> None:
    body = section(ARTEFACTS, "`ledger.json`")
    listed = re.search(r"`columns`\s*\(([^)]*)\)", body)
    assert listed is not None
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(COLUMNS)


def tiny_run(run_dir: Path) -> px.FitResult:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    learner = px.Learner(
        torch.nn.Linear(4, 2),
        functools.partial(torch.optim.SGD, lr=0.1),
        px.cross_entropy_step,
        metrics=[px.metrics.Accuracy()],
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2),
        precision="16-mixed",
    )
    return learner.fit(data, data, epochs=2, batch_size=8, run_dir=str(run_dir), sinks=None)


@pytest.mark.timeout(120)
def test_the_files_of_a_real_run_hold_only_documented_fields(tmp_path: Path) -> None:
    """run.json's keys, steps.csv's columns and a checkpoint's keys (a 16-mixed run with a
    scheduler: every key filled) as a run writes them."""
    run_dir = tmp_path / "run"
    tiny_run(run_dir)
    doc = read_run(run_dir)
    assert doc is not None
    missing = set(doc) - named(section(ARTEFACTS, "`run.json`"))
    assert not missing, f"run.json: {sorted(missing)} not documented"

    with (run_dir / "steps.csv").open(newline="") as f:
        columns = next(csv.reader(f))
    missing = {c for c in columns if not c.startswith("train/")} - named(
        section(ARTEFACTS, "`steps.csv`")
    )
    assert not missing, f"steps.csv: {sorted(missing)} not documented"

    index = json.loads((run_dir / "checkpoints" / "checkpoints.json").read_text())
    entry = next(iter(index["checkpoints"].values()))
    body = section(ARTEFACTS, "`checkpoints/`")
    assert not (set(index) | set(entry)) - named(body)
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    checkpoint = torch.load(newest, weights_only=True)
    assert checkpoint["scaler"] is not None and checkpoint["scheduler"] is not None
    for where, text in (("docs/artefacts.md", body), ("README", README)):
        missing = set(checkpoint) - named(text)
        assert not missing, f"{where}: checkpoint keys {sorted(missing)} not documented"
    for part in ("loop", "plan", "phalanx"):
        missing = set(checkpoint[part]) - named(body)
        assert not missing, f"checkpoint {part}: {sorted(missing)} not documented"


def reference_rows(title: str) -> set[str]:
    """The argument names of the README's table under the paragraph naming ``title``."""
    start = README.index("| argument", README.index(title))
    table = README[start : README.index("\n\n", start)]
    names: set[str] = set()
    for line in table.splitlines()[2:]:
        names.update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize(
    ("title", "function"),
    [
        ("`px.Learner(model, optimizer, step, ...)`", px.Learner.__init__),
        ("`learner.fit(train, valid=None, ...)`", px.Learner.fit),
    ],
)
def test_every_learner_and_fit_argument_is_in_the_readme_reference(
    title: str, function: object
) -> None:
    params = set(inspect.signature(function).parameters) - {"self"}  # type: ignore[arg-type]
    documented = reference_rows(title)
    assert params - documented == set(), f"not in the README: {sorted(params - documented)}"
    assert documented - params == set(), f"no such argument: {sorted(documented - params)}"


def test_the_readmes_pictures_of_the_panel_and_the_plot_are_in_the_repository() -> None:
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert {"docs/img/panel.png", "docs/img/run.png"} <= set(images)
    for image in images:
        assert (ROOT / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
