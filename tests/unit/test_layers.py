"""Imports point one way only (DESIGN.md "Layers"): events <- projections <- nnx_es <- tools.

events/       msgspec, lmdb, stdlib                      (no torch, no nnx_es, no projections)
projections/  events, msgspec, pure stdlib               (no torch, lmdb, structlog, I/O, clock)
nnx_es/       events, projections, third-party runtime   (never tools, never tests)
tools/        anything above                             (never tests)
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STDLIB = frozenset(sys.stdlib_module_names)

#: stdlib modules that do I/O, read a clock or randomness, or log: not in a pure fold.
IMPURE_STDLIB = frozenset(
    {
        "os", "io", "pathlib", "shutil", "socket", "subprocess", "tempfile", "glob", "fcntl", "mmap",
        "sqlite3", "pickle", "shelve", "time", "datetime", "random", "secrets", "logging", "threading",
        "multiprocessing", "asyncio", "urllib", "http", "builtins",
    }
)  # fmt: skip
IMPURE_CALLS = frozenset({"open", "print", "input", "exec", "eval", "__import__"})


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if ".venv" not in p.parts)


def imported_roots(source: str, package: str) -> set[str]:
    """Top-level names of every module ``source`` imports (anywhere, TYPE_CHECKING included).

    Relative imports resolve to ``package``; ``importlib.import_module("x")`` counts as importing ``x``.
    """
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add(package if node.level else (node.module or "").split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            roots.add(node.args[0].value.split(".")[0])
    return roots


def called_names(source: str) -> set[str]:
    return {
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }


def _violations(package: str, allowed: frozenset[str], forbidden: frozenset[str] = frozenset()) -> list[str]:
    out = []
    files = _sources(package)
    for path in files:
        for root in sorted(imported_roots(path.read_text(), package)):
            ok = (root in STDLIB or root in allowed) and root not in forbidden
            if not ok:
                out.append(f"{path.relative_to(REPO)} imports {root}")
    return out


# --- the checker itself can fail ----------------------------------------------------------


def test_checker_sees_every_form_of_import() -> None:
    source = (
        "import os.path\n"
        "import torch as t, lmdb\n"
        "from nnx_es.trainer import Trainer\n"
        "from . import sibling\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from structlog import BoundLogger\n"
        "def f():\n"
        "    import transitions\n"
        "    importlib.import_module('numpy.linalg')\n"
        "    return open('x')\n"
    )
    assert imported_roots(source, "projections") == {
        "os", "torch", "lmdb", "nnx_es", "projections", "typing", "structlog", "transitions", "numpy",
    }  # fmt: skip
    assert "open" in called_names(source)


# --- the rules --------------------------------------------------------------------------------


def test_packages_exist_and_parse() -> None:
    for package in ("events", "projections", "nnx_es"):
        files = _sources(package)
        assert REPO / package / "__init__.py" in files
        for path in files:
            ast.parse(path.read_text(), filename=str(path))
    for path in _sources("tools"):
        ast.parse(path.read_text(), filename=str(path))


def test_events_imports_only_msgspec_lmdb_and_stdlib() -> None:
    assert _violations("events", frozenset({"events", "msgspec", "lmdb"})) == []


def test_projections_imports_only_events_msgspec_and_pure_stdlib() -> None:
    assert _violations("projections", frozenset({"projections", "events", "msgspec"}), IMPURE_STDLIB) == []


def test_projections_do_no_io() -> None:
    bad = [
        f"{path.relative_to(REPO)} calls {name}()"
        for path in _sources("projections")
        for name in sorted(called_names(path.read_text()) & IMPURE_CALLS)
    ]
    assert bad == []


@pytest.mark.parametrize("package", ["events", "projections", "nnx_es"])
def test_runtime_packages_never_import_tools_or_tests(package: str) -> None:
    bad = [
        f"{path.relative_to(REPO)} imports {root}"
        for path in _sources(package)
        for root in imported_roots(path.read_text(), package) & {"tools", "tests", "conftest"}
    ]
    assert bad == []


def test_lower_layers_never_import_higher_ones() -> None:
    higher = {"events": {"projections", "nnx_es", "tools"}, "projections": {"nnx_es", "tools"}}
    bad = [
        f"{path.relative_to(REPO)} imports {root}"
        for package, banned in higher.items()
        for path in _sources(package)
        for root in imported_roots(path.read_text(), package) & banned
    ]
    assert bad == []


def test_tools_never_import_tests() -> None:
    bad = [
        f"{path.relative_to(REPO)} imports {root}"
        for path in _sources("tools")
        for root in imported_roots(path.read_text(), "tools") & {"tests", "conftest"}
    ]
    assert bad == []


def test_importing_events_and_projections_loads_no_torch_or_runtime() -> None:
    code = (
        "import sys, events, projections\n"
        "heavy = sorted({'torch', 'nnx_es', 'structlog', 'transitions', 'numpy'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# --- seams of the runtime (STYLE.md "Seams"; docs/ARCHITECTURE.md) ------------------------------

#: the composition root, the model facade over it, and the package's lazy public API
TRAINER_IMPORTERS = frozenset({"nnx_es/trainer.py", "nnx_es/nnmodel.py", "nnx_es/__init__.py"})


def imported_modules(source: str, package: str, path: Path) -> set[str]:
    """Dotted names of every module ``source`` imports (TYPE_CHECKING and function bodies included),
    relative imports resolved against ``path`` inside ``package``."""
    mods: set[str] = set()
    here = ".".join(path.relative_to(REPO).with_suffix("").parts)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: -node.level]
                mods.add(".".join([*base, node.module] if node.module else base))
            else:
                mods.add(node.module or "")
    return mods


def private_imports(source: str) -> list[str]:
    """``from nnx_es... import _name`` and ``module._name`` reads of another nnx_es module's private names."""
    out = []
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in {"nnx_es", "events", "projections"}:
            out += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")
                    and not a.name.startswith("__")]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in {"nnx_es", "events", "projections"}:
                    aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            out.append(f"{aliases[node.value.id]}.{node.attr}")
    return out


def test_the_seam_checkers_can_fail() -> None:
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nnx_es.trainer import Trainer\n"
    assert "nnx_es.trainer" in imported_modules(src, "nnx_es", REPO / "nnx_es" / "engine.py")
    assert "nnx_es.trainer" in imported_modules("from .trainer import Trainer\n", "nnx_es", REPO / "nnx_es" / "x.py")
    assert private_imports("from nnx_es.trainer import _dispatch\n") == ["from nnx_es.trainer import _dispatch"]
    assert private_imports("import nnx_es.runtime.commit as c\nc._Pending\n") == ["nnx_es.runtime.commit._Pending"]
    assert private_imports("from nnx_es.runtime.commit import Committer\n") == []


def test_only_the_composition_root_and_the_model_import_the_trainer() -> None:
    bad = [
        str(path.relative_to(REPO))
        for path in _sources("nnx_es")
        if str(path.relative_to(REPO)) not in TRAINER_IMPORTERS
        and "nnx_es.trainer" in imported_modules(path.read_text(), "nnx_es", path)
    ]
    assert bad == [], f"modules importing nnx_es.trainer (a collaborator takes what it needs in its constructor): {bad}"


@pytest.mark.parametrize("package", ["events", "projections", "nnx_es", "tools"])
def test_no_module_reads_another_modules_private_names(package: str) -> None:
    bad = [f"{path.relative_to(REPO)}: {what}" for path in _sources(package)
           for what in private_imports(path.read_text())]
    assert bad == []
