"""Sequence and Request: what the scheduler moves around.

A `Sequence` owns a cell slot while it holds cells, its token ids (the truth) and `n_cached`, how
many of those tokens have cells. Its cells always hold exactly positions `[0, n_cached)`, so
dropping them (eviction, preemption) loses nothing: the sequence re-prefills and continues with
the same output. A `Request` is one generation call: one sequence per choice (`n > 1` forks
children off the prompt), the sampling params, and where its outputs go.
Their ids come from `engine.api.ids`.
"""

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.api.lora import LoraBinding
from engine.api.outputs import PromptLogprobs, RequestOutput, Timing
from engine.api.sampling_params import SamplingParams
from engine.spec.costs import PRIOR_KEPT, PRIOR_MISSED

if TYPE_CHECKING:  # annotations only: torch, the detokenizer and the grammar stay out of the server's imports
    import torch

    from engine.core.detokenizer import IncrementalDetokenizer
    from engine.sample.grammar import GrammarState

class SeqStatus(enum.Enum):
    WAITING = "waiting"  # wants to run, holds no slot in this step's running set yet
    RUNNING = "running"  # admitted: prefilling or decoding
    IDLE = "idle"  # persistent, not generating; may still hold cells
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]
    persistent: bool = False
    parent: str | None = None
    fork_at: int | None = None  # tokens it took from `parent` when forked (kept on disk with --state-dir)
    lora: "LoraBinding | None" = None  # the adapter its cells were computed under (None: the base); forks inherit it
    slot: int | None = None
    n_cached: int = 0
    status: SeqStatus = SeqStatus.IDLE
    request: "Request | None" = None
    index: int = 0  # choice index within its request
    gen_start: int = 0  # len(token_ids) when the current request started: output = token_ids[gen_start:]
    params: SamplingParams | None = None  # this choice's params (seed + index for n > 1)
    generator: "torch.Generator | None" = None
    finish_reason: str | None = None
    error: str | None = None
    detok: "IncrementalDetokenizer | None" = None  # None: no engine-side text (prefill-only, or decoded off-thread)
    grammar: "GrammarState | None" = None  # while a structured-output request runs
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0  # monotonic order of admission, for "preempt the newest"
    lookup_done: bool = False  # the prefix cache was consulted since this sequence was last queued
    # False: never take a cached prefix. A request that scores its prompt (prompt logprobs) needs every
    # prompt row's logits from its own prefill, on first admission and after a preemption.
    shares_prefix: bool = True
    draft: list[int] = field(default_factory=list)  # guessed next tokens for this tick (speculative), not yet truth
    draft_q: "torch.Tensor | None" = None  # a draft model's sampled draft: the distribution of each token (rows)
    draft_len: int = 0  # how many tokens its next draft may hold (0: the engine's maximum); adapts to acceptance
    draft_match: int = 0  # a prompt-lookup draft's match length (0: the draft came from elsewhere)
    draft_pause: int = 0  # ticks to go without the draft model ("auto" backs off after its drafts wholly missed)
    draft_misses: int = 0  # wholly rejected model drafts in a row
    drafts_kept: float = PRIOR_KEPT  # decayed counts of drafted tokens kept and of misses that ended drafts
    drafts_missed: float = PRIOR_MISSED  # (engine/spec/costs.py: what draft length pays)
    short_expected: float = 0.0  # its lookup drafts behind short matches: drafted tokens the engine-wide rates
    short_hits: float = 0.0  # expected kept, and tokens kept (decayed sums; costs.calibrated)
    draft_expect: float | None = None  # this tick's own short-match lookup draft: the tokens of it the engine-wide
    # rates expect kept (None: a draft the sequence's record does not judge)

    @property
    def pending(self) -> int:
        """Tokens that still need cells."""
        return len(self.token_ids) - self.n_cached

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.gen_start :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.gen_start

    @property
    def wants_logits(self) -> bool:
        """A generating sequence samples when a chunk caches its last token; a prefill-only one never."""
        return self.request is not None and not self.request.prefill_only

    def cache_target(self) -> int:
        """How many tokens this sequence should have cells for before it is done with its prefill.

        Idle sequences keep their last token uncached: generating from them then needs the logits of
        that token, which a 1-token forward produces.
        """
        if self.request is not None and self.request.prefill_only:
            return len(self.token_ids) - 1
        return len(self.token_ids)


@dataclass(eq=False)
class Request:
    """One generation call (or a prefill-only `create`), possibly with `n` choices."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput], None]
    seqs: list[Sequence] = field(default_factory=list)
    prefill_only: bool = False
    detokenize: bool = True  # False: the consumer makes the text (AsyncEngine, requests without stop strings)
    persistent_seq: Sequence | None = None  # set when the request runs on a persistent sequence
    children_pending: int = 0  # n - 1 forks to make once the prompt is prefilled
    timing: Timing = field(default_factory=lambda: Timing(queued=time.monotonic()))
    finished: bool = False
    reported: set[int] = field(default_factory=set)  # choice indices whose finish was emitted
    cached_tokens: int | None = None  # prompt tokens whose cells came from the prefix cache (set at admission)
    grammar: object | None = None  # compiled grammar of a structured-output request (one state per choice)
    prompt_logprobs: PromptLogprobs | None = None  # filled while the prompt prefills, when asked for
    prompt_logprobs_sent: bool = False
    accepted_draft_tokens: int = 0  # speculative decoding, over all choices
    rejected_draft_tokens: int = 0

    def live(self) -> list[Sequence]:
        """Choices still generating for this request (a finished choice drops its `request`)."""
        return [s for s in self.seqs if s.request is self]
