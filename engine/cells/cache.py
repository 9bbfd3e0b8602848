"""The cell cache: one pool of per-token KV cells shared by every sequence.

A *cell* holds one token's K and V for every layer, that token's position, and the set of sequence
slots that own it. A cell is free iff nobody owns it. Sequences need not be contiguous: a token
claims the lowest free cell, forks share cells (`seq_cp`), removals drop claims (`seq_rm`) and a
cell frees when its last owner leaves. Semantics follow llama.cpp's unified KV cells and the
ExecuTorch `CellReferenceCache`.

`CellCache` is also a `transformers.cache_utils.Cache`, so an unmodified Hugging Face model writes
into and reads from the pool: `begin_step` plans a forward (claims cells, computes what each query
token may see) *before* the model runs, because transformers 5.x gives `update()` no positions.
Every layer then scatters its K/V into the claimed cells and reads back the read window.
What a plan holds and how each query row reads it lives in `engine/cells/plan.py`.
"""


import torch
from transformers.cache_utils import Cache

from engine.cells import int8_kv
from engine.cells.layer import CellLayer
from engine.cells.plan import StepPlan

DEFAULT_MAX_SEQS = 256


class CellCacheError(RuntimeError):
    """The cache was used in a way its contract forbids; the message says how to fix the call."""


class CacheFull(CellCacheError):
    """A step needs more free cells than the pool has. Raised before anything is claimed."""

    def __init__(self, needed: int, free: int):
        super().__init__(
            f"step needs {needed} free cells but only {free} are free; "
            "remove sequences (seq_rm), run a smaller step, or size the pool larger"
        )
        self.needed = needed
        self.free = free


class CellCache(Cache):
    """A pool of `n_cells` KV cells owned by up to `max_seqs` sequence slots.

    Guarantees:
    - metadata lives in tensors (`owner` [max_seqs, n_cells] bool, `n_owners`, `pos`) and every verb
      is a broadcast over them, never a Python loop over cells;
    - every verb validates its arguments before changing anything, so a failed call leaves the
      cache exactly as it was;
    - cells are interchangeable, so a step that passes `can_extend` cannot fail to allocate;
    - `free_cells`, `used_cells` and `can_extend` cost no tensor work: the verbs keep the count;
    - `read_len` is one past the highest occupied cell: freeing trailing cells shrinks it.
    """

    def __init__(
        self,
        n_cells: int,
        n_layers: int,
        max_seqs: int = DEFAULT_MAX_SEQS,
        compact: bool = True,
        device: str | torch.device = "cpu",
        kv_dtype: torch.dtype | None = None,
    ):
        """`kv_dtype`: None keeps K/V in the model's dtype; torch.int8 stores them as int8 rows with a float32
        scale per (cell, kv head) (`engine/cells/layer.py`)."""
        if n_cells < 1 or n_layers < 1 or max_seqs < 1:
            raise ValueError(f"n_cells, n_layers and max_seqs must be >= 1 (got {n_cells}, {n_layers}, {max_seqs})")
        if kv_dtype not in (None, torch.int8):
            raise ValueError(f"kv_dtype={kv_dtype!r}: use None (the model's dtype) or torch.int8")
        self.kv_dtype = kv_dtype
        self.n_cells = n_cells
        self.max_seqs = max_seqs
        self.compact = compact
        self.device = torch.device(device)  # where K/V pools live; metadata always stays on the host
        super().__init__(layers=[CellLayer(self, i) for i in range(n_layers)])
        self.owner = torch.zeros(max_seqs, n_cells, dtype=torch.bool)
        self.n_owners = torch.zeros(n_cells, dtype=torch.int32)
        self.pos = torch.full((n_cells,), -1, dtype=torch.int64)
        self.read_len = 0
        self._n_used = 0  # cells with an owner, kept by the verbs so that admission costs no reduction
        self.plan: StepPlan | None = None
        self._served = torch.zeros(n_layers, dtype=torch.bool)

    # ----- queries -------------------------------------------------------------------------
    def free_cells(self) -> int:
        return self.n_cells - self.used_cells()

    def used_cells(self) -> int:
        return self._n_used

    def can_extend(self, n: int) -> bool:
        return self.free_cells() >= n

    def seq_len(self, seq_id: int) -> int:
        self._check_slot(seq_id, "seq_id")
        return int(self.owner[seq_id, : self.read_len].sum())

    def next_pos(self, seq_id: int) -> int:
        self._check_slot(seq_id, "seq_id")
        held = self.pos[: self.read_len][self.owner[seq_id, : self.read_len]]
        return int(held.max()) + 1 if held.numel() else 0

    def shared_cells(self, seq_id: int) -> int:
        """Cells `seq_id` owns together with at least one other sequence."""
        self._check_slot(seq_id, "seq_id")
        r = self.read_len
        return int((self.owner[seq_id, :r] & (self.n_owners[:r] > 1)).sum())

    def cells_owned_only_by(self, seq_ids: list[int], others: list[int]) -> int:
        """Cells some of `seq_ids` own and none of `others` does (what dropping `seq_ids` would free)."""
        r = self.read_len
        mine = self.owner[seq_ids, :r].any(0)
        if others:
            mine &= ~self.owner[others, :r].any(0)
        return int(mine.sum())

    def seq_positions(self, seq_id: int) -> torch.Tensor:
        """Sorted positions `seq_id` holds cells for."""
        self._check_slot(seq_id, "seq_id")
        r = self.read_len
        return self.pos[:r][self.owner[seq_id, :r]].sort().values

    # ----- verbs ---------------------------------------------------------------------------
    def begin_step(self, seq_ids, positions) -> StepPlan:
        """Claim the lowest free cell for each token and plan what every token may attend.

        Raises before claiming anything if the step is empty, a slot is out of range, a token's
        (seq, position) is already held or repeated, or the pool lacks free cells (`CacheFull`).
        """
        seq_ids, positions = _int_tensor(seq_ids, "seq_ids"), _int_tensor(positions, "positions")
        self._validate_step(seq_ids, positions)
        n_tok = seq_ids.numel()
        free = torch.nonzero(self.n_owners == 0).squeeze(1)
        if free.numel() < n_tok:
            raise CacheFull(n_tok, int(free.numel()))
        cells = free[:n_tok]
        self.owner[seq_ids, cells] = True
        self.n_owners[cells] = 1
        self.pos[cells] = positions
        self.read_len = max(self.read_len, int(cells[-1]) + 1)
        self._n_used += n_tok
        self.plan = self._plan(cells, seq_ids, positions)
        self._served.zero_()
        return self.plan

    def end_step(self) -> None:
        """The forward finished: the claimed cells now hold valid K/V."""
        self.plan = None

    def abort_step(self) -> None:
        """The forward failed: release the cells this step claimed, as if it never happened."""
        plan, self.plan = self.plan, None
        if plan is None:
            return
        self.owner[plan.seq_ids, plan.cells] = False
        self.n_owners[plan.cells] = 0
        self.pos[plan.cells] = -1
        self._n_used -= plan.cells.numel()
        self._shrink_read_len()

    def seq_cp(self, src: int, dst: int, upto: int | None = None, start: int = 0) -> None:
        """Fork: `dst` also owns `src`'s cells with `start` <= position < `upto` (to the end if None).
        Copies no K/V. `dst` must not hold cells of those positions already."""
        self._check_between_steps("seq_cp")
        self._check_slot(src, "src")
        self._check_slot(dst, "dst")
        r = self.read_len
        sel = self.owner[src, :r] & self._pos_range(start, upto)
        new = sel & ~self.owner[dst, :r]
        self.owner[dst, :r] |= new
        self.n_owners[:r] += new.to(torch.int32)

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None) -> int:
        """Drop `seq_id`'s claim on positions [p0, p1) (p1=None: to the end). Returns cells freed."""
        self._check_between_steps("seq_rm")
        self._check_slot(seq_id, "seq_id")
        if p0 < 0 or (p1 is not None and p1 < p0):
            raise CellCacheError(f"seq_rm range [{p0}, {p1}) is invalid: need 0 <= p0 <= p1")
        r = self.read_len
        sel = self.owner[seq_id, :r] & self._pos_range(p0, p1)
        self.owner[seq_id, :r] &= ~sel
        self.n_owners[:r] -= sel.to(torch.int32)
        freed = sel & (self.n_owners[:r] == 0)
        self.pos[:r].masked_fill_(freed, -1)
        self._shrink_read_len()
        n_freed = int(freed.sum())
        self._n_used -= n_freed
        return n_freed

    def seq_read(self, seq_id: int, p0: int, p1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `seq_id`'s cells for positions [p0, p1), in position order: `[n_layers, n_kv_heads,
        p1 - p0, head_dim]` each, copies on the host (what a saved sequence writes to disk). int8 pools give
        their rows as stored, each packed with its scale (int8 `[..., head_dim + 4]`, `int8_kv.pack`), so
        saving and restoring them neither rounds again nor grows them. `seq_id` must hold every one of
        those positions."""
        self._check_between_steps("seq_read")
        cells = self._cells_at(seq_id, p0, p1)
        if not self.layers[0].is_initialized:
            raise CellCacheError("no forward has run yet: the pools hold no K/V to read")
        rows = [layer.rows(cells.to(self.device)) for layer in self.layers]
        return torch.cat([k for k, _ in rows]).cpu(), torch.cat([v for _, v in rows]).cpu()

    def seq_load(self, seq_id: int, p0: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Restore: `seq_id` claims the lowest free cells for positions [p0, p0 + n) and they take `keys`,
        `values` (`[n_layers, n_kv_heads, n, head_dim]`, as `seq_read` gives them), so the sequence continues
        as if it had computed them. Allocates the pools on first use (restore before any forward).
        Raises before claiming anything if the shapes do not fit the pools, `seq_id` already holds one of
        those positions, or fewer than n cells are free (`CacheFull`)."""
        self._check_between_steps("seq_load")
        self._check_slot(seq_id, "seq_id")
        n = keys.shape[2]
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3] or keys.shape[0] != len(self.layers):
            raise CellCacheError(f"seq_load takes [n_layers={len(self.layers)}, heads, n, head_dim] K and V, "
                                 f"got {tuple(keys.shape)} and {tuple(values.shape)}")
        self._check_rows(keys, values)
        if n == 0:
            return
        if (self.owner[seq_id, : self.read_len] & (self.pos[: self.read_len] >= p0)
                & (self.pos[: self.read_len] < p0 + n)).any():
            raise CellCacheError(f"seq {seq_id} already holds a position in [{p0}, {p0 + n}): seq_rm it first")
        free = torch.nonzero(self.n_owners == 0).squeeze(1)
        if free.numel() < n:
            raise CacheFull(n, int(free.numel()))
        cells = free[:n]
        with torch.inference_mode():  # pools a forward allocated are inference tensors: written in that mode only
            extra = int8_kv.SCALE_BYTES if self.kv_dtype == torch.int8 else 0  # packed rows carry their scale
            for i, layer in enumerate(self.layers):
                if not layer.is_initialized:
                    layer.lazy_initialization(keys[i : i + 1, :, :1, : keys.shape[3] - extra].to(self.device),
                                              values[i : i + 1, :, :1, : values.shape[3] - extra].to(self.device))
                layer.load_rows(cells.to(self.device), keys[i : i + 1], values[i : i + 1])
        self.owner[seq_id, cells] = True
        self.n_owners[cells] = 1
        self.pos[cells] = torch.arange(p0, p0 + n)
        self.read_len = max(self.read_len, int(cells[-1]) + 1)
        self._n_used += n

    def _check_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`seq_load`'s K/V must be rows as this cache's `seq_read` gives them: the same kind (int8 packed with
        scales, or float), and once the pools exist, their heads, widths and dtype."""
        int8_pools = self.kv_dtype == torch.int8
        if (keys.dtype == torch.int8) != int8_pools or (values.dtype == torch.int8) != int8_pools:
            raise CellCacheError(f"K/V of dtype {keys.dtype} do not fit {'int8' if int8_pools else 'float'} KV pools: "
                                 f"they were saved with another --kv-cache-dtype")
        layer0 = self.layers[0]
        if not layer0.is_initialized:
            return
        extra = int8_kv.SCALE_BYTES if int8_pools else 0
        want_k = (layer0.keys.shape[1], layer0.keys.shape[3] + extra)
        want_v = (layer0.values.shape[1], layer0.values.shape[3] + extra)
        if ((keys.shape[1], keys.shape[3]) != want_k or (values.shape[1], values.shape[3]) != want_v
                or (not int8_pools and keys.dtype != layer0.dtype)):
            raise CellCacheError(f"K/V of shape {tuple(keys.shape)} ({keys.dtype}) do not fit pools of "
                                 f"{tuple(layer0.keys.shape)} ({layer0.dtype}): they come from another model")

    def take_layer(self, layer_idx: int) -> StepPlan:
        """Called by each layer's `update`: the current plan, once per layer per step."""
        if self.plan is None:
            raise CellCacheError("forward without a step: call begin_step(seq_ids, positions) first")
        if self._served[layer_idx]:
            raise CellCacheError(
                f"layer {layer_idx} served twice in one step: call begin_step before every forward"
            )
        self._served[layer_idx] = True
        return self.plan

    # ----- internals -----------------------------------------------------------------------
    def _plan(self, cells, seq_ids, positions) -> StepPlan:
        r = self.read_len
        key_pos = self.pos[:r]
        visible = self.owner[seq_ids, :r] & (key_pos[None, :] <= positions[:, None])
        read_idx = None
        if self.compact:
            cols = torch.nonzero(visible.any(0)).squeeze(1)
            # Gathering costs a copy per layer; only worth it when it drops at least half the window.
            if cols.numel() * 2 <= r:
                read_idx, visible, key_pos = cols.to(self.device), visible[:, cols], key_pos[cols]
        return StepPlan(cells, cells.to(self.device), seq_ids, positions, r, read_idx, visible, key_pos)

    def _validate_step(self, seq_ids: torch.Tensor, positions: torch.Tensor) -> None:
        if self.plan is not None:
            raise CellCacheError("a step is already in progress: call end_step() or abort_step() first")
        if seq_ids.numel() == 0:
            raise CellCacheError("empty step: pass at least one (seq_id, position)")
        if seq_ids.numel() != positions.numel():
            raise CellCacheError(f"{seq_ids.numel()} seq_ids but {positions.numel()} positions: pass one each")
        bad = (seq_ids < 0) | (seq_ids >= self.max_seqs)
        if bad.any():
            raise CellCacheError(
                f"seq_id {int(seq_ids[bad][0])} out of range [0, {self.max_seqs}): raise max_seqs"
            )
        if (positions < 0).any():
            raise CellCacheError(f"negative position {int(positions.min())}: positions start at 0")
        keys = seq_ids * (int(positions.max()) + 1) + positions
        if keys.unique().numel() != keys.numel():
            raise CellCacheError("the step repeats a (seq_id, position) pair: each token needs its own position")
        r = self.read_len
        held = self.owner[seq_ids, :r] & (self.pos[:r][None, :] == positions[:, None])
        if held.any():
            i = int(torch.nonzero(held.any(1))[0])
            raise CellCacheError(
                f"seq {int(seq_ids[i])} already holds position {int(positions[i])}: "
                "seq_rm it first (truncate) or use next_pos()"
            )

    def _cells_at(self, seq_id: int, p0: int, p1: int) -> torch.Tensor:
        """The cells `seq_id` holds for positions [p0, p1), ordered by position (all of them, or it raises)."""
        self._check_slot(seq_id, "seq_id")
        r = self.read_len
        sel = self.owner[seq_id, :r] & self._pos_range(p0, p1)
        cells = torch.nonzero(sel).squeeze(1)
        if cells.numel() != p1 - p0:
            raise CellCacheError(f"seq {seq_id} holds {cells.numel()} of the positions [{p0}, {p1}), not all")
        return cells[self.pos[cells].argsort()]

    def _pos_range(self, p0: int, p1: int | None) -> torch.Tensor:
        key_pos = self.pos[: self.read_len]
        sel = key_pos >= p0
        return sel if p1 is None else sel & (key_pos < p1)

    def _shrink_read_len(self) -> None:
        occupied = torch.nonzero(self.n_owners[: self.read_len] > 0)
        self.read_len = int(occupied[-1]) + 1 if occupied.numel() else 0

    def _check_between_steps(self, verb: str) -> None:
        if self.plan is not None:
            raise CellCacheError(f"{verb} during a step would corrupt its plan: call it before begin_step "
                                 "or after end_step/abort_step")

    def _check_slot(self, seq_id: int, name: str) -> None:
        if not isinstance(seq_id, int) or isinstance(seq_id, bool) or not 0 <= seq_id < self.max_seqs:
            raise CellCacheError(f"{name}={seq_id!r} is not a slot in [0, {self.max_seqs}): raise max_seqs")


def _int_tensor(values, name: str) -> torch.Tensor:
    """A 1-D int64 tensor of `values`; bools and floats are refused rather than silently cast."""
    t = torch.as_tensor(values)
    if t.numel() == 0:
        return t.to(torch.int64).reshape(-1)  # an empty list is float to torch; the step check names it
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise CellCacheError(f"{name} must be integers, got dtype {t.dtype}")
    return t.to(torch.int64).reshape(-1)
