"""Checks of the raw config (TOML and ``--section.key value`` overrides) against TorchTitan's merged
JobConfig, before TorchTitan's own parser sees it: unknown keys and sections, scalar values of the
wrong type, switches given a value, and the ``[coda]`` schema. Each problem is one ``ConfigError``
line naming the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import typing

from .job_config import FIELDS, ConfigError, validate_table

_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _bad_scalar(tp, value) -> bool:
    if tp is bool:
        return not isinstance(value, bool)
    if tp is int:
        return isinstance(value, bool) or not isinstance(value, int)
    if tp is float:
        return isinstance(value, bool) or not isinstance(value, (int, float))
    if tp is str:
        return not isinstance(value, str)
    return False  # lists, unions, literals: TorchTitan's parser checks those


def _hints(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp for name, tp in hints.items()}


def check_toml(cls, values: dict, where: str = "") -> None:
    """Every TOML key must be a field of the merged JobConfig, every scalar of its field's type."""
    hints = _hints(cls)
    for key, value in values.items():
        here = f"{where}.{key}" if where else key
        if key not in hints:
            section = f"[{where}]" if where else "the top level"
            raise ConfigError(f"unknown key {key!r} in {section} of the config; valid keys there: {', '.join(sorted(hints))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"[{here}] must be a table (section), got {value!r}")
            check_toml(tp, value, here)
        elif where != "coda" and tp in _SCALARS and _bad_scalar(tp, value):
            raise ConfigError(f"{here} = {value!r} is not allowed: use {_SCALARS[tp]}")
    if where == "coda":
        validate_table(values)


def _parse(tp, text: str):
    """An override's text as the field's type, or the text itself (for the check to refuse)."""
    try:
        return int(text) if tp is int else float(text) if tp is float else text
    except ValueError:
        return text


def check_overrides(cls, overrides: list[str], toml: dict) -> None:
    """``--section.key value`` overrides: known keys, values of the field's type, switches without a
    value; the ``[coda]`` ones also through the schema, together with the TOML's ``[coda]``."""
    coda = dict(toml.get("coda", {})) if isinstance(toml.get("coda"), dict) else {}
    for i, arg in enumerate(overrides):
        if not arg.startswith("--") or "." not in arg or arg in ("--help", "-h"):
            continue
        dotted, eq, value = arg[2:].replace("-", "_").partition("=")
        if not eq:
            nxt = overrides[i + 1] if i + 1 < len(overrides) else None
            value = nxt if nxt is not None and not nxt.startswith("--") else None
        *path, key = dotted.split(".")
        section = cls
        for part in path:
            section = _hints(section).get(part)
            if section is None or not dataclasses.is_dataclass(section):
                raise ConfigError(f"unknown override --{dotted}: no section [{'.'.join(path)}]")
        hints = _hints(section)
        name = key[3:] if key.startswith("no_") and key[3:] in hints else key
        if name not in hints:
            raise ConfigError(f"unknown override --{dotted}; valid keys of [{'.'.join(path)}]: {', '.join(sorted(hints))}")
        tp, where = hints[name], f"{'.'.join(path)}.{name}"
        if tp is bool:
            if value is not None:
                raise ConfigError(f"--{where} is a switch: write --{where} (true) or --{'.'.join(path)}.no_{name} "
                                  "(false), without a value")
            value = name == key
        elif value is None:
            raise ConfigError(f"--{where} needs a value")
        else:
            value = _parse(tp, value)
        if path == ["coda"] and name in FIELDS:
            coda[name] = value
        elif tp in _SCALARS and _bad_scalar(tp, value):
            raise ConfigError(f"{where} = {value!r} is not allowed: use {_SCALARS[tp]}")
    validate_table(coda)
