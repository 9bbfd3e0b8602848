"""Attend: how a step's queries read the cell pools, planned once a step for every layer.

The parts (`cells`, `gather`, `dense`, `sdpa`) and when each is chosen are described in
engine/model/native/model.py's docstring; this file holds the plan and the code that runs it.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from engine.cells.plan import RowGather, StepPlan, gather_rows, row_gather_for, windowed
from engine.model.native.rows import INVARIANT_ROWS


@dataclass
class _Part:
    """Some rows of a step, the pool cells they read (None: the prefix [0, read_len)) and their mask
    per attention window, in the form `kind` needs (see the module docstring)."""

    kind: str
    rows: slice | torch.Tensor
    cells: torch.Tensor | None
    masks: dict
    width: int | None = None  # gather: cells per row


class Attend:
    """One step's attention plan (see the module docstring); `__call__` runs it for one layer."""

    def __init__(self, plan: StepPlan, n_kv: int, group: int, windows, device, fused: bool = False):
        n_tok = plan.visible.shape[0]
        self.n_tok, self.n_kv, self.group, self.read_len = n_tok, n_kv, group, plan.read_len
        ids = plan.seq_ids
        bounds = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist(), n_tok]
        seen = {w: windowed(plan, w) for w in windows}  # [T, C] visibility per attention window
        if len(bounds) - 1 < n_tok:  # some sequence brings several rows: a prefill chunk
            self.parts = _split_parts(plan, seen, bounds, n_kv, group, device, fused)
            whole = len(self.parts) == 1 and _row_count(self.parts[0].rows, n_tok) == n_tok  # one prefill, or drafts
            if whole:  # every row in order: no per-layer index and index_put of q and out
                self.parts[0].rows = slice(None)
            self.mode = self.parts[0].kind if whole else "split"
            return
        everyone = slice(None)
        gather = None if fused else row_gather_for(plan, max_tokens=None)
        if fused:
            part = _cell_part(plan, seen, everyone, device)
        elif gather is not None:
            part = _gather_part(plan, seen, gather, everyone, n_kv, group, device)
        else:
            masks = {w: _additive(m).repeat_interleave(group, 0)[None].to(device) for w, m in seen.items()}
            part = _Part("dense", everyone, plan.read_idx, masks)
        self.mode, self.parts = part.kind, [part]

    def __call__(self, q: torch.Tensor, pools, scale: float, window) -> torch.Tensor:
        """q `[T, Hq, D]` over one layer's pools (a `CellLayer`) -> attention output `[T, Hq*D]`."""
        if self.mode != "split":  # one part, every row
            return self._run(self.parts[0], q, pools, scale, window)
        out = q.new_empty(self.n_tok, q.shape[1] * q.shape[2])
        for part in self.parts:
            out[part.rows] = self._run(part, q[part.rows], pools, scale, window)
        return out

    def _run(self, part: _Part, q, pools, scale, window) -> torch.Tensor:
        """One part's rows of q `[t, Hq, D]` -> `[t, Hq*D]`. int8 pools: the kernel reads them in place; the
        eager parts dequantize only the rows they read (`CellLayer.read`)."""
        mask = part.masks[window]
        cells = part.cells[window] if isinstance(part.cells, dict) else part.cells  # `cells`: one list per window
        if part.kind == "cells" and pools.quantized:
            return torch.ops.cellserve.cell_attention_q8(q.contiguous(), pools.keys, pools.values, pools.k_scale,
                                                         pools.v_scale, cells, mask, scale)
        if part.kind == "cells":
            return torch.ops.cellserve.cell_attention(q.contiguous(), pools.keys, pools.values, cells, mask, scale)
        k, v = pools.read(part.cells, self.read_len, q.dtype)  # [Hkv, t*L or C, D]
        if part.kind == "sdpa":
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                               scale=scale, enable_gqa=self.group > 1)
            return o[0].transpose(0, 1).reshape(o.shape[2], -1)
        return self._bmm(q, k, v, mask, scale, part.width)

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


def _split_parts(plan: StepPlan, seen: dict, bounds: list[int], n_kv: int, group: int, device,
                 fused: bool) -> list[_Part]:
    """One sdpa part per multi-row chunk (rows `bounds[i]:bounds[i+1]`), one part for all one-row ones; with
    the fused kernel, chunks of up to `INVARIANT_ROWS` rows (a sequence's drafted tokens, short prefills)
    join the one-row part, so each of their rows is computed exactly as a lone decode row would be."""
    parts, singles = [], []
    read_idx = None if plan.read_idx is None else plan.read_idx.cpu()
    alone = INVARIANT_ROWS if fused else 1  # the fused kernel computes each row as a decode row: drafts too
    for a, b in pairwise(bounds):
        if b - a <= alone:
            singles.extend(range(a, b))
            continue
        cols = plan.visible[a:b].any(0).nonzero().flatten()
        cells = cols if read_idx is None else read_idx[cols]
        masks = {w: mask[a:b, cols][None, None].to(device) for w, mask in seen.items()}
        parts.append(_Part("sdpa", slice(a, b), cells.to(device), masks))
    if singles:
        rows = torch.tensor(singles)
        part = (_cell_part(plan, seen, rows, device) if fused else
                _gather_part(plan, seen, gather_rows(plan.visible[rows]), rows, n_kv, group, device))
        part.rows = rows.to(device)
        parts.append(part)
    return parts


def _row_count(rows: slice | torch.Tensor, n_tok: int) -> int:
    """How many of a step's `n_tok` rows a part holds (its rows are in order, each once)."""
    return len(range(n_tok)[rows]) if isinstance(rows, slice) else rows.numel()


def _row_cells(plan: StepPlan, seen: dict, gather: RowGather, rows):
    """The pool cells `[t, L]` the given one-row queries read (padded) and their biases `[t, L]` per window."""
    idx = gather.idx if plan.read_idx is None else plan.read_idx.cpu()[gather.idx]
    return idx, {w: _additive(torch.gather(mask[rows], 1, gather.idx) & gather.valid) for w, mask in seen.items()}


def _cell_part(plan: StepPlan, seen: dict, rows, device) -> _Part:
    """The fused kernel's part: cells `[t, L]` read in place (in position order), biases `[t, L]`. With sliding
    windows (Gemma 3's local layers, Qwen2's), each window gets its own cells, the ones its rows can see: a local
    layer reads its window, not the whole context (`cells` then a dict by window, as `masks` is)."""
    if len(seen) == 1:
        gather = _shared_cells(gather_rows(plan.visible[rows], plan.key_pos), plan.seq_ids[rows])
        idx, bias = _row_cells(plan, seen, gather, rows)
        return _Part("cells", rows, idx.to(device), {w: b.to(device) for w, b in bias.items()})
    cells, masks = {}, {}
    for w, visible in seen.items():
        gather = _shared_cells(gather_rows(visible[rows], plan.key_pos), plan.seq_ids[rows])
        idx, bias = _row_cells(plan, {w: visible}, gather, rows)
        cells[w], masks[w] = idx.to(device), bias[w].to(device)
    return _Part("cells", rows, cells, masks)


def _shared_cells(gather: RowGather, seq_ids: torch.Tensor) -> RowGather:
    """A sequence's consecutive rows (its last token and its drafted ones) given the cells of its last row, each
    row still masked by its own bias: the kernel then converts each block of those cells once for all of them
    (kernels/csrc/cell_blocks.h). Only where a row's own cells sit in the same columns of the last row's, so
    every row keeps the order of its sums (a drafted row stays bitwise the decode row it stands for)."""
    ids = seq_ids.cpu()
    n = ids.shape[0]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    if bool(starts.all()):  # one row per sequence: nothing shared
        return gather
    ends = torch.cat([starts.nonzero().flatten()[1:] - 1, torch.tensor([n - 1])])
    last = ends[starts.cumsum(0) - 1]  # each row's run's last row
    idx, valid = gather.idx, gather.valid
    inside = ((idx == idx[last]) | ~valid).all(1) & (valid[last] | ~valid).all(1)
    return RowGather(torch.where(inside[:, None], idx[last], idx), torch.where(inside[:, None], valid[last], valid))


def _gather_part(plan: StepPlan, seen: dict, gather: RowGather, rows, n_kv: int, group: int, device) -> _Part:
    """The eager part: cells `[t*L]` copied out, biases expanded to `[Hkv*t, G, L]` for the bmm."""
    idx, bias = _row_cells(plan, seen, gather, rows)
    n_tok, width = idx.shape
    masks = {w: b[None, :, None, :].expand(n_kv, n_tok, group, width).reshape(n_kv * n_tok, group, width).to(device)
             for w, b in bias.items()}
    return _Part("gather", rows, idx.reshape(-1).to(device), masks, width)


def _softmax_scores(q, k, bias, scale):
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)
    else:  # low precision: accumulate the scores and the softmax in fp32
        scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale).add_(bias)
    return torch.softmax(scores, dim=-1)


def _additive(seen: torch.Tensor) -> torch.Tensor:
    """0 where visible, -inf elsewhere; fp32, since scores are fp32 whatever the model dtype."""
    return torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, float("-inf"))
