"""One tick as data: what the speculative decoder reads before it (`Queues`), the scheduler's plan
(`SchedulerOutput`), the flat step it becomes (`flatten`), and the logits the forward gives back, split by what
each row is for (`ModelOutput`).

The tick flows one way (vLLM v1's `schedule -> SchedulerOutput -> execute_model -> ModelRunnerOutput ->
update_from_output`): `Scheduler.schedule` returns a plan, `Engine._execute` runs it, `Engine._update`
applies the output (tokens, cached counts, finishes, drafts kept or dropped). A row's kind says what it is
for: sampled, drafted, prompt-logprob rows give logits; an embedding request's rows give their final hidden
states (`ModelOutput.hidden`, `FlatStep.hidden_indices`), pooled instead of sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.sequence import Sequence
from engine.model.flat_step import FlatStep, flatten_step
from engine.model.lora import step_rows


@dataclass
class Chunk:
    seq: Sequence
    start: int  # first token index (= position) of the chunk
    n_tokens: int  # of the sequence's own tokens
    draft: list[int] = field(default_factory=list)  # drafted tokens after them (speculative decoding)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.n_tokens] + self.draft

    @property
    def completes(self) -> bool:
        """After this chunk every token of the sequence has a cell: its last row gives next-token logits."""
        return self.start + self.n_tokens == len(self.seq.token_ids)


@dataclass(frozen=True)
class Queues:
    """The scheduler's queues as the speculative decoder may read them before a tick (`Scheduler.queues`): a copy
    of the running sequences, in the scheduler's order, and how many sequences wait. A read, never a handle on
    the scheduler's own lists."""

    running: list[Sequence]
    n_waiting: int


@dataclass
class SchedulerOutput:
    """What runs this tick: `chunks` in step order, and `cached`, the sequences the scheduler looked up in the
    prefix cache (and on disk) at admission this tick with how many tokens it found (OpenAI's cached tokens)."""

    chunks: list[Chunk]
    cached: list[tuple[Sequence, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampling = [c for c in self.chunks if c.completes and c.seq.wants_logits]  # a row picks a token
        self.plain = [c for c in self.sampling if not c.draft]  # one row each
        self.drafted = [c for c in self.sampling if c.draft]  # 1 + len(draft) rows each
        self.prompt_rows = prompt_rows(self.chunks)  # id(chunk) -> its first rows scoring prompt tokens
        self.pooling = [c for c in self.chunks if c.seq.request is not None and c.seq.request.pooling]
        self.pooled_rows = pooled_rows(self.pooling)  # id(chunk) -> (first, count) of its rows to pool


@dataclass
class ModelOutput:
    """The logits of one forward, by kind, each block in its chunks' order: `plain` one row per plain chunk,
    `drafted` 1 + len(draft) rows per drafted chunk, `prompt` the prompt-logprob rows; `hidden` the final hidden
    states of the pooled rows (`SchedulerOutput.pooled_rows`, in chunk order), or None."""

    plain: torch.Tensor
    drafted: torch.Tensor
    prompt: torch.Tensor
    hidden: torch.Tensor | None = None

    @classmethod
    def split(cls, plan: SchedulerOutput, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> ModelOutput:
        n_plain = len(plan.plain)
        n_sampled = n_plain + sum(1 + len(c.draft) for c in plan.drafted)
        return cls(logits[:n_plain], logits[n_plain:n_sampled], logits[n_sampled:], hidden)


def prompt_rows(chunks: list[Chunk]) -> dict[int, int]:
    """id(chunk) -> how many of its first rows predict prompt tokens of a request that wants their
    logprobs (positions up to the prompt's second-to-last token; the last one's row samples)."""
    out = {}
    for c in chunks:
        req = c.seq.request
        if req is not None and req.prompt_logprobs is not None and c.seq.choice.index == 0:
            k = min(c.start + c.n_tokens, len(req.prompt_ids) - 1) - c.start
            if k > 0:
                out[id(c)] = k
    return out


def pooled_rows(chunks: list[Chunk]) -> dict[int, tuple[int, int]]:
    """id(chunk) -> (first, count): the rows of an embedding request's chunk whose hidden states its pooling
    reads: every row (mean), the sequence's first token (cls), its last token (last, on the chunk that
    completes it). A chunk with none of them (cls past the first chunk) is left out."""
    out = {}
    for c in chunks:
        pooling = c.seq.request.pooling
        if pooling == "mean":
            out[id(c)] = (0, c.n_tokens)
        elif pooling == "cls" and c.start == 0:
            out[id(c)] = (0, 1)
        elif pooling == "last" and c.completes:
            out[id(c)] = (c.n_tokens - 1, 1)
    return out


def flatten(plan: SchedulerOutput) -> FlatStep:
    """The flat step, keeping logits only for the rows the plan uses (at least one row: 0 means all): one row
    per plain chunk, then every row (last token + draft) of each drafted chunk, then, in chunk order, the first
    `prompt_rows[id(chunk)]` rows of chunks whose prompt logprobs are wanted (one arange per such chunk: a loop
    over chunks, not tokens). The pooled rows of embedding chunks go to `hidden_indices`."""
    chunks, rows_for = plan.chunks, plan.prompt_rows
    step = flatten_step({c.seq.slot: (c.token_ids, c.start) for c in chunks})
    step.lora = step_rows([c.seq.lora for c in chunks], [c.n_tokens + len(c.draft) for c in chunks])
    sampling = {id(c) for c in plan.sampling}
    last = step.logits_indices
    pick = [i for i, c in enumerate(chunks) if id(c) in sampling and not c.draft]
    drafted = [torch.arange(-len(c.draft), 1) + last[i] for i, c in enumerate(chunks) if id(c) in sampling and c.draft]
    extra = [torch.arange(rows_for[id(c)]) + (last[i] - c.n_tokens + 1)
             for i, c in enumerate(chunks) if rows_for and id(c) in rows_for]
    rows = [last[pick], *drafted, *extra]
    step.logits_indices = torch.cat(rows) if pick or drafted or extra else last[[0]]
    step.drafts = bool(drafted)
    pooled = plan.pooled_rows
    if pooled:
        step.hidden_indices = torch.cat([torch.arange(pooled[id(c)][1]) + (last[i] - c.n_tokens + 1 + pooled[id(c)][0])
                                         for i, c in enumerate(chunks) if id(c) in pooled])
    return step
