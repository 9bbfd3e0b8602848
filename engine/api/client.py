"""EngineClient: what the server may ask of a running engine, and nothing else.

The server holds an engine only through this protocol (vLLM's `EngineClient` plays the same part), so
it never imports the engine's torch side: `engine.core.async_engine.AsyncEngine` satisfies it, and the
one place that builds one is `server/config.py`. Guarantees of each call are the implementation's
(see `AsyncEngine`); this file only says which calls exist.
"""

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from engine.api.lora import AdapterInfo, LoraRef
from engine.api.memory import MemoryReport
from engine.api.outputs import EngineStats, RequestOutput, SequenceInfo
from engine.api.sampling_params import SamplingParams


class EngineClient(Protocol):
    model_name: str
    tokenizer: Any  # a transformers tokenizer, or None for an engine built without one
    max_model_len: int
    n_cells: int
    cell_bytes: int
    kv_cache_dtype: str  # "auto" (the model's dtype) or "int8"
    dtype: Any  # the model's torch dtype (printed, never computed with)
    prefix_caching: bool
    failure: str | None  # why the engine loop stopped, if it ever did
    on_failure: Callable[[str], None] | None

    @property
    def accepting(self) -> bool: ...

    async def shutdown(self, grace_s: float = 5.0) -> None: ...

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                     seq_id: str | None = None) -> AsyncIterator[RequestOutput]: ...

    async def cancel(self, request_id: str) -> None: ...

    def cancel_nowait(self, request_id: str) -> None: ...

    async def create_sequence(self, prompt_ids: list[int], lora: LoraRef | None = None) -> SequenceInfo: ...

    async def fork(self, seq_id: str, at: int | None = None, lora: LoraRef | None = None) -> SequenceInfo: ...

    async def truncate(self, seq_id: str, length: int) -> SequenceInfo: ...

    async def delete(self, seq_id: str) -> None: ...

    async def sequence_info(self, seq_id: str) -> SequenceInfo: ...

    async def list_sequences(self) -> list[SequenceInfo]: ...

    async def cached_prefix_cells(self) -> int: ...

    async def clear_prefix_cache(self) -> int: ...

    async def embed(self, prompts: list[list[int]], pooling: str) -> list[list[float]]: ...

    def max_tokens_left(self, prompt_len: int, n: int = 1) -> int: ...

    def check_fits(self, prompt_lens: list[int], max_tokens: int, n: int = 1) -> None: ...

    def stats(self) -> EngineStats: ...

    def memory(self) -> MemoryReport: ...

    async def load_lora(self, name: str, path: str, replace: bool = False) -> AdapterInfo: ...

    async def unload_lora(self, name: str) -> AdapterInfo: ...

    def lora_adapters(self) -> list[AdapterInfo]: ...
