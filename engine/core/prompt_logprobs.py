"""Prompt logprobs (echo + logprobs, vLLM's prompt_logprobs, lm-eval's loglikelihood) come from the same
step's logits: `plan.prompt_rows` says which rows a step keeps for them, `take_prompt_logprobs` turns those
rows into the logprobs of the prompt tokens they predict. A request that asks scores every prompt token
but the first (nothing predicts it) from the logits its own prefill computes, chunk by chunk, with one
log_softmax / gather / top-k per block of BLOCK_ROWS rows (no loop over tokens beyond building the output
lists; the temporaries stay BLOCK_ROWS x vocab however long the chunk); its
sequence never takes a cached prefix (`Sequence.shares_prefix` is False), so no row is skipped; a row that was never
computed is an error, never a silent gap.
"""

from __future__ import annotations

import torch

from engine.core.plan import Chunk

BLOCK_ROWS = 64  # rows scored at once: the log-softmax and rank temporaries stay BLOCK_ROWS x vocab


def take_prompt_logprobs(chunks: list[Chunk], rows: dict[int, int], logits) -> None:
    """Append the logprobs of the prompt tokens these chunks' rows predict (row p predicts token p+1):
    one log_softmax, gather and top-k per chunk. Rows already taken (a re-prefill after preemption)
    are skipped; rows never computed are an error, never a silent gap."""
    at = 0
    for c in chunks:
        k = rows[id(c)]
        block, at = logits[at : at + k], at + k
        req = c.seq.request
        if req is None or req.finished:
            continue
        plp = req.prompt_logprobs
        have = len(plp.logprobs) - 1  # rows taken so far: positions [0, have)
        if c.start > have:
            raise RuntimeError(f"prompt logprobs of positions [{have}, {c.start}) were never computed")
        skip = have - c.start
        if skip >= k:
            continue
        targets = c.seq.token_ids[c.start + skip + 1 : c.start + k + 1]
        for at_row in range(0, len(targets), BLOCK_ROWS):  # temporaries of BLOCK_ROWS rows, not the chunk's
            _append(plp, block[skip + at_row : skip + at_row + BLOCK_ROWS], targets[at_row : at_row + BLOCK_ROWS],
                    req.params.prompt_logprobs)


def _append(plp, logits, targets: list[int], n_top: int | None) -> None:
    """The logprobs, ranks and top `n_top` of `targets` under these rows' logits, appended to `plp`."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_t = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])
    ranks = ((lp > chosen_t).sum(dim=-1) + 1).tolist()
    chosen = chosen_t[:, 0].tolist()
    if n_top:
        top_v, top_i = lp.topk(n_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [[] for _ in targets]
    plp.token_ids.extend(targets)
    plp.logprobs.extend(chosen)
    plp.top.extend(tops)
    plp.ranks.extend(ranks)
