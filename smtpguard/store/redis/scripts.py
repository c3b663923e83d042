"""The Redis store's Lua scripts, read from the .lua files in lua/ beside this module.

A file is a header and a body. The header, its leading `--` lines, says what the script takes
(KEYS, ARGV) and returns; it is not sent. The body, every line after the header, is sent as it
is written: Redis caches a script by the SHA1 of its bytes, so blank lines count.

A body line `{{include lib/NAME.lua A=1 B=2}}` (at the start of the line) is replaced by the
body of that library file, in which each `{{A}}` becomes 1 and each `{{B}}` 2. Every
placeholder a library holds must be given a value, and every value given must be used: a
misspelt name fails when the store module is imported, not in Redis. A script's own body holds
no placeholders (one in a header is documentation, left alone). Includes nest (a library
may include another), never in a circle.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable

_ROOT = resources.files("smtpguard.store.redis").joinpath("lua")
_INCLUDE = re.compile(
    r"\{\{include (?P<path>lib/[a-z_]+\.lua)(?P<params>(?: [A-Z][A-Z0-9_]*=[^\s{}]+)*)\}\}\n?"
)
_PLACEHOLDER = re.compile(r"\{\{([A-Z][A-Z0-9_]*)\}\}")
_MAX_DEPTH = 8


class ScriptError(ValueError):
    """A .lua file that cannot be assembled: the message names the file and the problem."""


@functools.cache
def load(name: str) -> str:
    """The script `lua/<name>.lua`, its includes expanded: what RedisStore registers."""
    return assemble(_ROOT, f"{name}.lua")


def names() -> list[str]:
    """Every script in lua/ (not its lib/), by the name load() takes."""
    return sorted(f.name.removesuffix(".lua") for f in _ROOT.iterdir() if f.name.endswith(".lua"))


def assemble(root: Traversable, path: str) -> str:
    """The body of `path` under `root`, its includes expanded (the loader itself, for any folder)."""
    return _body(root, path, {}, ())


def _body(root: Traversable, path: str, params: Mapping[str, str], chain: tuple[str, ...]) -> str:
    where = f" (included from {', '.join(chain)})" if chain else ""
    if path in chain:
        raise ScriptError(f"{path}: includes itself{where}")
    if len(chain) >= _MAX_DEPTH:
        raise ScriptError(f"{path}: includes nested deeper than {_MAX_DEPTH}{where}")
    file = root.joinpath(path)
    if not file.is_file():
        raise ScriptError(f"{path}: no such file{where}")
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    header = 0
    while header < len(lines) and lines[header].startswith("--"):
        header += 1
    if header == 0:
        raise ScriptError(f"{path}: no header (leading -- lines saying what it takes and returns){where}")

    used: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in params:
            raise ScriptError(f"{path}: no value for {{{{{name}}}}}{where}")
        used.add(name)
        return params[name]

    out = []
    for number, line in enumerate(lines[header:], start=header + 1):
        if line.startswith("{{include"):
            include = _INCLUDE.fullmatch(line)
            if include is None:
                raise ScriptError(f"{path}:{number}: not an include line: {line.strip()!r}{where}")
            given: dict[str, str] = {}
            for pair in include.group("params").split():
                key, _, value = pair.partition("=")
                if key in given:
                    raise ScriptError(f"{path}:{number}: {key} given twice{where}")
                given[key] = value
            out.append(_body(root, include.group("path"), given, (*chain, path)))
        elif "{{include" in line:
            raise ScriptError(f"{path}:{number}: an include must start its line{where}")
        else:
            out.append(_PLACEHOLDER.sub(fill, line))
    unused = sorted(set(params) - used)
    if unused:
        raise ScriptError(f"{path}: {', '.join(unused)} given but not used{where}")
    return "".join(out)
