"""The house's import graph, read from the source (no module is imported).

A room is a package (its modules together) or a module directly under src/. Every
`import` of a src module counts, wherever it is written: at the top, inside a function,
or under TYPE_CHECKING (a type-only import is a dependency of the design all the same).
The layers say which way arrows may run: a room imports rooms of its own layer or below.

    python -m tests.import_graph           # the house's figures
    python -m tests.import_graph --arrows  # and every arrow between rooms
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Bottom to top. A planner may price its candidates with the simulator, so the planners sit
# above the backends; the backends run a Program and never import a planner or the door.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "foundation",
        (
            "src.errors",
            "src.out_paths",
            "src.bounds",
            "src.progress",
            "src.parallel_work",
            "src.collector",
            "src.mesh",
            "src.cluster_profile",
            "src.measured_files",
            "src.cluster_inputs",
            "src.gemm_measurements",
            "src.attention_measurements",
            "src.cluster",
            "src.config",
            "src.timeline",
            "src.backends",
            "src.codec",
        ),
    ),
    ("descriptions", ("src.models", "src.costmodel", "src.batch_layout", "src.program", "src.schedules", "src.data")),
    (
        "measures and backends",
        ("src.metrics", "src.report", "src.write_failures", "src.plan_io", "src.sim", "src.runtime", "src.runtime.modules"),
    ),
    ("planners", ("src.strategies", "src.strategies.*")),
    ("front door", ("src.setup",)),
    (
        "tools",
        (
            "src.run",
            "src.prepare",
            "src.sweep",
            "src.gantt",
            "src.compare",
            "src.balance_study",
            "src.calibrate",
            "src.fuzz",
            "src.validate",
            "src.heldout",
            "src.gemm_fixed",
            "src.figure_diff",
            "src.plan_diff",
            "src.reproduce",
            "src.reproduction",
        ),
    ),
)


@dataclass(frozen=True)
class Graph:
    modules: dict[str, Path]  # dotted name -> file
    imports: set[tuple[str, str]]  # (importer, imported), modules

    def room(self, module: str) -> str:
        if self.modules[module].name == "__init__.py":
            return module
        return module.rpartition(".")[0] if module.count(".") > 1 else module

    def rooms(self) -> set[str]:
        return {self.room(m) for m in self.modules} - {"src"}

    def arrows(self) -> set[tuple[str, str]]:
        """Room-to-room imports (a package's own modules importing each other is none)."""
        pairs = {(self.room(a), self.room(b)) for a, b in self.imports}
        return {(a, b) for a, b in pairs if a != b and "src" not in (a, b)}

    def lines(self) -> int:
        return sum(len(path.read_text().splitlines()) for path in self.modules.values())


def read_graph(src: Path = SRC) -> Graph:
    modules = {}
    for path in src.rglob("*.py"):
        parts = path.relative_to(src.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = set()
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from src.a import b` imports module src.a.b when b is one, else src.a.
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    imports.add((name, target))
    return Graph(modules, imports)


def layer_of(room: str) -> int:
    for index, (_, rooms) in enumerate(LAYERS):
        for pattern in rooms:
            if room == pattern or (pattern.endswith(".*") and room.startswith(pattern[:-1])):
                return index
    raise KeyError(f"{room} has no layer in tests/import_graph.py LAYERS")


def upward(graph: Graph) -> list[tuple[str, str]]:
    return sorted((a, b) for a, b in graph.arrows() if layer_of(a) < layer_of(b))


def cycles(graph: Graph) -> list[list[str]]:
    """Modules that import each other, directly or around a loop: the strongly connected
    components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    successors: dict[str, list[str]] = {m: [] for m in graph.modules}
    for a, b in sorted(graph.imports):
        successors[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(successors):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, next_child = work.pop()
            if next_child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            children = successors[node]
            if next_child < len(children):
                work.append((node, next_child + 1))
                child = children[next_child]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrows", action="store_true", help="list every arrow between rooms")
    args = parser.parse_args()
    graph = read_graph()
    arrows, up, loops = graph.arrows(), upward(graph), cycles(graph)
    print(
        f"{len(graph.modules)} modules, {len(graph.rooms())} rooms, {graph.lines()} lines, "
        f"{len(arrows)} arrows between rooms ({len(up)} running up), {len(loops)} import cycles"
    )
    for a, b in up:
        print(f"  up: {a} -> {b}")
    for loop in loops:
        print(f"  cycle: {' <-> '.join(loop)}")
    if args.arrows:
        for a, b in sorted(arrows):
            print(f"  {a} -> {b}")


if __name__ == "__main__":
    main()
