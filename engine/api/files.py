"""Files written whole or not at all: the one way the engine's durable state (engine/core/state) and the
server's stored responses (server/responses/saved.py) replace a file on disk.

A write goes to a temporary file in the same folder (`.<name>.<pid>.tmp`), is flushed and fsynced, then
renamed over the old file (`os.replace`, atomic on POSIX): a `kill -9` (or a power cut, once the data is
synced) at any moment leaves either the previous content or the new one, never a torn file. Readers
remove leftover temporary files (`TMP_SUFFIX`) at start.
"""

import os
from pathlib import Path

TMP_SUFFIX = ".tmp"


def write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` or its old content, whatever happens; raises OSError (ENOSPC...) leaving it old."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
