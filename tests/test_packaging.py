"""What pyproject.toml declares: every third-party module that src/, hydra_plugins/ and
benchmarks/ import belongs to a declared distribution, and one imported at module level
outside the real backend (src/runtime, src/data) to a core dependency (a user without the
`runtime` extra imports it too); the `mmdist` command is the front door. That the README's
and docs/'s commands paste into a shell as they read is tests/test_docs.py's."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, cli_env

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
LOCAL = {"src", "hydra_plugins", "tests"}
RUNTIME_ONLY = ("src/runtime/", "src/data/")


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level) of each import in a file, but those
    for type checkers only."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    checking = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name.split(".")[0], id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], id(node) in top))
    return out


def _project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def test_every_imported_distribution_is_declared():
    project = _project()
    core = {_name(r) for r in project["dependencies"]}
    declared = core | {_name(r) for group in project["optional-dependencies"].values() for r in group}
    distributions = importlib.metadata.packages_distributions()
    undeclared, not_core = set(), set()
    for folder in ("src", "hydra_plugins", "benchmarks"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(REPO_ROOT))
            for module, at_top in _imports(path):
                # A script beside it (benchmarks import one another) is local too.
                if module in LOCAL or (path.parent / f"{module}.py").is_file():
                    continue
                if module in sys.stdlib_module_names or module == "__future__":
                    continue
                names = {_name(d) for d in distributions.get(module, [module])}
                if not names & declared:
                    undeclared.add(f"{module} ({where})")
                elif at_top and folder == "src" and not where.startswith(RUNTIME_ONLY) and not names & core:
                    not_core.add(f"{module} ({where})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {sorted(undeclared)}"
    assert not not_core, f"imported at module level outside the real backend, but only an optional dependency: {sorted(not_core)}"


@pytest.mark.slow  # the front door in a subprocess
def test_the_mmdist_command_is_the_front_door(tmp_path):
    module, function = _project()["scripts"]["mmdist"].split(":")
    assert callable(getattr(importlib.import_module(module), function))
    # What the installed script runs, with the script's name as argv[0].
    code = f"import sys; from {module} import {function}; sys.argv[0] = 'mmdist'; {function}()"
    args = ["model=clip", "logger=none", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "summary.json").exists() and (tmp_path / "run.log").exists()
    assert result.stdout.startswith("simulated iteration | ")


@pytest.mark.slow  # a fresh interpreter
def test_the_torch_free_tier_collects_without_torch():
    """A simulator-only install (`pip install -e .`, no torch) runs the tests outside
    conftest's TORCH_MODULES: each of those modules imports in an interpreter where
    `import torch` fails (a module that needs torch at its top belongs in TORCH_MODULES, a
    test that needs it imports it inside and is marked torch)."""
    from tests.conftest import TESTS, imports_torch

    modules = [
        ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        for path in sorted(TESTS.rglob("test_*.py"))
        if not imports_torch(path)
    ]
    code = (
        "import importlib, sys\n"
        "sys.modules['torch'] = None  # `import torch` raises ImportError, as where it is not installed\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as error:\n"
        "        print(name, error)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(modules) > 40 and result.stdout == "", f"import torch at their top: {result.stdout}"
