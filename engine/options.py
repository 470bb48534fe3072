"""Options declared once: each field of a configuration dataclass carries its type (the
annotation), default, bounds and help (`option(...)`), and everything else is derived from
that declaration — validation (`validate`), parsing from text (`parse`), the help line of a
CLI flag or an environment variable (`describe`). The engine's own `EngineConfig` and every
group of the service's settings are declared this way.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

__all__ = ["Spec", "base_type", "describe", "fields", "option", "parse", "validate"]


@dataclass(frozen=True, slots=True)
class Spec:
    """What a field declares besides its type and default."""

    help: str
    ge: float | None = None  # value >= ge
    gt: float | None = None  # value > gt
    le: float | None = None  # value <= le
    choices: tuple[str, ...] | None = None  # allowed values (of each item, for tuples)


def option(default: Any = dataclasses.MISSING, help: str = "", *, ge: float | None = None,
           gt: float | None = None, le: float | None = None,
           choices: tuple[str, ...] | None = None,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field declared as an option (use as `name: type = option(default, help)`)."""
    md = {"option": Spec(help, ge, gt, le, choices)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def fields(cls: type) -> list[tuple[str, Spec, type, bool]]:
    """(name, spec, base type, optional) of every option of a dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("option")
        if spec is None or not f.init:
            continue
        base, optional = base_type(hints[f.name])
        out.append((f.name, spec, base, optional))
    return out


def base_type(tp: Any) -> tuple[Any, bool]:
    """`int | None` -> (int, True); `Path` -> (Path, False); `tuple[str, ...]` -> (tuple, False)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return base_type(args[0])[0], True
    if origin is tuple:
        return tuple, False
    return tp, False


def _type_ok(value: Any, base: Any) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if base is Path:
        return isinstance(value, Path)
    return isinstance(value, base)


def validate(obj: Any) -> None:
    """Check every option of a dataclass instance against its declaration; raise ValueError
    naming `Class.name`, the bound and the value."""
    owner = type(obj).__name__
    for name, spec, base, optional in fields(type(obj)):
        value = getattr(obj, name)
        where = f"{owner}.{name}"
        if value is None:
            if not optional:
                raise ValueError(f"{where} must be set, got None")
            continue
        if not _type_ok(value, base):
            kind = "a tuple of names" if base is tuple else getattr(base, "__name__", str(base))
            raise ValueError(f"{where} must be {kind}, got {value!r}")
        if base in (int, float):
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{where} must be a number, got nan")
            if spec.ge is not None and not value >= spec.ge:
                raise ValueError(f"{where} must be >= {spec.ge:g}, got {value!r}")
            if spec.gt is not None and not value > spec.gt:
                raise ValueError(f"{where} must be > {spec.gt:g}, got {value!r}")
            if spec.le is not None and not value <= spec.le:
                raise ValueError(f"{where} must be <= {spec.le:g}, got {value!r}")
        if spec.choices is not None:
            items = value if base is tuple else (value,)
            bad = sorted(set(items) - set(spec.choices))
            if bad:
                raise ValueError(f"{where}: unknown value(s) {bad}; choose from "
                                 f"{', '.join(spec.choices)}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse(cls: type, name: str, raw: str) -> Any:
    """The value of option `name` of `cls` from its text form (a CLI flag, an environment
    variable): 'none'/'auto'/'' for an optional option's None, true/false for booleans,
    comma-separated names for tuples."""
    spec = {n: (b, o) for n, _, b, o in fields(cls)}
    if name not in spec:
        raise KeyError(f"{cls.__name__} has no option {name!r}")
    base, optional = spec[name]
    text = raw.strip()
    if optional and text.lower() in ("", "none", "auto"):
        return None
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("expected true or false")
    if base is int:
        return int(text.replace("_", ""))
    if base is float:
        return float(text)
    if base is Path:
        return Path(text).expanduser()
    if base is tuple:
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return text


def describe(cls: type, name: str) -> str:
    """The help of option `name`, with its bounds and choices."""
    for n, spec, base, _ in fields(cls):
        if n != name:
            continue
        extra = []
        if spec.choices is not None:
            extra.append(("comma-separated, of: " if base is tuple else "one of: ")
                         + ", ".join(spec.choices))
        bounds = [f">= {spec.ge:g}" if spec.ge is not None else "",
                  f"> {spec.gt:g}" if spec.gt is not None else "",
                  f"<= {spec.le:g}" if spec.le is not None else ""]
        if any(bounds):
            extra.append(" and ".join(b for b in bounds if b))
        return spec.help + (f" ({'; '.join(extra)})" if extra else "")
    raise KeyError(f"{cls.__name__} has no option {name!r}")
