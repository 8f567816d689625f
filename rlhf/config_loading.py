"""From plain data and recipe files to the config's dataclasses (rlhf.config re-exports what
callers use): type checks that name the key, overrides, and the recipe's lines, so that an error
about a key the recipe sets names `file:line` as an editor shows it (yaml's marks are 0-based).

A recipe may start from another: `base: other.yaml` (relative to the recipe's folder) takes the
base's keys, then the recipe's merged over them section by section (a list or a value replaces the
base's whole), then the overrides. One level only, so a variant is read against one file that says
everything else: a base with a `base:` of its own is refused. An error about a key the base brings
names the recipe's `base:` line.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from rlhf.errors import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is tuple:
        return "a list"
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` converted to type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}", key=key)
        return build(tp, value, key)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{key}={value!r} is not allowed: {_type_name(tp)}", key=key)
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}", key=key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type: expected a list", key=key)
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}={value!r} must have {len(args)} items", key=key)
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    else:  # pragma: no cover - every field type is handled above
        raise TypeError(f"unsupported config type {tp} for {key}")
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {_type_name(tp)}", key=key)


# Keys of earlier versions: a recipe that still uses one gets told what to write instead.
_RENAMED = {
    "cluster.generator_gpus": "use cluster.generator_tp (devices per engine) and cluster.generator_engines "
                              "(how many engines)",
    "model.gradient_checkpointing": "use learner.gradient_checkpointing",
}


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """`cls(**data)` with every value type-checked (`_coerce`), nested sections built alike."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if key in _RENAMED:
            raise ConfigError(f"'{key}' was replaced: {_RENAMED[key]}", key=key)
        if name not in hints:
            raise ConfigError(f"unknown key '{key}' (allowed: {', '.join(names)})", key=key)
        kwargs[name] = _coerce(value, hints[name], key)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in kwargs:
            # located at the mapping that lacks it (load_config names its line)
            raise ConfigError(f"{prefix}.{name} is required" if prefix else f"{name} is required", key=prefix)
    return cls(**kwargs)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value read as YAML, or the raw text where it is not YAML)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value (e.g. grpo.group_size=8)")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override '{item}' has no key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [deep_copy(v) for v in d]
    return d


BASE_KEY = "base"


def read_recipe(p: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The recipe's data over its base's (`base:`, one level), and the line of `p` each dotted key
    is written on (list items as `key[i]`); a key only the base sets has the `base:` line."""
    data, lines = _read_file(p)
    if BASE_KEY not in data:
        return data, lines
    where = lines.pop(BASE_KEY)
    base_path = _base_path(p, where, data.pop(BASE_KEY))
    base, base_lines = _read_file(base_path)
    if BASE_KEY in base:
        raise ConfigError(f"{p}:{where}: its base {base_path} has a base of its own ({base[BASE_KEY]!r}); "
                          f"one level only: start {p.name} from a recipe without `base:`", key=BASE_KEY)
    for key in base_lines:
        lines.setdefault(key, where)
    return _merged(base, data), lines


def _base_path(p: Path, line: int, value: Any) -> Path:
    """The file `base: value` names, relative to the folder of recipe `p` (written on `line`)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{p}:{line}: base={value!r} must name a YAML file (relative to the recipe's "
                          f"folder), e.g. base: base/grpo_gsm8k.yaml", key=BASE_KEY)
    path = p.parent / value
    if not path.exists():
        raise ConfigError(f"{p}:{line}: its base {path} does not exist (base: {value}, relative to the "
                          f"recipe's folder)", key=BASE_KEY)
    return path


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged over `base`: sections (mappings) key by key, any other value replaces."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = _merged(base[key], value) if both else value
    return out


def _read_file(p: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """One YAML file's data, and the line each dotted key is written on (list items as `key[i]`)."""
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a folder, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        text = p.read_text()
        loaded, node = yaml.safe_load(text), yaml.compose(text, Loader=yaml.SafeLoader)
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{p}' is not UTF-8 text") from None
    except yaml.MarkedYAMLError as e:
        raise ConfigError(_yaml_error(p, e)) from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "parse error"
        raise ConfigError(f"config file '{p}' is not valid YAML: {first}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping at the top level")
    lines: dict[str, int] = {}
    twice = _key_lines(node, "", lines)
    if twice:
        key, first, again = twice
        raise ConfigError(f"{p}:{again}: '{key}' is set twice (first on line {first}); keep one", key=key)
    return loaded or {}, lines


def _yaml_error(p: Path, e: yaml.MarkedYAMLError) -> str:
    """`file:line: not valid YAML (problem; context at line n)` from yaml's marks (0-based there)."""
    mark = e.problem_mark or e.context_mark
    where = f"{p}:{mark.line + 1}" if mark is not None else f"config file '{p}'"
    context = ""
    if e.context:
        at = e.context_mark
        context = f"; {e.context}" + (f" at line {at.line + 1}" if at is not None and at is not mark else "")
    return f"{where}: not valid YAML ({e.problem or 'parse error'}{context})"


def _key_lines(node: Any, prefix: str, lines: dict[str, int]) -> tuple[str, int, int] | None:
    """Fill `lines` (dotted key -> 1-based line) from a composed YAML node; return (key, first
    line, second line) for the first key a mapping sets twice (yaml would keep the last silently)."""
    if isinstance(node, yaml.MappingNode):
        children = [(f"{prefix}.{k.value}" if prefix else str(k.value), k, v) for k, v in node.value]
    elif isinstance(node, yaml.SequenceNode):
        children = [(f"{prefix}[{i}]", item, item) for i, item in enumerate(node.value)]
    else:
        return None
    for key, at, value in children:
        if key in lines and isinstance(node, yaml.MappingNode):
            return key, lines[key], at.start_mark.line + 1
        lines[key] = at.start_mark.line + 1
        twice = _key_lines(value, key, lines)
        if twice:
            return twice
    return None


def line_of(key: str | None, lines: dict[str, int], overrides: list[str]) -> int | None:
    """The recipe line of `key`, unless the key is not in the recipe or an override sets it."""
    if not key or key not in lines:
        return None
    for item in overrides:
        set_key = item.split("=", 1)[0].strip()
        if key == set_key or key.startswith((set_key + ".", set_key + "[")):
            return None
    return lines[key]


def explicit_keys(path: str | Path | None, overrides: list[str] = ()) -> set[str]:
    """The dotted keys a recipe file and overrides set (what `memory.plan: auto` must not change);
    a list or a non-section value is one key. Call after `load_config` has validated both."""
    def leaves(data: Any, prefix: str) -> set[str]:
        if not isinstance(data, dict):
            return {prefix}
        return set().union(*(leaves(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in data.items()))

    loaded = read_recipe(Path(path))[0] if path is not None else None
    keys = leaves(loaded, "") - {""} if isinstance(loaded, dict) else set()
    for item in overrides:
        path_parts, value = parse_override(item)
        keys |= leaves(value, ".".join(path_parts))
    return keys
