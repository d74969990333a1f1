"""Typed values to JSON and back, driven by their dataclasses' type hints.

A dataclass becomes an object of its fields, leaving out those at their default and those
named with a leading underscore (caches its constructor rebuilds); where a field's type
is a union of dataclasses (an Instruction, a Route) the object names its class under
"type". A sequence of integers (rank lists: tens of thousands on a large cluster) becomes
a string of runs, "0-7,16-30:2" (start-end inclusive, then the step when it is not 1),
order kept. Decoding calls each class's constructor, so its own checks run on what a file
says. Each class's fields are compiled into encoders and decoders once.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Callable

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]
TYPE_KEY = "type"
_MISSING = object()


class CodecError(ValueError):
    """A value that is not what its type hint says."""


def register(cls: type, enc: Encode, dec: Decode) -> None:
    """A class's own codec in place of its fields' (one that keeps shared objects shared)."""
    _CACHE[cls] = (enc, dec)
    _REGISTERED.add(cls)


def fields_codec(cls: type) -> tuple[Encode, Decode]:
    """A dataclass's codec by its fields, whatever is registered for it."""
    return _dataclass(cls, cache=False)


def encode(value: Any, hint: Any) -> Any:
    return _codec(hint)[0](value)


def decode(data: Any, hint: Any) -> Any:
    return _codec(hint)[1](data)


def encode_ints(values: tuple[int, ...] | list[int]) -> str:
    """'0-7,16-30:2,5': arithmetic runs in order (descending runs too)."""
    parts: list[str] = []
    i, n = 0, len(values)
    while i < n:
        start = values[i]
        if start < 0 or not isinstance(start, int) or isinstance(start, bool):
            raise CodecError(f"{start!r} is not a non-negative integer")
        j = i + 1
        if j < n and values[j] != start:
            step = values[j] - start
            while j + 1 < n and values[j + 1] - values[j] == step:
                j += 1
            if j - i >= 2 or step == 1:
                parts.append(f"{start}-{values[j]}" if step == 1 else f"{start}-{values[j]}:{step}")
                i = j + 1
                continue
        parts.append(str(start))
        i += 1
    return ",".join(parts)


def decode_ints(text: Any) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise CodecError(f"expected a run string of integers, got {type(text).__name__}")
    if not text:
        return ()
    out: list[int] = []
    for part in text.split(","):
        if "-" not in part:
            out.append(int(part))
            continue
        span, _, step = part.partition(":")
        first, last = (int(x) for x in span.split("-"))
        stride = int(step) if step else 1
        if stride == 0 or (last - first) % stride or (last - first) * stride < 0:
            raise CodecError(f"run {part!r} does not step from {first} to {last}")
        out.extend(range(first, last + (1 if stride > 0 else -1), stride))
    return tuple(out)


_CACHE: dict[Any, tuple[Encode, Decode]] = {}
_REGISTERED: set[type] = set()  # classes with a codec of their own (register)


def _codec(hint: Any) -> tuple[Encode, Decode]:
    try:
        return _CACHE[hint]
    except (KeyError, TypeError):
        pass
    made = _make(hint)
    try:
        _CACHE[hint] = made
    except TypeError:  # an unhashable hint: compiled each time
        pass
    return made


def _same(value: Any) -> Any:
    """A value JSON holds as it is (compiled codecs read it without calling this)."""
    return value


def _make(hint: Any) -> tuple[Encode, Decode]:
    if hint in (int, str, bool, Any, dict, list) or hint is type(None):
        return _same, _same
    if hint is float:
        return _same, _same
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return _same, _same
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            enc, dec = _codec(members[0])
            return (lambda v: None if v is None else enc(v)), (lambda d: None if d is None else dec(d))
        return _tagged(members, optional=len(members) < len(args))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is int:
                return encode_ints, decode_ints
            enc, dec = _codec(args[0])
            if enc is _same and dec is _same:
                return list, tuple
            return (lambda v: [enc(x) for x in v]), (lambda d: tuple(dec(x) for x in d))
        codecs = [_codec(a) for a in args]
        if all(c == (_same, _same) for c in codecs):  # scalars: as they are
            return list, tuple
        return (
            lambda v: [c[0](x) for c, x in zip(codecs, v)],
            lambda d: tuple(c[1](x) for c, x in zip(codecs, d)),
        )
    if origin is list:
        enc, dec = _codec(args[0])
        if enc is _same and dec is _same:
            return list, list
        return (lambda v: [enc(x) for x in v]), (lambda d: [dec(x) for x in d])
    if origin in (dict, collections.abc.Mapping):
        if not args:
            return _same, _same
        key = args[0]
        venc, vdec = _codec(args[1])
        parse = int if key is int else str
        return (lambda v: {str(k): venc(x) for k, x in v.items()}), (lambda d: {parse(k): vdec(x) for k, x in d.items()})
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint)
    if isinstance(hint, type) and hint.__subclasses__():  # an abstract base: its dataclass subclasses
        subclasses: list[type] = list(filter(dataclasses.is_dataclass, hint.__subclasses__()))
        return _tagged(subclasses, optional=False)
    raise TypeError(f"no JSON codec for {hint!r}")


def _tagged(members: list[type], optional: bool) -> tuple[Encode, Decode]:
    """A union of dataclasses: each object names its class."""
    by_class = {m: _codec(m) for m in members}
    by_name = {m.__name__: c[1] for m, c in by_class.items()}
    # A member coded by its fields is compiled to write its name first itself (a Program's
    # instructions are hundreds of thousands of these: one dict each, not two).
    named = {
        m: _dataclass(m, cache=False, tag=m.__name__)[0]
        if dataclasses.is_dataclass(m) and m not in _REGISTERED
        else lambda value, c=c, name=m.__name__: {TYPE_KEY: name, **c[0](value)}
        for m, c in by_class.items()
    }

    def enc(value: Any) -> Any:
        if value is None and optional:
            return None
        return named[type(value)](value)

    def dec(data: Any) -> Any:
        if data is None and optional:
            return None
        name = data.get(TYPE_KEY) if isinstance(data, dict) else None
        if name not in by_name:
            raise CodecError(f"expected one of {sorted(by_name)}, got {name!r}")
        return by_name[name](data)

    return enc, dec


def _dataclass(cls: type, cache: bool = True, tag: str | None = None) -> tuple[Encode, Decode]:
    """A dataclass's codec, compiled into one function each way (attribute reads and
    default checks written out per field: a plan holds hundreds of thousands of objects);
    `tag`: a class name its encoding starts with (a member of a union)."""
    # Placeholders first: a dataclass may refer to itself through its fields.
    compiled: list[Callable[[Any], Any]] = []
    if cache:
        _CACHE[cls] = (lambda value: compiled[0](value)), (lambda data: compiled[1](data))
    hints = typing.get_type_hints(cls)
    names: dict[str, Any] = {"MISSING": _MISSING, "cls": cls, "CodecError": CodecError, "TYPE_KEY": TYPE_KEY}
    enc_lines = ["def enc(value):", "    out = {}" if tag is None else f"    out = {{TYPE_KEY: {tag!r}}}"]
    dec_lines = [
        "def dec(data):",
        "    if type(data) is not dict:",
        "        raise CodecError(f'{cls.__name__}: expected an object, got {type(data).__name__}')",
    ]
    dec_lines += ["    get = data.get", "    kwargs = {}"]
    fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_") and f.init]
    for i, f in enumerate(fields):
        field_enc, field_dec = _codec(hints[f.name])
        names[f"e{i}"], names[f"d{i}"] = field_enc, field_dec
        value = "x" if field_enc is _same else f"e{i}(x)"
        enc_lines.append(f"    x = value.{f.name}")
        if f.default is not dataclasses.MISSING:
            names[f"default{i}"] = f.default
            enc_lines.append(f"    if x is not default{i} and x != default{i}:")
            enc_lines.append(f"        out[{f.name!r}] = {value}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"default{i}"] = f.default_factory()
            enc_lines.append(f"    if x != default{i}:")
            enc_lines.append(f"        out[{f.name!r}] = {value}")
        else:
            enc_lines.append(f"    out[{f.name!r}] = {value}")
        dec_lines.append(f"    x = get({f.name!r}, MISSING)")
        dec_lines.append("    if x is not MISSING:")
        dec_lines.append(f"        kwargs[{f.name!r}] = {'x' if field_dec is _same else f'd{i}(x)'}")
    enc_lines.append("    return out")
    type_field = any(f.name == TYPE_KEY for f in fields)
    dec_lines.append(f"    if len(kwargs) + {'0' if type_field else '(TYPE_KEY in data)'} != len(data):")
    dec_lines.append("        unknown = sorted(set(data) - set(kwargs) - {TYPE_KEY})")
    dec_lines.append("        raise CodecError(f'{cls.__name__} has no field(s) {unknown}')")
    dec_lines.append("    return cls(**kwargs)")
    exec("\n".join(enc_lines + dec_lines), names)  # noqa: S102 - code built from the class's own field names
    compiled[:] = [names["enc"], names["dec"]]
    if cache:
        _CACHE[cls] = (names["enc"], names["dec"])
    return names["enc"], names["dec"]
