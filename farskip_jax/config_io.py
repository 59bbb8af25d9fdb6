"""Config dataclasses <-> plain dicts, with validation: the generic half of the config loader
(`farskip_jax.config` has the sections, YAML files and `base:` inheritance, and re-exports these).

`from_dict` builds a frozen dataclass from a mapping, coercing YAML/CLI scalars where unambiguous
and rejecting unknown keys with the allowed ones (a class may name where its former keys went,
`MOVED_KEYS`); `apply_overrides` / `override` set dotted keys (`--set model.num_layers=4`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import yaml

from farskip_jax.errors import ConfigError


def _to_dict(obj: Any) -> Any:
    # Fresh containers all the way down: a config's dict sections (`data`, `demo`) must not be shared
    # with the result, or editing the dict (`demo.pipeline.derive`) would edit the config it came from.
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _to_dict(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_dict(v) for v in obj)
    return obj


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict of a config dataclass (for YAML dumps and checkpoints)."""
    return _to_dict(cfg)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against annotation `tp`, converting YAML/CLI scalars where unambiguous."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; allowed values: {list(allowed)}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r} is invalid")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    if origin is tuple:  # tuple[int, ...]: a YAML/JSON list
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    return value


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Builds dataclass `cls` from a mapping, rejecting unknown keys with the allowed ones; a key
    that `cls.MOVED_KEYS` maps to its new dotted name is refused with that name. The result is
    validated when `cls` has a `validate` method."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    moved: Mapping[str, str] = getattr(cls, "MOVED_KEYS", {})
    for name in unknown:
        if name in moved:
            key, new = f"{prefix}.{name}" if prefix else name, moved[name]
            raise ConfigError(f"config key {key!r} has moved to {new!r}: set that instead (YAML: "
                              f"under `{new.split('.')[0]}:`; command line: --set {new}=VALUE)")
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(f"unknown config key {key!r}; allowed keys under {prefix or 'the top level'}: "
                          f"{sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(value, hints[name], key)
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def _parse_scalar(text: str) -> Any:
    """CLI override values are YAML scalars: 4, 1e-5, true, null, greedy, [1, 2]."""
    value = yaml.safe_load(text)
    # YAML 1.1 reads `1e-5` (no dot) as a string; a CLI user means the number.
    if isinstance(value, str) and _EXP_FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def apply_overrides(base: dict[str, Any], overrides: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A deep copy of the plain dict `base` with dotted `overrides` ({"farskip.enabled": True}) set;
    an override below a key that is not a section raises ConfigError naming `prefix.key`."""
    out = json.loads(json.dumps(base))  # deep copy of plain data
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                if node.get(part) is None and part in node:
                    node[part] = {}
                else:
                    where = ".".join(([prefix] if prefix else []) + parts[: i + 1])
                    raise ConfigError(f"unknown config key {where!r}")
            node = node[part]
        node[parts[-1]] = value
    return out


def override(obj: Any, overrides: Mapping[str, Any], prefix: str) -> Any:
    """The config dataclass `obj` with dotted `overrides` applied and validated, e.g.
    `override(model_cfg, {"farskip.enabled": True}, "model")`; `prefix` names the section in errors."""
    if not overrides:
        return obj
    return from_dict(type(obj), apply_overrides(to_dict(obj), overrides, prefix), prefix)


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`["model.num_layers=4", "train.mode=sft"]` -> {"model.num_layers": 4, "train.mode": "sft"}."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. model.num_layers=4")
        key, _, text = item.partition("=")
        out[key.strip()] = _parse_scalar(text)
    return out

