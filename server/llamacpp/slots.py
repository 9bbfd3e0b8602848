"""llama.cpp's slots mapped onto persistent sequences: slot k is a sequence of the engine that keeps the last
prompt and answer run in it (`id_slot: k`), so the next request on that slot prefills only what differs
from it (llama.cpp's `cache_prompt`: the longest common prefix is kept, the rest of the sequence rewound).

`save` writes the slot's sequence with its KV cells to a file (`--state-dir`/slots/FILE, the engine's
portable sequence archive: model, KV dtype and adapter checked when read back); `restore` imports such a
file as the slot's new sequence; `erase` deletes the slot's sequence. Slots exist only as they are used:
there are `SLOTS` of them, none holds cells until a request runs in it. A slot's sequence lives as any
sequence does (deleted after `--seq-ttl` idle); its saved file stays until overwritten.
"""

import asyncio
import contextlib
import os
import time
from pathlib import Path

from engine.api.errors import EngineError, SequenceNotFound
from server.errors import APIError

SLOTS = 16  # llama-server's -np: how many slot ids a client may name (0..SLOTS-1)


class Slots:
    def __init__(self, state_dir: str | None):
        self.seqs: dict[int, str] = {}  # slot id -> its sequence id
        self.dir = Path(state_dir) / "slots" if state_dir else None

    @staticmethod
    def check(id_slot: int) -> None:
        if not 0 <= id_slot < SLOTS:
            raise APIError(400, f"id_slot {id_slot} is out of range: slots are 0 to {SLOTS - 1} (-1: none, "
                           "the prefix cache still reuses cells)", param="id_slot")

    async def info(self, engine, id_slot: int):
        """The slot's sequence (None: empty, or expired)."""
        seq = self.seqs.get(id_slot)
        if seq is None:
            return None
        try:
            return await engine.sequence_info(seq)
        except SequenceNotFound:
            self.seqs.pop(id_slot, None)
            return None

    async def prepare(self, engine, id_slot: int, prompt: list[int], reuse: bool) -> tuple[str, list[int], int]:
        """Make slot `id_slot`'s sequence hold the longest prefix of `prompt` it can keep (`reuse`: llama.cpp's
        cache_prompt) and return (sequence id, the prompt tokens still to append, prompt tokens whose cells are
        kept: the last kept token is computed again, as llama-server re-evaluates one token of a repeated prompt)."""
        info = await self.info(engine, id_slot)
        common = _common_prefix(info.token_ids, prompt) if info is not None and reuse else 0
        if common:
            if common < info.length:
                info = await engine.truncate(info.seq_id, common)
            return info.seq_id, prompt[common:], min(info.n_cached, common, len(prompt) - 1)
        if info is not None:
            await engine.delete(info.seq_id)
            self.seqs.pop(id_slot, None)
        made = await engine.create_sequence(prompt)
        self.seqs[id_slot] = made.seq_id
        return made.seq_id, [], 0

    async def save(self, engine, id_slot: int, filename: str) -> dict:
        started = time.monotonic()
        folder = self._folder()
        info = await self.info(engine, id_slot)
        if info is None:
            raise APIError(400, f"slot {id_slot} holds nothing to save; run a completion with id_slot {id_slot} "
                           "first", param="id_slot")
        blob = await engine.export_sequences(info.seq_id)
        await asyncio.to_thread(_write_atomic, folder / filename, blob)
        return {"id_slot": id_slot, "filename": filename, "n_saved": info.length, "n_written": len(blob),
                "timings": {"save_ms": (time.monotonic() - started) * 1e3}}

    async def restore(self, engine, id_slot: int, filename: str) -> dict:
        started = time.monotonic()
        path = self._folder() / filename
        if not path.is_file():
            raise APIError(404, f"no saved slot file {filename!r}; save one with POST /slots/ID?action=save",
                           param="filename", code="not_found")
        blob = await asyncio.to_thread(path.read_bytes)
        made = await engine.import_sequences(blob, new_ids=True)
        if len(made) != 1:
            for info in made.values():
                with contextlib.suppress(EngineError):
                    await engine.delete(info.seq_id)
            raise APIError(400, f"{filename!r} holds {len(made)} sequences, not one slot's", param="filename")
        info = next(iter(made.values()))
        await self.erase(engine, id_slot)
        self.seqs[id_slot] = info.seq_id
        return {"id_slot": id_slot, "filename": filename, "n_restored": info.length, "n_read": len(blob),
                "timings": {"restore_ms": (time.monotonic() - started) * 1e3}}

    async def erase(self, engine, id_slot: int) -> dict:
        info = await self.info(engine, id_slot)
        if info is not None:
            with contextlib.suppress(SequenceNotFound):
                await engine.delete(info.seq_id)
            self.seqs.pop(id_slot, None)
        return {"id_slot": id_slot, "n_erased": info.length if info is not None else 0}

    def _folder(self) -> Path:
        if self.dir is None:
            raise APIError(400, "saving and restoring slots needs a folder: start the server with --state-dir DIR "
                           "(files go to DIR/slots; llama-server's --slot-save-path)", param="action")
        self.dir.mkdir(parents=True, exist_ok=True)
        return self.dir


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _write_atomic(path: Path, blob: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
