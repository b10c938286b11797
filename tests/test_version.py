"""The version lives in a leaf module; no phalanx module takes a name from the package root
(an import loop: the root imports every module)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import phalanx
from phalanx.version import __version__

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "phalanx"


def test_the_version_is_pyprojects() -> None:
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib: Python 3.11 on)
    found = re.search(r'^\[project\][^\[]*?^version = "([^"]+)"', text, flags=re.M | re.S)
    assert found is not None
    assert __version__ == found.group(1) == phalanx.__version__


def test_the_version_module_imports_nothing() -> None:
    tree = ast.parse((SRC / "version.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_module_takes_a_name_from_the_package_root() -> None:
    """``from phalanx import catalog`` (a module) is fine; ``from phalanx import
    __version__`` or ``Learner`` (a name the root defines by importing everything) is not."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "phalanx" and node.level == 0:
                for alias in node.names:
                    if not ((SRC / f"{alias.name}.py").is_file() or (SRC / alias.name).is_dir()):
                        offenders.append(f"{path.relative_to(SRC)}: {alias.name}")
    assert offenders == []
