"""The slow source directory (placeholder: the lead is writing this module now).

`SourceIdentity` is what a cached copy of a source file is checked against: a cached block is
served only while the source's (size, mtime_ns, ino) are the ones recorded with the block.
"""

from __future__ import annotations

from typing import NamedTuple


class SourceIdentity(NamedTuple):
    size: int
    mtime_ns: int
    ino: int
