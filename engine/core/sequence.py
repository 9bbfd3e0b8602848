"""Sequence and Request: what the scheduler moves around.

A `Sequence` owns a cell slot while it holds cells, its token ids (the truth) and `n_cached`, how
many of those tokens have cells. Its cells always hold exactly positions `[0, n_cached)`, so
dropping them (eviction, preemption) loses nothing: the sequence re-prefills and continues with
the same output. A `Request` is one generation call: one `Choice` per choice, each generating on one
sequence (`n > 1` forks children off the prompt), the sampling params, and where its outputs go.
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
    """Identity, tokens, slot, cached count, status and parent: nothing a request or a draft owns.

    Who writes what: the scheduler every field past `created` (`slot`, `n_cached`, `status`, which `choice`
    runs on it, and its own bookkeeping: `last_used`, `admitted_at`, `lookup_done`); the output processor
    appends to `token_ids`, persistent-sequence verbs (engine/core/persistent.py) cut them. Draft state is
    the speculative decoder's (`engine.spec.state.DraftState`), per-choice state its `Choice`'s.
    """

    seq_id: str
    token_ids: list[int]
    persistent: bool = False
    parent: str | None = None
    fork_at: int | None = None  # tokens it took from `parent` when forked (kept on disk with --state-dir)
    lora: "LoraBinding | None" = None  # the adapter its cells were computed under (None: the base); forks inherit it
    created: float = field(default_factory=time.time)
    slot: int | None = None
    n_cached: int = 0
    status: SeqStatus = SeqStatus.IDLE
    choice: "Choice | None" = None  # the request's choice generating on it now (None: not generating)
    last_used: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0  # monotonic order of admission, for "preempt the newest"
    lookup_done: bool = False  # the prefix cache was consulted since this sequence was last queued

    @property
    def request(self) -> "Request | None":
        """The request generating on this sequence now, if any."""
        return self.choice.request if self.choice is not None else None

    @property
    def pending(self) -> int:
        """Tokens that still need cells."""
        return len(self.token_ids) - self.n_cached

    @property
    def num_generated(self) -> int:
        """Tokens its current choice has generated (0 when not generating)."""
        return self.choice.num_generated if self.choice is not None else 0

    @property
    def shares_prefix(self) -> bool:
        """False: never take a cached prefix. A request that scores its prompt (prompt logprobs, choice 0) needs
        every prompt row's logits from its own prefill, on first admission and after a preemption."""
        c = self.choice
        if c is not None and c.request.pooling in ("mean", "cls"):  # pools rows a cached prefix has no state of
            return False
        return c is None or c.index > 0 or c.request.prompt_logprobs is None

    @property
    def wants_logits(self) -> bool:
        """A generating sequence samples when a chunk caches its last token; a prefill-only one never."""
        return self.choice is not None and not self.choice.request.prefill_only

    def cache_target(self) -> int:
        """How many tokens this sequence should have cells for before it is done with its prefill.

        Idle sequences keep their last token uncached: generating from them then needs the logits of
        that token, which a 1-token forward produces.
        """
        if self.choice is not None and self.choice.request.prefill_only and self.choice.request.pooling is None:
            return len(self.token_ids) - 1
        return len(self.token_ids)


@dataclass(eq=False)
class Choice:
    """One of a request's `n` choices, generating on one sequence: its params (seed + index for n > 1), random
    generator, grammar state, detokenizer and, once it ended, its finish. It outlives its sequence's turn
    (`Sequence.choice` goes back to None when it finishes) so that the finish is reported once."""

    request: "Request"
    seq: Sequence
    index: int  # choice index within its request
    gen_start: int  # len(seq.token_ids) when it started: its output = seq.token_ids[gen_start:]
    params: SamplingParams
    generator: "torch.Generator | None" = None
    detok: "IncrementalDetokenizer | None" = None  # None: no engine-side text (prefill-only, or decoded off-thread)
    grammar: "GrammarState | None" = None  # while a structured-output request runs
    finish_reason: str | None = None
    error: str | None = None

    @property
    def live(self) -> bool:
        """Still generating: its sequence has not finished it (nor moved on to another request)."""
        return self.seq.choice is self

    @property
    def output_ids(self) -> list[int]:
        return self.seq.token_ids[self.gen_start :]

    @property
    def num_generated(self) -> int:
        return len(self.seq.token_ids) - self.gen_start

    @property
    def history(self) -> list[int]:
        """The tokens before its output (the prompt and, on a persistent sequence, what came before)."""
        return self.seq.token_ids[: self.gen_start]


@dataclass
class RequestMetrics:
    """What a request's outputs report besides tokens (the output processor keeps it): when it was queued, got its
    first token and finished; how many prompt tokens the prefix cache held at its first admission (OpenAI's
    cached tokens); the drafted tokens verification kept and refused (speculative decoding, over all choices)."""

    timing: Timing = field(default_factory=lambda: Timing(queued=time.monotonic()))
    cached_tokens: int | None = None  # None until its first admission looked the prompt up
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


@dataclass(eq=False)
class Request:
    """One generation call (or a prefill-only `create`, or an embedding: `pooling` set), possibly with `n` choices:
    what was asked, how it runs (its choices, on a persistent sequence or not), what its outputs have said so far,
    and its metrics."""

    # what was asked, and where its outputs go
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput], None]
    # how it runs (the engine sets these when it takes the request)
    choices: list[Choice] = field(default_factory=list)
    detokenize: bool = True  # False: the consumer makes the text (AsyncEngine, requests without stop strings)
    grammar: object | None = None  # compiled grammar of a structured-output request (one state per choice)
    persistent_seq: Sequence | None = None  # set when the request runs on a persistent sequence
    children_pending: int = 0  # n - 1 forks to make once the prompt is prefilled
    pooling: str | None = None  # an embedding (prefill-only): its prompt's hidden states pooled so (last, mean, cls)
    score_tokens: list[int] | None = None  # a scorer: the last row's logits of these tokens instead of a vector
    # what its outputs have said so far (the output processor's)
    finished: bool = False
    reported: set[int] = field(default_factory=set)  # choice indices whose finish was emitted
    prompt_logprobs: PromptLogprobs | None = None  # filled while the prompt prefills, when asked for
    prompt_logprobs_sent: bool = False
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def prefill_only(self) -> bool:
        """max_tokens 0 asks for no token (SamplingParams' contract): the prompt is cached, nothing sampled."""
        return self.params.max_tokens == 0

    @property
    def seqs(self) -> list[Sequence]:
        """Its choices' sequences, in choice order."""
        return [c.seq for c in self.choices]

    def live(self) -> list[Sequence]:
        """Sequences of the choices still generating for this request."""
        return [c.seq for c in self.choices if c.live]
