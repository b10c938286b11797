"""Private torch names live in ``phalanx/torchprivate.py`` only: the one file to check at a
torch upgrade. This reads every other module's source for them."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "phalanx"
ALLOWED = SRC / "torchprivate.py"


def private_torch_uses(path: Path) -> list[str]:
    """Private names this module takes from torch: an import of a ``_module`` of torch, a
    ``_name`` attribute of anything (``options._timeout``, ``pg._register_backend``,
    ``state._metadata``) other than this object's own (``self._x``, ``cls._x``), and a
    ``torch._module`` named in a string."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            parts = [*(node.module or "").split("."), *(a.name for a in node.names)]
            found += [f"import {p}" for p in parts if p.startswith("_") and not p.startswith("__")]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torch") and any(
                    p.startswith("_") for p in alias.name.split(".")
                ):
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") or _own(node.value):
                continue
            if node.attr in TORCH_PRIVATE:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and str(node.value).startswith("torch._"):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def _own(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


# The private names torch objects carry that phalanx once used outside torchprivate (kept
# to the names torch has: phalanx's own classes have private attributes of their own).
TORCH_PRIVATE = {
    "_metadata",
    "_timeout",
    "_register_backend",
    "_set_default_backend",
    "_pytree",
    "_get_default_group",
    "_world",
    "_C",
    "_dynamo",
    "_utils",
    "_store_based_barrier",
}


def test_no_module_but_torchprivate_uses_a_private_torch_name() -> None:
    offenders = {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if path != ALLOWED and (uses := private_torch_uses(path))
    }
    assert offenders == {}


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from torch.utils import _pytree\n"
        "import torch._dynamo\n"
        "options._timeout = 3\n"
        "self._timeout = 3\n"
        "PRELOAD = ['torch._dynamo']\n"
    )
    assert private_torch_uses(sample) == [
        "import _pytree",
        "import torch._dynamo",
        "line 3: ._timeout",
        "line 5: 'torch._dynamo'",
    ]
