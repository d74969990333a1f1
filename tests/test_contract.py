"""The contract between planners and backends (docs/design.md):

- the backends know no strategy: nothing in src/runtime or src/sim imports a strategy
  module, compares a strategy's name or reads a plan's `details` (display only);
- the runtime never imports the front door (src.run), so no import cycle;
- a named mesh lays out ranks, groups and families for any number of axes.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from src.mesh import Mesh, Sharding, tensor_parallel
from src.strategies import STRATEGIES

SRC = Path(__file__).resolve().parent.parent / "src"
BACKEND_DIRS = ("runtime", "sim")
# strategy=auto plans nothing itself: its plan is the winner's, under the winner's name
# (and "auto" is also a backend setting's value, dist_backend=auto).
PLANNING_STRATEGIES = set(STRATEGIES) - {"auto"}


def _backend_sources() -> list[Path]:
    return sorted(p for d in BACKEND_DIRS for p in (SRC / d).rglob("*.py"))


@pytest.mark.parametrize("path", _backend_sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_backends_know_no_strategy(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("src.strategies"), f"{path.name} imports {node.module}"
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("src.strategies") for a in node.names), path.name
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value not in PLANNING_STRATEGIES, f"{path.name} names strategy {node.value!r}"
        if isinstance(node, ast.Attribute) and node.attr == "details":
            pytest.fail(f"{path.name}:{node.lineno} reads a plan's details")


@pytest.mark.slow  # a fresh interpreter; tests/test_imports.py checks the static graph in the quick tier
@pytest.mark.torch
def test_the_runtime_never_imports_the_front_door():
    modules = [f"src.runtime.{p.stem}" for p in (SRC / "runtime").glob("*.py") if p.stem != "__init__"]
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('src.run' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC.parent, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # a fresh interpreter importing torch and DeepSpeed
@pytest.mark.torch
def test_a_worker_loads_the_written_plan_and_never_plans_or_runs_hydra():
    """What a worker imports (its entry, its session, the local driver) leaves the
    planners, the door and Hydra out: it runs the plan the door wrote (src/plan_io)."""
    code = (
        "import sys\n"
        "import src.runtime.worker, src.runtime.session, src.runtime.driver\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf') "
        "or m == 'src.setup' or m == 'src.run' or m.startswith('src.strategies')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=SRC.parent, check=True)
    assert out.stdout.strip() == "[]"


# ---- meshes -----------------------------------------------------------------------------
def test_a_mesh_of_four_axes_lays_out_par4d_ranks():
    # Par4D's (x, y, z, data) = (2, 2, 2, 2): rank = x + 2(y + 2(z + 2d)).
    mesh = Mesh.contiguous((("x", 2), ("y", 2), ("z", 2), ("dp", 2)))
    assert mesh.rank(x=1, y=0, z=1, dp=1) == 1 + 2 * (0 + 2 * (1 + 2 * 1))
    assert mesh.coords(13) == {"x": 1, "y": 0, "z": 1, "dp": 1}
    assert mesh.group("y", 5) == (5, 7) and mesh.group("z", 5) == (1, 5) and mesh.group("dp", 5) == (5, 13)
    assert mesh.family("x")[:2] == [(0, 1), (2, 3)] and mesh.family("y")[:4] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    for axis in ("x", "y", "z", "dp"):
        family = mesh.family(axis)
        assert sorted(r for g in family for r in g) == list(range(16)) and all(len(g) == 2 for g in family)
    assert mesh.group("tp", 5) == (5,)  # an axis the mesh does not have: the rank alone


def test_a_mesh_over_given_ranks_and_its_errors():
    mesh = Mesh((("tp", 2), ("dp", 2)), (8, 9, 12, 13))
    assert mesh.slice(dp=1) == (12, 13) and mesh.group("dp", 9) == (9, 13) and 12 in mesh and 10 not in mesh
    with pytest.raises(ValueError, match="holds 4 ranks, given 3"):
        Mesh((("tp", 2), ("dp", 2)), (0, 1, 2))
    with pytest.raises(ValueError, match="repeat"):
        Mesh((("tp", 2), ("tp", 2)), (0, 1, 2, 3))
    with pytest.raises(ValueError, match="twice"):
        Mesh((("tp", 2),), (0, 0))
    with pytest.raises(KeyError, match="rank 3"):
        mesh.coords(3)


def test_a_sharding_divides_each_gemm_as_its_layout_says():
    megatron = tensor_parallel(4)
    assert [megatron.gemm_divisors(split) for split in ("n", "k", "batch", "none")] == [
        (1, 4, 1, 1),
        (1, 1, 4, 1),
        (1, 1, 1, 4),
        (1, 1, 1, 1),
    ]
    grid = Sharding((("x", 2), ("y", 4), ("z", 8)))
    assert grid.gemm_divisors("n") == (8, 2, 4, 1)  # (m/z x k/y) @ (k/y x n/x)
    assert grid.gemm_divisors("k") == (8, 4, 2, 1)  # the next layer is transposed: x and y swap
    transposed = Sharding((("x", 2), ("y", 4), ("z", 8)), transposed=True)
    assert transposed.gemm_divisors("n") == (8, 4, 2, 1)
    assert grid.devices == 64 and tensor_parallel(1).devices == 1
    with pytest.raises(ValueError, match="not both"):
        Sharding((("tp", 2), ("x", 2)))
