"""Loading: YAML in (1.2 booleans, duplicate keys refused), a Config out, and every
pydantic error turned into one line naming the YAML path and line.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ValidationError

from smtpguard.config.base import ConfigError, FieldProblem
from smtpguard.config.schema import Config


# --- loading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadedConfig:
    config: Config
    path: Path


def load(path: str | os.PathLike[str]) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{p}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{p}: cannot read: {e}"]) from None
    return loads(text, str(p))


def loads(text: str, source: str = "<config>") -> Config:
    node, data = parse_yaml(text, source)
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the config must be a mapping of sections"])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError([_describe(err, node, source) for err in e.errors()]) from None


# --- YAML ------------------------------------------------------------------------------------
_YAML_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_YAML_BASE):  # type: ignore[misc,valid-type]
    """PyYAML's safe loader with YAML 1.2 booleans: only true/false are flags. YAML 1.1's
    yes/no/on/off stay strings, so `paused: on` is refused rather than read as true, and a
    country code `NO` in a list stays `NO`."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def parse_yaml(text: str, source: str = "<config>") -> tuple[yaml.Node | None, Any]:
    """The document's node tree (for line numbers) and its data; refuses duplicate keys.

    PyYAML keeps the last of two equal keys; here both lines are named instead. This is a
    walk over the node tree PyYAML composes anyway, so no second YAML library is needed."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError([f"{source}: nested too deeply"]) from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError([f"{source}{where}: invalid YAML: {problem}"]) from None
        if node is None:
            return None, None
        try:
            duplicates = _duplicate_keys(node)
        except _TooDeep as e:
            raise ConfigError([f"{source} (line {e.line}): nested too deeply"]) from None
        if duplicates:
            raise ConfigError([f"{source}: {d}" for d in duplicates])
        try:
            data = loader.construct_document(node)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise ConfigError([f"{source}{where}: invalid YAML: {getattr(e, 'problem', e)}"]) from None
        return node, data
    finally:
        loader.dispose()


_MAX_DEPTH = 64
"""No config section nests anywhere near this deep; past it, a document is refused before
anything walks it recursively."""
_MERGE = "tag:yaml.org,2002:merge"


class _TooDeep(Exception):
    def __init__(self, line: int) -> None:
        self.line = line


def _duplicate_keys(root: yaml.Node) -> list[str]:
    """Every key given twice in one mapping, including inside a merge (`<<:`) value; a walk
    with its own stack, so depth costs no recursion. Raises _TooDeep past _MAX_DEPTH."""
    out: list[str] = []
    seen: set[int] = set()
    todo: list[tuple[yaml.Node, str, int]] = [(root, "", 0)]
    while todo:
        node, path, depth = todo.pop()
        if id(node) in seen:  # an alias: its node was checked where the anchor is
            continue
        seen.add(id(node))
        if depth > _MAX_DEPTH:
            raise _TooDeep(node.start_mark.line + 1)
        children: list[tuple[yaml.Node, str, int]] = []
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode):
                    continue
                if k.tag == _MERGE:
                    # The merged mapping (or list of them) is checked as part of this one's path.
                    children.append((v, path, depth + 1))
                    continue
                line = k.start_mark.line + 1
                here = f"{path}.{k.value}" if path else str(k.value)
                if k.value in lines:
                    out.append(
                        f"{here} (lines {lines[k.value]} and {line}): duplicate key; "
                        "YAML would keep only the second, silently"
                    )
                else:
                    lines[k.value] = line
                children.append((v, here, depth + 1))
        elif isinstance(node, yaml.SequenceNode):
            children = [(item, f"{path}[{i}]", depth + 1) for i, item in enumerate(node.value)]
        todo.extend(reversed(children))
    return out


# --- errors ----------------------------------------------------------------------------------
_TYPE_NAMES = {
    "bool_type": "true or false",
    "int_type": "a whole number",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


_BOUNDS = {
    "greater_than_equal": ("at least", "ge"),
    "greater_than": ("more than", "gt"),
    "less_than_equal": ("at most", "le"),
    "less_than": ("less than", "lt"),
}


def _describe(err: Any, root: yaml.Node | None, source: str, schema: type[BaseModel] | None = None) -> str:
    raw_loc = list(err["loc"])
    problem = (err.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        raw_loc += list(problem.loc)
    loc, union = _strip_union_tags(schema or Config, raw_loc)
    path = _dotted(loc)
    line = _line_of(root, loc)
    msg = str(err["msg"]).removeprefix("Value error, ")
    kind = err["type"]
    if kind == "extra_forbidden":
        msg = "unknown key"
        known = _known_keys(schema or Config, raw_loc[:-1])
        close = difflib.get_close_matches(str(raw_loc[-1]), known, n=1, cutoff=0.6)
        if close:
            msg += f"; did you mean `{close[0]}`?"
    elif kind == "missing":
        msg = "required key is missing"
    elif kind in ("union_tag_not_found", "union_tag_invalid"):
        disc = str((err.get("ctx") or {}).get("discriminator", "kind")).strip("'")
        tags = ", ".join(union)
        if kind == "union_tag_not_found":
            msg = f"`{disc}` is missing; say which kind this is: one of {tags}"
        else:
            msg = f"{disc} {err['ctx']['tag']!r} is not a known kind; one of {tags}"
            line = _line_of(root, [*loc, disc]) or line
    elif kind in _BOUNDS:
        ctx = err.get("ctx") or {}
        word, name = _BOUNDS[kind]
        msg = f"must be {word} {ctx.get(name)}, got {_shown(loc, err.get('input'))}"
    elif kind in ("too_short", "string_too_short"):
        n = (err.get("ctx") or {}).get("min_length")
        msg = "must not be empty" if n == 1 else f"needs at least {n} entries"
    elif kind == "literal_error":
        expected = str((err.get("ctx") or {}).get("expected", "")).replace("'", "")
        msg = f"{_shown(loc, err.get('input'))} is not one of: {expected.replace(' or ', ', ')}"
    elif kind == "is_instance_of" and (err.get("ctx") or {}).get("class") == "Path":
        msg = f"expected a file path, got {_shown(loc, err.get('input'))}"
    elif kind in _TYPE_NAMES:
        got = err.get("input")
        msg = f"expected {_TYPE_NAMES[kind]}, got {_shown(loc, got)}"
        if isinstance(got, str) and _unquoted_would_do(kind, got):
            msg += " (a quoted string: write it without quotes)"
        elif kind == "bool_type" and isinstance(got, str):
            msg += " (yes/no/on/off are strings here: write true or false)"
    where = f"{source}: {path or '(top level)'}"
    if line:
        where += f" (line {line})"
    return f"{where}: {msg}"


_SECRET_FIELD = re.compile(r"password|secret|key", re.IGNORECASE)
_SHOWN_MAX = 60


def _shown(loc: list[Any], value: object) -> str:
    """A refused value as an error may echo it: hidden under a field that may hold a secret
    (password…, …secret…, …key…), cut short when long."""
    field = next((str(p) for p in reversed(loc) if isinstance(p, str)), "")
    if _SECRET_FIELD.search(field) and field != "missing_key":
        return "(a value, not shown)"
    text = repr(value)
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 1] + "…"


def _unquoted_would_do(kind: str, text: str) -> bool:
    if kind == "bool_type":
        return text.lower() in ("true", "false")
    try:
        (int if kind == "int_type" else float)(text)
    except ValueError:
        return False
    return kind in ("int_type", "float_type")


def _unwrap(tp: Any) -> Any:
    """The type under Annotated and Optional."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return tp


def _union_members(tp: Any) -> list[type[BaseModel]] | None:
    """The models of a discriminated union (providers' `kind`), else None."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return None
    members = [_unwrap(a) for a in typing.get_args(tp) if a is not type(None)]
    if not all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return None
    return members


def _tags(model: type[BaseModel], members: list[type[BaseModel]]) -> list[str]:
    """The values `model` takes in the union's discriminator: the field that is a Literal
    in every member (`kind`)."""
    for name, f in model.model_fields.items():
        if all(
            typing.get_origin(getattr(m.model_fields.get(name), "annotation", None)) is Literal
            for m in members
        ):
            return [str(a) for a in typing.get_args(f.annotation)]
    return []


def _step(tp: Any, part: Any) -> Any:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(str(part))
        return field.annotation if field is not None else None
    origin = typing.get_origin(tp)
    if origin in (list, tuple) and isinstance(part, int):
        return typing.get_args(tp)[0]
    if origin is dict:
        return typing.get_args(tp)[1]
    return None


def _strip_union_tags(schema: type[BaseModel], loc: list[Any]) -> tuple[list[Any], list[str]]:
    """pydantic puts a discriminated union's tag (`smtp`) into the location; walking the
    schema tells a tag from a key of the same spelling (a zone named `smtp`). Returns the
    location without tags and the tags of the last union met."""
    out: list[Any] = []
    tags: list[str] = []
    tp: Any = schema
    for part in loc:
        members = _union_members(_unwrap(tp)) if tp is not None else None
        if members is not None:
            tags = [t for m in members for t in _tags(m, members)]
            chosen = next((m for m in members if str(part) in _tags(m, members)), None)
            if chosen is not None:
                tp = chosen
                continue
        out.append(part)
        tp = _step(tp, part) if tp is not None else None
    if tp is not None and (members := _union_members(_unwrap(tp))) is not None:
        tags = [t for m in members for t in _tags(m, members)]
    return out, tags


def _known_keys(schema: type[BaseModel], loc: list[Any]) -> list[str]:
    """The keys the model at `loc` (a location as pydantic gives it, tags included) knows."""
    tp: Any = schema
    for part in loc:
        members = _union_members(_unwrap(tp))
        if members is not None:
            tp = next((m for m in members if str(part) in _tags(m, members)), None)
        else:
            tp = _step(tp, part)
        if tp is None:
            return []
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return list(tp.model_fields)
    return []


def _dotted(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """The line of the deepest YAML node the error location reaches."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            # The last match: after a merge (`<<:`) PyYAML puts the merged pairs first, and
            # the key that overrides one of them is the one that counts.
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(part):
                    nxt = v
                    line = k.start_mark.line + 1
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
