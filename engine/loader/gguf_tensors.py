"""A GGUF file's tensors read as they are: quantized linears stay quantized (one copy, no float32 weights).

`read_tensor_index(path)` reads the header and the tensor table (names, ggml types, shapes, offsets)
without parsing the token list, so it is fast even for a 150k-token vocabulary. `load_quantized(path)`
returns every tensor of a Llama-family file (`QUANT_ARCHS`) by its llama.cpp name: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tensors as `QuantWeight` (repacked once from the file's blocks into the arrays
the kernels read: below, and engine/model/kernels/csrc/quant_blocks.h; llama-quantize stores most of a Gemma 3
Q4_K_M file's matrices in Q5_0, its fallback where a row is not whole 256-weight super-blocks), F32/F16/BF16
as they are (F32
norms, F16/BF16 in bfloat16), and any other type dequantized by gguf-py to bfloat16 per tensor (logged
once per file). A mixture-of-experts projection (`blk.N.ffn_{gate,up,down}_exps`, 3-D [E, N, K]) is a list
of E such weights, each repacked from its expert's contiguous slice of the file's bytes.
`load_gguf_model(folder)` builds the transformers model of a `cellserve.json` folder whose weights are
in a GGUF file (`weights: "gguf"`) as a skeleton with zero-byte placeholder weights, so the native
forward is the one holder of the weights.

Block layouts in the file (ggml's public definition; d, m, dmin fp16):
  Q8_0  32 weights: d, int8 q[32]                          w = d * q                             34 B
  Q4_0  32 weights: d, uint8 qs[16] (q_j | q_{j+16} << 4)  w = d * (q - 8)                       18 B
  Q4_1  32 weights: d, m, qs[16] (same nibbles)            w = d * q + m                         20 B
  Q5_0  32 weights: d, uint32 qh, qs[16] (Q4_0's nibbles; bit j of qh: bit 4 of element j)
                                                            w = d * (q - 16)                      22 B
  Q5_1  32 weights: d, m, uint32 qh, qs[16] (as Q5_0)       w = d * q + m                         24 B
  Q4_K  256 weights, 8 sub-blocks of 32: d, dmin, scales[12] (8 6-bit scales sc_j and 8 6-bit mins
        m_j: j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
        m = (s[j+4] >> 4) | (s[j] >> 6) << 4), qs[128]: 32-byte group g holds sub-block 2g in its low
        nibbles and 2g+1 in its high nibbles                w = d * sc_j * q - dmin * m_j         144 B
  Q5_K  as Q4_K plus qh[32] before qs: bit j of qh[i] is the 5th bit of element i of sub-block j
                                                            w = d * sc_j * q - dmin * m_j         176 B
  Q6_K  256 weights, 16 groups of 16: ql[128], qh[64], int8 scales[16], d; for half h (128 weights,
        ql_h = ql[64h:], qh_h = qh[32h:]) and l < 32: q[l] = ql_h[l] & 15 | (qh_h[l] & 3) << 4,
        q[l+32] = ql_h[l+32] & 15 | (qh_h[l] >> 2 & 3) << 4, q[l+64] = ql_h[l] >> 4 | (qh_h[l] >> 4 & 3) << 4,
        q[l+96] = ql_h[l+32] >> 4 | (qh_h[l] >> 6) << 4      w = d * sc_{e/16} * (q - 32)          210 B

Repacked (`QuantWeight`, one row of blocks per output row; the kernels read these):
  qs  q8_0: uint8 [N, K], the int8 value + 128; every other kind: uint8 [N, K/2], per 32 weights
      16 bytes, byte j = element j (low nibble) | element j + 16 (high nibble): Q4_0's own layout
  d   fp16: [N, K/32] (32-weight kinds), [N, K/256] (K-quants: the super-block's d)
  m   fp16: q4_1/q5_1 [N, K/32] the block minimum; q4_k/q5_k [N, K/256] dmin
  sc  q4_k/q5_k: uint8 [N, K/32] the 6-bit scales; q6_k: int8 [N, K/16]
  mn  q4_k/q5_k: uint8 [N, K/32] the 6-bit mins
  qh  the high bits, per 64 weights (two 32-blocks, "a pair") in the kernels' order of the pair
      (position i < 32: block i / 16, element i % 16; i >= 32: block (i - 32) / 16, element 16 + i % 16):
      q5_0/q5_1/q5_k uint8 [N, K/8], 8 bytes a pair: bit i (little-endian uint64) = bit 4 of position i
      (a 32-weight K of an odd block count: its last pair's 8 bytes, the missing block's bits zero);
      q6_k uint8 [N, K/4], 16 bytes a pair: bit 4 plane then bit 5 plane.
  Bytes per weight: q8_0 1.0625, q4_0 0.5625, q4_1 0.625, q5_0 0.6875, q5_1 0.75 (the file's), q4_k 0.578
  (file 0.5625), q5_k 0.703 (0.6875), q6_k 0.8203 (the file's): the K-quants' packed 6-bit scales are kept a
  byte each. The native forward keeps the 32-weight kinds' linears in 16-row tiles of these same bytes instead
  (engine/model/native/quant_tiles.py, made from this layout once at load).
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.api.errors import ModelSourceError
from engine.loader.gguf import (  # noqa: F401 (re-exported)
    BF16,
    F16,
    F32,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QUANT_ARCHS,
    TensorInfo,
    quantized_share,
    read_tensor_index,
)

log = logging.getLogger("cellserve.gguf")

# the ggml types kept quantized, as the kernels call them
KINDS = {Q8_0: "q8_0", Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q5_1: "q5_1", Q4_K: "q4_k", Q5_K: "q5_k",
         Q6_K: "q6_k"}
# the kernels' `kind` argument (csrc/quant_blocks.h's Kind)
KIND_IDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q4_k": 3, "q5_k": 4, "q6_k": 5, "q5_0": 6, "q5_1": 7}
ZERO_POINTS = {"q8_0": 128, "q4_0": 8, "q4_1": 0, "q5_0": 16, "q5_1": 0, "q4_k": 0, "q5_k": 0, "q6_k": 32}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
BLOCK_WEIGHTS = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256}


def kind_of(ggml_type: int) -> str | None:
    """The kind a tensor of `ggml_type` is kept in (None: not kept quantized)."""
    return KINDS.get(ggml_type)
FIELDS = ("qs", "d", "m", "sc", "mn", "qh")  # the order the kernels take them in
_NONE = torch.empty(0, dtype=torch.uint8)  # an absent field, to the kernels


@dataclass
class QuantWeight:
    """A [N, K] weight in its blocks, repacked (module docstring: `qs`, `d`, `m`, `sc`, `mn`, `qh`;
    the fields a kind does not use are None). w = scale * (q - z) + min per block or group."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None
    qh: torch.Tensor | None = None

    def fields(self) -> list[torch.Tensor | None]:
        return [getattr(self, f) for f in FIELDS]

    def tensors(self) -> list[torch.Tensor]:
        """The kernels' argument: every field in `FIELDS` order, an empty tensor for an absent one."""
        return [_NONE if t is None else t for t in self.fields()]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * (1 if self.kind == "q8_0" else 2)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields() if t is not None)

    def _map(self, fn) -> "QuantWeight":
        return QuantWeight(self.kind, *(None if t is None else fn(t) for t in self.fields()))

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        return self._map(lambda t: t.index_select(0, index).contiguous())

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """The weights' rows stacked (one kind): Q|K|V or gate|up as one weight."""
        kind = parts[0].kind
        assert all(p.kind == kind for p in parts), "one kind per concatenated weight"
        if len(parts) == 1:
            return parts[0]
        cols = [[p.fields()[i] for p in parts] for i in range(len(FIELDS))]
        return QuantWeight(kind, *(None if c[0] is None else torch.cat(c) for c in cols))

    def dequantize(self, r0: int = 0, r1: int | None = None, *, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 rows [r0, r1) (or the rows `index`) in torch ops: the reference, the eager path and
        embedding lookups. Only those rows are unpacked; equal to gguf-py's dequantize bit for bit."""
        if index is not None:
            w = self.rows(index)
        else:
            r1 = self.shape[0] if r1 is None else r1
            w = self._map(lambda t: t[r0:r1])
        n, k = w.shape
        z = ZERO_POINTS[self.kind]
        if self.kind == "q8_0":
            q = w.qs.reshape(n, k // 32, 32)
        else:
            b = w.qs.reshape(n, k // 32, 16)
            q = torch.cat([b & 0x0F, b >> 4], dim=-1)  # [n, K/32, 32] in element order
        if w.qh is not None:  # the high bit planes, kernel order -> element order (whole pairs: see _bit_planes)
            pairs = -(-k // 64)
            planes = w.qh.reshape(n, pairs, -1, 8)
            shifts = torch.arange(8, dtype=torch.uint8)
            for i in range(planes.shape[2]):
                bits = ((planes[:, :, i, :, None] >> shifts) & 1).reshape(n, pairs, 2, 2, 16)
                q = q | (bits.transpose(2, 3).reshape(n, 2 * pairs, 32)[:, :k // 32] << (4 + i))
        if BLOCK_WEIGHTS[self.kind] == 32:
            out = (q.float() - z) * w.d.float()[..., None]
            if w.m is not None:
                out += w.m.float()[..., None]
            return out.reshape(n, k)
        if self.kind == "q6_k":
            scale = w.d.float().repeat_interleave(16, dim=1) * w.sc.float()  # [n, K/16]
            return (scale[..., None] * (q.reshape(n, k // 16, 16).float() - z)).reshape(n, k)
        scale = w.d.float().repeat_interleave(8, dim=1) * w.sc.float()  # [n, K/32]
        dmin = w.m.float().repeat_interleave(8, dim=1) * w.mn.float()
        return (scale[..., None] * q.float() - dmin[..., None]).reshape(n, k)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, k] values < 16 -> [n, k/2] bytes, per 32: byte j = element j | element j + 16 << 4."""
    b = q.reshape(q.shape[0], -1, 32)
    return ((b[..., :16] & 0x0F) | ((b[..., 16:] & 0x0F) << 4)).astype(np.uint8).reshape(q.shape[0], -1)


def _bit_planes(q: np.ndarray, bits: tuple[int, ...]) -> np.ndarray:
    """The given bits of [n, k] values, per 64 weights in the kernels' order: 8 bytes a plane (a K of an odd
    block count padded with a zero block to whole pairs, as the kernels read it)."""
    if q.shape[1] % 64:
        q = np.concatenate([q, np.zeros((q.shape[0], 32), dtype=q.dtype)], axis=1)
    n, k = q.shape
    order = q.reshape(n, k // 64, 2, 2, 16).transpose(0, 1, 3, 2, 4).reshape(n, k // 64, 64)
    planes = [np.packbits((order >> b) & 1, axis=-1, bitorder="little") for b in bits]
    return np.concatenate(planes, axis=-1).reshape(n, -1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 6-bit scales and 8 6-bit mins (module docstring)."""
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, mn


def _half(blocks: np.ndarray, at: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16).reshape(n, -1))


def pack_blocks(raw: np.ndarray, ggml_type: int, n: int, k: int) -> QuantWeight:
    """The file's interleaved blocks of a [n, k] tensor -> a `QuantWeight` (one copy, made here)."""
    kind = KINDS[ggml_type]
    bsize = BLOCK_BYTES[kind]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // BLOCK_WEIGHTS[kind], bsize)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    if kind == "q8_0":
        return QuantWeight(kind, t(blocks[..., 2:].reshape(n, k) ^ np.uint8(0x80)), _half(blocks, 0, n))
    if kind in ("q4_0", "q4_1"):
        m = _half(blocks, 2, n) if kind == "q4_1" else None
        return QuantWeight(kind, t(blocks[..., bsize - 16:].reshape(n, k // 2)), _half(blocks, 0, n), m)
    if kind in ("q5_0", "q5_1"):
        return _q5(blocks, kind, n, k)
    nsb = k // 256
    if kind == "q6_k":
        ql = blocks[..., 0:128].reshape(n, nsb, 2, 2, 32)  # [half, byte group of 32, l]
        qh = blocks[..., 128:192].reshape(n, nsb, 2, 1, 32)
        lo = np.stack([ql & 15, ql >> 4], axis=2)  # [n, nsb, nibble, half, group, l]: q[64 nib + 32 group + l]
        lo = lo.transpose(0, 1, 3, 2, 4, 5)  # [n, nsb, half, nibble, group, 32]
        hi = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3  # [n, nsb, half, 4, 32]
        q = (lo.reshape(n, nsb, 2, 4, 32) | (hi << 4)).reshape(n, k)
        sc = t(blocks[..., 192:208].view(np.int8).reshape(n, k // 16))
        return QuantWeight(kind, t(_nibbles(q)), _half(blocks, 208, n), sc=sc, qh=t(_bit_planes(q, (4, 5))))
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., bsize - 128:].reshape(n, nsb, 4, 1, 32)
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 15  # [n, nsb, group, 2, 32]
    qh = None
    if kind == "q5_k":
        hb = blocks[..., 16:48].reshape(n, nsb, 1, 32)
        high = (hb >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [n, nsb, sub-block, 32]
        q = q.reshape(n, nsb, 8, 32) | (high << 4)
        qh = t(_bit_planes(q.reshape(n, k), (4,)))
    q = q.reshape(n, k)
    return QuantWeight(kind, t(_nibbles(q)), _half(blocks, 0, n), _half(blocks, 2, n),
                       t(sc.reshape(n, k // 32)), t(mn.reshape(n, k // 32)), qh)


def _q5(blocks: np.ndarray, kind: str, n: int, k: int) -> QuantWeight:
    """Q5_0 / Q5_1 blocks [n, k/32, 22 or 24]: Q4_0's nibbles as they are, d (and q5_1's m), and bit 4 of each
    weight as a plane per pair in the kernels' order (q5_k's), so the weight keeps the file's bytes."""
    at = 4 if kind == "q5_1" else 2  # the uint32 qh after d (and m)
    high = np.ascontiguousarray(blocks[..., at:at + 4]).view("<u4")  # [n, k/32, 1]: bit j = bit 4 of element j
    bit4 = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8).reshape(n, k)  # element order
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    m = _half(blocks, 2, n) if kind == "q5_1" else None
    return QuantWeight(kind, t(blocks[..., at + 4:].reshape(n, k // 2)), _half(blocks, 0, n), m,
                       qh=t(_bit_planes(bit4 << 4, (4,))))


def _unpermute_index(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's Q/K permutation (convert_hf_to_gguf's `permute`, as transformers'
    `_reverse_permute_weights` undoes it): HF row r is file row index[r]."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(-1)


def load_quantized(path: str | Path) -> tuple[dict, dict[str, "QuantWeight | torch.Tensor"]]:
    """(metadata, tensors by llama.cpp name) of a Llama-family GGUF file; see the module docstring."""
    import gguf
    from gguf import quants

    meta, index = read_tensor_index(path)
    arch = meta["general.architecture"]
    if arch not in QUANT_ARCHS:
        raise ModelSourceError(f"{Path(path).name}: architecture {arch!r} cannot be served quantized "
                               f"(only {', '.join(QUANT_ARCHS)})")
    n_head = int(meta[f"{arch}.attention.head_count"])
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    out: dict = {}
    as_bf16: set[str] = set()
    # read tensor by tensor, not through a memory map: a map's pages count in the process's resident memory
    # until it is unmapped, so the whole file stayed resident beside its repacked copy (the load's peak)
    with open(path, "rb") as data:
        for name, t in index.items():
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            numel = int(np.prod(t.shape))
            data.seek(t.offset)
            raw = np.frombuffer(data.read(numel // block * type_size), dtype=np.uint8)
            kind = kind_of(t.ggml_type)
            if len(t.shape) == 3:  # a MoE projection's experts [E, N, K]: one weight per expert's slice
                w = _experts(raw, t, qtype, kind)
                as_bf16 |= set() if kind or t.ggml_type == F32 else {qtype.name}
            elif kind and len(t.shape) == 2 and t.shape[1] % BLOCK_WEIGHTS[kind] == 0:
                w = pack_blocks(raw, t.ggml_type, *t.shape)
            elif t.ggml_type == F32 or len(t.shape) == 1:  # norms, biases: float32
                arr = raw.view(np.float32) if t.ggml_type == F32 else quants.dequantize(raw, qtype)
                w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(t.shape))
            else:  # any other matrix: bfloat16, one tensor at a time
                w = _bf16(raw, t.ggml_type, qtype).reshape(t.shape)
                as_bf16.add(qtype.name)
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                perm = _unpermute_index(t.shape[0], n_head if ".attn_q." in name else n_kv)
                w = w.rows(perm) if isinstance(w, QuantWeight) else w.index_select(0, perm)
            out[name] = w
    if as_bf16:
        log.warning("%s: tensors of type %s are not read by the quantized kernels; served as bfloat16",
                    Path(path).name, ", ".join(sorted(as_bf16)))
    return meta, out


def _experts(raw: np.ndarray, t: TensorInfo, qtype, kind: str | None) -> list:
    """A 3-D expert tensor [E, N, K] as E weights, each from its own contiguous slice of the file's bytes: a
    `QuantWeight` in a kind the kernels read, else a float tensor (float32 for F32, bfloat16 otherwise)."""
    n_exp, n, k = t.shape
    per = raw.size // n_exp
    if kind and k % BLOCK_WEIGHTS[kind] == 0:
        return [pack_blocks(raw[e * per:(e + 1) * per], t.ggml_type, n, k) for e in range(n_exp)]
    if t.ggml_type == F32:
        return list(torch.from_numpy(raw.view(np.float32).copy().reshape(t.shape)).unbind(0))
    return [_bf16(raw[e * per:(e + 1) * per], t.ggml_type, qtype).reshape(n, k) for e in range(n_exp)]


def _bf16(raw: np.ndarray, ggml_type: int, qtype) -> torch.Tensor:
    """A tensor's bytes as a flat bfloat16 tensor (BF16 as it is; F16 and other types via float32)."""
    from gguf import quants

    if ggml_type == BF16:
        return torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
    arr = raw.view(np.float16) if ggml_type == F16 else quants.dequantize(raw, qtype)
    return torch.from_numpy(np.asarray(arr, dtype=np.float32).reshape(-1)).to(torch.bfloat16)


def is_gguf_folder(folder: str | Path) -> bool:
    """Whether `folder` is a converted entry whose weights stay in a GGUF file (`weights: "gguf"`)."""
    info = Path(folder) / "cellserve.json"
    try:
        return info.is_file() and json.loads(info.read_text()).get("weights") == "gguf"
    except (OSError, ValueError):
        return False


def placeholder_model(config):
    """The transformers model of `config` with every parameter a zero-byte placeholder (a broadcast scalar:
    the model reports its device and dtype, float32, holds no weights and must not be run): the
    architecture for `NativeLlama`, which runs quantized tensors given beside it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            module._parameters[pname] = torch.nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape),
                                                           requires_grad=False)
        for bname, b in list(module.named_buffers(recurse=False)):
            if b.device.type == "meta":
                module._buffers[bname] = torch.empty(b.shape, dtype=b.dtype)
    base = getattr(model, "model", None)
    if hasattr(base, "rotary_emb"):
        base.rotary_emb = type(base.rotary_emb)(config=config)  # its inv_freq, computed on the CPU
    return model.eval()


def load_gguf_model(folder: str | Path):
    """(model skeleton, tokenizer, tensors) of a `weights: "gguf"` folder: `placeholder_model` of the
    folder's config, and the GGUF's tensors as `load_quantized` gives them, for `NativeLlama` to take."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(folder)
    info = json.loads((folder / "cellserve.json").read_text())
    src = Path(info["gguf"])
    if not src.is_file():
        raise ModelSourceError(f"{folder} serves the weights of {src}, which is gone; convert the file again")
    model = placeholder_model(AutoConfig.from_pretrained(folder, local_files_only=True))
    _, tensors = load_quantized(src)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer, tensors
