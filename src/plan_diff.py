"""What differs between two written plans, one line per difference:

    python -m src.plan_diff RUN_DIR_A RUN_DIR_B     # run directories or their plan.json

A field that differs is `path: A -> B`, units, groups, routes and kernels named by their
name (`plan.units[llm].micro_batch: 2 -> 4`), runs of list entries that differ alike in
one line (`model.units[llm].layers[1-96].kernels[fc1].n: 49152 -> 65536`); a rank class's
instruction list is diffed instruction by instruction (`plan.program.classes[<label>] @12 - ...`
for A's, `+ ...` for B's). Exit code 0 when the plans are the same, 1 when they differ, 2 when a
file cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from src.codec import encode, encode_ints
from src.errors import ConfigError
from src.plan_io import PlannedRun, read_plan
from src.program import Payload, RankProgram, Work

ABSENT = "(absent)"
WIDTH = 120  # a value longer than this is shown cut, with its length
NAMED_BY = ("name", "unit")  # list entries carrying one of these are matched by it


def plan_diff(a: PlannedRun, b: PlannedRun) -> list[str]:
    return [f"{path.lstrip('.')}{text}" for path, text in _diff(a, b)]


def _diff(a: Any, b: Any) -> Iterator[tuple[str, str]]:
    """(path below here, ': A -> B' or an instruction line) of each difference."""
    if a is b or a == b:
        return
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for field in dataclasses.fields(a):
            if not field.name.startswith("_"):
                yield from _under(f".{field.name}", _diff(getattr(a, field.name), getattr(b, field.name)))
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            step = f".{key}" if str(key).isidentifier() else f"[{key}]"  # a group's or route's name
            yield from _under(step, _diff(a.get(key, ABSENT), b.get(key, ABSENT)))
    elif _sequences(a, b) and a and all(isinstance(x, RankProgram) for x in [*a, *b]):
        yield from _classes(a, b)
    elif _sequences(a, b) and (key := _naming_key(a, b)) is not None:
        left, right = {getattr(x, key): x for x in a}, {getattr(x, key): x for x in b}
        for name in [*left, *(n for n in right if n not in left)]:
            yield from _under(f"[{name}]", _diff(left.get(name, ABSENT), right.get(name, ABSENT)))
    elif _sequences(a, b) and len(a) == len(b) and any(dataclasses.is_dataclass(x) or isinstance(x, (list, tuple)) for x in a):
        yield from _runs([list(_diff(x, y)) for x, y in zip(a, b)])
    else:
        yield "", f": {_show(a)} -> {_show(b)}"


def _under(step: str, lines: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    return ((step + path, text) for path, text in lines)


def _sequences(a: Any, b: Any) -> bool:
    return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))


def _naming_key(a: Any, b: Any) -> str | None:
    """The attribute that names each entry of both sequences once, if one does."""
    for key in NAMED_BY:
        if all(hasattr(x, key) for x in [*a, *b]) and all(len({getattr(x, key) for x in s}) == len(s) for s in (a, b)):
            return key
    return None


def _runs(per_index: list[list[tuple[str, str]]]) -> Iterator[tuple[str, str]]:
    """Consecutive entries that differ alike, as one run ([1-96])."""
    start = 0
    while start < len(per_index):
        end = start
        while end + 1 < len(per_index) and per_index[end + 1] == per_index[start]:
            end += 1
        where = f"[{start}]" if start == end else f"[{start}-{end}]"
        yield from _under(where, iter(per_index[start]))
        start = end + 1


def _classes(a: Any, b: Any) -> Iterator[tuple[str, str]]:
    """Rank classes side by side in order; each one's instructions diffed as lines."""
    if len(a) != len(b):
        yield "", f": {len(a)} rank classes -> {len(b)}"
    for index, (left, right) in enumerate(zip(a, b)):
        name = f"[{left.label or index}]"
        for field in ("ranks", "label", "units", "pipelined"):
            if getattr(left, field) != getattr(right, field):
                yield f"{name}.{field}", f": {_show(getattr(left, field))} -> {_show(getattr(right, field))}"
        old, new = [_instruction(i) for i in left.instructions], [_instruction(i) for i in right.instructions]
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
            if tag != "equal":
                yield from ((name, f" @{i} - {old[i]}") for i in range(i1, i2))
                yield from ((name, f" @{j} + {new[j]}") for j in range(j1, j2))


def _instruction(instruction: Any) -> str:
    """One line: its kind, then the fields not at their default (a Work's spelled out)."""
    return f"{type(instruction).__name__} {' '.join(_fields(instruction))}"


def _fields(obj: Any) -> Iterator[str]:
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        if isinstance(value, Work):
            yield from _fields(value)
        else:
            yield f"{field.name}={_show(value)}"


def _show(value: Any) -> str:
    if value is ABSENT:
        return ABSENT
    if isinstance(value, Payload) or isinstance(value, str):
        text = str(value)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(x, Payload) for x in value):
        text = "[" + ",".join(map(str, value)) + "]"
    elif isinstance(value, (list, tuple)) and len(value) > 2 and all(type(x) is int and x >= 0 for x in value):
        text = encode_ints(value)  # rank lists
    elif dataclasses.is_dataclass(value):
        text = f"{type(value).__name__}{json.dumps(encode(value, type(value)), separators=(',', ':'))}"
    else:
        text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= WIDTH else f"{text[: WIDTH - 20]}... ({len(text)} chars)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.plan_diff", description="What differs between two written plans.")
    parser.add_argument("a", type=Path, help="a run directory or its plan.json")
    parser.add_argument("b", type=Path, help="another")
    args = parser.parse_args(argv)
    try:
        a, b = read_plan(args.a), read_plan(args.b)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines = plan_diff(a, b)
    for line in lines:
        print(line)
    if not lines:
        print(f"the plans are the same ({a.plan.strategy}, {a.plan.devices} ranks)")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
