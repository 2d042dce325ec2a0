"""YAML → typed dataclasses, with NeMo-style dotted overrides.

``load_config(RunConfig, "recipe.yaml", ["actor.parallel.tp=4"])``. Every key is
checked against the dataclass fields: an unknown key, or a value of the wrong
type, raises ConfigError naming the dotted field (and the file).

Recipes are read strictly: UTF-8 only, a duplicate key is an error (YAML would let
the second ``actor:`` block silently win), and anchors/aliases may not expand the
document past ``MAX_YAML_NODES`` values (a 1 KB "billion laughs" recipe would
otherwise take gigabytes once the loader and ``--check`` walk it).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

# A recipe is a page of settings; these bounds only stop hostile or broken files early.
MAX_RECIPE_BYTES = 2**20
MAX_YAML_NODES = 100_000  # values after alias expansion (a real recipe has a few hundred)


class ConfigError(ValueError):
    """A bad configuration; the message names the dotted field."""


class _Refused(yaml.MarkedYAMLError):
    """A document the strict loader refuses (duplicate key, alias bomb); carries its position."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys in a mapping."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                # `<<` merge keys may repeat and be overridden; only explicit keys must be unique
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                try:
                    first = seen.get(key)
                except TypeError:
                    continue
                if first is not None:
                    raise _Refused(None, None, f"duplicate key {key!r} (first at line {first}); a repeated key "
                                   "would silently replace the first one", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: yaml.Node) -> int:
    """Values in the document with every alias expanded; raises _Refused past MAX_YAML_NODES."""
    sizes: dict[int, int] = {}  # aliases share nodes: each distinct node is sized once
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _Refused(None, None, "an alias refers to a node that contains it (recursive alias)",
                           node.start_mark)
        active.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        else:
            children = []
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise _Refused(None, None, f"the document holds more than {MAX_YAML_NODES} values once its "
                               "anchors and aliases are expanded; a recipe is a page of settings", node.start_mark)
        active.discard(key)
        sizes[key] = total
        return total

    return size(root)


def _yaml_problem(e: yaml.YAMLError, source: str, one_line: bool) -> str:
    """'SOURCE:LINE:COLUMN: problem' ('SOURCE: column N: problem' for a one-line text), on one line."""
    if isinstance(e, _Refused):
        mark, what = e.problem_mark, e.problem
    elif isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark, what = e.problem_mark, "invalid YAML: " + ", ".join(part for part in (e.context, e.problem) if part)
    elif isinstance(e, yaml.reader.ReaderError):
        return f"{source}: invalid YAML: unacceptable character #x{e.character:04x} at character {e.position}"
    else:
        return f"{source}: invalid YAML: " + " ".join(str(e).split())
    if one_line:
        return f"{source}: column {mark.column + 1}: {what}"
    return f"{source}:{mark.line + 1}:{mark.column + 1}: {what}"


def load_yaml_text(text: str, source: str, one_line: bool = False) -> Any:
    """Parses one YAML document strictly. Errors are ConfigError 'SOURCE:LINE:COLUMN: problem'
    ('SOURCE: column N: problem' with ``one_line``, for a command-line value)."""
    loader = None
    try:
        loader = _StrictLoader(text)  # the reader refuses control characters here
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_problem(e, source, one_line)) from None
    except RecursionError:  # the composer recurses once per nesting level
        raise ConfigError(f"{source}: nested too deeply to be a recipe") from None
    finally:
        if loader is not None:
            loader.dispose()


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return _choice(value, typing.get_args(hint), where)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{where}: must not be null")
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1] or (Any,)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as text
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        # YAML reads `name: 2024` or `path=123` as numbers; for a string field they mean text.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported field type {hint!r}")


def _choice(value: Any, choices: tuple, where: str) -> Any:
    """An enumerated field's value (``Literal[...]``), or one line naming the choices."""
    if any(value == c and type(value) is type(c) for c in choices):  # True is not the choice 1
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and str(value) in choices:
        return str(value)  # YAML's numbers for text choices, as for string fields
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}{hint}")


def _enumerated(hint: Any) -> bool:
    """A ``Literal[...]`` field type, or one in a union (``Literal[...] | None``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_enumerated(option) for option in typing.get_args(hint))
    return typing.get_origin(hint) is typing.Literal


def enumeration_errors(cfg: Any, where: str = "") -> list[str]:
    """Every enumerated field of a config built in code (the loader checks those it reads) whose
    value is not one of its choices; one line each, as the loader words it (``_coerce``)."""
    errors: list[str] = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), f"{where}.{f.name}" if where else f.name
        if _enumerated(hints[f.name]):
            try:
                _coerce(value, hints[f.name], path)
            except ConfigError as e:
                errors.append(str(e))
        elif dataclasses.is_dataclass(value):
            errors += enumeration_errors(value, path)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    errors += enumeration_errors(item, f"{path}[{i}]")
    return errors


def _build(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if not isinstance(key, str):
            raise ConfigError(f"{where or 'the top level'}: key {key!r} is not a field name")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {'.'.join(filter(None, [where, close[0]]))!r}?)" if close else ""
            raise ConfigError(f"unknown key {path!r}{hint}; known keys here: {', '.join(fields)}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a mapping")
        node = child
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'actor.parallel.tp=4' -> ('actor.parallel.tp', 4); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    return key, load_yaml_text(raw, f"override {text!r}: cannot parse value", one_line=True) if raw.strip() else ""


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory")
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_RECIPE_BYTES // 2**20} MiB; a recipe is a page "
                          "of settings (put data in data.source)")
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark is harmless
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the recipe as "
                          "UTF-8") from None
    data = load_yaml_text(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def load_config(cls: type[T], source: str | Path | dict[str, Any] | None = None,
                overrides: list[str] | None = None) -> T:
    """Builds ``cls`` from a YAML file (or a dict) plus dotted overrides."""
    # a deep copy: overrides must not write into the caller's nested dicts
    data = copy.deepcopy(source) if isinstance(source, dict) else (read_yaml(source) if source else {})
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    try:
        return _build(cls, data)
    except ConfigError as e:
        if isinstance(source, (str, Path)):
            raise ConfigError(f"{source}: {e}") from None
        raise


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
