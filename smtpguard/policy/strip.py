"""Removing header fields from a submitted message before relay (DESIGN.md §16).

Byte-exact by construction: only whole fields of the top-level header block are cut (the
field line and its folded continuation lines, each with its CRLF), and every other byte,
the body above all, is passed through as it came. The message has already passed the
smuggling check and `parse`, so every line ends in CRLF and every field name is valid.
"""

from __future__ import annotations

from collections.abc import Iterable


def without_headers(data: bytes, names: Iterable[str], prefix: bytes = b"") -> bytes:
    """`prefix` + `data` without any field named in `names` (case-insensitive) in its
    header block. One copy of the message at most: a message may be tens of megabytes."""
    wanted = {n.lower().encode() for n in names}
    end = data.find(b"\r\n\r\n")
    head_end = len(data) if end < 0 else end + 2
    head = data[:head_end]
    lowered = head.lower()
    if not any(name + b":" in lowered for name in wanted):
        # The common case when the client sent none of them: no copy (but the prefix's).
        return prefix + data if prefix else data
    kept: list[bytes] = []
    dropping = False
    start = 0
    while start < head_end:
        nl = head.find(b"\r\n", start)
        stop = head_end if nl < 0 else nl + 2
        line = head[start:stop]
        if line[:1] in (b" ", b"\t"):
            # A continuation belongs to the field above it: it goes or stays with it.
            if not dropping:
                kept.append(line)
        else:
            colon = line.find(b":")
            dropping = colon > 0 and line[:colon].lower() in wanted
            if not dropping:
                kept.append(line)
        start = stop
    return b"".join([prefix, *kept, memoryview(data)[head_end:]])
