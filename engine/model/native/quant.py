"""QuantLinear: the native forward's linears over GGUF block-quantized weights, read as they are.

A `QuantWeight` (engine/loader/gguf_tensors.py: Q8_0, Q4_0, Q4_1 in 32-weight blocks, 1.0625 / 0.5625 /
0.625 bytes per weight; Q4_K, Q5_K, Q6_K in 256-weight super-blocks, 0.578 / 0.703 / 0.820) is the only
copy of a linear's weight. `QuantLinear` has `Linear`'s interface
(call, `silu`, `times`, `plus`, `is_small`, `small`) plus `swiglu` for a [gate; up] weight:
- with the fused kernels built and AVX-512 VNNI, up to `BF16_ROWS` rows (`TILED_BF16_ROWS` for tiled
  weights) run in integers: the rows
  quantized once per call to int8 (per 32-block; the K-quants per 256-weight super-block, llama.cpp's
  q8_K) and dotted with the weight blocks (bias, residual add and SiLU*up fused).
  The 32-weight kinds (K a whole number of 64-weight pairs, as in every real model) are kept in 16-row
  tiles (`TiledWeight`, engine/model/native/quant_tiles.py; the one copy) and run on
  `torch.ops.cellserve.quant_tiles` (csrc/quant_tiles.cpp) at every row count: one kernel for decode,
  speculative verification and batched decode, each row bitwise as alone, 1.3-2.7x faster than the row
  kernel at one row and 2-3x at 9-16 (docs/performance.md, "The 32-weight kinds in tiles").
  The K-quants (and a 32-weight K of an odd block count): up to `K_ROW_KERNEL_ROWS` rows
  (`ROW_KERNEL_ROWS`), and up to `INVARIANT_ROWS` in a step that carries drafts (engine/model/native/rows.py,
  `must_match_alone`), on `torch.ops.cellserve.quant_linear` (csrc/quant_linear.cpp; the K-quants
  quant_krows.cpp, which sums each super-block in integers), which streams each weight row once for all the
  rows and computes each row bitwise as a call with it alone; more (batched decode):
  `torch.ops.cellserve.quant_gemm` (csrc/quant_gemm.cpp), a blocked GEMM that unpacks 32 weight rows x
  512 inputs at a time and runs every row over them in int32 registers (its sums differ from the row
  kernel's in the last bits). All round the activations alike, so their error against
  dequantize-then-`F.linear` is the same: at most sum_k |w_k| * da(k) / 2 per output, da(k) input k's
  block or super-block scale (tests/engine/model/test_quant_linear.py, test_quant_tiles.py).
- `BF16_ROWS` (tiled: `TILED_BF16_ROWS`) rows and more (prefill) where the CPU multiplies bf16 natively (AVX512-BF16; AMX under
  oneDNN): the weight is dequantized to bf16 one tile of `TILE_BYTES` at a time
  (`quant_dequant_bf16`, vectorized) and multiplied by torch's bf16 matmul with x rounded to bf16;
  error: the three bf16 roundings (x, W, the output), within the bound the tests state.
  A tiled weight's rows are read straight from its tiles (`quant_tiles_bf16`: bitwise the same bf16 rows).
  The crossovers were measured (`python -m engine.bench.quant_kernels`, docs/performance.md issue 26):
  the GEMM wins from ~16 rows for the K-quants (their row kernel is faster to 12 rows), up to ~64-96
  rows, bf16 tiles above; quant_tiles up to ~72 rows (a bf16 step dequantizes every weight first); the GEMM is 5-20x faster than the
  fp32 tiles below at every row count, bf16 tiles 2-6x at 512 rows.
- no VNNI (the row kernel would run in plain C), `gemm` switched off past the row kernel's rows (the
  bench's A/B baseline), or no kernels: the weight dequantized to float32 one tile of `TILE_BYTES` at a
  time (`quant_dequant`, or torch ops without the kernels) and multiplied by `torch.mm` (in a step with
  drafts, up to `INVARIANT_ROWS` rows one row at a time, so each row is as alone), so at most one tile of float32
  exists per call; the result equals dequantize-then-`F.linear` up to float32 summation order.
`QuantEmbedding` looks token rows up in the same blocks (a tied LM head and its embedding share them).
`GroupLinear` runs stacked weights of several kinds (Q|K|V with V in Q6_K, as Q4_K_M files have it) as
one linear per kind, and `CastLinear` / `CastEmbedding` hold the tensors of types the kernels do not
read in bfloat16 (float32 in and out).
"""

import functools

import torch
import torch.nn.functional as F

from engine.api.memory import malloc_trim
from engine.loader.gguf_tensors import BLOCK_WEIGHTS, KIND_IDS, QuantWeight
from engine.model.native.layer import DenseMLP
from engine.model.native.linear import Linear
from engine.model.native.quant_tiles import TiledWeight, tileable
from engine.model.native.rows import must_match_alone

TILE_BYTES = 8 << 20  # float32 bytes of weight unpacked at once on the fp32-tile path
# For weights in the row layout (the K-quants; a 32-weight K of an odd block count): the row kernel computes each
# row bitwise as alone; quant_gemm sums in another order (its rows differ in the last bits). With VNNI the row
# kernel takes every call of up to ROW_KERNEL_ROWS rows (K_ROW_KERNEL_ROWS for the K-quants: their integer
# super-block sums win to 8-12), and up to INVARIANT_ROWS in a step with drafts (`must_match_alone`), so drafted
# rows round as one-row decode steps do, even where the GEMM is faster. Tiled weights need none of this.
ROW_KERNEL_ROWS = 3
K_ROW_KERNEL_ROWS = 8
BF16_ROWS = 80  # from this many rows bf16 tiles, where the CPU multiplies bf16 natively (measured: 64-96)
# Tiled weights: a bf16 step dequantizes every weight first (straight from the tiles, `quant_tiles_bf16`: ~8 ms
# for SmolLM2's Q4_1 file, 4-bit weights through a table of 16 per block; ~12 ms computing each weight; untiling
# them first took ~13 ms more), which quant_tiles never pays. Its prefill steps, 2 threads, tiles / bf16: 64 rows
# 36.0-36.1 / 36.8-37.7 ms, 72 rows 40.0-40.1 / 39.0-40.8, 80 rows 43.8-44.3 / 39.9-41.7 (2026-12-06, 9b92357;
# with the per-weight dequantization the crossover was ~80: fd756b7).
TILED_BF16_ROWS = 72
INTEGER_PATHS = ("tiles", "rows", "gemm")  # `QuantLinear.path`s that run in integers, the op fused


def _kernels() -> bool:
    return hasattr(torch.ops.cellserve, "quant_linear")


class QuantLinear:
    """`y = x @ W.T + b` (float32) for a block-quantized W; `swiglu` for W = [gate; up]."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None, parts: int = 1):
        # the 32-weight kinds are kept in quant_tiles' 16-row tiles (the one copy; `parts` = 2 for [gate; up])
        self.tiled = tileable(weight)
        self.weight = TiledWeight.of(weight, parts) if self.tiled else weight
        self.kind = KIND_IDS[weight.kind]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = weight.shape
        self.small = False  # NativeLlama.fused sets it: the fused kernels are loaded
        self.gemm = True  # many rows on quant_gemm (with `small` and VNNI); off: fp32 tiles, the old path
        self.tile = max(16, TILE_BYTES // (4 * self.in_features))
        self.row_rows = K_ROW_KERNEL_ROWS if BLOCK_WEIGHTS[weight.kind] == 256 else ROW_KERNEL_ROWS  # K-quants
        self.bf16_rows = TILED_BF16_ROWS if self.tiled else BF16_ROWS

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.numel() * 4)

    def path(self, x: torch.Tensor) -> str:
        """Which kernel this call runs: "tiles" (quant_tiles, the 32-weight kinds), "rows" (quant_linear),
        "gemm" (quant_gemm), "bf16" (bf16 tiles) or "fp32" (fp32 tiles); see the module's docstring."""
        rows = x.shape[0]
        if not (self.small and _kernels()):
            return "fp32"
        integers, bf16 = _fast()
        if self.gemm and bf16 and rows >= self.bf16_rows:
            return "bf16"
        if not integers:  # the row kernel in plain C: fp32 tiles instead, as before
            return "fp32"
        few = rows <= self.row_rows or must_match_alone(rows)
        if not (few or self.gemm):
            return "fp32"  # the GEMM switched off: the bench's A/B baseline
        if self.tiled:
            return "tiles"  # quant_tiles: each row as alone at every row count
        return "rows" if few else "gemm"

    def is_small(self, x: torch.Tensor) -> bool:
        """Whether this call runs in integers (quant_tiles, the row kernel or the GEMM)."""
        return self.path(x) in INTEGER_PATHS

    def _integers(self, x, path: str, other, op) -> torch.Tensor:
        """This call on the integer kernel `path`, the op fused."""
        w, x = self.weight, x.float().contiguous()
        if path == "tiles":
            return torch.ops.cellserve.quant_tiles(x, w.tensors(), self.kind, w.n, w.parts, self.bias, other, op)
        kernel = torch.ops.cellserve.quant_gemm if path == "gemm" else torch.ops.cellserve.quant_linear
        return kernel(x, w.tensors(), self.kind, self.bias, other, op)

    def _linear(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """x @ W.T + b on `path` (chosen once a call: `path` reads the step's state)."""
        return self._integers(x, path, None, "none") if path in INTEGER_PATHS else self._dense(x, path == "bf16")

    def _tile(self, r0: int, r1: int, bf16: bool) -> torch.Tensor:
        w = self.weight
        if self.tiled and bf16:  # straight from the tiles, no row-layout copy (bitwise the untiled rows' bf16)
            return torch.ops.cellserve.quant_tiles_bf16(w.tensors(), self.kind, w.n, w.parts, r0, r1)
        if self.tiled:  # those rows in the row layout the dequantizing kernels read
            w, r0, r1 = w.untile(r0, r1), 0, r1 - r0
        if bf16:
            return torch.ops.cellserve.quant_dequant_bf16(w.tensors(), self.kind, r0, r1)
        if self.small and _kernels():
            return torch.ops.cellserve.quant_dequant(w.tensors(), self.kind, r0, r1)
        return w.dequantize(r0, r1)

    def _dense(self, x: torch.Tensor, bf16: bool | None = None) -> torch.Tensor:
        """x @ W.T + b, W unpacked one tile of rows at a time: fp32, or bf16 with x rounded to bf16
        (`bf16` None: as `path` says)."""
        bf16 = self.path(x) == "bf16" if bf16 is None else bf16
        x = x.to(torch.bfloat16) if bf16 else x.float()
        n, tile = self.out_features, self.tile * (2 if bf16 else 1)
        if n <= tile:
            y = _times(x, self._tile(0, n, bf16)).float()
        else:
            y = torch.empty(x.shape[0], n, dtype=torch.float32)
            for r0 in range(0, n, tile):
                r1 = min(n, r0 + tile)
                y[:, r0:r1] = _times(x, self._tile(r0, r1, bf16))
        return y if self.bias is None else y.add_(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.path(x))

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        y = self(x)
        if not must_match_alone(y.shape[0]):
            return F.silu(y)
        for row in y:  # torch's silu rounds the tail of its vector loop apart: each row its own loop, as alone
            F.silu(row, inplace=True)
        return y

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`linear(x) * other`."""
        return self(x).mul_(other)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """`other + linear(x)` (the residual add)."""
        path = self.path(x)
        if path in INTEGER_PATHS:
            return self._integers(x, path, other, "add").to(other.dtype)
        return self._dense(x, path == "bf16").add_(other)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(x @ G.T + bg) * (x @ U.T + bu)` for W = [G; U]."""
        path = self.path(x)
        if path in INTEGER_PATHS and (not self.tiled or self.weight.halves_apart):
            return self._integers(x, path, None, "swiglu")
        y = self._linear(x, path)
        n = self.out_features // 2
        return F.silu(y[:, :n]).mul_(y[:, n:])


def _times(x: torch.Tensor, tile: torch.Tensor) -> torch.Tensor:
    """x @ tile.T; up to INVARIANT_ROWS rows one row at a time (each a fresh, aligned [1, K] tensor), since
    torch's matmul may sum a row in another order beside other rows than alone (a matrix-vector kernel
    at one row)."""
    if not must_match_alone(x.shape[0]):
        return F.linear(x, tile)
    return torch.cat([F.linear(x[i:i + 1].clone(), tile) for i in range(x.shape[0])])


@functools.cache
def _fast() -> tuple[bool, bool]:
    """(the integer kernels are vectorized (AVX-512 VNNI), bf16 tiles pay (AVX512-BF16)) for this build."""
    return bool(torch.ops.cellserve.quant_linear_fast()), bool(torch.ops.cellserve.quant_bf16_fast())


class QuantEmbedding:
    """Token rows of a block-quantized [vocab, hidden] table, dequantized per lookup (float32); a tied
    table is the LM head's weight, in tiles where the head keeps it so (`TiledWeight.rows`)."""

    def __init__(self, weight: "QuantWeight | TiledWeight"):
        self.weight = weight

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize(index=tokens.reshape(-1))


class CastLinear:
    """A float linear whose weight is kept in bfloat16 (a GGUF tensor type the kernels do not read,
    dequantized once per tensor), the one copy (no packed second one): float32 in and out, the bias
    added in float32. Its `small` stays off (torch's bf16 matmul takes every row count)."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None = None):
        parts = [w.detach().to(torch.bfloat16) for w in weights]
        self.weight = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = self.weight.shape[0]
        self.small = False

    def is_small(self, x: torch.Tensor) -> bool:
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y.add_(self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self(x))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x).mul_(other)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x).add_(other)


class GroupLinear:
    """Stacked weights of different kinds (Q|K|V with V in q6_k and Q, K in q4_k, as Q4_K_M files have
    them; or a part in a type kept as bfloat16): one linear per run of one kind, outputs concatenated.
    `swiglu` for [gate; up]."""

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    @property
    def small(self) -> bool:
        return any(p.small for p in self.parts)

    @small.setter
    def small(self, on: bool) -> None:
        for p in self.parts:
            if not isinstance(p, CastLinear):
                p.small = on

    def is_small(self, x: torch.Tensor) -> bool:
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x).float() for p in self.parts], dim=1)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self(x))

    def times(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x).mul_(other)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self(x).add_(other)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        y = self(x)
        n = self.out_features // 2
        return F.silu(y[:, :n]).mul_(y[:, n:])


def _kind_of(p) -> str:
    return p.kind if isinstance(p, QuantWeight) else str(p.dtype)


def linear_of(parts: list, bias: torch.Tensor | None = None, swiglu: bool = False) -> "QuantLinear | GroupLinear":
    """One linear over the stacked rows of `parts` (QuantWeights and/or float tensors): a QuantLinear
    when they are all quantized in one kind, else a `GroupLinear` of one linear per run of one kind
    (QuantLinear; float32 `Linear` for float32 tensors; `CastLinear` for bfloat16 ones)."""
    if all(isinstance(p, QuantWeight) for p in parts) and len({p.kind for p in parts}) == 1:
        return QuantLinear(QuantWeight.cat(parts), bias, len(parts) if swiglu else 1)
    runs: list[list] = []
    for p in parts:
        if runs and _kind_of(runs[-1][-1]) == _kind_of(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    out, r0 = [], 0
    for run in runs:
        rows = sum(_rows(p) for p in run)
        b = None if bias is None else bias[r0:r0 + rows]
        r0 += rows
        if isinstance(run[0], QuantWeight):
            out.append(QuantLinear(QuantWeight.cat(run), b))
        elif run[0].dtype == torch.float32:
            out.append(Linear(run, b))
        else:
            out.append(CastLinear(run, b))
    return GroupLinear(out)


class CastEmbedding:
    """Token rows of a bfloat16 table, as float32."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).float()


def cat_biases(tensors: dict, names: list[str], sizes: list[int]) -> torch.Tensor | None:
    """The biases of the named linears concatenated (zeros for those without), or None."""
    found = [tensors.get(n) for n in names]
    if all(b is None for b in found):
        return None
    return torch.cat([b.float() if b is not None else torch.zeros(s) for b, s in zip(found, sizes)])


def weight_bytes(native) -> int:
    """Bytes the native forward's weights hold: quantized blocks, norms, biases and any float linears
    (a oneDNN-packed copy counted as its parts' bytes); a tensor shared by two holders counts once."""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, (QuantWeight, TiledWeight)):
            for a in t.fields():
                add(a)
        elif isinstance(t, torch.Tensor) and t.layout == torch.strided:
            seen[t.data_ptr()] = t.numel() * t.element_size()

    def add_linear(lin) -> None:
        if isinstance(lin, GroupLinear):
            for p in lin.parts:
                add_linear(p)
        elif isinstance(lin, (CastLinear, QuantLinear)):
            add(lin.weight)
            add(lin.bias)
        else:
            for p in lin.parts or ():  # the plain weights, where they are kept beside the packed ones
                add(p)
            if lin.packed is not None:
                elt = torch.empty((), dtype=lin.packed.dtype).element_size()
                seen[id(lin.packed)] = lin.out_features * lin.in_features * elt
            add(lin.weight)
            add(lin.bias)

    add(getattr(native.embed, "weight", native.embed))
    add(native.norm)
    add_linear(native.head)
    for layer in native.layers:
        for norm in layer.norms():
            add(norm)
        for lin in {id(lin): lin for lin in layer.linears()}.values():
            add_linear(lin)
    return sum(seen.values())


def layer_weights(tensors: dict, i: int, act: str = "silu") -> dict:
    """`Layer`'s attributes for block `i` of a GGUF file's tensors (llama.cpp names; engine/model/native/layer.py),
    the MLP's gate activated by `act`. Takes the block's tensors out of `tensors`: what a layer re-lays (tiles,
    stacks) is freed as soon as its layer is built, so a load holds one copy of the weights plus one layer's, not
    two copies. Gemma's norms are stored with their 1 added (llama.cpp's converter adds it), as `Layer` keeps them.
    The heap the previous layer freed goes back to the OS first: glibc keeps it otherwise, and the load's peak was
    the weights twice over (a Gemma 3 1B Q4_K_M file: peak 1,294 MB, 1,010 MB once loaded)."""
    malloc_trim()
    prefix = f"blk.{i}."
    t = {k.removeprefix(prefix): tensors.pop(k) for k in [k for k in tensors if k.startswith(prefix)]}
    qkv = [t[f"attn_{p}.weight"] for p in "qkv"]
    out = {"ln1": t["attn_norm.weight"], "ln2": t["ffn_norm.weight"],
           "qkv": linear_of(qkv, cat_biases(t, [f"attn_{p}.bias" for p in "qkv"], [_rows(w) for w in qkv])),
           "o": linear_of([t["attn_output.weight"]], t.get("attn_output.bias"))}
    for name, key in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"), ("post_attn", "post_attention_norm"),
                      ("post_ffn", "post_ffw_norm")):
        if f"{key}.weight" in t:
            out[name] = t[f"{key}.weight"].float()
    if "ffn_gate_inp.weight" in t:  # a mixture-of-experts block: its router and experts, for moe.MoeBlock
        return out | {"moe": {k: v for k, v in t.items() if k.startswith("ffn_") and k != "ffn_norm.weight"}}
    gate_up = linear_of([t["ffn_gate.weight"], t["ffn_up.weight"]], swiglu=True)  # both have `swiglu`
    down = linear_of([t["ffn_down.weight"]], t.get("ffn_down.bias"))
    return out | {"mlp": DenseMLP(gate_up, gate_up, down, act=act, gate_up=gate_up)}


def model_weights(tensors: dict) -> tuple:
    """(embedding, final norm weight, LM head) of a GGUF file's tensors; a tied head (no `output.weight`)
    reads the embedding's own blocks. Takes them out of `tensors`, as `layer_weights` does."""
    embed = tensors.pop("token_embd.weight")
    head = tensors.pop("output.weight", embed)
    if isinstance(head, QuantWeight):
        lm_head = QuantLinear(head)
    else:
        lm_head = Linear([head], gemv=True) if head.dtype == torch.float32 else CastLinear([head])
    if isinstance(embed, QuantWeight):  # a tied table reads the head's weight (it may be tiled): one copy
        table = QuantEmbedding(lm_head.weight if head is embed else embed)
    else:
        table = embed if embed.dtype == torch.float32 else CastEmbedding(embed)
    return table, tensors.pop("output_norm.weight"), lm_head


def _rows(w) -> int:
    return w.shape[0]
