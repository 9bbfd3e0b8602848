"""CellLayer: one layer's K/V pools in the cell cache, in the model's dtype or as int8 with scales.

A float pool holds K and V as the model computed them. An int8 pool (`CellCache(kv_dtype=torch.int8)`)
holds each (cell, kv head) row as int8 plus one float32 scale (`engine/cells/int8_kv.py` says why):
`keys`/`values` int8 `[1, n_kv_heads, n_cells, head_dim]` and `k_scale`/`v_scale` float32
`[1, n_kv_heads, n_cells]`. Writes (`store`) quantize; reads (`read`) dequantize only the rows asked for,
never the whole pool; the native forward's fused kernel reads the int8 rows in place.
"""

import torch
from transformers.cache_utils import CacheLayerMixin

from engine.cells import int8_kv


class CellLayer(CacheLayerMixin):
    """One layer's K/V pools `[1, n_kv_heads, n_cells, head_dim]`, allocated on first use.

    Shapes come from the model's own key/value states, so any architecture (GQA, GPT-2, different
    K and V head sizes) works without parsing its config. `dtype` is the pools' storage dtype (the
    model's, or int8); `k_scale`/`v_scale` are None for float pools.
    """

    is_compileable = False
    is_sliding = False  # a sliding window lives in the mask, not in the pool

    def __init__(self, cache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.k_scale = self.v_scale = None

    @property
    def quantized(self) -> bool:
        return self.cache.kv_dtype == torch.int8

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = self.cache.n_cells
        k_shape = (1, key_states.shape[1], n, key_states.shape[3])
        v_shape = (1, value_states.shape[1], n, value_states.shape[3])
        dtype, device = self.cache.kv_dtype or key_states.dtype, key_states.device
        self.keys = torch.zeros(k_shape, dtype=dtype, device=device)
        self.values = torch.zeros(v_shape, dtype=dtype, device=device)
        if self.quantized:
            self.k_scale = torch.zeros(k_shape[:3], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(v_shape[:3], dtype=torch.float32, device=device)
        self.dtype, self.device = dtype, device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' call: store this step's K/V, return the step's read window (int8 pools: those
        rows dequantized to the model's dtype; the hf path has no kernel that reads int8 in place)."""
        plan = self.cache.take_layer(self.layer_idx)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store(plan.kv_cells, key_states, value_states)
        if not self.quantized:
            if plan.read_idx is not None:
                return self.keys.index_select(2, plan.read_idx), self.values.index_select(2, plan.read_idx)
            return self.keys[:, :, : plan.read_len], self.values[:, :, : plan.read_len]
        k, v = self.read(plan.read_idx, plan.read_len, key_states.dtype)
        return k[None], v[None]

    def store(self, cells: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """K and V `[1, n_kv_heads, T, head_dim]` (the model's dtype) into `cells` `[T]` (quantized for int8 pools)."""
        if not self.quantized:
            self.keys.index_copy_(2, cells, keys)
            self.values.index_copy_(2, cells, values)
            return
        for pool, scales, x in ((self.keys, self.k_scale, keys), (self.values, self.v_scale, values)):
            q, s = int8_kv.quantize(x)
            pool.index_copy_(2, cells, q)
            scales.index_copy_(2, cells, s)

    def read(self, cells: torch.Tensor | None, upto: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[n_kv_heads, C, head_dim]` of `cells` `[C]` (None: cells [0, upto)) in `dtype`. Float pools in
        their own dtype give a view for None and a copy otherwise; int8 pools dequantize just those rows."""
        if cells is None:
            k, v = self.keys[0, :, :upto], self.values[0, :, :upto]
            ks, vs = (None, None) if not self.quantized else (self.k_scale[0, :, :upto], self.v_scale[0, :, :upto])
        else:
            k, v = self.keys[0].index_select(1, cells), self.values[0].index_select(1, cells)
            if self.quantized:
                ks, vs = self.k_scale[0].index_select(1, cells), self.v_scale[0].index_select(1, cells)
        if not self.quantized:
            return k, v
        return int8_kv.dequantize(k, ks, dtype), int8_kv.dequantize(v, vs, dtype)

    def rows(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[1, n_kv_heads, C, width]` of `cells` as stored: float rows, or int8 rows packed with their
        scales (`int8_kv.pack`, width head_dim + 4). What `CellCache.seq_read` saves."""
        k, v = self.keys.index_select(2, cells), self.values.index_select(2, cells)
        if not self.quantized:
            return k, v
        return (int8_kv.pack(k, self.k_scale.index_select(2, cells)),
                int8_kv.pack(v, self.v_scale.index_select(2, cells)))

    def load_rows(self, cells: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The inverse of `rows`: `[1, n_kv_heads, C, width]` as `rows` gives them into `cells`."""
        if not self.quantized:
            self.keys.index_copy_(2, cells, keys.to(self.device, self.dtype))
            self.values.index_copy_(2, cells, values.to(self.device, self.dtype))
            return
        for pool, scales, packed in ((self.keys, self.k_scale, keys), (self.values, self.v_scale, values)):
            q, s = int8_kv.unpack(packed.to(self.device))
            pool.index_copy_(2, cells, q)
            scales.index_copy_(2, cells, s)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.read_len, 0

    def get_seq_length(self) -> int:
        return self.cache.read_len

    def get_max_length(self) -> int:
        return self.cache.n_cells
