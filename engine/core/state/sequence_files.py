"""SequenceFiles: one JSON file per persistent sequence under `DIR/sequences/`, replaced atomically.

A write goes to a temporary file in the same folder, is flushed and fsynced, then renamed over the old
file (`os.replace`, atomic on POSIX): a `kill -9` (or a power cut, once the data is synced) at any moment
leaves either the previous record or the new one, never a torn one. Leftover temporary files are removed
at start. A delete unlinks the file. Why one file per sequence rather than a journal: a sequence's state is
small, replaced whole, and needs no compaction or replay; the folder listing is the set of live sequences.
"""

import logging
from pathlib import Path

from engine.api.files import TMP_SUFFIX, write_atomic
from engine.core.state.records import BadRecord, SequenceRecord

log = logging.getLogger("cellserve.state")


class SequenceFiles:
    """Records by sequence id (ids are checked before they name a file)."""

    def __init__(self, root: Path):
        self.dir = root / "sequences"
        self.dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.dir.glob(f".*{TMP_SUFFIX}"):  # a write the process did not finish
            tmp.unlink(missing_ok=True)

    def write(self, record: SequenceRecord) -> None:
        write_atomic(self._path(record.seq_id), record.to_json().encode())

    def delete(self, seq_id: str) -> None:
        self._path(seq_id).unlink(missing_ok=True)

    def load_all(self) -> list[SequenceRecord]:
        """Every readable record; a file that is not one is logged and left where it is (never trusted)."""
        records = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                record = SequenceRecord.from_json(path.read_bytes())
                if path.stem != record.seq_id:
                    raise BadRecord(f"its id {record.seq_id!r} is not its file name")
            except (OSError, BadRecord) as exc:
                log.error("skipping %s: not a valid sequence record (%s)", path, exc)
                continue
            records.append(record)
        return records

    def _path(self, seq_id: str) -> Path:
        return self.dir / f"{seq_id}.json"
