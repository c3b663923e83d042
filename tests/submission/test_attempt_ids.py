"""submission.new_id draws the random part of attempt ids 1,024 at a time: ids must stay
unique in one process, between a process and a child it forks (the child must not hand out
its parent's remaining draws), and keep the millisecond prefix limits.token_time reads."""

from __future__ import annotations

import os
import re

from smtpguard import submission
from smtpguard.policy.limits import token_time
from smtpguard.submission import new_id

NOW = 1_764_600_000.123


def test_ids_are_unique_past_several_refills_and_carry_their_millisecond() -> None:
    ids = [new_id(NOW) for _ in range(5000)]
    assert len(set(ids)) == 5000
    assert all(re.fullmatch(r"[0-9a-f]{19}", i) for i in ids)
    assert {token_time(i) for i in ids} == {int(NOW * 1000) / 1000}
    assert new_id(NOW + 1.0) > new_id(NOW)  # time-ordered


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    new_id(NOW)  # the parent holds drawn suffixes, ~1,023 left
    assert submission._SUFFIXES
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next 200 ids, same millisecond as the parent's
        try:
            os.close(read)
            os.write(write, "\n".join(new_id(NOW) for _ in range(200)).encode())
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    child = set(b"".join(chunks).decode().split("\n"))
    parent = {new_id(NOW) for _ in range(200)}
    assert len(child) == 200
    assert child.isdisjoint(parent)
