"""StepPlan: what the cell cache decided for one forward (the cells its tokens claim, what each query
token may see), and how each query row reads that visibility (row gather, sliding window) for both
attention paths, transformers' and the native one.

Visibility is a broadcast compare over cell metadata, computed once per step by
`CellCache.begin_step`; everything here reads the plan and never changes the pool.
"""

from dataclasses import dataclass

import torch


@dataclass
class StepPlan:
    """Everything one forward needs, decided once for all layers.

    `visible[i, j]` says query token i may attend read column j. Read columns are cells
    `[0, read_len)`, or only the cells in `read_idx` when the step reads a compacted window.
    """

    cells: torch.Tensor  # [T] cell claimed by each token of the step (host, for metadata)
    kv_cells: torch.Tensor  # the same on the K/V pools' device
    seq_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    read_len: int
    read_idx: torch.Tensor | None  # [C] cells read by this step (on the pools' device), or None: [0, read_len)
    visible: torch.Tensor  # [T, C or read_len] bool
    key_pos: torch.Tensor  # [C or read_len] position of each read column (for sliding windows)

    @property
    def n_tokens(self) -> int:
        return int(self.cells.numel())


GATHER_MAX_TOKENS = 128  # prefill-heavy steps stay dense: T x L gathered rows would cost more than they save


@dataclass
class RowGather:
    """For each query row, the read columns it can see (`idx` [T, L], padded; `valid` marks real ones)."""

    idx: torch.Tensor
    valid: torch.Tensor


def row_gather_for(plan: StepPlan, max_tokens: int | None = GATHER_MAX_TOKENS) -> RowGather | None:
    """The per-row gather index, or None when the dense (compacted) window is as cheap (one row, rows
    that see most of it, or more than `max_tokens` rows)."""
    n_tok, n_cols = plan.visible.shape
    if (max_tokens is not None and n_tok > max_tokens) or n_tok == 1:
        return None
    if int(plan.visible.sum(1).max()) * 2 > n_cols:
        return None
    return gather_rows(plan.visible)


def gather_rows(visible: torch.Tensor, key_pos: torch.Tensor | None = None) -> RowGather:
    """Row i's visible columns, left-aligned and padded to the widest row; in column order, or in position
    order when the columns' positions `key_pos` are given (a row sees one cell per position, so that order
    does not depend on where the pool put the cells: what keeps a row's attention sums in the same order
    whichever step computes it, engine/model/native/rows.py)."""
    counts = visible.sum(1)
    width = int(counts.max())
    rows, cols = visible.nonzero(as_tuple=True)
    rank = visible.cumsum(1)[rows, cols] - 1
    idx = torch.zeros(visible.shape[0], width, dtype=torch.int64)
    idx[rows, rank] = cols
    valid = torch.arange(width)[None, :] < counts[:, None]
    if key_pos is None:
        return RowGather(idx, valid)
    # each row's own columns sorted, not the whole window: a row sees its context, the window can be the pool;
    # and usually the pool already holds a sequence's cells in position order (no sort at all then)
    keys = key_pos.cpu()[idx].masked_fill_(~valid, torch.iinfo(torch.int64).max)
    if bool((keys[:, 1:] >= keys[:, :-1]).all()):
        return RowGather(idx, valid)
    order = keys.argsort(dim=1, stable=True)
    return RowGather(idx.gather(1, order), valid.gather(1, order))


def windowed(plan: StepPlan, window: int | None) -> torch.Tensor:
    """`plan.visible` narrowed to a sliding window of `window` positions (None: the full visibility)."""
    if window is None:
        return plan.visible
    return plan.visible & (plan.key_pos[None, :] > plan.positions[:, None] - window)
