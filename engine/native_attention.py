"""How the native forward's queries read the cell pools, decided once a step for every layer.

Steps of one-row (decoding) queries, with the fused kernels (`engine/kernels.py`): `cells`, each
row reads its own visible cells in place from the pools (`torch.ops.cellserve.cell_attention`, no
copy). Without them: `gather`, row i copies its own visible cells out of the pool (`cells` [T*L]
pool indices) and attends with an additive `bias` [Hkv*T, G, L]; or `dense` (one row, or rows that
each see most of the window), every row reads the step's window (`cells` [C] or the prefix
[0, read_len)) with `bias` [1, T*G, C]. Steps with a prefill chunk: `split`, each chunk reads only the
cells its own rows can see, through torch's tiled sdpa kernel with a bool mask, and the step's
one-row queries are one `cells` or `gather` part. A chunk reading the whole step window would cost
its rows x every cell of every sequence in the step (with 32 1,000-token conversations, 32x the
attention work of reading its own history), and gathering per row would copy its history once
per row.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from engine.attention import gather_rows, row_gather_for, windowed
from engine.cells import StepPlan


class Attend:
    """One step's attention plan (see the module docstring); `__call__` runs it for one layer."""

    def __init__(self, plan: StepPlan, n_kv: int, group: int, windows, device, fused: bool = False):
        n_tok = plan.visible.shape[0]
        self.n_tok, self.n_kv, self.group = n_tok, n_kv, group
        ids = plan.seq_ids
        bounds = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), n_tok]
        rows = None
        if len(bounds) - 1 < n_tok:  # some sequence brings several rows: a prefill chunk
            self.mode = "split"
        elif fused:
            self.mode = "cells"
        else:
            rows = row_gather_for(plan, max_tokens=None)
            self.mode = "dense" if rows is None else "gather"
        self.read_len = plan.read_len
        self.bias: dict[int | None, torch.Tensor] = {}
        seen = {w: windowed(plan, w) for w in windows}  # [T, C] visibility per attention window
        if self.mode == "split":
            self.parts = _split_parts(plan, seen, bounds, n_kv, group, device, fused)
        elif self.mode == "cells":
            self.cells, self.bias = _cell_part(plan, seen, slice(None), device)
        elif self.mode == "gather":
            self.cells, self.width, self.bias = _gather_part(plan, seen, rows, slice(None), n_kv, group, device)
        else:
            self.cells = None if plan.read_idx is None else plan.read_idx
            for w, mask in seen.items():
                self.bias[w] = _additive(mask).repeat_interleave(group, 0)[None].to(device)

    def read(self, pool: torch.Tensor, cells: torch.Tensor | None) -> torch.Tensor:
        """The K or V rows read, `[Hkv, T*L or C, D]`."""
        if cells is None:
            return pool[0, :, : self.read_len]
        return pool[0].index_select(1, cells)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window) -> torch.Tensor:
        """q `[T, Hq, D]` -> attention output `[T, Hq*D]`."""
        if self.mode == "cells":
            return torch.ops.cellserve.cell_attention(q, keys, values, self.cells, self.bias[window], scale)
        if self.mode != "split":
            width = self.width if self.mode == "gather" else None
            return self._bmm(q, self.read(keys, self.cells), self.read(values, self.cells), self.bias[window],
                             scale, width)
        out = q.new_empty(self.n_tok, q.shape[1] * q.shape[2])
        for part in self.parts:
            if part.width == "cells":
                out[part.rows] = torch.ops.cellserve.cell_attention(
                    q[part.rows], keys, values, part.cells, part.masks[window], scale)
                continue
            k, v = self.read(keys, part.cells), self.read(values, part.cells)
            if part.width is not None:
                out[part.rows] = self._bmm(q[part.rows], k, v, part.masks[window], scale, part.width)
            else:
                o = F.scaled_dot_product_attention(q[part.rows].transpose(0, 1)[None], k[None], v[None],
                                                   attn_mask=part.masks[window], scale=scale,
                                                   enable_gqa=self.group > 1)
                out[part.rows] = o[0].transpose(0, 1).reshape(o.shape[2], -1)
        return out

    def _bmm(self, q, k, v, bias, scale, width):
        """Scores, softmax and values by batched matmuls: per row over `width` gathered cells, or every
        row over the same window (`width` None)."""
        n_tok, n_kv, group, head_dim = q.shape[0], self.n_kv, self.group, q.shape[-1]
        dtype = q.dtype
        if dtype != torch.float32 and n_tok == 1:
            # One decoding row: torch's CPU bf16 bmm builds a oneDNN primitive for every new key
            # length (every step), ~10x the work; fp32 copies of so few rows cost less. With more
            # rows the bf16 kernels win (measured: 32 rows 2.3x slower in fp32).
            q, k, v = q.float(), k.float(), v.float()
        q = q.reshape(n_tok, n_kv, group, head_dim).transpose(0, 1)  # [Hkv, T, G, D]
        if width is not None:
            q = q.reshape(n_kv * n_tok, group, head_dim)
            k = k.view(n_kv * n_tok, width, head_dim)
            v = v.view(n_kv * n_tok, width, head_dim)
        else:
            q = q.reshape(n_kv, n_tok * group, head_dim)
        probs = _softmax_scores(q, k, bias, scale).to(v.dtype)
        out = torch.bmm(probs, v)  # [Hkv*T, G, D] or [Hkv, T*G, D]
        return out.view(n_kv, n_tok, group, head_dim).transpose(0, 1).reshape(n_tok, -1).to(dtype)


@dataclass
class _Part:
    """Some rows of a `split` step: the pool cells they read and their mask per window (`width` an
    int: a gather part with additive biases; "cells": the fused kernel's [t, L] cells and biases;
    None: one chunk's bool mask for sdpa)."""

    rows: slice | torch.Tensor
    cells: torch.Tensor
    masks: dict
    width: int | str | None = None


def _split_parts(plan: StepPlan, seen: dict, bounds: list[int], n_kv: int, group: int, device,
                 fused: bool) -> list[_Part]:
    """One sdpa part per multi-row chunk (rows `bounds[i]:bounds[i+1]`), one part for all one-row ones."""
    parts, singles = [], []
    read_idx = None if plan.read_idx is None else plan.read_idx.cpu()
    for a, b in pairwise(bounds):
        if b - a == 1:
            singles.append(a)
            continue
        cols = plan.visible[a:b].any(0).nonzero().flatten()
        cells = cols if read_idx is None else read_idx[cols]
        masks = {w: mask[a:b, cols][None, None].to(device) for w, mask in seen.items()}
        parts.append(_Part(slice(a, b), cells.to(device), masks))
    if singles:
        rows = torch.tensor(singles)
        if fused:
            cells, bias = _cell_part(plan, seen, rows, device)
            parts.append(_Part(rows.to(device), cells, bias, "cells"))
        else:
            cells, width, bias = _gather_part(plan, seen, gather_rows(plan.visible[rows]), rows, n_kv, group, device)
            parts.append(_Part(rows.to(device), cells, bias, width))
    return parts


def _cell_part(plan: StepPlan, seen: dict, rows, device):
    """Pool cells `[t, L]` each of the given one-row queries reads, and additive biases `[t, L]` per window."""
    gather = gather_rows(plan.visible[rows])
    idx = gather.idx if plan.read_idx is None else plan.read_idx.cpu()[gather.idx]
    bias = {w: _additive(torch.gather(mask[rows], 1, gather.idx) & gather.valid).to(device) for w, mask in seen.items()}
    return idx.to(device), bias


def _gather_part(plan: StepPlan, seen: dict, gather, rows, n_kv: int, group: int, device):
    """Pool indices `[t*L]`, width L and additive biases `[Hkv*t, G, L]` per window of gathered rows."""
    idx = gather.idx if plan.read_idx is None else plan.read_idx.cpu()[gather.idx]
    n_tok, width = idx.shape
    bias = {}
    for w, mask in seen.items():
        visible = torch.gather(mask[rows], 1, gather.idx) & gather.valid
        bias[w] = _additive(visible)[None, :, None, :].expand(
            n_kv, n_tok, group, width).reshape(n_kv * n_tok, group, width).to(device)
    return idx.reshape(-1).to(device), width, bias


def _softmax_scores(q, k, bias, scale):
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    else:  # low precision: accumulate the scores and the softmax in fp32
        scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale).add_(bias)
    return torch.softmax(scores, dim=-1)


def _additive(seen: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere; fp32, since scores are fp32 whatever the model dtype."""
    return torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, float("-inf"))
