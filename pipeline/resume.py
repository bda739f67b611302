"""Resume fingerprints: a decision stands while the files it was made on are unchanged.

A search is done again when a candidate file was edited after it was screened (the edit is kept
and screened as it is now); an acceptance or rejection is made again when a source it read has
changed since.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from core.records import Search


def edited_since_screened(search: Search | dict) -> bool:
    for c in Search.of(search).candidates or []:
        if c.sha1 is None:  # proposals, and logs written before sha1 was recorded
            continue
        p = Path(c.path)
        if not p.is_file() or hashlib.sha1(p.read_bytes()).hexdigest() != c.sha1:
            return True
    return False


def sha256(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def fingerprint(search: Search | dict) -> dict[str, str | None]:
    return {p: sha256(p) for p in Search.of(search).order or []}
