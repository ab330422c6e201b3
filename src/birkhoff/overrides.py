"""A run's settings from the command line and from TOML files, checked by the configs themselves.

A run's configuration is a `Preset`: name, task, task_options, num_threads and the model, train
and rl configs (nested: model.moe, rl.loss). Every leaf has a dotted path (`rl.lr`,
`model.moe.num_experts`, `task_options.num_digits`). An `Override` sets one leaf and remembers
how the user wrote it (`--set rl.lr=1e-4`, `--rl.lr 1e-4`, `--steps 5`, a line of a TOML file),
so that a value the config's own check rejects is reported in the user's words
(`--max-new-tokens -5 is invalid: must be an int >= 1`), never as an internal field name.
Text values are parsed by the field's declared type. TOML has no null: an unset optional field
is written and read as "none". `to_toml` writes every setting of a preset; `toml_overrides` +
`apply` read such a file back into the same preset.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from birkhoff.presets import Preset

NONE = "none"
CHECK_MESSAGE = re.compile(r"^(\w+)=(.*) is invalid: (.*)$", re.S)


class Override(NamedTuple):
    path: str  # dotted: "rl.lr"
    value: Any  # a str from the command line (parsed by the field's type) or a TOML value
    label: str  # how the user wrote it: "--set rl.lr=x", "--steps -1", "run.toml: rl.lr = -1"


def as_settings(obj: Any) -> Any:
    """A config as plain TOML-able data: dataclasses as tables, None as "none", tuples as lists,
    dicts (task options) with sorted keys so that their text does not depend on merge order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: as_settings(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): as_settings(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, tuple | list):
        return [as_settings(v) for v in obj]
    return NONE if obj is None else obj


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as {dotted path: leaf value}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def to_toml(preset: Preset) -> str:
    """Every setting of `preset` as TOML that `--config` reads back into the same preset."""
    import tomli_w

    header = (
        f"# birkhoff preset {preset.name!r}: every setting (`birkhoff run --config FILE` "
        'reads it back; "none" = unset)\n'
    )
    return header + tomli_w.dumps(as_settings(preset))


def toml_overrides(path: Path) -> list[Override]:
    """The settings of a TOML file as overrides labelled with the file and the setting."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read ({err.strerror or err})") from err
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {path}: invalid TOML ({err})") from err
    return [Override(k, v, f"{path}: {k} = {json.dumps(v)}") for k, v in flatten(data).items()]


def text_override(assignment: str, label: str) -> Override:
    """`PATH=VALUE` (from `--set`) as an override."""
    path, sep, value = assignment.partition("=")
    if not sep or not path.strip():
        raise ValueError(f"{label}: expected PATH=VALUE, e.g. --set rl.lr=1e-4")
    return Override(path.strip(), value.strip(), label)


# ---------------------------------------------------------------------------- types


def field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def nested_class(tp: Any) -> type | None:
    """The dataclass of a field typed `SomeConfig` or `SomeConfig | None`, else None."""
    candidates = get_options(tp)
    found = [c for c in candidates if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return found[0] if found else None


def get_options(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


def is_optional(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args


def is_none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() == NONE)


def coerce(value: Any, tp: Any) -> Any:
    """`value` (text or TOML data) as a value of type `tp`; ValueError says what was expected.

    Only the type is checked here; ranges and choices are the config's own checks."""
    if is_optional(tp) and is_none(value):
        return None
    options = get_options(tp)
    if len(options) > 1:
        errors = []
        for option in options:
            try:
                return coerce(value, option)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(" or ".join(errors))
    tp = options[0]
    origin = typing.get_origin(tp)
    if origin is Literal or tp is str:
        return value if isinstance(value, str) else str(value)
    if tp is bool:
        return parse_bool(value)
    if tp is int:
        return parse_number(value, int)
    if tp is float:
        return float(parse_number(value, float))
    if origin is tuple:
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        args = typing.get_args(tp)
        if not isinstance(items, list | tuple) or len(items) != len(args):
            raise ValueError(f"expected {len(args)} comma-separated values")
        return tuple(coerce(v, a) for v, a in zip(items, args, strict=True))
    if dataclasses.is_dataclass(tp):
        raise ValueError(f'expected a table of settings or "{NONE}"')
    return parse_any(value) if isinstance(value, str) else value


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_number(value: Any, kind: type) -> int | float:
    if isinstance(value, bool):
        raise ValueError(f"expected {'an int' if kind is int else 'a number'}")
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        return value
    try:
        return kind(str(value).strip())
    except ValueError:
        raise ValueError(f"expected {'an int' if kind is int else 'a number'}") from None


def parse_any(text: str) -> Any:
    """A value of an untyped setting (task_options): a TOML literal if it reads as one."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


# ---------------------------------------------------------------------------- apply


def leaf_paths(obj: Any, cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted path under a config of class `cls` (None: its class's fields)."""
    out = []
    for name, tp in field_types(cls).items():
        sub = nested_class(tp)
        value = getattr(obj, name, None) if obj is not None else None
        if sub is not None:
            out += [f"{prefix}{name}", *leaf_paths(value, sub, f"{prefix}{name}.")]
        elif isinstance(value, dict):
            out += [f"{prefix}{name}.{k}" for k in value] or [f"{prefix}{name}"]
        else:
            out.append(f"{prefix}{name}")
    return out


def known_path(path: str) -> bool:
    """Whether `path` names a setting of today's configs (recorded settings may be older)."""
    cls: type | None = Preset
    parts = path.split(".")
    for i, part in enumerate(parts):
        types_ = field_types(cls) if cls is not None else {}
        if part not in types_:
            return False
        cls = nested_class(types_[part])
        if cls is None:
            return len(parts) == i + 1 or (
                typing.get_origin(types_[part]) is dict and len(parts) == i + 2
            )
    return True


def apply(preset: Preset, overrides: Sequence[Override]) -> Preset:
    """`preset` with `overrides` applied in order (later wins); ValueError in the user's words."""
    tree: dict[str, Any] = {}
    for o in overrides:
        typed = typed_value(preset, o)
        *parents, leaf = o.path.split(".")
        node = tree
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = (typed, o.label)
    return rebuild(preset, Preset, "", tree)


def typed_value(preset: Preset, o: Override) -> Any:
    """The value of `o` parsed by the type of the field at its path."""
    cls: type | None = Preset
    parts = o.path.split(".")
    for i, part in enumerate(parts):
        assert cls is not None
        types_ = field_types(cls)
        if part not in types_:
            raise ValueError(unknown_message(preset, o))
        tp = types_[part]
        sub = nested_class(tp)
        rest = parts[i + 1 :]
        if not rest:
            if isinstance(o.value, dict):
                if typing.get_origin(tp) is dict:
                    return dict(o.value)
                raise ValueError(f"{o.label}: expected a value, got a table")
            try:
                return coerce(o.value, tp)
            except ValueError as err:
                raise ValueError(f"{o.label}: {err}") from None
        if sub is None:
            if typing.get_origin(tp) is dict and len(rest) == 1:  # task_options.NAME
                return parse_any(o.value) if isinstance(o.value, str) else o.value
            raise ValueError(unknown_message(preset, o))
        cls = sub
    raise AssertionError("unreachable")


def unknown_message(preset: Preset, o: Override) -> str:
    paths = leaf_paths(preset, Preset)
    close = difflib.get_close_matches(o.path, paths, n=3, cutoff=0.6)
    hint = (
        f"; did you mean {' or '.join(close)}?" if close else "; `birkhoff presets NAME` lists all"
    )
    return f"{o.label}: unknown setting {o.path!r}{hint}"


def rebuild(obj: Any, cls: type, prefix: str, tree: dict[str, Any]) -> Any:
    """`obj` (a `cls`, or None: built from the settings alone) with the settings of `tree`."""
    changes: dict[str, Any] = {}
    labels: dict[str, str] = {}
    types_ = field_types(cls)
    for name, node in tree.items():
        current = getattr(obj, name) if obj is not None else None
        if isinstance(node, dict) and nested_class(types_[name]) is not None:
            sub = nested_class(types_[name])
            assert sub is not None
            changes[name] = rebuild(current, sub, f"{prefix}{name}.", node)
        elif isinstance(node, dict):  # a dict field: merged key by key
            changes[name] = {**(current or {}), **{k: v for k, (v, _) in node.items()}}
            labels[name] = ", ".join(lbl for _, lbl in node.values())
        else:
            changes[name], labels[name] = node
    try:
        return dataclasses.replace(obj, **changes) if obj is not None else cls(**changes)
    except (ValueError, TypeError) as err:
        raise ValueError(in_user_words(err, prefix, labels)) from None


def in_user_words(err: Exception, prefix: str, labels: dict[str, str]) -> str:
    """A config check's `field=value is invalid: why` as `<the user's flag> is invalid: why`."""
    given = ", ".join(labels.values())
    if isinstance(err, TypeError) and "missing" in str(err):  # a new nested config, incomplete
        missing = ", ".join(prefix + name for name in re.findall(r"'(\w+)'", str(err)))
        return f"{given}: {prefix.rstrip('.')} also needs {missing}"
    match = CHECK_MESSAGE.match(str(err))
    if match and match[1] in labels:
        return f"{labels[match[1]]} is invalid: {match[3]}"
    where = f"{prefix}{match[1]}={match[2]} is invalid: {match[3]}" if match else str(err)
    return f"{where} (with {given})" if given else where
