"""Temporary: the Lua scripts RedisStore registers, byte for byte as they were assembled in
Python strings before they moved into .lua files (tests/redis_scripts_before.json, dumped from
that code). Redis caches a script by the SHA1 of these bytes, so whitespace counts too."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import smtpguard.store.redis as redis_store

BEFORE = json.loads((Path(__file__).parent / "redis_scripts_before.json").read_text(encoding="utf-8"))


def test_every_registered_script_is_in_the_fixture() -> None:
    source = Path(redis_store.__file__).read_text(encoding="utf-8")
    registered = {
        line.split("register_script(")[1].split(")")[0]
        for line in source.splitlines()
        if "register_script(" in line
    }
    assert registered == set(BEFORE), registered ^ set(BEFORE)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_script_is_byte_for_byte_what_it_was(name: str) -> None:
    text = getattr(redis_store, name)
    assert text == BEFORE[name]["text"]
    assert hashlib.sha1(text.encode()).hexdigest() == BEFORE[name]["sha1"]
