"""The Redis store's Lua files (smtpguard/store/redis/lua/) and their loader, redis/scripts.py:
every script assembles, is what RedisStore registers, and compiles on a real redis-server; a
file the loader cannot assemble is refused with the file and the problem named."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from redis import Redis
from redis.commands.core import AsyncScript

from smtpguard.store import redis_scripts
from smtpguard.store.redis import RedisStore
from smtpguard.store.redis_scripts import ScriptError, assemble
from tests.support import RedisServer

# What the loader replaces: nothing of it may reach Redis.
LEFTOVER = re.compile(r"\{\{(include\b|[A-Z][A-Z0-9_]*\}\})")


def test_every_script_compiles_on_redis_server(redis_server: RedisServer) -> None:
    names = redis_scripts.names()
    assert len(names) == 17, names
    client = Redis.from_url(redis_server.url)
    try:
        for name in names:
            text = redis_scripts.load(name)
            assert LEFTOVER.search(text) is None, name
            # SCRIPT LOAD compiles the script: a Lua syntax error is refused here.
            assert client.script_load(text) == hashlib.sha1(text.encode()).hexdigest(), name
    finally:
        client.close()


async def test_the_store_registers_every_script_file_and_nothing_else(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    await store.open()
    try:
        registered = {s.script for s in vars(store).values() if isinstance(s, AsyncScript)}
    finally:
        await store.close()
    assert registered == {redis_scripts.load(name) for name in redis_scripts.names()}


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def test_headers_are_dropped_and_includes_filled_in_byte_for_byte(tmp: Path) -> None:
    root = write(
        tmp,
        {
            "s.lua": "-- KEYS: record\n{{include lib/a.lua N=2}}\n\nreturn 1\n",
            "lib/a.lua": "-- takes N\n\nlocal x = ARGV[{{N}}]\n{{include lib/b.lua M=x}}\n",
            "lib/b.lua": "-- takes M\n  if {{M}} then\n    -- kept: a comment in a body\n  end\n",
        },
    )
    assert assemble(root, "s.lua") == (
        "\nlocal x = ARGV[2]\n  if x then\n    -- kept: a comment in a body\n  end\n\nreturn 1\n"
    )


@pytest.mark.parametrize(
    ("files", "refusal"),
    [
        pytest.param(
            {"s.lua": "-- h\n{{include lib/a.lua}}\n", "lib/a.lua": "-- h\nKEYS[{{IDX}}]\n"},
            "lib/a.lua: no value for {{IDX}} (included from s.lua)",
            id="no-value",
        ),
        pytest.param(
            {
                "s.lua": "-- h\n{{include lib/a.lua IDX=1 SCORE=2}}\n",
                "lib/a.lua": "-- {{SCORE}}\nKEYS[{{IDX}}]\n",
            },
            "lib/a.lua: SCORE given but not used (included from s.lua)",
            id="unused",
        ),
        pytest.param(
            {"s.lua": "-- h\n{{include lib/a.lua A=1 A=2}}\n", "lib/a.lua": "-- h\n{{A}}\n"},
            "s.lua:2: A given twice",
            id="twice",
        ),
        pytest.param(
            {"s.lua": "-- h\nreturn ARGV[{{N}}]\n"}, "s.lua: no value for {{N}}", id="script-placeholder"
        ),
        pytest.param(
            {"s.lua": "-- h\n{{include lib/gone.lua}}\n"},
            "lib/gone.lua: no such file (included from s.lua)",
            id="missing",
        ),
        pytest.param(
            {
                "s.lua": "-- h\n{{include lib/a.lua}}\n",
                "lib/a.lua": "-- h\n{{include lib/b.lua}}\n",
                "lib/b.lua": "-- h\n{{include lib/a.lua}}\n",
            },
            "lib/a.lua: includes itself (included from s.lua, lib/a.lua, lib/b.lua)",
            id="circle",
        ),
        pytest.param({"s.lua": "return 1\n"}, "s.lua: no header", id="no-header"),
        pytest.param(
            {"s.lua": "-- h\n{{include other.lua}}\n", "other.lua": "-- h\n"},
            "s.lua:2: not an include line: '{{include other.lua}}'",
            id="not-lib",
        ),
        pytest.param(
            {"s.lua": "-- h\n{{include lib/a.lua idx=1}}\n", "lib/a.lua": "-- h\n"},
            "s.lua:2: not an include line",
            id="bad-name",
        ),
        pytest.param(
            {"s.lua": "-- h\n  {{include lib/a.lua}}\n", "lib/a.lua": "-- h\n"},
            "s.lua:2: an include must start its line",
            id="indented",
        ),
    ],
)
def test_a_file_that_cannot_be_assembled_is_refused_by_name(
    tmp: Path, files: dict[str, str], refusal: str
) -> None:
    with pytest.raises(ScriptError) as refused:
        assemble(write(tmp, files), "s.lua")
    assert str(refused.value).startswith(refusal), str(refused.value)
