"""Typed config trees from YAML recipes: loading, dotted overrides, strict keys, saving.

Generic machinery only; the sections themselves live with the code that reads them (see `core/config.py`).
YAML is data: every key must name a dataclass field, and an unknown key fails with the nearest valid key named.
Fields typed `dict` are free-form (e.g. a Hugging Face model config) and accept any nested keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A recipe or override that cannot be turned into the typed config; the message says how to fix it."""


def check_seed(key: str, seed: int) -> None:
    """Seeds feed numpy and torch generators, which take 0 <= seed < 2**32."""
    if not 0 <= seed < 2**32:
        raise ConfigError(f"{key} must be in [0, 2**32), got {seed}.")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean '{where}{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{where}{key}'.{hint} Valid keys here: {', '.join(sorted(valid))}.")


def _finite_float(value: Any, where: str) -> float:
    """A float field's value: ints and numeric strings (YAML 1.1 reads `1e-4`, without a dot, as a string) become
    floats; nan and ±inf are refused here, where the key can be named, not steps later as a NaN loss."""
    number = value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):  # not a number: the type error below names it
            number = float(value)
    if not isinstance(number, int | float) or isinstance(number, bool):
        raise ConfigError(f"'{where}' expects float, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(number):
        raise ConfigError(f"'{where}' must be a finite number, got {value!r}.")
    return float(number)


def _check_finite_leaves(value: Any, where: str) -> None:
    """Free-form mappings (a model config) are not typed, but a nan or inf in them is never meant either."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"'{where}' must be a finite number, got {value!r}.")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite_leaves(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_finite_leaves(item, f"{where}[{index}]")


def _is_kind(value: Any, typ: Any) -> bool:
    """Whether `value` is of the container or plain class `typ` names (dict for dict[str, int], str for str)."""
    base = typing.get_origin(typ) or typ
    return isinstance(base, type) and isinstance(value, base)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check/convert a YAML value against a field's annotation (the subset of types configs use)."""
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        if not isinstance(value, dict):
            raise ConfigError(f"'{where}' is a section: expected a mapping, got {value!r}.")
        return build(typ, value, prefix=f"{where}.")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"'{where}' may not be null.")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append((arg, str(exc)))
        # The arm of the value's own kind (a mapping's, for a dict | str field) says what is wrong inside it.
        own_kind = [message for arg, message in errors if _is_kind(value, arg)]
        if len(errors) == 1 or len(own_kind) == 1:
            raise ConfigError((own_kind or [errors[0][1]])[0])
        raise ConfigError(f"'{where}': {value!r} fits none of {typ}.")
    if origin is typing.Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"'{where}' must be one of {list(choices)}, got {value!r}.")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"'{where}' expects a list, got {value!r}.")
        (item,) = typing.get_args(typ)[:1] or (Any,)
        items = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if typ is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"'{where}' expects a mapping, got {value!r}.")
        _check_finite_leaves(value, where)
        return value
    if typ is Any:
        return value
    if typ is float:
        return _finite_float(value, where)
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"'{where}' expects true or false, got {value!r}.")
    if typ in (int, float, str) and (not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool)):
        raise ConfigError(f"'{where}' expects {typ.__name__}, got {value!r} ({type(value).__name__}).")
    return value


def build(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested mapping; missing keys take their defaults."""
    types_ = _field_types(cls)
    for key in raw:
        if key not in types_:
            raise _unknown_key_error(key, list(types_), prefix)
    kwargs = {key: _coerce(value, types_[key], f"{prefix}{key}") for key, value in raw.items()}
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check()
    return obj


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ['a.b=1', 'c=x'] into {'a': {'b': 1}, 'c': 'x'}; values are parsed as YAML scalars/lists."""
    nested: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value (e.g. train.max_steps=100).")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override '{item}' has an empty key part.")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override of '{part}'.")
        try:
            node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as error:
            raise ConfigError(f"override '{item}' is not a valid YAML value: {_yaml_problem(error)}.") from None
    return nested


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `update` into a copy of `base` (mappings merge, everything else replaces)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The parser's problem and its context, on one line."""
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    return " ".join(f"{problem}{f' ({context})' if context else ''}".split())


def parse_yaml(path: Path) -> Any:
    """The YAML document at `path` ({} when empty); ConfigError in one line when it is not valid YAML (file, line,
    column and the parser's problem) or not UTF-8 text."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)  # editors count from 1
        raise ConfigError(f"recipe {where} is not valid YAML: {_yaml_problem(error)}.") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {error.start}).") from None


def load(cls: type, path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Load recipe YAML at `path` (or only defaults when None), apply dotted overrides, build `cls`."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe '{path}' does not exist (recipes live in recipes/*.yaml).")
        raw = parse_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe '{path}' must be a YAML mapping of sections, got {type(raw).__name__}.")
    raw = deep_merge(raw, parse_overrides(overrides or []))
    return build(cls, raw)


def to_dict(obj: Any) -> dict[str, Any]:
    """The resolved config as plain data (tuples become lists so YAML stays portable)."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple | list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(obj))


def save(obj: Any, path: str | Path) -> None:
    """Write the resolved config so a run directory records exactly what ran."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
