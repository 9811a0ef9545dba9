"""Typed config loading: a YAML mapping into a dataclass, with one-line errors.

Unknown keys are an error naming the key and the nearest valid one. A field may carry a converter in
its metadata (``field(metadata={"convert": parse_size})``) that turns the raw YAML value into the
field's value and raises ConfigError on bad input. Shared by the store's config and the trainer's.

Every key of a config says what it means beside its type and default (``setting``): its metadata's ``help``,
read by ``tiermem-train --keys`` and the generator of docs/config.md (``trainer.config_doc``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from tiermem.errors import ConfigError, nearest, shown


def setting(default: Any = dataclasses.MISSING, *, help: str, shown: str | None = None, group: str | None = None,
            convert: Any = None, yaml_type: str | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its meaning: ``help`` (one paragraph; what the key does, its values), ``shown``
    (the default as the docs show it, where the field's default value is a stand-in such as None for "decided
    at start"), ``group`` (the heading it is listed under), ``convert`` (see the module) and ``yaml_type`` (what
    the YAML may give, where a converter takes more than the field's type says: ``size | auto``)."""
    meta = {"help": help}
    given = (("shown", shown), ("group", group), ("convert", convert), ("yaml_type", yaml_type))
    meta.update({k: v for k, v in given if v is not None})
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: unexpected value {value!r}")
    if origin is typing.Literal:
        options = typing.get_args(tp)
        if isinstance(value, bool):  # YAML reads a bare no/yes/false/true as a bool
            for word in (("true", "yes") if value else ("false", "no")):
                if word in options:
                    return word
        elif value in options:
            return value
        hint = nearest(str(value), [str(o) for o in options])
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, options))}{hint}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return load_dataclass(tp, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        ktp, vtp = typing.get_args(tp)
        return {_coerce(k, ktp, where): _coerce(v, vtp, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (etp,) = typing.get_args(tp)
        return [_coerce(v, etp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str) and "\0" in value:
            raise ConfigError(f"{where}: {shown(value)} holds a NUL character, which no name or path may")
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config field type {_describe(tp)} at {where}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def load_dataclass(cls: type, data: dict[str, Any], where: str = "", problems: list[str] | None = None) -> Any:
    """Build ``cls`` from ``data``, checking keys and types; ``where`` prefixes error messages.

    With a ``problems`` list, every bad key is appended to it (and left at its default) instead of raising
    at the first; the result is None when a required key is missing."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        try:
            if key not in fields:
                raise ConfigError(f"unknown config key '{path}'{nearest(str(key), list(fields))}")
            convert = fields[key].metadata.get("convert")
            kwargs[key] = convert(value, path) if convert and value is not None else _coerce(value, hints[key], path)
        except ConfigError as e:
            if problems is None:
                raise
            problems.append(str(e))
    missing = [n for n, f in fields.items() if n not in kwargs and n not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        message = f"{where or cls.__name__}: missing required key '{missing[0]}'"
        if problems is None:
            raise ConfigError(message)
        problems.extend(f"{where or cls.__name__}: missing required key '{m}'" for m in missing)
        return None
    if problems is not None and any(n not in kwargs for n in data if n in fields and fields[n].default is
                                    dataclasses.MISSING and fields[n].default_factory is dataclasses.MISSING):
        return None  # a required key of a bad type
    return cls(**kwargs)


def to_plain(obj: Any) -> Any:
    """A dataclass tree as plain dicts/lists, for writing the resolved config."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj
