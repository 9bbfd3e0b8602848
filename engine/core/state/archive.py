"""Portable archives: one sequence, or its whole fork family, as one safetensors file.

The file holds each distinct cell chunk once (tensors `<key>.k`, `<key>.v`; a family's common prefix is
stored once, as on disk) and, in its header, the format, the `ModelIdentity` that computed the cells and
the sequences' records (tokens, parents, fork points, which chunks cover them). `export_archive` takes the
cells from the pool (or from the cell files for a sequence whose cells were evicted from RAM but are
saved); `read_archive` checks everything before anything is created: the format, the model identity
(another model's archive is refused whole: `IncompatibleState`) and every record, as a client's input.
"""

import json
import struct

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from engine.api.errors import IncompatibleState, InvalidRequest
from engine.core.state.cell_files import chunk_spans
from engine.core.state.identity import ModelIdentity
from engine.core.state.records import BadRecord, SequenceRecord

FORMAT = "cellserve-sequences/1"
MAX_HEADER = 64 * 2**20


def export_archive(identity: ModelIdentity, seqs, scheduler, saved: dict[str, SequenceRecord], read_saved) -> bytes:
    """The archive of `seqs` (parents first). `saved`, `read_saved(key)`: the store's records and cell files, for
    cells no longer in RAM (empty, None without a store)."""
    tensors, records = {}, []
    for seq in seqs:
        rec = SequenceRecord(seq.seq_id, list(seq.token_ids), seq.parent, seq.fork_at, seq.created, seq.created,
                             lora=SequenceRecord.lora_of(seq))
        on_disk = saved.get(seq.seq_id)
        # an adapter's cells stay in RAM (engine/core/state/store.py): its tokens and its adapter's name travel
        if rec.lora is None and seq.slot is not None and seq.n_cached > 0 and (on_disk is None or seq.n_cached >= on_disk.cells_n):
            spans = chunk_spans(identity, seq.token_ids, seq.n_cached)
            for key, a, b in spans:
                if f"{key}.k" not in tensors:
                    tensors[f"{key}.k"], tensors[f"{key}.v"] = scheduler.read_cells(seq, a, b)
            rec.cells_n, rec.chunks = seq.n_cached, [k for k, _, _ in spans]
        elif rec.lora is None and on_disk is not None and on_disk.chunks and on_disk.token_ids == seq.token_ids:
            rec.cells_n, rec.chunks = on_disk.cells_n, list(on_disk.chunks)
            for key in rec.chunks:
                if f"{key}.k" not in tensors:
                    tensors[f"{key}.k"], tensors[f"{key}.v"] = read_saved(key)
        records.append(json.loads(rec.to_json()))
    meta = {"format": FORMAT, "identity": identity.to_json(), "records": json.dumps(records)}
    return st_save({k: t.contiguous() for k, t in tensors.items()}, metadata=meta)


def read_archive(identity: ModelIdentity, blob: bytes) -> tuple[list[SequenceRecord], dict]:
    """(records oldest first, tensors by name) of an archive made for `identity`, or the reason it is refused."""
    meta = _metadata(blob)
    if meta.get("format") != FORMAT:
        raise IncompatibleState(f"not a cellserve sequence archive (format {meta.get('format')!r}, want {FORMAT})")
    try:
        theirs = ModelIdentity.from_json(meta["identity"])
        docs = json.loads(meta["records"])
    except (KeyError, ValueError, TypeError) as exc:
        raise IncompatibleState(f"the archive's header is damaged ({exc})") from None
    why = identity.differs(theirs)
    if why:
        raise IncompatibleState(f"the archive was written by another model: {why}; import it into a server "
                                f"running that model (same weights, dtype and KV layout)")
    try:
        records = [SequenceRecord.from_dict(d) for d in docs] if isinstance(docs, list) else None
    except BadRecord as exc:
        raise InvalidRequest(f"the archive holds an invalid sequence: {exc}", "archive") from None
    if not records:
        raise InvalidRequest("the archive holds no sequence", "archive")
    if len({r.seq_id for r in records}) != len(records):
        raise InvalidRequest("the archive holds one sequence id twice", "archive")
    try:
        tensors = st_load(blob)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise IncompatibleState(f"the archive's tensors are unreadable ({exc})") from None
    return sorted(records, key=lambda r: r.created), tensors


def _metadata(blob: bytes) -> dict:
    if len(blob) < 8:
        raise IncompatibleState("not a cellserve sequence archive (too short to be a safetensors file)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > min(MAX_HEADER, len(blob) - 8):
        raise IncompatibleState("not a cellserve sequence archive (its safetensors header is out of bounds)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except ValueError:
        raise IncompatibleState("not a cellserve sequence archive (its header is not JSON)") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}
