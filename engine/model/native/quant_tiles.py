"""TiledWeight: a 32-weight-kind quantized weight (q8_0, q4_0, q4_1, q5_0, q5_1) kept in 16-row tiles, the layout
`torch.ops.cellserve.quant_tiles` reads (engine/model/kernels/csrc/quant_tiles.cpp documents it).

Why: the row layout (`QuantWeight`, engine/loader/gguf_tensors.py) makes the row kernel unpack every
weight pair and do float work per int32 lane for each row of x, so a speculative verification step of
9 rows cost 3.5-4x a decode step; the GEMM that is cheaper per row unpacks and transposes 16 weight rows
per call, too slow for one row. Kept in the GEMM's tiles (same bytes: packed nibbles, fp16 scales), one
kernel serves one row as fast as the row kernel and 9-16 rows at a fraction of its cost, and computes
each row bitwise as alone at every row count (engine/model/native/rows.py).

`TiledWeight.of(w, parts)` tiles a `QuantWeight` once (`tileable`: K a whole number of 64-weight pairs) (parts = 2 for a [gate; up] weight: each half is
tiled apart, so a tile never holds rows of both and `swiglu` pairs tile i with tile T/2 + i); it is then
the only copy. Whatever reads rows (an embedding lookup of a tied table, the fp32 tile path of prefill, the
eager path) asks `untile(r0, r1)` or `rows(index)` for those rows in the row layout; the bf16 tile path of
prefill reads them straight from the tiles (`quant_tiles_bf16`, bitwise the untiled rows' bf16).
"""

from dataclasses import dataclass

import torch

from engine.loader.gguf_tensors import _NONE, QuantWeight

TILE_ROWS = 16
TILED_KINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def tileable(w: QuantWeight) -> bool:
    """Whether `w` is kept in tiles: a 32-weight kind whose rows are whole pairs of blocks (K % 64 == 0, as in
    every real model's shapes; a K of an odd block count would carry a zero block a row)."""
    return w.kind in TILED_KINDS and w.shape[1] % 64 == 0


def _records(kind: str) -> int:
    """64-byte records a pair and tile: q8_0 one a lane, the 4-bit kinds one a lane pair (two nibbles a byte)."""
    return 16 if kind == "q8_0" else 8


@dataclass
class TiledWeight:
    """A [n, k] weight in tiles: qs [T, P, L, 16, 4] uint8, d (and q4_1's / q5_1's m) [T, P, 2, 16] fp16
    (P = k / 64), q5_0's / q5_1's qh [T, P, 8, 2, 8] uint8 (the fifth bits as per-record masks: quant_tiles.cpp),
    made of `parts` parts of n / parts rows, each padded with zero rows to whole tiles."""

    kind: str
    n: int
    k: int
    parts: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    qh: torch.Tensor | None = None

    @staticmethod
    def of(w: QuantWeight, parts: int = 1) -> "TiledWeight":
        n, k = w.shape
        assert tileable(w) and n % parts == 0, (w.kind, n, k, parts)
        rows = n // parts
        tiles = [_tile_part(w, p * rows, (p + 1) * rows) for p in range(parts)]
        cat = [None if t[0] is None else torch.cat(t) for t in zip(*tiles)]
        return TiledWeight(w.kind, n, k, parts, *cat)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields())

    @property
    def padding(self) -> int:
        """Bytes of the zero rows that fill each part's last tile (none where a part has whole tiles)."""
        part_rows, part_tiles = self.n // self.parts, self.qs.shape[0] // self.parts
        return self.nbytes * (part_tiles * TILE_ROWS - part_rows) // (part_tiles * TILE_ROWS)

    @property
    def halves_apart(self) -> bool:
        """Whether `swiglu` can pair its [gate; up] halves tile by tile: tiled apart, or whole tiles each (the
        kernel's own rule)."""
        return self.parts == 2 or (self.n // 2) % TILE_ROWS == 0 and self.n % 2 == 0

    def fields(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.d, self.m, self.qh) if t is not None]

    def tensors(self) -> list[torch.Tensor]:
        """The kernel's argument: [qs, d, m, qh] (m empty but for q4_1 / q5_1, qh but for q5_0 / q5_1)."""
        return [self.qs, self.d, *(_NONE if t is None else t for t in (self.m, self.qh))]

    def _tile_of(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tile, row within the tile) of weight rows `row`."""
        part_rows = self.n // self.parts
        part_tiles = self.qs.shape[0] // self.parts
        part, within = row // part_rows, row % part_rows
        return part * part_tiles + within // TILE_ROWS, within % TILE_ROWS

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """Weight rows `index` in the row layout (`QuantWeight`): an embedding lookup, an eager call."""
        tile, j = self._tile_of(index.reshape(-1).long())
        # two advanced indices around slices: numpy's rule puts their dimension first -> [I, P, L, 4]
        qs = self.qs[tile, :, :, j, :].reshape(len(tile), -1)
        d = self.d[tile, :, :, j].reshape(len(tile), -1)
        m = None if self.m is None else self.m[tile, :, :, j].reshape(len(tile), -1)
        qh = None
        if self.qh is not None:  # row j's 4 bits of each mask: nibble j % 2 of byte j // 2
            b = self.qh[tile, :, :, :, j // 2]  # [I, P, 8, 2]
            qh = _row_bytes((b >> (4 * (j % 2)).to(torch.uint8).reshape(-1, 1, 1, 1)) & 0x0F)
        return QuantWeight(self.kind, qs, d, m, qh=qh)

    def untile(self, r0: int = 0, r1: int | None = None) -> QuantWeight:
        """Weight rows [r0, r1) in the row layout: a tile of the bf16/fp32 paths, one copy of those rows
        (whole tiles transposed back, a strided copy: the gather `rows` does is ~10x slower per byte)."""
        r1 = self.n if r1 is None else r1
        part_rows, part_tiles = self.n // self.parts, self.qs.shape[0] // self.parts
        pieces = []
        for part in range(r0 // part_rows if r1 > r0 else 0, -(-r1 // part_rows)):
            a, b = max(r0, part * part_rows) - part * part_rows, min(r1, (part + 1) * part_rows) - part * part_rows
            t0, t1 = part * part_tiles + a // TILE_ROWS, part * part_tiles + -(-b // TILE_ROWS)
            skip = a % TILE_ROWS
            # each record's 4 bytes moved as one int32: a strided copy of 4-byte elements, ~4x one of bytes
            qs = self.qs[t0:t1].view(torch.int32).permute(0, 3, 1, 2, 4).reshape((t1 - t0) * TILE_ROWS, -1)
            d, m = ([None if t is None else t[t0:t1].permute(0, 3, 1, 2).reshape((t1 - t0) * TILE_ROWS, -1)
                     for t in (self.d, self.m)])
            qh = None if self.qh is None else _untile_qh(self.qh[t0:t1])
            qs = qs[skip:skip + b - a]
            qs = qs.contiguous().view(torch.uint8) if qs.numel() else torch.empty(0, qs.shape[1] * 4, dtype=torch.uint8)
            pieces.append([qs, *(None if t is None else t[skip:skip + b - a].contiguous() for t in (d, m, qh))])
        cols = [None if c[0] is None else c[0] if len(c) == 1 else torch.cat(c) for c in zip(*pieces)]
        return QuantWeight(self.kind, cols[0], cols[1], cols[2], qh=cols[3])

    def dequantize(self, r0: int = 0, r1: int | None = None, *, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 rows, as `QuantWeight.dequantize` (the reference, the eager path, embedding lookups)."""
        return (self.untile(r0, r1) if index is None else self.rows(index)).dequantize()


def _row_bytes(nib: torch.Tensor) -> torch.Tensor:
    """Per row and pair the 8 x 2 nibbles [I, P, 8 (record l), 2 (low / high nibbles)] of the tile masks as the
    row layout's 8 bytes a pair (bit i = position i = 32h + 4l + b: byte 4h + l // 2, nibble l % 2): [I, 8P]."""
    nib = nib.transpose(2, 3).reshape(*nib.shape[:2], 2, 4, 2)  # [I, P, h, l // 2, l % 2]
    return (nib[..., 0] | (nib[..., 1] << 4)).reshape(nib.shape[0], -1)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2n]: each byte's low nibble, then its high one."""
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*b.shape[:-1], -1)


def _tile_qh(qh: torch.Tensor, tiles: int) -> torch.Tensor:
    """Row-layout fifth bits [16 T, 8P] -> the tiles' masks [T, P, 8, 2, 8]: bit 4j + b of mask (l, h) is row j's
    position 32h + 4l + b, so byte j // 2 holds rows j (low nibble) and j + 1 of record l."""
    nib = _nibbles(qh).reshape(tiles, TILE_ROWS, -1, 2, 8)  # [T, j, P, h, l]: position 32h + 4l's 4 bits
    nib = nib.permute(0, 2, 4, 3, 1).reshape(tiles, -1, 8, 2, 8, 2)  # [T, P, l, h, j // 2, j % 2]
    return (nib[..., 0] | (nib[..., 1] << 4)).contiguous()


def _untile_qh(qh: torch.Tensor) -> torch.Tensor:
    """The tiles' masks [T, P, 8, 2, 8] -> the row layout's fifth bits [16 T, 8P] (`_tile_qh` undone)."""
    nib = _nibbles(qh)  # [T, P, l, h, j]
    return _row_bytes(nib.permute(0, 4, 1, 2, 3).reshape(-1, qh.shape[1], 8, 2))


def _tile_part(w: QuantWeight, r0: int, r1: int) -> tuple[torch.Tensor | None, ...]:
    """Rows [r0, r1) of a row-layout weight as whole tiles (zero rows past r1)."""
    n, k = r1 - r0, w.shape[1]
    tiles, pairs = -(-n // TILE_ROWS), k // 64
    qs = torch.zeros(tiles * TILE_ROWS, w.qs.shape[1], dtype=torch.uint8)
    qs[:n] = w.qs[r0:r1]
    qs = qs.reshape(tiles, TILE_ROWS, pairs, _records(w.kind), 4).permute(0, 2, 3, 1, 4).contiguous()

    def scales(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(tiles * TILE_ROWS, 2 * pairs, dtype=torch.float16)
        out[:n] = t[r0:r1]
        return out.reshape(tiles, TILE_ROWS, pairs, 2).permute(0, 2, 3, 1).contiguous()

    qh = None
    if w.qh is not None:
        qh = torch.zeros(tiles * TILE_ROWS, w.qh.shape[1], dtype=torch.uint8)
        qh[:n] = w.qh[r0:r1]
        qh = _tile_qh(qh, tiles)
    return qs, scales(w.d), None if w.m is None else scales(w.m), qh
