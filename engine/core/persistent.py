"""Persistent sequences: the conversations a client creates, continues, forks, truncates and deletes.

`SequenceTable` keeps them by id and turns each verb into scheduler requests (share, cut, release):
it never touches cells itself. A verb that is refused raises before it changes anything. A sequence
that is generating can be forked (its tokens so far) but not truncated; deleting one is the engine's
verb, because it must first cancel the request running on it.

With a `DurableStore` (`--state-dir`, engine/core/state/) every change is written before the verb returns
(fork, truncate, delete; a generation or a create when its request ends: `settled`), idle sequences'
cells with it, and `restore` brings them all back under the same ids in a new engine: their tokens at
once, their cells when each is next scheduled (`Scheduler.page_in`, at admission), or at once with
`eager`. `page_in` also brings back, from disk rather than by a recompute, the cells a sequence lost in
RAM (evicted while idle, preempted). A write the disk refuses is logged and leaves the sequence in memory
(`save` reports it: StorageFull).
"""

import logging
import time

from engine.api.errors import InvalidRequest, SequenceBusy, SequenceNotFound, StorageFull
from engine.api.ids import new_id
from engine.api.lora import LoraBinding
from engine.api.outputs import SequenceInfo
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.state.archive import export_archive, read_archive
from engine.core.state.records import SequenceRecord
from engine.core.state.store import DurableStore, restore_cells

log = logging.getLogger("cellserve.state")


class SequenceTable:
    """Persistent sequences by id, over one scheduler (and, optionally, a store on disk)."""

    def __init__(self, scheduler: Scheduler, store: DurableStore | None = None, identity=None):
        self.scheduler = scheduler
        self.store = store
        self.identity = identity  # () -> ModelIdentity, for archives (computed on first use)
        self.by_id: dict[str, Sequence] = {}

    def get(self, seq_id: str) -> Sequence:
        seq = self.by_id.get(seq_id)
        if seq is None:
            raise SequenceNotFound(f"no sequence {seq_id!r}: it was deleted, expired, or never existed")
        return seq

    def new(self, token_ids: list[int] | None = None, parent: str | None = None) -> Sequence:
        seq = Sequence(new_id("seq"), list(token_ids or []), persistent=True, parent=parent)
        self.by_id[seq.seq_id] = seq
        return seq

    def fork(self, seq_id: str, at: int | None = None) -> Sequence:
        """A new sequence sharing `seq_id`'s first `at` tokens (all if None) and their cells."""
        parent = self.get(seq_id)
        at = len(parent.token_ids) if at is None else at
        if not 1 <= at <= len(parent.token_ids):
            raise InvalidRequest(f"fork at={at} is outside [1, {len(parent.token_ids)}]", "at")
        child = Sequence(new_id("seq"), parent.token_ids[:at], persistent=True, parent=seq_id, fork_at=at,
                         lora=parent.lora)
        self.scheduler.fork(parent, child, min(parent.n_cached, at - 1))
        self.by_id[child.seq_id] = child
        self._write(child)
        return child

    def truncate(self, seq_id: str, length: int) -> Sequence:
        seq = self.get(seq_id)
        if seq.request is not None:
            raise SequenceBusy(f"sequence {seq_id} is generating; cancel it before truncating")
        if not 1 <= length <= len(seq.token_ids):
            raise InvalidRequest(f"length={length} is outside [1, {len(seq.token_ids)}]", "length")
        if seq.n_cached > length - 1:
            self.scheduler.uncache(seq, length - 1)
        del seq.token_ids[length:]
        self.scheduler.touch(seq)
        self._write(seq)
        return seq

    def drop(self, seq_id: str) -> None:
        """Forget an idle sequence and release its cells (the engine cancels its request first)."""
        self.scheduler.release(self.by_id.pop(seq_id))
        if self.store is not None:
            self.store.forget(seq_id)

    def settled(self, seq_id: str) -> None:
        """A request on the sequence ended (its last output is not sent yet): write it, cells included."""
        seq = self.by_id.get(seq_id)
        if seq is not None and seq.token_ids:
            self._write(seq)

    def info(self, seq_id: str) -> SequenceInfo:
        seq = self.get(seq_id)
        owned, shared = self.scheduler.cells_of(seq)
        saved = self.store.saved_tokens(seq) if self.store is not None else 0
        return SequenceInfo(seq.seq_id, len(seq.token_ids), list(seq.token_ids), seq.status.value, seq.parent,
                            seq.n_cached, owned, shared, seq.created, seq.last_used, saved)

    def idle_longer_than(self, ttl_s: float, now: float) -> list[str]:
        return [s.seq_id for s in self.by_id.values() if s.request is None and now - s.last_used > ttl_s]

    # ----- durability (engine/core/state) ------------------------------------------------------------
    def save(self, seq_id: str) -> SequenceInfo:
        """Write the sequence and its cells now; StorageFull if the disk refuses (nothing is lost)."""
        seq = self.get(seq_id)
        if self.store is None:
            raise InvalidRequest("this server keeps sequences in memory only: start it with --state-dir DIR to "
                                 "save them (or export one: GET /v1/sequences/{id}/export)")
        self.store.write(seq, self.scheduler, cells=True)
        self.store.enforce_budget(keep=seq_id)
        return self.info(seq_id)

    def restore(self, vocab_size: int, eager: bool = False) -> tuple[int, int]:
        """Every sequence saved in the store, under its own id; with `eager` its saved cells are loaded now as
        far as the pool has room (else when it is next scheduled: `page_in`). Returns (sequences, tokens that
        came back with cells now)."""
        n_seqs = n_cells = 0
        for rec in self.store.load():
            if max(rec.token_ids) >= vocab_size:
                log.error("skipping saved sequence %s: token id %d is outside this model's vocabulary (%d)",
                          rec.seq_id, max(rec.token_ids), vocab_size)
                continue
            seq = self._adopt(rec, rec.seq_id, rec.parent)
            n_cells += restore_cells(seq, rec, self.scheduler, self.store.cells.read) if eager else 0
            n_seqs += 1
        return n_seqs, n_cells

    def family(self, seq_id: str) -> list[Sequence]:
        """`seq_id`'s fork family: its oldest live ancestor and every live sequence forked from it, oldest first."""
        root = self.get(seq_id)
        while root.parent in self.by_id:
            root = self.by_id[root.parent]
        members, frontier = [root], {root.seq_id}
        while frontier:
            kids = [s for s in self.by_id.values() if s.parent in frontier]
            members += kids
            frontier = {s.seq_id for s in kids}
        return sorted(members, key=lambda s: s.created)

    def export(self, seq_id: str, family: bool = False) -> bytes:
        seqs = self.family(seq_id) if family else [self.get(seq_id)]
        saved, read = (self.store.records, self.store.cells.read) if self.store else ({}, None)
        return export_archive(self.identity(), seqs, self.scheduler, saved, read)

    def import_archive(self, blob: bytes, vocab_size: int, new_ids: bool = False) -> dict[str, str]:
        """The archive's sequences as new sequences here: each keeps its id when that is free (else, or always
        with `new_ids`, a new one made here; forks follow their parent's), its cells loaded into the pool;
        returns {archive id: id here}, oldest first."""
        records, tensors = read_archive(self.identity(), blob)
        bad = [r.seq_id for r in records if max(r.token_ids) >= vocab_size]
        if bad:
            raise InvalidRequest(f"sequence {bad[0]} holds token ids outside this model's vocabulary", "archive")
        ids = {r.seq_id: r.seq_id if r.seq_id not in self.by_id and not new_ids else new_id("seq") for r in records}
        made = {}
        for rec in records:
            seq = self._adopt(rec, ids[rec.seq_id], ids.get(rec.parent))
            # room as a prefill makes it (cached prefixes first): an import is asked for now, and a pool full
            # of cached prefixes would otherwise take the family with no cells and recompute it later
            restore_cells(seq, rec, self.scheduler, lambda key: (tensors[f"{key}.k"], tensors[f"{key}.v"]), reserve=0)
            self._write(seq)
            made[rec.seq_id] = seq.seq_id
        return made

    def _adopt(self, rec: SequenceRecord, seq_id: str, parent: str | None) -> Sequence:
        # its adapter by name: bound to the load it finds when it next runs (uid -1: none yet)
        lora = LoraBinding(-1, *rec.lora) if rec.lora is not None else None
        seq = Sequence(seq_id, list(rec.token_ids), persistent=True, parent=parent, fork_at=rec.fork_at, lora=lora,
                       created=rec.created or time.time())
        self.by_id[seq_id] = seq
        return seq

    def _write(self, seq: Sequence) -> None:
        if self.store is None:
            return
        try:
            self.store.write(seq, self.scheduler, cells=True)
        except StorageFull:
            return  # logged by the store; the sequence lives on in memory
        self.store.enforce_budget(keep=seq.seq_id)
