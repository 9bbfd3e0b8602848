"""Q4_K, Q5_K and Q6_K blocks written from ggml's public definition (gguf-py's quants module can read
them but not write them): a plain round-to-nearest quantizer, good enough for test weights (no
error-minimizing search like llama.cpp's), laid out byte for byte as engine/loader/gguf_tensors.py's
docstring describes. `quantize(w, qtype)` -> the file's bytes [rows, row bytes], as gguf-py's."""

import numpy as np


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _scales_mins(w: np.ndarray, qmax: int):
    """Per 32-weight sub-block: 6-bit scale and min codes under fp16 d, dmin (w ~ d sc q - dmin m)."""
    lo = np.minimum(w.min(-1), 0)  # [n, 8]
    scale = (w.max(-1) - lo) / qmax
    d = _fp16(scale.max(-1, keepdims=True) / 63)
    dmin = _fp16((-lo).max(-1, keepdims=True) / 63)
    df, mf = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(np.divide(-lo, mf, out=np.zeros_like(lo), where=mf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(w + (mf * mn)[..., None], step, out=np.zeros_like(w), where=step > 0)
    return d, dmin, sc, mn, np.clip(np.rint(q), 0, qmax).astype(np.uint8)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    out = np.zeros(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    import gguf

    n, k = w.shape
    assert k % 256 == 0
    nsb = k // 256
    Q = gguf.GGMLQuantizationType
    if qtype == Q.Q6_K:
        g = w.reshape(n, nsb, 16, 16).astype(np.float32)
        gs = np.abs(g).max(-1) / 31.5  # [n, nsb, 16]
        d = _fp16(gs.max(-1, keepdims=True) / 127)
        df = d.astype(np.float32)
        sc = np.clip(np.rint(np.divide(gs, df, out=np.zeros_like(gs), where=df > 0)), -128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.divide(g, step, out=np.zeros_like(g), where=step != 0)
        q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(n, nsb, 2, 4, 32)  # [half, u, l]
        ql = np.zeros((n, nsb, 2, 64), np.uint8)
        ql[..., :32] = (q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4)
        ql[..., 32:] = (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)
        qh = sum(((q[:, :, :, u] >> 4) & 3) << (2 * u) for u in range(4)).astype(np.uint8)  # [n, nsb, 2, 32]
        blocks = np.concatenate([ql.reshape(n, nsb, 128), qh.reshape(n, nsb, 64), sc.view(np.uint8),
                                 d.view(np.uint8).reshape(n, nsb, 2)], axis=-1)
        return blocks.reshape(n, nsb * 210)
    five = qtype == Q.Q5_K
    assert five or qtype == Q.Q4_K
    d, dmin, sc, mn, q = _scales_mins(w.reshape(n, nsb, 8, 32).astype(np.float32), 31 if five else 15)
    qs = ((q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)).reshape(n, nsb, 128)
    parts = [d.view(np.uint8).reshape(n, nsb, 2), dmin.view(np.uint8).reshape(n, nsb, 2), _pack_scales(sc, mn)]
    if five:
        parts.append(sum(((q[:, :, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8))  # [n, nsb, 32]
    blocks = np.concatenate(parts + [qs], axis=-1)
    return blocks.reshape(n, -1)
