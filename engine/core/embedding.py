"""Embeddings: a prompt's final hidden states pooled into one vector, computed on the engine's own cells.

`embed` runs on the engine's loop thread between ticks (an `AsyncEngine` command). Each prompt borrows a
slot from the scheduler, is prefilled in chunks of at most `max_num_batched_tokens` tokens on the native
forward (`ModelRunner.forward(step, hidden=True)`: the rows' normed hidden states instead of logits), and
gives its slot and cells back at once; cached prefixes are evicted first when cells run short. Pooling:
`mean` over every prompt token, `last` (the last token: a causal model has read the whole text only
there; the default for causal LMs, as e5-mistral and Qwen3-Embedding pool), `cls` (the first token).
Vectors are L2-normalized (OpenAI's embeddings are unit length, and so are vLLM's by default).

Not yet in the flat step: an embedding runs as its own forwards between generation ticks rather than as
rows of the tick's step (that needs the runner to hand back hidden rows of a mixed step).
"""

import torch

from engine.api.errors import InvalidRequest, PromptTooLong
from engine.core.sequence import Sequence
from engine.model.flat_step import flatten_step

POOLINGS = ("mean", "last", "cls")


def embed(engine, prompts: list[list[int]], pooling: str) -> list[list[float]]:
    """One unit vector per prompt; raises InvalidRequest (bad pooling, empty prompt) or PromptTooLong
    (a prompt beyond the context or the pool) before any forward, and releases every cell it took."""
    if pooling not in POOLINGS:
        raise InvalidRequest(f"pooling {pooling!r} is not one of {POOLINGS}", "pooling")
    limit = min(engine.runner.max_model_len, engine.cache.n_cells)
    for ids in prompts:
        if not ids:
            raise InvalidRequest("an input is empty: give some text or token ids", "input")
        if len(ids) > limit:
            raise PromptTooLong(f"an input has {len(ids)} tokens, more than the {limit} this model and cell pool "
                                "take; shorten it", "input")
    return [_pooled(engine, ids, pooling).tolist() for ids in prompts]


def _pooled(engine, ids: list[int], pooling: str) -> torch.Tensor:
    scheduler = engine.scheduler
    seq = Sequence(seq_id="embedding", token_ids=list(ids))
    if not scheduler.make_room(len(ids)) or not scheduler.acquire_slot(seq):
        raise PromptTooLong(f"the cell pool has no room for an input of {len(ids)} tokens now (running requests "
                            "hold the cells); retry, or shorten it", "input")
    try:
        total = None
        budget = scheduler.max_num_batched_tokens
        for start in range(0, len(ids), budget):
            chunk = ids[start:start + budget]
            step = flatten_step({seq.slot: (chunk, start)})
            if pooling == "mean":
                step.logits_indices = torch.arange(len(chunk))
            elif pooling == "cls" and start > 0:
                continue
            elif pooling == "cls":
                step.logits_indices = torch.zeros(1, dtype=torch.int64)
            rows = engine.runner.forward(step, hidden=True)
            if pooling == "mean":
                total = rows.sum(0) if total is None else total + rows.sum(0)
            elif pooling == "cls" or start + budget >= len(ids):
                total = rows[0] if pooling == "cls" else rows[-1]
        vector = total / len(ids) if pooling == "mean" else total
        return torch.nn.functional.normalize(vector, dim=0)
    finally:
        scheduler.release(seq)
