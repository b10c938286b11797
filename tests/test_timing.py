"""Every duration of the ddp strategy is a field of ``Timing`` in
``phalanx/strategies/ddp/timing.py``, built once from the run's configuration: this reads
every other module of the strategy for a timing literal, checks that reader on a sample, and
checks what ``Timing.of`` derives from the configuration."""

from __future__ import annotations

import ast
import dataclasses
import re
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from phalanx.snapshot import Snapshots
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.timing import DEFAULT, Timing

DDP = Path(__file__).resolve().parent.parent / "src" / "phalanx" / "strategies" / "ddp"
ALLOWED = DDP / "timing.py"

# Calls that wait: a number among their arguments is a duration.
WAITING_CALLS = {"sleep", "wait", "poll", "settimeout", "join", "select", "next"}
# The clock: a number added to (or compared with) a reading of it is a duration.
CLOCKS = {"monotonic", "time", "perf_counter", "total_seconds"}
# Names a duration goes by: module constants (upper case) and parameters (lower case).
CONSTANT_ENDINGS = ("_S", "_WAIT", "_TIMEOUT", "_EVERY", "_INTERVAL", "TICK", "POLL")
CONSTANT_ENDINGS += ("_SETTLE", "_RETRY", "_AFTER", "_GRACE", "_DELAY")
PARAMETER_ENDINGS = ("timeout", "wait", "every", "interval", "tick", "poll", "retry", "settle")
PARAMETER_ENDINGS += ("grace", "delay", "deadline", "handshake")


def _number(node: ast.AST) -> bool:
    """A numeric literal other than zero (no wait is not a duration), signed or not."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _number(node.operand)
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
        and node.value != 0
    )


def _has_number(node: ast.AST) -> bool:
    """A numeric literal in ``node``, not counting indices (``parts[1:]``)."""
    if _number(node):
        return True
    children = (c for c in ast.iter_child_nodes(node) if c is not getattr(node, "slice", None))
    return any(_has_number(c) for c in children)


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else ""


def _reads_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _name(n.func) in CLOCKS for n in ast.walk(node))


def _is_duration(value: ast.expr) -> bool:
    """A number, arithmetic on numbers, or a timedelta (what a timing constant holds)."""
    if isinstance(value, ast.Call):
        return _name(value.func) == "timedelta"
    if isinstance(value, ast.BinOp):
        return _is_duration(value.left) or _is_duration(value.right)
    return _number(value)


def _constants(tree: ast.Module) -> list[str]:
    """Module constants named for a duration that hold a number or a timedelta."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            name = target.id if isinstance(target, ast.Name) else ""
            if name.isupper() and name.endswith(CONSTANT_ENDINGS) and _is_duration(value):
                found.append(f"line {node.lineno}: constant {name}")
    return found


def _call(node: ast.Call) -> list[str]:
    """A number in a timedelta, in a waiting call's arguments, in a ``timeout=``."""
    name = _name(node.func)
    args = [*node.args, *(k.value for k in node.keywords)]
    if name == "timedelta":
        return [f"line {node.lineno}: timedelta(...)"] if any(map(_has_number, args)) else []
    found = []
    if name in WAITING_CALLS and any(_has_number(a) for a in node.args):
        found.append(f"line {node.lineno}: {name}(...)")
    for keyword in node.keywords:
        if (keyword.arg or "").lower().endswith("timeout") and _has_number(keyword.value):
            found.append(f"line {node.lineno}: {name}(..., {keyword.arg}=...)")
    return found


def _on_the_clock(node: ast.BinOp | ast.Compare) -> list[str]:
    """A number added to, or compared with, a reading of the clock."""
    if isinstance(node, ast.BinOp):
        operands = [node.left, node.right]
    else:
        operands = [node.left, *node.comparators]
    if any(_number(o) for o in operands) and any(_reads_clock(o) for o in operands):
        return [f"line {node.lineno}: a number on the clock"]
    return []


def _defaults(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A parameter named for a duration with a number as its default."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    pairs = list(zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True))
    pairs += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
    return [
        f"line {node.lineno}: {node.name}({param.arg}=...)"
        for param, default in pairs
        if param.arg.lower().endswith(PARAMETER_ENDINGS) and _has_number(default)
    ]


def timing_literals(source: str) -> list[str]:
    """Each timing literal in ``source`` as ``line N: form``: a number in a ``timedelta``, in
    a waiting call's arguments (``sleep``, ``wait``, ``poll``, ``settimeout``, ``join``,
    ``select``, ``next``) or in any ``timeout=`` keyword; a number added to or compared with
    a clock reading; a parameter named for a duration with a number as its default; a
    module constant named for a duration (``..._TIMEOUT``, ``..._WAIT``, ``TICK``, ...) that
    holds a number or a timedelta. Zero is no wait, not a duration: never one."""
    tree = ast.parse(source)
    found = _constants(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found += _call(node)
        elif isinstance(node, (ast.BinOp, ast.Compare)):
            found += _on_the_clock(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _defaults(node)
    return found


def test_no_ddp_module_but_timing_holds_a_timing_literal() -> None:
    modules = sorted(p for p in DDP.rglob("*.py") if p != ALLOWED)
    assert len(modules) > 10  # (the strategy's modules were found)
    found = [
        f"{path.name} {where}" for path in modules for where in timing_literals(path.read_text())
    ]
    assert not found, (
        "a timing literal outside strategies/ddp/timing.py (make it a field of Timing and "
        "read it from the run's Timing):\n" + "\n".join(found)
    )


SAMPLE = """
import time
from datetime import timedelta

POLL = timedelta(seconds=0.1)  # caught
STORE_TIMEOUT = 30  # caught
HANDSHAKE_TIMEOUT: float = 10.0  # caught
BEAT_EVERY = 2 * 0.5  # caught
TICK = timedelta(milliseconds=500)  # caught
WATCH_INTERVAL = timedelta(seconds=1)  # caught
SAVE_S = 60  # caught
RING_COUNT = 32
LABEL_TIMEOUT = "thirty seconds"

def run(proc, link, sock, store, agent, timing, config):
    time.sleep(0.02)  # caught
    sock.settimeout(5)  # caught
    proc.join(timeout=5)  # caught
    proc.join(5)  # caught
    agent.poll(timedelta(seconds=0 if store else 0.1))  # caught
    event.wait(2.5)  # caught
    link.next(0.05)  # caught
    select.select([fd], [], [], 5)  # caught
    Link.connect(address, token, hello, timeout=5.0)  # caught
    queue.get(timeout=min(left, 0.2))  # caught
    deadline = time.monotonic() + 0.5  # caught
    late = time.monotonic() - asked_at > 2 * timing.stack_wait.total_seconds() + 1  # caught
    limit = config.node_timeout + timedelta(seconds=5)  # caught

def wait_for(store, timeout=5.0, every: float = 0.05, *, poll_tick=0.2, limit=120):  # caught
    pass
"""

FORMS = {
    "constant POLL",
    "constant STORE_TIMEOUT",
    "constant HANDSHAKE_TIMEOUT",
    "constant BEAT_EVERY",
    "constant TICK",
    "constant WATCH_INTERVAL",
    "constant SAVE_S",
    "timedelta(...)",
    "sleep(...)",
    "settimeout(...)",
    "join(..., timeout=...)",
    "join(...)",
    "poll(...)",
    "wait(...)",
    "next(...)",
    "select(...)",
    "connect(..., timeout=...)",
    "get(..., timeout=...)",
    "a number on the clock",
    "wait_for(timeout=...)",
    "wait_for(every=...)",
    "wait_for(poll_tick=...)",
}


def test_the_checker_catches_each_form_of_timing_literal() -> None:
    """Each line of the sample marked ``caught`` is found, and only those; each form is
    named (a constant's name, the call, the parameter)."""
    found = timing_literals(SAMPLE)
    marked = {n for n, line in enumerate(SAMPLE.splitlines(), 1) if line.endswith("# caught")}
    assert {int(f.split()[1].rstrip(":")) for f in found} == marked
    assert {f.split(": ", 1)[1] for f in found} == FORMS


def test_the_checker_lets_timings_read_from_a_timing_object_pass() -> None:
    clean = textwrap.dedent(
        """
        RING_COUNT = 32
        MAX_HELLO = 1 << 20
        PROTOCOL = "px-link/1"

        def run(proc, link, sock, agent, timing, fd, parts, config):
            time.sleep(timing.store_poll.total_seconds())
            sock.settimeout(timing.handshake.total_seconds())
            proc.join(timeout=timing.exit_wait.total_seconds())
            agent.poll(timedelta() if parts else timing.poll)
            select.select([fd], [], [], 0)
            link.next(timing.link_poll.total_seconds())
            text = ", ".join(parts[1:])
            deadline = time.monotonic() + timing.last_word.total_seconds()
            attempt = parts.count(1) + 1

        def helper(store, poll: timedelta = DEFAULT.store_poll, limit: int = 120):
            pass
        """
    )
    assert timing_literals(clean) == []


# -- Timing.of --------------------------------------------------------------------------
def config(hang: float, node: float, strategy: str = "ddp", snapshots: bool = True) -> FitConfig:
    return FitConfig(
        epochs=1,
        batch_size=4,
        devices=["cpu:0", "cpu:1"],
        strategy=strategy,
        hang_timeout=timedelta(seconds=hang),
        node_timeout=timedelta(seconds=node),
        snapshots=Snapshots() if snapshots else None,
    )


# hang_timeout, node_timeout -> forming (max(10 s, hang)), collective (2 hang + 30 s),
# verdict (node + 5 s), takeover (node + 10 s), follow (save_wait 60 s + node + 20 s);
# settle_copy is forming / 2
DERIVED = [
    (60, 10, 60, 150, 15, 20, 90),  # fit's defaults
    (5, 3, 10, 40, 8, 13, 83),  # a short hang_timeout: forming never under 10 s
    (10, 1, 10, 50, 6, 11, 81),
    (0.5, 0.5, 10, 31, 5.5, 10.5, 80.5),
    (600, 120, 600, 1230, 125, 130, 200),  # (a follower outwaits its leader's wait)
]


@pytest.mark.parametrize(
    ("hang", "node", "forming", "collective", "verdict", "takeover", "follow"), DERIVED
)
def test_timing_of_a_configuration_derives_its_bounds(
    hang: float,
    node: float,
    forming: float,
    collective: float,
    verdict: float,
    takeover: float,
    follow: float,
) -> None:
    timing = Timing.of(config(hang, node))
    assert timing.hang == timedelta(seconds=hang)
    assert timing.node == timedelta(seconds=node)
    assert timing.forming == timedelta(seconds=forming)
    assert timing.collective == timedelta(seconds=collective)
    assert timing.verdict == timedelta(seconds=verdict)
    assert timing.takeover == timedelta(seconds=takeover)
    assert timing.follow == timedelta(seconds=follow)
    assert timing.follow > timing.save_wait + timing.takeover  # (the leader saves, then waits)
    assert timing.settle_copy == timedelta(seconds=forming) / 2  # (within forming)
    derived = {"hang", "node", "forming", "collective", "verdict", "takeover", "follow"}
    derived.add("settle_copy")
    for f in dataclasses.fields(Timing):  # every other bound is the configuration's own
        if f.name not in derived:
            assert getattr(timing, f.name) == getattr(DEFAULT, f.name), f.name


# fsdp with snapshots: a survivor of the head's loss writes its machine's shard snapshots
# (up to save_wait) before it reaches the successor: takeover and follow are save_wait longer
SHARDED = [
    ("ddp", True, 20, 90),
    ("fsdp", True, 80, 150),
    ("fsdp", False, 20, 90),  # (no snapshots: nothing to write)
]


@pytest.mark.parametrize(("strategy", "snapshots", "takeover", "follow"), SHARDED)
def test_under_fsdp_with_snapshots_the_takeover_waits_for_the_survivors_writing(
    strategy: str, snapshots: bool, takeover: float, follow: float
) -> None:
    timing = Timing.of(config(60, 10, strategy, snapshots))
    assert timing.takeover == timedelta(seconds=takeover)
    assert timing.follow == timedelta(seconds=follow)
    assert timing.follow > timing.save_wait + timing.takeover  # (the leader saves, then waits)


def test_the_default_timing_is_that_of_fits_default_configuration() -> None:
    defaults = FitConfig(epochs=1, batch_size=4, devices=["cpu:0"], strategy="ddp")
    assert Timing.of(defaults) == DEFAULT == Timing()


def test_a_timing_is_frozen() -> None:
    timing = Timing.of(config(60, 10))
    with pytest.raises(dataclasses.FrozenInstanceError):
        timing.hang = timedelta(seconds=1)  # type: ignore[misc]
    assert timing.hang == timedelta(seconds=60)


def test_every_field_is_a_timedelta_with_a_comment_on_what_it_bounds() -> None:
    """A field's comment is on its line or on the lines just above it."""
    lines = ALLOWED.read_text().splitlines()
    for f in dataclasses.fields(Timing):
        assert isinstance(getattr(DEFAULT, f.name), timedelta), f.name
        at = next(i for i, line in enumerate(lines) if re.match(rf"\s+{f.name}: timedelta", line))
        assert "#" in lines[at] or lines[at - 1].strip().startswith("#"), f.name
