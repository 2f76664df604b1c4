"""Generic validation of the node file's fields: one parser for every documented key.

A key is a dataclass field declared with :func:`config_key`, whose type hint and :class:`_Rule` say
what a valid value is. :func:`convert_value` checks one YAML value against them and words the error
(``global.scheduler.max_queue_depth: expected a positive integer, got 'abc'``);
:func:`parse_partial` validates the keys one block sets without filling in defaults, and
:func:`merge_partial` lays such a partial block over a complete one. Nothing here knows any particular
key: the schema lives in :mod:`xlaserve.config.schema`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType, NoneType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints


class ConfigError(Exception):
    """The node file or an ``INFERENCE_SERVER_*`` variable is invalid.

    The message starts with where the mistake is (a key path such as ``workers[1].name`` or a
    variable name) and says what was expected.
    """


# --- validation rules, attached to dataclass fields ----------------------------------------------

class InvalidValue(Exception):
    """Raised by a custom field parser; the generic code turns it into a ConfigError.

    Without arguments the error says what the field expects (its ``describe``); with ``detail``
    it says that instead, after the key path extended by ``where`` (``[1].header``)."""

    def __init__(self, detail: str = "", where: str = "") -> None:
        super().__init__(detail)
        self.detail = detail
        self.where = where


@dataclass(frozen=True, slots=True)
class _Rule:
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    # A custom parser for values the type alone cannot describe; raises InvalidValue.
    parse: Callable[[Any], Any] | None = None
    describe: str = ""
    # False for fields an environment variable may not set.
    env: bool = True


def config_key(default: Any = MISSING, *, factory: Any = MISSING, **rule: Any) -> Any:
    return field(default=default, default_factory=factory, metadata={"rule": _Rule(**rule)})


# --- the generic field parser --------------------------------------------------------------------

@functools.cache
def field_specs(cls: type) -> dict[str, tuple[Any, _Rule, bool]]:
    """name -> (type hint, rule, required) for each field of a config dataclass."""
    hints = get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.metadata.get("rule", _Rule()),
                 f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)
    }


def optional_inner(hint: Any) -> Any | None:
    if get_origin(hint) in (Union, UnionType) and NoneType in get_args(hint):
        (inner,) = (a for a in get_args(hint) if a is not NoneType)
        return inner
    return None


def _bound(value: float) -> str:
    return f"{value:g}"


def _expected(hint: Any, rule: _Rule) -> str:
    inner = optional_inner(hint)
    if inner is not None:
        return f"{_expected(inner, rule)} or null"
    if rule.describe:
        return rule.describe
    if rule.choices:
        return "one of " + ", ".join(rule.choices)
    if hint is bool:
        return "true or false"
    if hint in (int, float):
        noun = "integer" if hint is int else "number"
        article = "an" if hint is int else "a"
        if rule.high is None and rule.low == 0:
            return f"a {'positive' if rule.low_open else 'non-negative'} {noun}"
        if rule.high is None and rule.low == 1 and hint is int:
            return "a positive integer"
        if rule.low is None and rule.high is None:
            return f"{article} {noun}"
        if hint is int:
            return f"an integer in [{rule.low}, {rule.high}]"
        return (f"a number in {'(' if rule.low_open else '['}{_bound(rule.low)}, "
                f"{_bound(rule.high)}{')' if rule.high_open else ']'}")
    if hint is Path:
        return "a path"
    if get_origin(hint) is tuple:
        return "a list of names"
    if get_origin(hint) is Mapping:
        return "a mapping of model name to settings"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return "a non-empty string"


def show_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, Mapping)):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _in_range(value: float, rule: _Rule) -> bool:
    if rule.low is not None and not (value > rule.low if rule.low_open else value >= rule.low):
        return False
    return rule.high is None or (value < rule.high if rule.high_open else value <= rule.high)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def convert_value(hint: Any, rule: _Rule, value: Any, path: str, base_dir: Path | None,
                  described: Any = None) -> Any:
    """Validate one YAML value against a field's type and rule; ``base_dir`` anchors paths.

    ``described`` is the hint the error message describes (the field's own, optional included).
    """
    def fail() -> ConfigError:
        expected = _expected(described or hint, rule)
        return ConfigError(f"{path}: expected {expected}, got {show_value(value)}")

    inner = optional_inner(hint)
    if inner is not None:
        return None if value is None else convert_value(inner, rule, value, path, base_dir, hint)
    if rule.parse is not None:
        try:
            return rule.parse(value)
        except InvalidValue as exc:
            if exc.detail:
                raise ConfigError(f"{path}{exc.where}: {exc.detail}") from None
            raise fail() from None
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if is_int(value) and _in_range(value, rule):
            return value
    elif hint is float:
        if (is_int(value) or isinstance(value, float)) and math.isfinite(value) \
                and _in_range(value, rule):
            return float(value)
    elif hint is str:
        if isinstance(value, str) and value and (not rule.choices or value in rule.choices):
            return value
    elif hint is Path:
        if isinstance(value, str) and value:
            resolved = Path(value).expanduser()
            if base_dir is None:
                return resolved.absolute()
            return base_dir / resolved
    elif get_origin(hint) is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
            return tuple(value)
    elif get_origin(hint) is Mapping:
        if isinstance(value, Mapping):
            nested = get_args(hint)[1]
            out = {}
            for name, sub in value.items():
                if not isinstance(name, str) or not name:
                    raise ConfigError(f"{path}: keys must be model names, got {show_value(name)}")
                out[name] = parse_partial(nested, sub, f"{path}.{name}", base_dir)
            return MappingProxyType(out)
    elif dataclasses.is_dataclass(hint):
        # a nested block (endpoints.tls): set as a whole, never merged key by key
        if isinstance(value, Mapping):
            keys = parse_partial(hint, value, path, base_dir)
            for name, (_, _, required) in field_specs(hint).items():
                if required and name not in keys:
                    needed = " and ".join(n for n, spec in field_specs(hint).items() if spec[2])
                    raise ConfigError(f"{join_path(path, name)}: required ({path} needs {needed})")
            return hint(**keys)
    else:  # pragma: no cover - a field type this parser does not know is a bug here
        raise TypeError(f"no parser for {hint!r}")
    raise fail()


def field_value(cls: type, name: str, value: Any, path: str, base_dir: Path | None) -> Any:
    hint, rule, _ = field_specs(cls)[name]
    return convert_value(hint, rule, value, path, base_dir)


def as_mapping(raw: Any, path: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {show_value(raw)}")
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be strings, got {show_value(key)}")
    return raw


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def reject_unknown(raw: Mapping[str, Any], known: set[str] | frozenset[str], path: str) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"{join_path(path, key)}: unknown key (known: {', '.join(sorted(known))})")


def parse_partial(cls: type, raw: Any, path: str,
                  base_dir: Path | None) -> Mapping[str, Any]:
    """Validate the keys a block sets, without filling in defaults (so blocks can merge).

    A block class may accept keys beyond its fields: its ``ALIASES`` class attribute maps each
    such key to a function ``(value, validated keys so far, key path, block path)`` that returns
    the validated keys with the alias applied (or raises :class:`ConfigError`).
    """
    raw = as_mapping(raw, path)
    aliases: Mapping[str, Callable[..., Mapping[str, Any]]] = getattr(cls, "ALIASES", {})
    reject_unknown(raw, set(field_specs(cls)) | set(aliases), path)
    out = {key: field_value(cls, key, value, join_path(path, key), base_dir)
           for key, value in raw.items() if key in field_specs(cls)}
    for key, apply in aliases.items():
        if key in raw:
            out = dict(apply(raw[key], out, join_path(path, key), path))
    return MappingProxyType(out)


def merge_partial(base: Any, partial: Mapping[str, Any]) -> Any:
    """``base`` with the keys of ``partial`` set; mapping-of-block fields merge per entry."""
    if not partial:
        return base
    changes = {}
    for name, value in partial.items():
        hint = field_specs(type(base))[name][0]
        if get_origin(hint) is Mapping and dataclasses.is_dataclass(get_args(hint)[1]):
            nested = get_args(hint)[1]
            merged = dict(getattr(base, name))
            for key, sub in value.items():
                merged[key] = merge_partial(merged.get(key) or nested(), sub)
            value = MappingProxyType(merged)
        changes[name] = value
    return dataclasses.replace(base, **changes)
