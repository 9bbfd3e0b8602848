"""CellFiles: saved KV cells as content-addressed chunks under `DIR/cells/`, one safetensors file each.

A sequence's cells for positions [0, n) are cut at fixed boundaries into chunks of `CHUNK` tokens (the last
one shorter). A chunk's key hashes the model identity and *every* token up to its end (a chained hash), so
two sequences whose tokens agree up to a chunk's end name the same file: a fork family's common prefix,
or any two conversations that share a prompt, is written once. A file holds `k` and `v`
(`[n_layers, n_kv_heads, n, head_dim]`) and, in its header, the `ModelIdentity` that computed them; a
reader refuses a file whose identity differs (`IncompatibleState`), so K/V of another model or dtype never
reach the pool. Files are written atomically (`write_atomic`); deleting them is the store's call (it
counts which records use each key).
"""

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from engine.api.errors import IncompatibleState
from engine.api.files import TMP_SUFFIX, write_atomic
from engine.core.state.identity import ModelIdentity

log = logging.getLogger("cellserve.state")
CHUNK = 64  # tokens per chunk file: a family's branches differ in at most their last chunk of the prefix


def chunk_spans(identity: ModelIdentity, token_ids: list[int], n: int) -> list[tuple[str, int, int]]:
    """(key, start, end) of the chunks covering tokens [0, n), in position order."""
    h = hashlib.sha256(identity.to_json().encode())
    spans = []
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        h.update(np.asarray(token_ids[a:b], dtype="<i8").tobytes())
        spans.append((_end_key(h, b), a, b))
    return spans


def saved_prefix(identity: ModelIdentity, token_ids: list[int], limit: int, has) -> list[tuple[str, int, int]]:
    """(key, start, end) of the chunks `has(key)` says are saved that cover the longest prefix of `token_ids`,
    at most `limit` tokens: whole chunks along the chain, then the longest saved partial one after them (a
    sequence saved with n cells ends its last chunk at n, wherever that falls). Content addressing makes this
    a disk-backed prefix cache: any sequence whose tokens begin like a saved one finds its chunks."""
    h = hashlib.sha256(identity.to_json().encode())
    spans: list[tuple[str, int, int]] = []
    for a in range(0, limit, CHUNK):
        whole = h.copy()
        whole.update(np.asarray(token_ids[a : a + CHUNK], dtype="<i8").tobytes())
        if a + CHUNK <= limit and has(key := _end_key(whole, a + CHUNK)):
            spans.append((key, a, a + CHUNK))
            h = whole
            continue
        for b in range(min(a + CHUNK, limit), a, -1):  # the longest partial chunk saved after the whole ones
            part = h.copy()
            part.update(np.asarray(token_ids[a:b], dtype="<i8").tobytes())
            if has(key := _end_key(part, b)):
                spans.append((key, a, b))
                break
        break
    return spans


def _end_key(h, end: int) -> str:
    h = h.copy()
    h.update(b"|%d" % end)
    return h.hexdigest()[:40]


def chunk_bounds(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]


def encode_chunk(identity: ModelIdentity, keys: torch.Tensor, values: torch.Tensor) -> bytes:
    return st_save({"k": keys.contiguous(), "v": values.contiguous()}, metadata={"identity": identity.to_json()})


class CellFiles:
    """Chunk files by key, and their sizes (for `--state-max-bytes`)."""

    def __init__(self, root: Path, identity: ModelIdentity):
        self.dir = root / "cells"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        for tmp in self.dir.glob(f".*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        self.sizes = {p.stem: p.stat().st_size for p in self.dir.glob("*.safetensors")}

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    def has(self, key: str) -> bool:
        return key in self.sizes

    def write(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        data = encode_chunk(self.identity, keys, values)
        write_atomic(self._path(key), data)
        self.sizes[key] = len(data)

    def read(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of chunk `key`; IncompatibleState if another model wrote it, OSError if it is gone."""
        path = self._path(key)
        try:
            with safe_open(str(path), "pt") as f:
                theirs = (f.metadata() or {}).get("identity")
                why = self.identity.differs(ModelIdentity.from_json(theirs)) if theirs else "no identity in its header"
                if why:
                    raise IncompatibleState(f"cell file {path.name} was written by another model: {why}")
                return f.get_tensor("k"), f.get_tensor("v")
        except (IncompatibleState, OSError):
            raise
        except (SafetensorError, ValueError, KeyError, RuntimeError) as exc:  # torn or foreign: bad header, JSON, tensors
            raise IncompatibleState(f"cell file {path.name} is unreadable ({type(exc).__name__}: {exc})") from None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        self.sizes.pop(key, None)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.safetensors"
