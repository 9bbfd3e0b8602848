"""What `Engine` reports: its limits (model length, cells, dtypes), admission checks any thread may make, its
counters (`stats`), memory by owner, free cells, and dropping the prefix cache.

A mixin of `Engine` (engine/core/engine.py), kept apart so the engine's file reads as construction, requests
and the tick. Reads only, except `clear_prefix_cache` (between steps, on the loop thread).
"""

import torch

from engine.api.memory import MemoryReport
from engine.api.outputs import EngineStats
from engine.api.sampling_params import SamplingParams
from engine.cells.cache import CellCache
from engine.core.admission import Admission
from engine.core.memory import MemoryAccount
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.model.runner import ModelRunner


class EngineReports:
    """Read-only views of the engine's parts (`Engine` sets them); a caller asks these, never the parts."""

    runner: ModelRunner
    cache: CellCache
    admission: Admission
    scheduler: Scheduler
    memory_account: MemoryAccount
    sequences: dict[str, Sequence]
    generated_tokens: int
    prompt_tokens: int
    steps: int

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def n_cells(self) -> int:
        return self.cache.n_cells

    @property
    def cell_bytes(self) -> int:
        return self.runner.cell_bytes

    @property
    def kv_cache_dtype(self) -> str:
        return self.runner.kv_cache_dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def compile_grammar(self, params: SamplingParams):
        """`Admission.compile_grammar`: thread-safe, so a front end compiles off the loop thread first."""
        return self.admission.compile_grammar(params)

    def max_tokens_left(self, prompt_len: int, n: int = 1) -> int:
        """`Admission.max_tokens_left` (constants only: any thread)."""
        return self.admission.max_tokens_left(prompt_len, n)

    def check_fits(self, prompt_lens: list[int], max_tokens: int, n: int = 1) -> None:
        """`Admission.check_fits` (constants only: any thread)."""
        self.admission.check_fits(prompt_lens, max_tokens, n)

    def cached_prefix_cells(self) -> int:
        """Cells held only by cached prefixes (evictable on demand)."""
        return self.scheduler.cached_prefix_cells()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        idle = sum(1 for s in self.sequences.values() if s.request is None)  # persistent, not generating
        used = self.cache.used_cells()
        prefix = sched.prefix.stats
        return EngineStats(self.cache.n_cells, used, self.cache.n_cells - used, self.cache.read_len,
                           len(sched.running), len(sched.waiting), idle, sched.preemptions,
                           self.generated_tokens, self.prompt_tokens, self.steps,
                           len(sched.holders) - len(sched.running) - idle, prefix.queried_tokens, prefix.hit_tokens,
                           *((spec.drafted, spec.accepted) if (spec := self.speculative) else (0, 0)))

    def memory(self) -> MemoryReport:
        """Resident memory by owner (engine/api/memory.py); reads only, so any thread may ask."""
        return self.memory_account.report()

    def free_cells(self) -> int:
        """Cells a new request can get: free ones plus those only cached prefixes hold."""
        return self.cache.free_cells() + self.scheduler.cached_prefix_cells()

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (not live sequences); return the cells that became free."""
        before = self.cache.free_cells()
        for seq in self.scheduler.cached_prefixes():
            self.scheduler.release(seq)
        return self.cache.free_cells() - before
