"""Typed messages the engine hands back to its callers (the offline LLM and the HTTP server).

Every yield of a request's stream is a `RequestOutput` carrying only what is new since the previous
yield (deltas), so streaming and non-streaming callers read the same messages; `LLM.generate`
accumulates them.
"""

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class PromptLogprobs:
    """Logprobs of a request's prompt tokens (echo + logprobs, lm-eval's loglikelihood): entry i is prompt
    token i; the first token has none (nothing predicts it), so `logprobs[0]` and `top[0]` are None.
    Kept as parallel lists (filled by whole-chunk tensor ops, no per-token objects in the engine)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]
    ranks: list[int | None] = field(default_factory=lambda: [None])  # 1 = the model's most likely token


@dataclass
class CompletionOutput:
    """One choice of a request (index i of n). Token ids, text and logprobs are deltas."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # stop | length | cancelled | error
    stop_reason: str | int | None = None  # matched stop string or stop token id
    error: str | None = None


@dataclass
class Timing:
    """Wall-clock instants (time.monotonic()) of the request's life."""

    queued: float = 0.0
    prompt_started: float | None = None  # first scheduled: its prompt was looked up in the prefix cache
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class PromptProgress:
    """How far a request's prompt is prefilled, as of one engine step (`SamplingParams.report_progress`):
    `total` prompt tokens, `cached` of them found in the prefix cache at admission, `processed` that have cells
    now (the cached ones included), at the instant `at` (time.monotonic()) the step's forward had run."""

    total: int
    cached: int
    processed: int
    at: float


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    finished: bool = False
    seq_id: str | None = None  # the persistent sequence this request ran on, if any
    timing: Timing = field(default_factory=Timing)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    prompt_logprobs: PromptLogprobs | None = None  # on the request's first output only, when asked for
    # speculative decoding so far: drafted tokens kept / thrown away (usage.completion_tokens_details)
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's unit vector, on its last output
    prompt_progress: PromptProgress | None = None  # on the outputs a prompt chunk made, when asked for


@dataclass
class SequenceInfo:
    """A persistent sequence as seen from outside the engine."""

    seq_id: str
    length: int
    token_ids: list[int]
    status: str  # idle | running | waiting
    parent: str | None
    n_cached: int  # tokens of this sequence that currently have cells
    cells_owned: int  # cells this sequence has a claim on
    cells_shared: int  # of those, cells also owned by another sequence
    created: float  # wall clock (time.time()), for display
    last_used: float  # time.monotonic(), for idle TTLs; convert before showing it
    n_saved: int = 0  # tokens whose cells are saved in the state dir (loaded when it runs, not recomputed)


@dataclass
class EngineStats:
    n_cells: int
    cells_used: int
    cells_free: int
    read_len: int
    running: int
    waiting: int
    idle_sequences: int
    preemptions: int
    generated_tokens: int
    prompt_tokens: int
    steps: int
    prefix_cached: int = 0  # finished requests' sequences kept as cached prefixes
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens whose cells were shared instead of prefilled
    draft_tokens: int = 0  # speculative decoding: tokens drafted into steps
    accepted_draft_tokens: int = 0  # of those, tokens kept
