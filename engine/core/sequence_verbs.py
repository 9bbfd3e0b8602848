"""The persistent-sequence verbs `Engine` offers (create, fork, truncate, delete, save, export, import, expire).

A mixin of `Engine` (engine/core/engine.py), kept apart so the engine's file reads as construction, requests
and the tick. Each verb is a call between steps on the loop thread; the work is `SequenceTable`'s
(engine/core/persistent.py), the durable side its `DurableStore`'s (engine/core/state/).
"""

import time

from engine.api.args import EngineArgs
from engine.api.ids import new_id
from engine.api.lora import LoraRef
from engine.api.outputs import SequenceInfo
from engine.api.sampling_params import SamplingParams
from engine.core.adapters import Adapters
from engine.core.persistent import SequenceTable
from engine.core.sequence import Request, Sequence


class SequenceVerbs:
    """What a persistent sequence can be asked, through the engine's table, adapters, `add_request` and `cancel`."""

    config: EngineArgs
    persistent: SequenceTable
    adapters: Adapters
    vocab_size: int

    @property
    def sequences(self) -> dict[str, Sequence]:
        """Persistent sequences by id (read-only use: the verbs below change them)."""
        return self.persistent.by_id

    def create_sequence(self, prompt_ids, emit=None, lora: LoraRef | None = None) -> tuple[Sequence, Request]:
        """A new persistent sequence, prefilled as soon as it is scheduled (a max_tokens=0 request on it), under
        the adapter `lora` names (None: the base model) for its whole life."""
        seq = self.persistent.new()
        try:
            req = self.add_request(new_id("prefill"), prompt_ids, SamplingParams(max_tokens=0, lora=lora), emit,
                                   seq.seq_id)
        except Exception:
            del self.persistent.by_id[seq.seq_id]  # refused: nothing was created
            raise
        return seq, req

    def fork(self, seq_id: str, at: int | None = None, lora: LoraRef | None = None) -> Sequence:
        """A new sequence sharing `seq_id`'s first `at` tokens and their cells, under the parent's LoRA adapter;
        `lora` naming another adapter: under that one, its tokens recomputed (no cells shared)."""
        binding = self.adapters.bind(lora, self.persistent.get(seq_id)) if lora is not None else None
        child = self.persistent.fork(seq_id, at)  # refused above (an unknown adapter) before anything is made
        if lora is not None:
            self.adapters.rebind(child, binding)
        return child

    def truncate(self, seq_id: str, length: int) -> Sequence:
        return self.persistent.truncate(seq_id, length)

    def delete(self, seq_id: str) -> None:
        seq = self.persistent.get(seq_id)
        if seq.request is not None:
            self.cancel(seq.request.request_id)
        self.persistent.drop(seq_id)

    def sequence_info(self, seq_id: str) -> SequenceInfo:
        return self.persistent.info(seq_id)

    def save_sequence(self, seq_id: str) -> SequenceInfo:
        """Write the sequence and its cells to the state dir now (StorageFull if the disk refuses)."""
        return self.persistent.save(seq_id)

    def export_sequences(self, seq_id: str, family: bool = False) -> bytes:
        """A portable archive (safetensors) of the sequence, or of its whole fork family."""
        return self.persistent.export(seq_id, family)

    def import_sequences(self, blob: bytes, new_ids: bool = False) -> dict[str, str]:
        """An archive's sequences as new persistent sequences here (same model only): {archive id: id here}.
        With `new_ids` every one gets an id made here (a scale-out move: the id must name this replica)."""
        return self.persistent.import_archive(blob, self.vocab_size, new_ids)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Delete persistent sequences idle for longer than the TTL; return their ids."""
        expired = self.persistent.idle_longer_than(self.config.seq_ttl_s, time.monotonic() if now is None else now)
        for seq_id in expired:
            self.delete(seq_id)
        return expired
