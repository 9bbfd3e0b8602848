"""GGUF files -> Hugging Face folders: a torch-free header reader and a one-time dequantizing conversion.

`read_gguf_metadata(path)` reads only the key/value header (no tensors, no torch): enough to reject a file
that is not GGUF, is truncated inside its header, or holds an architecture transformers cannot load,
before anything slow happens. `convert_gguf(src, dest, dtype)` loads the file through transformers
(`from_pretrained(folder, gguf_file=...)`, which needs the `gguf` and `accelerate` packages), dequantizes
every weight to `dtype` and writes a plain folder (config, generation config, `model.safetensors`,
tokenizer files with the file's chat template and special tokens: the tokenizer the file itself describes,
engine/loader/gguf_tokenizer.py, whatever the architecture) that `ModelRunner.from_pretrained`
loads like any other. `dest` appears whole or not at all: it is written beside itself and renamed.
"""

import contextlib
import functools
import json
import os
import shutil
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from engine.api.errors import ModelSourceError

GGUF_MAGIC = b"GGUF"
# GGUF value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 1 << 24  # no key or scalar string in a sane header is longer; beyond it the file is corrupt
# llama.cpp's architecture names that transformers knows under another spelling.
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                 "minimax-m2": "minimax_m2", "t5encoder": "t5"}
_PATCH_LOCK = threading.Lock()
# llama.cpp architectures whose files can be served quantized (`dtype="quantized"`): the native forward's
# (engine/loader/gguf_tensors.py reads their tensors as they are); others are dequantized to float32.
QUANT_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3moe")
# ggml tensor type ids; QUANT_TYPES: those the quantized kernels read as they are (gguf_tensors.KINDS)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
QUANT_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)


class _Header:
    def __init__(self, f, path: Path):
        self.f, self.path = f, path

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ModelSourceError(f"{self.path} is truncated: its GGUF header ends early (the file is "
                                   f"incomplete or corrupt); download or copy it again")
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self, keep: bool = True) -> str | None:
        n = self.unpack("<Q")
        if n > _MAX_STRING:
            raise ModelSourceError(f"{self.path}: a GGUF header string claims {n} bytes; the file is corrupt")
        if not keep:
            self.f.seek(n, os.SEEK_CUR)
            return None
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int, keep: bool = True, arrays: bool = False):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(keep)
        if vtype == _ARRAY:  # token lists and the like: skipped unless `arrays` (then a list)
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if keep and arrays:
                return self.array(etype, count)
            if etype in _SCALARS:
                self.f.seek(struct.calcsize(_SCALARS[etype]) * count, os.SEEK_CUR)
            else:
                for _ in range(count):
                    self.value(etype, keep=False)
            return None
        raise ModelSourceError(f"{self.path}: unknown GGUF value type {vtype}; the file is corrupt or from a "
                               f"newer GGUF version than this reader knows")

    def array(self, etype: int, count: int) -> list:
        if etype in _SCALARS:
            import numpy as np

            fmt = _SCALARS[etype]
            return np.frombuffer(self.read(struct.calcsize(fmt) * count), dtype=np.dtype(fmt)).tolist()
        return [self.value(etype, arrays=True) for _ in range(count)]


def read_gguf_metadata(path: str | Path, arrays: bool = False) -> dict:
    """The scalar and string key/values of a GGUF header (arrays are skipped unless `arrays`: then lists, e.g.
    the token list), plus `gguf.version` and `gguf.tensor_count`. Raises ModelSourceError if the file is not
    GGUF or its header is cut short."""
    path = Path(path)
    with open(path, "rb") as f:
        h = _Header(f, path)
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelSourceError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a "
                                   f".gguf model file, a Hugging Face model folder or a known model name")
        version = h.unpack("<I")
        if version not in (2, 3):
            raise ModelSourceError(f"{path} is GGUF version {version}; only versions 2 and 3 can be read")
        meta: dict = {"gguf.version": version, "gguf.tensor_count": h.unpack("<Q")}
        for _ in range(h.unpack("<Q")):
            key = h.string()
            value = h.value(h.unpack("<I"), arrays=arrays)
            if value is not None:
                meta[key] = value
    if "general.architecture" not in meta:
        raise ModelSourceError(f"{path} has no general.architecture in its GGUF header; it is not a model file")
    return meta


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


def quantized_share(path: str | Path) -> float:
    """The fraction of a GGUF file's matrix bytes (norms and biases aside) in the types the kernels read
    quantized (0 for an F32/F16/BF16 file): `dtype="auto"` serves a file quantized when any is."""
    import math

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, index = read_tensor_index(path)
    total = kept = 0
    for t in index.values():
        if len(t.shape) < 2 or t.ggml_type not in GGMLQuantizationType._value2member_map_:  # 3-D: experts
            continue
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        nbytes = math.prod(t.shape) // block * size
        total += nbytes
        kept += nbytes if t.ggml_type in QUANT_TYPES else 0
    return kept / total if total else 0.0


def supported_architectures() -> set[str]:
    """The GGUF architectures the installed transformers can load (imports transformers)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    archs = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    with contextlib.suppress(ImportError):
        from transformers.integrations.gguf.utils import GGUF_ARCHS

        archs |= set(GGUF_ARCHS)
    return archs


def check_architecture(path: Path, meta: dict) -> str:
    arch = meta["general.architecture"]
    supported = supported_architectures()
    if arch not in supported and _ARCH_ALIASES.get(arch) not in supported:
        import transformers

        raise ModelSourceError(
            f"{path.name}: transformers {transformers.__version__} cannot load GGUF files of architecture "
            f"{arch!r} (it loads: {', '.join(sorted(supported))}); use a Hugging Face folder of this model instead")
    return arch


@contextlib.contextmanager
def _parse_once():
    """While converting, each GGUF file's header is parsed once, not once per transformers call.

    transformers builds a fresh `gguf.GGUFReader` for the tokenizer, the config and the weights, and a
    tensor-name map per module; each parse of a 49k-token vocabulary costs ~10 s on a small CPU. Both
    are pure functions of their arguments, so they are memoised for the duration of the block."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    with _PATCH_LOCK:
        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def convert_gguf(src: Path, dest: Path, dtype: str, *, progress: bool = True, record: dict | None = None) -> dict:
    """Dequantize `src` to `dtype` ("float32", "bfloat16", "float16") into the folder `dest`, with
    `cellserve.json` (what was done, plus `record`) written last. Returns that record. Raises
    ModelSourceError with the reason when the file cannot be converted; `dest` is then left absent. If
    another process finished `dest` first, its folder is kept and this conversion is discarded."""
    from tqdm.auto import tqdm

    meta = read_gguf_metadata(src)
    arch = check_architecture(src, meta)
    import torch
    from transformers import AutoModelForCausalLM

    from engine.loader.gguf_tokenizer import tokenizer_from_gguf

    if dtype == "quantized":
        return _write_quantized_folder(src, dest, arch, record or {})
    torch_dtype = getattr(torch, dtype)
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    started = time.perf_counter()
    stages = tqdm(total=3, desc=f"convert {src.name} -> {dtype}", unit="stage", disable=not progress)
    try:
        with _parse_once():
            stages.set_postfix_str("tokenizer")
            tokenizer = tokenizer_from_gguf(src, read_gguf_metadata(src, arrays=True))
            stages.update()
            stages.set_postfix_str("weights")
            config = _native_config(src)  # MoE, qwen3, gemma3 from the file; else transformers' own
            model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch_dtype,
                                                         **({"config": config} if config else {}),
                                                         **_dequantize_kwargs())
            stages.update()
        _forget_quantization(model)
        bad = [n for n, p in model.named_parameters() if type(p.data) is not torch.Tensor or p.dtype != torch_dtype]
        if bad:
            raise ModelSourceError(f"{src.name}: transformers left {len(bad)} weights packed or not in {dtype} "
                                   f"(e.g. {bad[0]}); cellserve needs plain dense weights")
        stages.set_postfix_str("save")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stages.update()
        info = {"architecture": arch, "dtype": dtype, "seconds": round(time.perf_counter() - started, 2),
                "bytes": sum(f.stat().st_size for f in tmp.iterdir()), **(record or {})}
        (tmp / "cellserve.json").write_text(json.dumps(info, indent=2))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "cellserve.json").is_file():  # not a concurrent twin that finished first
                raise
    except ModelSourceError:
        raise
    except Exception as exc:  # transformers/gguf raise many types for a bad file; one clear error instead
        raise ModelSourceError(f"could not convert {src} ({arch}) to a Hugging Face folder: "
                               f"{type(exc).__name__}: {exc}") from exc
    finally:
        stages.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _write_quantized_folder(src: Path, dest: Path, arch: str, record: dict) -> dict:
    """`dest` for dtype "quantized": the config, generation config and tokenizer only; `cellserve.json`
    says the weights stay in `src` (`weights: "gguf"`), read as they are at every load."""
    from transformers import AutoConfig, GenerationConfig

    from engine.loader.gguf_tokenizer import tokenizer_from_gguf

    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    started = time.perf_counter()
    try:
        with _parse_once():
            tokenizer = tokenizer_from_gguf(src, read_gguf_metadata(src, arrays=True))
            config = _native_config(src) or AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"architecture": arch, "dtype": "quantized", "weights": "gguf", "gguf": str(src.resolve()),
                "seconds": round(time.perf_counter() - started, 2), **record}
        (tmp / "cellserve.json").write_text(json.dumps(info, indent=2))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "cellserve.json").is_file():
                raise
    except ModelSourceError:
        raise
    except Exception as exc:
        raise ModelSourceError(f"could not read the config and tokenizer of {src} ({arch}): "
                               f"{type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _native_config(src: Path):
    """The config written from the file's own metadata (engine/loader/gguf_config.py) for the architectures
    transformers' mapping gets wrong, else None."""
    from engine.loader.gguf_config import CONFIG_ARCHS, config_from_metadata

    moe = _moe_config(src)
    if moe is not None:
        return moe
    _, index = read_tensor_index(src)
    meta = read_gguf_metadata(src, arrays=True)  # a layer pattern may be an array
    if meta["general.architecture"] not in CONFIG_ARCHS:
        return None
    return config_from_metadata(meta, index["token_embd.weight"].shape[0], "output.weight" not in index)


def _moe_config(src: Path):
    """The config of a mixture-of-experts file, from its metadata (engine/loader/gguf_moe.py), else None."""
    from engine.loader.gguf_moe import is_moe_file, moe_config

    meta, index = read_tensor_index(src)
    return moe_config(src, meta, index) if is_moe_file(meta) else None


def _dequantize_kwargs() -> dict:
    """Ask for dense weights explicitly where transformers can keep GGUF blocks packed."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _forget_quantization(model) -> None:
    """The weights are dense now; drop the GGUF quantizer so `save_pretrained` writes plain safetensors
    and the saved config does not ask the next load for a GGUF file."""
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
