"""DurableStore: persistent sequences on disk, written as they change and restored by a new engine.

What it guarantees (`SequenceTable` calls it; the engine thread is its only caller):
- `write(seq)` replaces the sequence's record atomically before returning, so a verb acknowledged after it
  survives a `kill -9`; with `cells=True` (the sequence is idle) the chunks of its cells not yet on disk are
  written first, so a record never names a chunk that was not there when it was written.
- Saved cells stay valid while the tokens they cover do: a record keeps its chunks through an eviction
  from RAM, and drops them only when its tokens change under them (a truncation, another generation).
- A chunk file is deleted when no record names it any more (delete, truncate, budget); files no record
  names after a crash are removed at `load`.
- Over `max_bytes` of cell files, the least recently used fork families (a root and every sequence
  forked from it) drop their cells: their tokens stay, and they recompute when next used.
- A failed write (disk full, read-only folder) raises `StorageFull` and leaves the previous record whole.
- A sequence written without cells in RAM (a fork of a sequence restored lazily, one whose cells were
  evicted) names the saved chunks its tokens begin with, so they stay on disk while it may page them in.
- `saved_prefix(tokens)`: the saved chunks any token list begins with (`page_in`: cells come back from
  disk, not from a recompute, for any sequence whose tokens a saved one shares).
"""

import logging
import time
from pathlib import Path

from engine.api.errors import IncompatibleState, StorageFull
from engine.api.files import write_atomic
from engine.core.state.cell_files import CellFiles, chunk_bounds, chunk_spans, saved_prefix
from engine.core.state.identity import ModelIdentity
from engine.core.state.records import SequenceRecord
from engine.core.state.sequence_files import SequenceFiles

log = logging.getLogger("cellserve.state")


class StateDirError(ValueError):
    """`--state-dir` cannot be used (not creatable, not writable): raised when the engine is built."""


class DurableStore:
    def __init__(self, root: str | Path, identity: ModelIdentity, max_bytes: int | None = None):
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / ".probe", b"ok")
            (self.root / ".probe").unlink()
            self.seqs = SequenceFiles(self.root)
            self.cells = CellFiles(self.root, identity)
        except OSError as exc:
            raise StateDirError(f"state dir {self.root} is not usable ({exc.strerror or exc}): give a folder this "
                                f"process can create and write, or leave --state-dir out") from None
        self.identity = identity
        self.max_bytes = max_bytes
        self.records: dict[str, SequenceRecord] = {}
        self.refs: dict[str, set[str]] = {}  # chunk key -> ids of the records naming it

    # ----- start -------------------------------------------------------------------------------
    def load(self) -> list[SequenceRecord]:
        """Every valid record, oldest first (parents before their forks), and the chunk files no record names
        removed (a crash between writing a chunk and its record). A record whose chunks are not this model's
        (their keys hash the model's identity) keeps its tokens only; its files stay until nothing names them."""
        foreign: set[str] = set()
        for rec in self.seqs.load_all():
            if len(rec.chunks) != len(chunk_bounds(rec.cells_n)):
                log.error("sequence %s: its cell list does not cover its %d tokens; restoring it by recompute",
                          rec.seq_id, rec.cells_n)
                rec.cells_n, rec.chunks = 0, []
            elif [k for k, _, _ in chunk_spans(self.identity, rec.token_ids, rec.cells_n)] != rec.chunks:
                log.warning("sequence %s: its saved cells were written by another model (or for other tokens); "
                            "they are left on disk and recomputed when it runs", rec.seq_id)
                foreign.update(rec.chunks)
                rec.cells_n, rec.chunks = 0, []
            self.records[rec.seq_id] = rec
            self._ref(rec)
        for key in [k for k in self.cells.sizes if k not in self.refs and k not in foreign]:
            self.cells.delete(key)
        return sorted(self.records.values(), key=lambda r: (r.created, r.seq_id))

    # ----- writes ------------------------------------------------------------------------------
    def write(self, seq, scheduler, cells: bool = False) -> SequenceRecord:
        """Make `seq`'s record match it (see the module docstring); raises StorageFull after writing what it
        could (an unsaved chunk costs a recompute only; an unsaved record keeps the previous one)."""
        prev = self.records.get(seq.seq_id)
        rec = SequenceRecord(seq.seq_id, list(seq.token_ids), seq.parent, seq.fork_at, seq.created, time.time(),
                             lora=SequenceRecord.lora_of(seq))
        # cells are content-addressed by tokens (and the model): an adapter's K/V are kept in RAM only, never
        # saved where a sequence under the base (or another adapter) could load them
        rec.cells_n, rec.chunks = self._still_valid(rec.token_ids, prev) if rec.lora is None else (0, [])
        failure = None
        plain = rec.lora is None
        if plain and cells and seq.request is None and seq.slot is not None and seq.n_cached > rec.cells_n:
            try:
                rec.cells_n, rec.chunks = self._save_cells(seq, scheduler)
            except OSError as exc:
                failure = exc
                log.error("could not save the cells of sequence %s (%s); its tokens are saved, its cells will be "
                          "recomputed after a restart", seq.seq_id, exc)
        elif plain and rec.cells_n < len(rec.token_ids) - 1 and (spans := self.saved_prefix(rec.token_ids)) \
                and spans[-1][2] > rec.cells_n:
            rec.cells_n, rec.chunks = spans[-1][2], [k for k, _, _ in spans]
        try:
            self.seqs.write(rec)
        except OSError as exc:
            log.error("could not save sequence %s to %s (%s); it lives in memory only until a save succeeds",
                      seq.seq_id, self.root, exc)
            raise StorageFull(f"the state dir {self.root} refused the write ({exc.strerror or exc}); the sequence "
                              f"is intact in memory: free space and save it again") from None
        self._swap(prev, rec)
        if failure is not None:
            raise StorageFull(f"the state dir {self.root} refused a cell file ({failure.strerror or failure}); "
                              f"the tokens are saved, the cells are not: free space and save again")
        return rec

    def forget(self, seq_id: str) -> None:
        """The sequence is gone (deleted, expired): its record, and the chunks nobody else names."""
        self.seqs.delete(seq_id)
        self._unref(self.records.pop(seq_id, None))

    def enforce_budget(self, keep: str | None = None) -> None:
        """While cell files exceed `max_bytes`, the least recently used family (not `keep`'s, unless it is
        the only one left) drops its cells to recompute-only."""
        if self.max_bytes is None:
            return
        families = sorted(self._families().items(), key=lambda f: max(r.last_used for r in f[1]))
        keep_root = self._root_of(keep) if keep else None
        families.sort(key=lambda f: f[0] == keep_root)  # stable: the kept family goes last
        for _, members in families:
            if self.cells.total_bytes <= self.max_bytes:
                return
            dropped = [r for r in members if r.chunks]
            for rec in dropped:
                self._drop_cells(rec)
            if dropped:
                log.info("state dir over %d bytes: the family of %s dropped its cells (tokens kept)",
                         self.max_bytes, dropped[0].seq_id)

    def saved_prefix(self, token_ids: list[int], limit: int | None = None) -> list[tuple[str, int, int]]:
        """(key, start, end) of the saved chunks covering the longest prefix of `token_ids` (at most `limit`
        tokens; default all but the last, which an idle sequence never has a cell for)."""
        limit = len(token_ids) - 1 if limit is None else limit
        return saved_prefix(self.identity, token_ids, limit, self.cells.has) if limit > 0 and self.cells.sizes else []

    def saved_tokens(self, seq) -> int:
        """Tokens of `seq` whose cells its record names and whose chunks are on disk (cheap: no hashing)."""
        rec = self.records.get(seq.seq_id)
        if rec is None or not rec.chunks or seq.token_ids[: rec.cells_n] != rec.token_ids[: rec.cells_n]:
            return 0
        return min(rec.cells_n, len(seq.token_ids) - 1) if all(map(self.cells.has, rec.chunks)) else 0

    # ----- internals ---------------------------------------------------------------------------
    def _still_valid(self, token_ids: list[int], prev: SequenceRecord | None) -> tuple[int, list[str]]:
        """The previous record's cells, if its tokens still begin with the ones they were computed for."""
        if prev is None or not prev.chunks or len(token_ids) < prev.cells_n:
            return 0, []
        if [k for k, _, _ in chunk_spans(self.identity, token_ids, prev.cells_n)] != prev.chunks:
            return 0, []
        return prev.cells_n, prev.chunks

    def _save_cells(self, seq, scheduler) -> tuple[int, list[str]]:
        spans = chunk_spans(self.identity, seq.token_ids, seq.n_cached)
        for key, a, b in spans:
            if not self.cells.has(key):
                self.cells.write(key, *scheduler.read_cells(seq, a, b))
        return seq.n_cached, [k for k, _, _ in spans]

    def _drop_cells(self, rec: SequenceRecord) -> None:
        new = SequenceRecord(rec.seq_id, rec.token_ids, rec.parent, rec.fork_at, rec.created, rec.last_used)
        try:
            self.seqs.write(new)
        except OSError as exc:  # the old record still names its chunks: keep them
            log.error("could not drop the cells of %s (%s)", rec.seq_id, exc)
            return
        self._swap(rec, new)

    def _swap(self, prev: SequenceRecord | None, rec: SequenceRecord) -> None:
        """`rec` replaced `prev` on disk: count the chunks it names, delete those nobody names any more."""
        self.records[rec.seq_id] = rec
        self._ref(rec)
        if prev is not None:
            kept = set(rec.chunks)
            self._unref(SequenceRecord(prev.seq_id, prev.token_ids, chunks=[k for k in prev.chunks if k not in kept]))

    def _ref(self, rec: SequenceRecord) -> None:
        for key in rec.chunks:
            self.refs.setdefault(key, set()).add(rec.seq_id)

    def _unref(self, rec: SequenceRecord | None) -> None:
        for key in rec.chunks if rec else ():
            users = self.refs.get(key)
            if users is not None:
                users.discard(rec.seq_id)
                if not users:
                    del self.refs[key]
                    self.cells.delete(key)

    def _root_of(self, seq_id: str) -> str:
        seen = set()
        while (rec := self.records.get(seq_id)) is not None and rec.parent in self.records and seq_id not in seen:
            seen.add(seq_id)
            seq_id = rec.parent
        return seq_id

    def _families(self) -> dict[str, list[SequenceRecord]]:
        out: dict[str, list[SequenceRecord]] = {}
        for rec in self.records.values():
            out.setdefault(self._root_of(rec.seq_id), []).append(rec)
        return out


def restore_cells(seq, rec: SequenceRecord, scheduler, read, reserve: int | None = None) -> int:
    """`seq` (just made, no cells) gets cells for up to `rec.cells_n` tokens: shared with an already restored
    sequence where their tokens agree (a family's prefix lands in the pool once), the rest loaded from the
    chunks (`read(key) -> (k, v)`: the cell files, or an archive's tensors); see `load_chunks` (`reserve`
    None, a start's restore: free cells only; 0, an import: cached prefixes and idle sequences make room, as
    for a prefill). Returns the tokens that have cells."""
    spans = [(key, a, b) for key, (a, b) in zip(rec.chunks, chunk_bounds(rec.cells_n))]
    return load_chunks(seq, spans, min(rec.cells_n, len(seq.token_ids) - 1), scheduler, read, reserve)


def load_chunks(seq, spans: list[tuple[str, int, int]], n: int, scheduler, read, reserve: int | None = None) -> int:
    """`seq` gets cells for its first `n` tokens where it has none: shared with any holder whose tokens agree
    (`Scheduler.share_longest`, no copy), the rest loaded from the chunks `spans` (key, start, end), in
    position order from 0. Stops at the first chunk that cannot be used (logged: another model's, gone, torn)
    or when the pool has no room (`reserve`: see `Scheduler.load_cells`): the rest is recomputed when the
    sequence runs. Returns `seq.n_cached`."""
    if n <= 0:
        return seq.n_cached
    have = scheduler.share_longest(seq, n)
    for key, a, b in spans:
        if have >= n:
            break
        if b <= have:
            continue
        try:
            k, v = read(key)
        except (IncompatibleState, OSError, KeyError) as exc:
            log.warning("sequence %s: recomputed from token %d (%s)", seq.seq_id, have, exc)
            break
        lo, hi = have - a, min(b, n) - a
        if k.shape[2] != b - a or not scheduler.load_cells(seq, k[:, :, lo:hi], v[:, :, lo:hi], reserve):
            break
        have = a + hi
    return have
