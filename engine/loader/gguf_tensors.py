"""A GGUF file's tensors read as they are: quantized linears stay quantized (one copy, no float32 weights).

`read_tensor_index(path)` reads the header and the tensor table (names, ggml types, shapes, offsets)
without parsing the token list, so it is fast even for a 150k-token vocabulary. `load_quantized(path)`
returns every tensor of a Llama-family file (`QUANT_ARCHS`) by its llama.cpp name: Q8_0, Q4_0 and
Q4_1 tensors as `QuantWeight` (repacked once from the file's interleaved blocks into the three arrays
the kernels read: engine/model/kernels/csrc/quant_linear.cpp says the layout), every other type
(F32, F16, BF16, K-quants...) dequantized to float32 with gguf-py (logged once per type).
`load_gguf_model(folder)` builds the transformers model of a `cellserve.json` folder whose weights are
in a GGUF file (`weights: "gguf"`) as a skeleton with zero-byte placeholder weights, so the native
forward is the one holder of the weights.

Block layouts (ggml's public definition, 32 weights a block, d and m fp16):
  Q8_0  d, int8 q[32]                          w = d * q                          34 bytes
  Q4_0  d, uint8 qs[16] (q_j | q_{j+16} << 4)  w = d * (q - 8)                    18 bytes
  Q4_1  d, m, uint8 qs[16] (same nibbles)      w = d * q + m                      20 bytes
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.api.errors import ModelSourceError
from engine.loader.gguf import GGUF_MAGIC, QUANT_ARCHS, _Header

log = logging.getLogger("cellserve.gguf")

# ggml type ids: those kept quantized, and their (block bytes, kind)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
KINDS = {Q8_0: "q8_0", Q4_0: "q4_0", Q4_1: "q4_1"}
KIND_IDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # the kernels' `kind` argument
ZERO_POINTS = {"q8_0": 128, "q4_0": 8, "q4_1": 0}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order (outermost first): a linear is [N, K]
    offset: int  # absolute byte offset in the file


def read_tensor_index(path: str | Path) -> tuple[dict, dict[str, TensorInfo]]:
    """(scalar metadata, tensors by name) of a GGUF file, from its header and tensor table only."""
    path = Path(path)
    with open(path, "rb") as f:
        h = _Header(f, path)
        if f.read(4) != GGUF_MAGIC:
            raise ModelSourceError(f"{path} is not a GGUF file")
        version = h.unpack("<I")
        if version not in (2, 3):
            raise ModelSourceError(f"{path} is GGUF version {version}; only versions 2 and 3 can be read")
        n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
        meta: dict = {}
        for _ in range(n_kv):
            key = h.string()
            value = h.value(h.unpack("<I"))
            if value is not None:
                meta[key] = value
        raw = []
        for _ in range(n_tensors):
            name = h.string()
            dims = [h.unpack("<Q") for _ in range(h.unpack("<I"))]
            raw.append((name, h.unpack("<I"), tuple(reversed(dims)), h.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-f.tell() // align) * align
    return meta, {n: TensorInfo(n, t, s, start + o) for n, t, s, o in raw}


@dataclass
class QuantWeight:
    """A [N, K] weight in 32-weight blocks: `qs` uint8 (q8_0: value + 128, [N, K]; q4: ggml's nibble
    bytes, [N, K/2]), `d` fp16 [N, K/32], `m` fp16 [N, K/32] for q4_1. w = d * (q - z) + m."""

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * 32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def rows(self, index: torch.Tensor) -> "QuantWeight":
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()
        return QuantWeight(self.kind, pick(self.qs), pick(self.d), pick(self.m))

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """The weights' rows stacked (one kind): Q|K|V or gate|up as one weight."""
        kind = parts[0].kind
        assert all(p.kind == kind for p in parts), "one kind per concatenated weight"
        if len(parts) == 1:
            return parts[0]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        return QuantWeight(kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def dequantize(self, r0: int = 0, r1: int | None = None, *, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 rows [r0, r1) (or the rows `index`) in torch ops: the reference, the eager path and
        embedding lookups. Only those rows are unpacked."""
        if index is not None:
            w = self.rows(index)
        else:
            r1 = self.shape[0] if r1 is None else r1
            w = QuantWeight(self.kind, self.qs[r0:r1], self.d[r0:r1], None if self.m is None else self.m[r0:r1])
        n, k = w.shape
        if self.kind == "q8_0":
            q = w.qs.reshape(n, k // 32, 32)
        else:
            b = w.qs.reshape(n, k // 32, 16)
            q = torch.cat([b & 0x0F, b >> 4], dim=-1)
        out = (q.float() - ZERO_POINTS[self.kind]) * w.d.float()[..., None]
        if w.m is not None:
            out += w.m.float()[..., None]
        return out.reshape(n, k)


def pack_blocks(raw: np.ndarray, ggml_type: int, n: int, k: int) -> QuantWeight:
    """The file's interleaved blocks of a [n, k] tensor -> a `QuantWeight` (one copy, made here)."""
    kind = KINDS[ggml_type]
    bsize = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[kind]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // 32, bsize)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // 32))
    m = None
    if kind == "q8_0":
        qs = torch.from_numpy(blocks[..., 2:].reshape(n, k) ^ np.uint8(0x80))  # int8 -> int8 + 128 as uint8
    else:
        if kind == "q4_1":
            m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, k // 32))
        qs = torch.from_numpy(np.ascontiguousarray(blocks[..., bsize - 16:]).reshape(n, k // 2))
    return QuantWeight(kind, qs.contiguous(), d.contiguous(), m)


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
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict = {}
    dequantized: set[str] = set()
    try:
        for name, t in index.items():
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            numel = int(np.prod(t.shape))
            raw = data[t.offset: t.offset + numel // block * type_size]
            if t.ggml_type in KINDS and len(t.shape) == 2:
                w = pack_blocks(raw, t.ggml_type, *t.shape)
            else:
                if t.ggml_type not in (F32, F16, BF16):
                    dequantized.add(qtype.name)
                arr = quants.dequantize(raw, qtype) if t.ggml_type != F32 else raw.view(np.float32)
                w = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(t.shape))
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                perm = _unpermute_index(t.shape[0], n_head if ".attn_q." in name else n_kv)
                w = w.rows(perm) if isinstance(w, QuantWeight) else w.index_select(0, perm)
            out[name] = w
    finally:
        del data
    if dequantized:
        log.warning("%s: tensors of type %s are not served quantized yet; dequantized to float32",
                    Path(path).name, ", ".join(sorted(dequantized)))
    return meta, out


def is_gguf_folder(folder: str | Path) -> bool:
    """Whether `folder` is a converted entry whose weights stay in a GGUF file (`weights: "gguf"`)."""
    info = Path(folder) / "cellserve.json"
    try:
        return info.is_file() and json.loads(info.read_text()).get("weights") == "gguf"
    except (OSError, ValueError):
        return False


def load_gguf_model(folder: str | Path):
    """(model skeleton, tokenizer, tensors) of a `weights: "gguf"` folder: the transformers model built
    from the folder's config with every parameter a zero-byte placeholder (a broadcast scalar: the
    model reports its device and dtype, holds no weights and must not be run), and the GGUF's tensors
    as `load_quantized` gives them, for `NativeLlama` to take."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    info = json.loads((folder / "cellserve.json").read_text())
    src = Path(info["gguf"])
    if not src.is_file():
        raise ModelSourceError(f"{folder} serves the weights of {src}, which is gone; convert the file again")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
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
    base = model.model
    base.rotary_emb = type(base.rotary_emb)(config=config)  # its inv_freq, computed on the CPU
    _, tensors = load_quantized(src)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer, tensors
