"""Embeddings: a prompt's final hidden states pooled into one vector, as rows of the engine's flat step.

An embedding is a prefill-only `Request` with `pooling` set (`add_embedding`): the scheduler plans its prompt
like any prefill (chunked, mixed with the decodes and prefills of generation), the flat step asks the runner
for the final hidden states of the rows its pooling reads (`plan.pooled_rows`, `FlatStep.hidden_indices`)
instead of sampling them, and the engine's `Pooler` folds them in after each forward. Once its last
token has a cell the vector is made, the request ends (finish `stop`, the vector on its last output) and its
sequence is retired like any finished request's: its cells are free at once, or kept as a cached prefix when
the prefix cache wants them (and a `last`-pooled embedding of a cached prompt prefills only its last token).

Pooling: `mean` over every prompt token, `last` (the last token: a causal model has read the whole text only
there; the default for causal LMs, as e5-mistral and Qwen3-Embedding pool), `cls` (the first token). `mean`
and `cls` read rows a cached prefix has no state of, so those never take one (`Sequence.shares_prefix`).
Vectors are L2-normalized (OpenAI's embeddings are unit length, and so are vLLM's by default).

A scorer is an embedding with `score_tokens` (pooling `last`): instead of a vector it gets its last row's
logits of those tokens (a causal reranker's "yes"/"no", as vLLM and llama.cpp score Qwen3-Reranker).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.api.errors import InvalidRequest, PromptTooLong
from engine.api.ids import new_id
from engine.api.outputs import RequestOutput
from engine.api.sampling_params import SamplingParams
from engine.core.plan import SchedulerOutput
from engine.core.sequence import Request, Sequence

POOLINGS = ("mean", "last", "cls")


def check_embeddings(engine, prompts: list[list[int]], pooling: str, score_tokens: list[int] | None = None) -> None:
    """Refuse (changing nothing) what can never be embedded: a bad pooling, an empty or too long prompt, a model
    off the native forward, score tokens outside the vocabulary or without `last` pooling; QueueFull when the
    waiting queue is full."""
    if pooling not in POOLINGS:
        raise InvalidRequest(f"pooling {pooling!r} is not one of {POOLINGS}", "pooling")
    if score_tokens is not None and (pooling != "last" or not all(0 <= t < engine.vocab_size for t in score_tokens)):
        raise InvalidRequest(f"score tokens {score_tokens} must be ids of the vocabulary (size {engine.vocab_size}), "
                             "scored on the last token (pooling 'last')", "input")
    if engine.runner.native is None:
        raise InvalidRequest("embeddings run on the native forward (Llama, Mistral, Qwen2/3, Gemma 3 families); "
                             "this model runs on the transformers modules", "model")
    limit = min(engine.runner.max_model_len, engine.cache.n_cells)
    for ids in prompts:
        if not ids:
            raise InvalidRequest("an input is empty: give some text or token ids", "input")
        if len(ids) > limit:
            raise PromptTooLong(f"an input has {len(ids)} tokens, more than the {limit} this model and cell pool "
                                "take; shorten it", "input")
    engine.admission.check_queue(len(engine.scheduler.waiting))


def new_embedding(request_id: str, ids: list[int], pooling: str, emit: Callable[[RequestOutput], None],
                  score_tokens: list[int] | None = None) -> tuple[Request, Sequence]:
    """The request and the sequence it prefills on (queued by the engine's `_start`)."""
    req = Request(request_id, list(ids), SamplingParams(max_tokens=0), emit, pooling=pooling,
                  score_tokens=score_tokens)
    return req, Sequence(new_id("emb"), list(ids))


class Pooler:
    """The pooled rows of the embeddings in flight: each one's sum so far (mean) or its pooled row (last, cls),
    kept here, not on the request (the engine's `_update` hands each forward's hidden rows over)."""

    def __init__(self, logits_of: Callable[[torch.Tensor], torch.Tensor]):
        """`logits_of`: the runner's LM head over final hidden states (`ModelRunner.logits_of`), for scorers."""
        self.partial: dict[Request, torch.Tensor] = {}
        self.logits_of = logits_of

    def take(self, plan: SchedulerOutput, hidden: torch.Tensor | None) -> list[tuple[Request, list[float]]]:
        """Fold a forward's pooled rows (`hidden`, in `plan.pooled_rows` order) into their requests; returns the
        requests whose prompt is now complete with their unit vectors (a scorer's: its last row's logits of its
        `score_tokens`, from the same head as a sampled row's). A chunk that starts the prompt starts the
        sum afresh (a preempted embedding re-prefills from its first token)."""
        at, done = 0, []
        for c in plan.pooling:
            req = c.seq.request
            if id(c) in plan.pooled_rows:
                count = plan.pooled_rows[id(c)][1]
                rows, at = hidden[at : at + count], at + count  # the forward's dtype: a scorer's head reads them
                if req.pooling != "mean":
                    self.partial[req] = rows[0]
                elif c.start == 0 or req not in self.partial:
                    self.partial[req] = rows.float().sum(0)
                else:
                    self.partial[req] = self.partial[req] + rows.float().sum(0)
            if c.completes:
                pooled = self.partial.pop(req)
                if req.score_tokens is not None:
                    done.append((req, self.logits_of(pooled[None])[0, req.score_tokens].tolist()))
                    continue
                vector = pooled / len(req.prompt_ids) if req.pooling == "mean" else pooled.float()
                done.append((req, torch.nn.functional.normalize(vector, dim=0).tolist()))
        for req in [r for r in self.partial if r.finished]:  # cancelled or failed on the way
            del self.partial[req]
        return done


def embed(engine, prompts: list[list[int]], pooling: str, score_tokens: list[int] | None = None) -> list[list[float]]:
    """One unit vector per prompt, stepping the engine until they are made (the synchronous caller's way: tests,
    `LLM`; `AsyncEngine.embed` submits them and its loop steps). Raises what `check_embeddings` raises, or
    RuntimeError with the engine's reason if one failed."""
    check_embeddings(engine, prompts, pooling, score_tokens)
    outs: dict[str, RequestOutput] = {}
    ids = [new_id("emb") for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_embedding(request_id, prompt, pooling, lambda out: outs.__setitem__(out.request_id, out),
                             score_tokens)
    while not all(i in outs and outs[i].finished for i in ids):
        engine.step()
    return [vector_of(outs[i]) for i in ids]


def vector_of(out: RequestOutput) -> list[float]:
    """The vector of an embedding's last output; RuntimeError if it ended without one (failed, cancelled)."""
    if out.embedding is None:
        why = out.outputs[0].error if out.outputs else None
        raise RuntimeError(f"the embedding did not complete: {why or out.outputs[0].finish_reason}")
    return out.embedding
