"""int8 KV cells (`--kv-cache-dtype int8`): how one head vector of K or V becomes int8 and a scale, and back.

Each (cell, kv head) row of `head_dim` values is stored as int8 with one float32 scale:
`scale = max|x| / 127`, `q = round(x / scale)` (round half to even, clamped to [-127, 127]), read as
`q * scale`. Why this choice:
- symmetric: K and V head vectors are centred near zero, so a zero point would buy little and cost an
  extra add in every dot product of the attention kernel (`score = scale * dot(q_row, int8_row)`);
- absmax per head vector: one token's head is the unit that is written once and never changes (a step
  writes whole rows), so its scale is known at write time with no calibration and no re-quantization
  when later tokens arrive; per-head rather than per-cell because heads differ in range by 10x or more
  (a shared scale would waste most heads' 8 bits). The error of every value is at most scale / 2,
  i.e. 1/254 of its row's largest magnitude;
- float32 scales: 4 bytes per row (6% of a 64-wide row's 68 bytes), exact for any range (bf16's 8-bit
  mantissa would add up to 0.4% error to a whole row, as much as the int8 rounding itself).

A row of zeros gets scale 0 and reads back as zeros. `pack` / `unpack` give the on-disk and transfer
form of such rows (saved cell chunks, archives): the int8 values followed by the scale's 4 bytes
(little-endian float32) in one int8 tensor `[..., head_dim + 4]`, so code that slices cells along the
token axis needs no second tensor.
"""

import sys

import torch

QMAX = 127
SCALE_BYTES = 4  # float32


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., D]` (any float dtype) -> (int8 `[..., D]`, float32 scales `[...]`)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xf / safe[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 `[..., D]` and scales `[...]` -> `[..., D]` in `dtype` (computed in float32, then cast)."""
    return (q.float() * scale[..., None]).to(dtype)


def pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 `[..., D]` and float32 scales `[...]` -> one int8 tensor `[..., D + 4]` (see the module docstring)."""
    raw = scale.to(torch.float32).contiguous()[..., None].view(torch.int8)  # [..., 4], native byte order
    if raw.shape[-1] != SCALE_BYTES:  # pragma: no cover - float32 is 4 bytes
        raise AssertionError("float32 scale is not 4 bytes")
    if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
        raw = raw.flip(-1)
    return torch.cat([q, raw], -1)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: int8 `[..., D + 4]` -> (int8 `[..., D]`, float32 scales `[...]`)."""
    if packed.dtype != torch.int8 or packed.shape[-1] <= SCALE_BYTES:
        raise ValueError(f"packed int8 KV rows are int8 [..., head_dim + {SCALE_BYTES}], got "
                         f"{tuple(packed.shape)} ({packed.dtype})")
    raw = packed[..., -SCALE_BYTES:]
    if sys.byteorder != "little":  # pragma: no cover
        raw = raw.flip(-1)
    return packed[..., :-SCALE_BYTES], raw.contiguous().view(torch.float32)[..., 0]
