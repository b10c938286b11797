"""The ddp strategy's folders are its layers: each imports only those below it, and nothing
but the package's lazy ``run_ddp`` imports the supervisor (so a worker process never loads
it). Imports under ``if TYPE_CHECKING:`` do not run and are not counted."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

DDP = Path(__file__).resolve().parent.parent / "src" / "phalanx" / "strategies" / "ddp"
PREFIX = "phalanx.strategies.ddp"

# What each part of the strategy may import of the strategy (itself always).
LEAVES = {"timing", "process"}
MAY = {
    "timing": set(),
    "process": set(),
    "wire": {"timing"},
    "coordinator": {"timing", "wire"},
    "worker": {"timing", "process", "wire"},
    "agent": {"timing", "process", "wire", "worker"},
    "nodes": {"timing", "process", "wire", "coordinator", "agent", "worker"},
    "supervisor": {"timing", "process", "wire", "coordinator", "agent", "worker", "nodes"},
}


def _part(path: Path) -> str:
    rel = path.relative_to(DDP)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """Every module a file imports when it runs (not under ``if TYPE_CHECKING:``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def _strategy_part(name: str) -> str | None:
    """The part of the strategy an imported name belongs to (None: outside it)."""
    if not name.startswith(PREFIX + "."):
        return None
    return name[len(PREFIX) + 1 :].split(".")[0]


def test_every_module_of_the_strategy_is_in_a_layer() -> None:
    parts = {_part(p) for p in DDP.rglob("*.py") if p.name != "__init__.py" or p.parent != DDP}
    assert parts == set(MAY), parts ^ set(MAY)


@pytest.mark.parametrize("part", sorted(MAY))
def test_a_layer_imports_only_the_layers_below_it(part: str) -> None:
    files = [p for p in DDP.rglob("*.py") if _part(p) == part and p != DDP / "__init__.py"]
    assert files
    wrong = []
    for path in files:
        for line, name in _runtime_imports(ast.parse(path.read_text())):
            other = _strategy_part(name)
            if other is not None and other != part and other not in MAY[part]:
                wrong.append(f"{path.relative_to(DDP)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_the_package_does_not_load_the_supervisor_until_asked() -> None:
    code = (
        "import sys\n"
        "import phalanx.strategies.ddp.worker.worker\n"
        "import phalanx.strategies.ddp.wire.messages\n"
        f"assert '{PREFIX}.supervisor' not in sys.modules, 'worker loaded the supervisor'\n"
        f"assert '{PREFIX}.nodes.hub' not in sys.modules, 'worker loaded the nodes'\n"
        f"assert '{PREFIX}.agent.agent' not in sys.modules, 'worker loaded the agent'\n"
        "from phalanx.strategies.ddp import run_ddp\n"
        f"assert '{PREFIX}.supervisor' in sys.modules and callable(run_ddp)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_stack_markers_name_files_that_exist() -> None:
    """hangs.py tells phalanx's own regroup path and the group's waits by file path in a
    stack dump: the paths must be those of the modules (a move would silently break it)."""
    from phalanx.strategies.ddp.coordinator import hangs
    from phalanx.strategies.ddp.worker import group, worker

    frame = f'  File "{worker.__file__}", line 1 in leave_group'
    assert hangs.REGROUP_FRAMES.search(frame), frame
    stacks = f'Current thread (most recent call first):\n  File "{group.__file__}", line 1 in w'
    assert hangs.waits_in_collective(stacks), stacks
    assert not hangs.waits_in_collective(stacks.replace("group.py", "groups.py"))
