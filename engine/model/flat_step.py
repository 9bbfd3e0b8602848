"""FlatStep: one forward's tokens of many sequences laid on one token axis.

Callers describe a step as `{seq_id: (token_ids, start_pos)}` and `flatten_step` builds the parallel
arrays (the ExecuTorch cell cache's helper of the same name): each sequence's tokens stay contiguous
and in order, so the row of its last token is where its next-token logits come from.
"""

from dataclasses import dataclass

import torch


@dataclass
class FlatStep:
    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    seq_ids: torch.Tensor  # [T]
    logits_indices: torch.Tensor  # [S] row of each sequence's last token, in dict order
    drafts: bool = False  # some chunk carries drafted tokens: its rows must round as one-row steps (rows.py)
    lora: list | None = None  # [(adapter uid, scale, rows)] per adapter present (engine/model/lora.py step_rows)
    hidden_indices: torch.Tensor | None = None  # rows whose final hidden states come back too (embeddings)


def flatten_step(chunks: dict[int, tuple[list[int], int]]) -> FlatStep:
    """Flatten `{seq_id: (token_ids, start_pos)}` into one token axis.

    Raises ValueError for an empty step or an empty chunk, which would give a sequence no row.
    """
    if not chunks:
        raise ValueError("empty step: give at least one sequence with at least one token")
    lengths = []
    for seq_id, (token_ids, start) in chunks.items():
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id} has no tokens in this step: drop it from the step")
        if start < 0:
            raise ValueError(f"sequence {seq_id} starts at negative position {start}")
        lengths.append(len(token_ids))
    lens = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.tensor([start for _, start in chunks.values()], dtype=torch.int64)
    ids = torch.tensor(list(chunks.keys()), dtype=torch.int64)
    # One tensor per sequence, concatenated: a loop over sequences, never over the step's tokens.
    tokens = torch.cat([torch.as_tensor(token_ids, dtype=torch.int64) for token_ids, _ in chunks.values()])
    offsets = torch.cumsum(lens, 0) - lens  # first row of each chunk
    seq_ids = torch.repeat_interleave(ids, lens)
    row = torch.arange(int(lens.sum()))
    positions = torch.repeat_interleave(starts - offsets, lens) + row
    return FlatStep(tokens, positions, seq_ids, offsets + lens - 1)
