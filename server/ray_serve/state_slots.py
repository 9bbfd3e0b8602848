"""`--state-dir` with `--replicas`: each engine replica keeps its sequences in a folder of its own, `DIR/replica-K`.

A replica claims the first slot no live replica holds: it takes an exclusive `flock` on `DIR/replica-K.lock`
and keeps it for its whole life, so the kernel (or, on shared storage, the file server: NFSv4 locks) frees the
slot the moment its process dies, `kill -9` included. The engine then restores that folder as a single server
restores its `--state-dir`: a replica Serve starts in place of a dead one takes the dead one's free slot and
brings its sequences back under their old ids (the router finds them in the replica's reported `held` ids).

Why slots and not the replica's own id: Serve gives a restarted replica a new id, and a folder keyed by the old
one would never be opened again. Why a lock and not a heartbeat: the lock cannot be held by a dead process,
and taking it is atomic, so two replicas starting at once never share a folder.
"""

import fcntl
import os
from pathlib import Path

MAX_SLOTS = 4096


class Slot:
    """A claimed `DIR/replica-K` folder; the claim lasts until `release` or the process's exit."""

    def __init__(self, folder: Path, fd: int):
        self.folder, self.fd = folder, fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = -1


def claim(root: str | Path) -> Slot:
    """The first slot under `root` no live process holds, locked by this one; OSError if the folder is unusable."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for k in range(MAX_SLOTS):
        fd = os.open(root / f"replica-{k}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        folder = root / f"replica-{k}"
        folder.mkdir(exist_ok=True)
        return Slot(folder, fd)
    raise OSError(f"every one of {MAX_SLOTS} replica slots under {root} is held: is another deployment using "
                  f"this --state-dir?")
