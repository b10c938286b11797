"""The data ledger: proof that every sample was used exactly once per epoch.

Each committed step records, from the vote (summed over the members that computed it), a
fingerprint of the sample indices actually computed: their count, sum, sum of squares and
sum of a 20-bit hash of each. :func:`check` compares it with the plan's global batch of that
step, and checks that every step of each finished epoch was committed exactly once. A member
that computed a wrong slice after a shrink, a step replayed after a recovery, or a step
skipped shows up here. The hash term is what makes the fingerprint a check of the set: two
different sets with the same count, sum and sum of squares exist ({1, 5, 6} and {2, 3, 7}),
but their hash sums differ unless 20-bit hashes collide by chance. The sums are exact in
float64 (the vote's dtype) for global batches up to about 2**30 samples of index < 2**26.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np

from phalanx.plan import Plan

WIDTH = 4  # count, sum, sum of squares, hash sum
Fingerprint = tuple[float, float, float, float]
EMPTY: Fingerprint = (0.0, 0.0, 0.0, 0.0)
_MASK = (1 << 64) - 1
# ledger.json's "steps" rows: the step's place (0-based epoch and step within it, and the
# number of steps committed before it) and the fingerprint of the samples computed.
COLUMNS = ("epoch", "step", "global_step", "count", "sum", "sum_of_squares", "hash_sum")


def mix(index: int) -> int:
    """A 20-bit hash of a sample index (splitmix64's finaliser, top bits): not linear, so
    sums of it tell sets apart where sums of powers do not."""
    z = (index + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 44


def mix_all(indices: np.ndarray) -> np.ndarray:
    """:func:`mix` of every index at once (uint64 arithmetic wraps as ``& _MASK`` does)."""
    z = indices.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) >> np.uint64(44)


def fingerprint(samples: Iterable[int]) -> Fingerprint:
    """The fingerprint of the samples one member computed in a step; members' fingerprints
    add up (the vote's all-reduce sums them) to that of the union. (The hash term is
    computed for all samples at once: a step's worth of :func:`mix` one by one cost
    ~0.2 ms.)"""
    values = list(samples)
    if not values:
        return EMPTY
    hashed = int(mix_all(np.asarray(values, dtype=np.uint64)).sum(dtype=np.uint64))
    squares = sum(i * i for i in values)  # (exact Python ints, then float as before)
    return (float(len(values)), float(sum(values)), float(squares), float(hashed))


def fingerprints(slices: Sequence[Sequence[int]]) -> list[Fingerprint]:
    """:func:`fingerprint` of each of ``slices``, the same values, computed together (a
    member's slices of a whole epoch at once: its steps then find theirs ready, where one
    step's own took 25 to 50 us). Each term is a difference of running sums in wrapping
    uint64 arithmetic, exact while no slice's sum of squares reaches 2**64 (else, and for
    negative indices, slice by slice)."""
    lengths = np.fromiter((len(s) for s in slices), dtype=np.int64, count=len(slices))
    total = int(lengths.sum())
    flat = np.fromiter(itertools.chain.from_iterable(slices), dtype=np.int64, count=total)
    if total == 0:
        return [EMPTY] * len(slices)
    if int(flat.min()) < 0 or int(flat.max()) ** 2 * int(lengths.max()) >= 1 << 64:
        return [fingerprint(s) for s in slices]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    values = flat.astype(np.uint64)

    def per_slice(terms: np.ndarray) -> list[int]:
        running = np.concatenate((np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)))
        return (running[ends] - running[starts]).tolist()  # (wraps back: exact)

    columns = zip(
        lengths.tolist(),
        per_slice(values),
        per_slice(values * values),
        per_slice(mix_all(values)),
        strict=True,
    )
    return [(float(n), float(t), float(q), float(h)) if n else EMPTY for n, t, q, h in columns]


def check(
    plan: Plan,
    entries: list[list[float]],
    epochs_done: int,
    quarantine: dict[int, int] | None = None,
) -> list[str]:
    """Problems found (empty: exactly once). ``entries`` are ``[epoch, step, global_step,
    *fingerprint]`` per committed step (an entry of a checkpoint written before the hash
    term existed has three terms, and is checked on those). ``quarantine``: samples left out
    (dataset index -> the global step from which): a step from then on must have computed
    its global batch without them, and is checked so."""
    quarantine = quarantine or {}
    problems: list[str] = []
    seen: dict[tuple[int, int], int] = {}
    orders: dict[int, list[int]] = {}
    for epoch_f, step_f, global_f, *computed_f in entries:
        epoch, step, global_step = int(epoch_f), int(step_f), int(global_f)
        computed = tuple(int(x) for x in computed_f)
        if (epoch, step) in seen:
            problems.append(
                f"epoch {epoch} step {step} committed twice (global steps "
                f"{seen[(epoch, step)]} and {global_step})"
            )
        seen[(epoch, step)] = global_step
        if epoch not in orders:  # (once per epoch: an order is as long as the dataset)
            orders[epoch] = plan.order(epoch)
        order = orders[epoch]
        batch = plan.global_batch(epoch, step, order)
        if quarantine:
            batch = [i for i in batch if quarantine.get(i, global_step + 1) > global_step]
        expected = tuple(int(x) for x in fingerprint(batch))[: len(computed)]
        if computed != expected:
            problems.append(
                f"epoch {epoch} step {step}: computed {computed[0]} samples "
                f"(fingerprint {list(computed[1:])}), the plan's global batch has "
                f"{expected[0]} (fingerprint {list(expected[1:])})"
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
        doc = {
            "exactly_once": not problems,
            "problems": problems,
            "columns": list(COLUMNS),
            "steps": entries,
        }
        json.dump(doc, fh)
    os.replace(path + ".tmp", path)
