// quant_gemm.h: what the two blocked integer GEMMs share (quant_gemm.cpp, which unpacks the row-layout
// weights into tiles per call, every kind; quant_tiles.cpp, over weights kept in those tiles, the 32-weight
// kinds): the register blocking, the activations quantized into per-pair records, and the epilogue.
#pragma once

#include "quant_blocks.h"

#ifdef CELLSERVE_QUANT_VNNI
namespace cq {

// rows of x a micro-kernel call holds in registers: 6 x 2 int32 and 6 x 2 fp32 accumulators and the 2 x 2
// unpacked weight vectors fit AVX-512's 32 registers, and a 9-row verification step is two passes, not three
// (quant_tiles q4_1 at 9 rows: 1536x576 0.038 -> 0.035 ms, the 49152x576 LM head 0.88 -> 0.80 against 4 rows).
constexpr int kR = 6;
constexpr int kNC = 2;  // column vectors (16 weight rows each) a task unpacks
constexpr int64_t kKB = 8;  // pairs unpacked at a time: 8 x 2.5-3 KB, so they stay in L1 across the rows

// The scale groups of a pair: lanes sharing one weight scale and one activation block.
template <int KIND>
constexpr int kGroups = KIND == Q6_K ? 4 : 2;
template <int KIND>
constexpr int group_block(int g) { return KIND == Q6_K ? g % 2 : g; }
template <int KIND>  // the i-th lane of group g (16 / groups lanes a group)
constexpr int group_lane(int g, int i) {
  return KIND == Q8_0 ? 8 * g + i : KIND == Q6_K ? 4 * g + i : (i < 4 ? 4 * g + i : 8 + 4 * g + i - 4);
}

// x's rows quantized, kR rows at a time (the last tile padded with zero rows), one record a pair:
// the rows' 64 int8 values in the pair order, then per scale group g and row r: da (the block's scale),
// ms = da * s and zi = -z * s, s the sum of the group's int8 values. A micro-kernel call reads one
// contiguous stream of these.
struct PairActs {
  int8_t q[kR][64];
  float da[4][kR], ms[4][kR];
  int32_t zi[4][kR];
};
struct Acts {
  int64_t pairs;
  std::vector<PairActs> v;  // [tile][pair]
  std::vector<int64_t> starts;  // tile t holds rows [starts[t], starts[t + 1])
  int64_t tiles() const { return static_cast<int64_t>(starts.size()) - 1; }
  int rows(int64_t tile) const { return static_cast<int>(starts[tile + 1] - starts[tile]); }
};

// Row tiles of at most kR rows: every tile full but the last (quant_gemm's micro-kernel always runs kR rows),
// or `balanced`: as few tiles, sizes differing by at most one (quant_tiles runs each tile's own count, so 7
// rows are 4 + 3, not 6 + 1, whose lone row pays a whole unpacked weight tile alone).
inline std::vector<int64_t> row_tiles(int64_t rows, bool balanced) {
  const int64_t tiles = (rows + kR - 1) / kR;
  std::vector<int64_t> starts(tiles + 1);
  for (int64_t t = 0; t <= tiles; ++t) starts[t] = balanced ? t * rows / tiles : std::min(rows, t * kR);
  return starts;
}

// One row: q in the pair order (pair p at q + p * stride); per block da (the K-quants: its super-block's,
// llama.cpp's q8_K) and the sums of its halves.
template <int KIND>
void quantize_row(const float* xr, int64_t nb, int8_t* q, int64_t stride, float* da, int32_t* s16) {
  constexpr int64_t span = super_blocks(KIND) ? 8 : 1;  // blocks sharing one scale
  for (int64_t b0 = 0; b0 < nb; b0 += span) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t b = b0; b < std::min(nb, b0 + span); ++b)
      m = _mm512_max_ps(m, _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xr + b * 32)),
                                         _mm512_abs_ps(_mm512_loadu_ps(xr + b * 32 + 16))));
    const float amax = _mm512_reduce_max_ps(m);
    for (int64_t b = b0; b < std::min(nb, b0 + span); ++b) da[b] = amax / 127.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 x0 = _mm512_loadu_ps(xr + b * 32), x1 = _mm512_loadu_ps(xr + b * 32 + 16);
    const __m512 inv = _mm512_set1_ps(da[b] != 0.f ? 1.f / da[b] : 0.f);
    const __m512i q0 = round_away(_mm512_mul_ps(x0, inv)), q1 = round_away(_mm512_mul_ps(x1, inv));
    s16[2 * b] = _mm512_reduce_add_epi32(q0);
    s16[2 * b + 1] = _mm512_reduce_add_epi32(q1);
    int8_t* dst = q + (b / 2) * stride;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + pair_pos(KIND, b % 2, 0)), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + pair_pos(KIND, b % 2, 16)), _mm512_cvtsepi32_epi8(q1));
  }
}

template <int KIND>
Acts quantize_rows(const float* x, int64_t rows, int64_t k, bool balanced = false) {
  constexpr int G = kGroups<KIND>;
  const int64_t nb = k / 32, pairs = (nb + 1) / 2;
  const int z = zero_point(KIND);
  Acts a;
  a.pairs = pairs;
  a.starts = row_tiles(rows, balanced);
  a.v.assign(a.tiles() * pairs, PairActs{});
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> da(nb);
    std::vector<int32_t> s16(2 * nb);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t tile = std::upper_bound(a.starts.begin(), a.starts.end(), r) - a.starts.begin() - 1;
      PairActs* rec = a.v.data() + tile * pairs;
      const int slot = static_cast<int>(r - a.starts[tile]);
      quantize_row<KIND>(x + r * k, nb, rec->q[slot], sizeof(PairActs), da.data(), s16.data());
      for (int64_t p = 0; p < pairs; ++p) {
        for (int g = 0; g < G; ++g) {
          const int64_t blk = 2 * p + group_block<KIND>(g);
          if (blk >= nb) continue;
          // a group is a block (both halves) or, for q6_k, half g / 2 of block g % 2
          const int s = KIND == Q6_K ? s16[2 * blk + g / 2] : s16[2 * blk] + s16[2 * blk + 1];
          rec[p].da[g][slot] = da[blk];
          rec[p].ms[g][slot] = da[blk] * static_cast<float>(s);
          rec[p].zi[g][slot] = -z * s;
        }
      }
    }
  });
  return a;
}

// y rows r0.. (rows of them) from out [rows][kNC * 16], with the bias, `other` and the op.
inline void epilogue(const Call& c, const int64_t* start, const int* count, int64_t r0, int rows, const float* out, float* y) {
  const float* bias = ptr_or_null(c.bias);
  const float* other = ptr_or_null(c.other);
  for (int r = 0; r < rows; ++r) {
    const float* o = out + r * kNC * 16;
    const int64_t yr = (r0 + r) * c.n_out;
    if (c.swiglu) {
      for (int j = 0; j < count[0]; ++j) {
        const int64_t n = start[0] + j, u = start[1] + j;
        y[yr + n] = silu(o[j] + (bias ? bias[n] : 0.f)) * (o[16 + j] + (bias ? bias[u] : 0.f));
      }
      continue;
    }
    for (int v = 0; v < kNC; ++v) {
      for (int j = 0; j < count[v]; ++j) {
        const int64_t n = start[v] + j;
        y[yr + n] = o[v * 16 + j] + (bias ? bias[n] : 0.f) + (other ? other[yr + n] : 0.f);
      }
    }
  }
}

}  // namespace cq
#endif
