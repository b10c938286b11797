"""The data ledger: proof that every sample was used exactly once per epoch.

Each committed step records, from the vote (summed over the members that computed it), the
count, sum and sum of squares of the sample indices actually computed. :func:`check`
compares them with the plan's global batch of that step, and checks that every step of each
finished epoch was committed exactly once. A member that computed a wrong slice after a
shrink, a step replayed after a recovery, or a step skipped shows up here.
"""

from __future__ import annotations

import json
import os

from phalanx.plan import Plan


def check(plan: Plan, entries: list[list[float]], epochs_done: int) -> list[str]:
    """Problems found (empty: exactly once). ``entries`` are
    ``[epoch, step, global_step, samples, sum, sum of squares]`` per committed step."""
    problems: list[str] = []
    seen: dict[tuple[int, int], int] = {}
    orders: dict[int, list[int]] = {}
    for epoch_f, step_f, global_f, count, total, squares in entries:
        epoch, step, global_step = int(epoch_f), int(step_f), int(global_f)
        if (epoch, step) in seen:
            problems.append(
                f"epoch {epoch} step {step} committed twice (global steps "
                f"{seen[(epoch, step)]} and {global_step})"
            )
        seen[(epoch, step)] = global_step
        order = orders.setdefault(epoch, plan.order(epoch))
        batch = plan.global_batch(epoch, step, order)
        expected = (len(batch), sum(batch), sum(i * i for i in batch))
        if (int(count), int(total), int(squares)) != expected:
            problems.append(
                f"epoch {epoch} step {step}: computed {int(count)} samples "
                f"(sum {int(total)}), the plan's global batch has {expected[0]} "
                f"(sum {expected[1]})"
            )
    for epoch in range(epochs_done):
        missing = [s for s in range(plan.steps) if (epoch, s) not in seen]
        if missing:
            problems.append(f"epoch {epoch}: steps {missing[:10]} were never committed")
    return problems


def write(run_dir: str | None, entries: list[list[float]], problems: list[str]) -> None:
    """``run_dir/ledger.json``: the entries and the verdict."""
    if not run_dir:
        return
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "ledger.json")
    with open(path + ".tmp", "w") as fh:
        doc = {"exactly_once": not problems, "problems": problems, "steps": entries}
        json.dump(doc, fh)
    os.replace(path + ".tmp", path)
