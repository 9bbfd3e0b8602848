"""Which LoRA adapter a request runs under, and what the server may read about loaded adapters (torch-free).

A request names its adapter with a `LoraRef` on its `SamplingParams` (`lora`): by name (vLLM's convention:
the adapter named as the request's `model`) or by the integer id llama.cpp's `lora: [{"id", "scale"}]`
uses, with a scale. The engine resolves it at admission to a `LoraBinding`: the adapter as loaded (its
`uid` changes with every load, so K/V computed under one load are never taken for another's) and the scale.
Cells are shared only between sequences of one binding (None: the base model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.api.errors import EngineError, InvalidRequest

MAX_LORA_SCALE = 100.0


class AdapterNotFound(EngineError):
    """A request or an unload named an adapter that is not loaded."""

    code = "adapter_not_found"


class AdapterBusy(EngineError):
    """An unload named an adapter that requests are running under: wait for them or cancel them."""

    code = "adapter_busy"


class AdapterMemoryFull(EngineError):
    """An adapter does not fit `max_loras` / `max_lora_memory` beside the adapters in use (none of which is
    unloaded while a request runs under it)."""

    code = "insufficient_storage"


@dataclass(frozen=True)
class LoraRef:
    """A request's adapter: `name`, or llama.cpp's integer `id`; `scale` multiplies its update (1: as
    trained). `by_model`: the name is the request's `model`, which names the base model (any name that is
    no adapter's) unless an adapter has it."""

    name: str | None = None
    id: int | None = None
    scale: float = 1.0
    by_model: bool = False

    def __post_init__(self):
        if (self.name is None) == (self.id is None):
            raise InvalidRequest("a LoRA reference names an adapter by name or by id (one of them)", "lora")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale) \
                or abs(self.scale) > MAX_LORA_SCALE:
            raise InvalidRequest(f"lora scale must be a finite number within +-{MAX_LORA_SCALE}, "
                                 f"got {self.scale!r}", "lora")


@dataclass(frozen=True)
class LoraBinding:
    """A sequence's adapter as resolved: the load's `uid`, its name and the scale. Hashable: the key under
    which the prefix index keeps its cells apart from every other adapter's and the base's."""

    uid: int
    name: str
    scale: float = 1.0


@dataclass(frozen=True)
class AdapterInfo:
    """A loaded adapter, as `/v1/models`, `/lora-adapters` and `/metrics` show it."""

    id: int  # llama.cpp's id (stable while loaded)
    name: str
    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    nbytes: int  # what it holds in memory, as the forward reads it
