"""An earlier release's package, for the tests of upgrades with it still serving."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def extract_release(commit: str, dest: Path) -> Path:
    """`smtpguard/` as `commit` had it, under `dest` (made if missing), from `git archive`:
    run with this checkout's interpreter and `dest` first on the path, it is that release's
    `serve` and CLI."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "smtpguard"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest
