// quant_gemm: `x @ W.T` for many rows (prefill, batched decode) over llama.cpp's block quantizations
// (quant_blocks.h), a blocked GEMM in integers (AVX-512 VNNI `vpdpbusd`).
//
// The rows are quantized once per call, per 32-block (the K-quants: per 256-weight super-block, one da
// for its 8 blocks), exactly as the row kernel does (quant_linear.cpp, quant_krows.cpp: int8,
// da = amax / 127, half away from zero, the pair order), so both kernels give the same sums up to fp32
// summation order. Then per task (at::parallel_for over tasks) NC = 2 vectors of 16 weight
// rows ("columns" of the output) are unpacked once into a tile that holds, per pair and per int32 lane
// l, the 4 bytes of lane l of the 16 rows side by side (a 16x16 transpose of the pairs' lanes), and
// their per-group scales dv, mv as 16-wide float vectors. Every R = kR (6) rows of x then run over the
// whole tile in registers: per scale group of a pair (a 32-block; a 16-weight chunk for q6_k) an int32
// accumulator per (row, column vector) starts at -z * s (s: the sum of the group's int8 activations)
// and takes one `vpdpbusd` per lane with the row's 4 activation bytes broadcast, so 16 columns x 4
// products per instruction; then, in fp32,
//   acc += dv * float(isum) * da  (+ mv * da * s for the kinds with mins)
// so one unpacked weight block serves every row, and the float work is per group, not per lane.
// Epilogues as quant_linear's: op "none" y = x W^T + b; "add" y = other + x W^T + b; "swiglu" (the
// two column vectors of a task are 16 gate rows and the same 16 up rows) y = silu(g + bg) * (u + bu).
// Without VNNI it runs quant_linear's row kernel (plain C; correct, not fast).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "quant_gemm.h"

namespace {

using namespace cq;

#ifdef CELLSERVE_QUANT_VNNI
// v[j] = 16 int32 of row j -> v[l] = element l of the 16 rows
inline void transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// A task's weights unpacked, one record a pair: per int32 lane l and column vector c, lane l of its
// 16 rows side by side (16 x 4 bytes), then per scale group g the 16 rows' dv and mv.
template <int G>
struct PairW {
  uint8_t w[16][kNC][64];
  float dv[G][kNC][16], mv[G][kNC][16];
};

// Pairs [p0, p1) of rows start[c] .. start[c] + count[c] of W (count <= 16, the rest zero) as column
// vector c, into t[0, p1 - p0).
template <int KIND>
void unpack(const Weight& w, const int64_t* start, const int* count, int64_t p0, int64_t p1, PairW<kGroups<KIND>>* t) {
  constexpr int G = kGroups<KIND>;
  const int64_t nb = w.k / 32;
  for (int c = 0; c < kNC; ++c) {
    Row rows[16];
    for (int j = 0; j < count[c]; ++j) rows[j] = row_of(w, start[c] + j);
    for (int64_t p = p0; p < p1; ++p) {
      const bool half = 2 * p + 1 == nb;
      __m512i v[16];
      for (int j = 0; j < 16; ++j) v[j] = j < count[c] ? load_pair<KIND>(rows[j], p, half) : _mm512_setzero_si512();
      transpose16(v);
      auto& tp = t[p - p0];
      for (int l = 0; l < 16; ++l) _mm512_storeu_si512(tp.w[l][c], v[l]);
      for (int g = 0; g < G; ++g) {
        const int64_t blk = 2 * p + group_block<KIND>(g);
        for (int j = 0; j < 16; ++j) {
          const bool ok = j < count[c] && blk < nb;
          tp.dv[g][c][j] = ok ? block_dv(KIND, rows[j], blk, KIND == Q6_K ? g / 2 : 0) : 0.f;
          tp.mv[g][c][j] = ok && has_mins(KIND) ? block_mv(KIND, rows[j], blk) : 0.f;
        }
      }
    }
  }
}

// out[r][c * 16 + j] (+)= row r of the tile's x . weight row j of column vector c over `pairs`, kR rows.
template <int KIND>
void micro(const PairW<kGroups<KIND>>* tw, const PairActs* ta, int64_t pairs, bool add, float* out) {
  constexpr int G = kGroups<KIND>, LPG = 16 / G, R = kR;
  __m512 af[R][kNC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kNC; ++c) af[r][c] = add ? _mm512_loadu_ps(out + (r * kNC + c) * 16) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const auto& W = tw[p];
    const PairActs& A = ta[p];
    for (int g = 0; g < G; ++g) {
      __m512i ai[R][kNC];
      for (int r = 0; r < R; ++r) {
        const __m512i z = _mm512_set1_epi32(A.zi[g][r]);
        for (int c = 0; c < kNC; ++c) ai[r][c] = z;
      }
      for (int i = 0; i < LPG; ++i) {
        const int l = group_lane<KIND>(g, i);
        __m512i wv[kNC];
        for (int c = 0; c < kNC; ++c) wv[c] = _mm512_loadu_si512(W.w[l][c]);
        for (int r = 0; r < R; ++r) {
          int32_t raw;
          std::memcpy(&raw, A.q[r] + 4 * l, 4);
          const __m512i av = _mm512_set1_epi32(raw);
          for (int c = 0; c < kNC; ++c) ai[r][c] = _mm512_dpbusd_epi32(ai[r][c], wv[c], av);
        }
      }
      for (int c = 0; c < kNC; ++c) {
        const __m512 dv = _mm512_loadu_ps(W.dv[g][c]);
        for (int r = 0; r < R; ++r)
          af[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ai[r][c]), dv), _mm512_set1_ps(A.da[g][r]), af[r][c]);
        if (has_mins(KIND)) {
          const __m512 mv = _mm512_loadu_ps(W.mv[g][c]);
          for (int r = 0; r < R; ++r) af[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(A.ms[g][r]), af[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kNC; ++c) _mm512_storeu_ps(out + (r * kNC + c) * 16, af[r][c]);
}

// Task i's column vectors: "none"/"add" weight rows 32i.. (outputs alike); "swiglu" gate rows 16i..
// and the same up rows (outputs 16i..).
void task_columns(const Call& c, int64_t i, int64_t* start, int* count) {
  if (c.swiglu) {
    start[0] = 16 * i;
    start[1] = c.n_out + 16 * i;
    count[0] = count[1] = static_cast<int>(std::min<int64_t>(16, c.n_out - 16 * i));
    return;
  }
  for (int v = 0; v < kNC; ++v) {
    start[v] = (i * kNC + v) * 16;
    count[v] = static_cast<int>(std::clamp<int64_t>(c.n_out - start[v], 0, 16));
  }
}

template <int KIND>
void gemm(const Call& c, float* y) {
  const Acts a = quantize_rows<KIND>(c.x.data_ptr<float>(), c.rows, c.w.k);
  const int64_t tasks = c.swiglu ? (c.n_out + 15) / 16 : (c.n_out + 16 * kNC - 1) / (16 * kNC);
  constexpr int64_t tile_out = kR * kNC * 16;
  at::parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<PairW<kGroups<KIND>>> t(kKB);
    std::vector<float> out(a.tiles() * tile_out);
    int64_t start[kNC];
    int count[kNC];
    for (int64_t i = i0; i < i1; ++i) {
      task_columns(c, i, start, count);
      for (int64_t p0 = 0; p0 < a.pairs; p0 += kKB) {  // K blocks: the unpacked pairs serve every row
        const int64_t p1 = std::min(a.pairs, p0 + kKB);
        unpack<KIND>(c.w, start, count, p0, p1, t.data());
        for (int64_t tile = 0; tile < a.tiles(); ++tile)
          micro<KIND>(t.data(), a.v.data() + tile * a.pairs + p0, p1 - p0, p0 > 0, out.data() + tile * tile_out);
      }
      for (int64_t tile = 0; tile < a.tiles(); ++tile)
        epilogue(c, start, count, a.starts[tile], a.rows(tile), out.data() + tile * tile_out, y);
    }
  });
}
#endif

at::Tensor quant_gemm(const at::Tensor& x, at::TensorList wl, int64_t kind, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& other, c10::string_view op) {
  const Call c = call_of(x, wl, kind, bias, other, op, "quant_gemm");
#ifdef CELLSERVE_QUANT_VNNI
  auto y = at::empty({c.rows, c.n_out}, x.options());
  float* yp = y.data_ptr<float>();
  switch (kind) {
    case Q8_0: gemm<Q8_0>(c, yp); break;
    case Q4_0: gemm<Q4_0>(c, yp); break;
    case Q4_1: gemm<Q4_1>(c, yp); break;
    case Q5_0: gemm<Q5_0>(c, yp); break;
    case Q5_1: gemm<Q5_1>(c, yp); break;
    case Q4_K: gemm<Q4_K>(c, yp); break;
    case Q5_K: gemm<Q5_K>(c, yp); break;
    default: gemm<Q6_K>(c, yp); break;
  }
  return y;
#else
  return linear_rows(c);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("quant_gemm(Tensor x, Tensor[] w, int kind, Tensor? bias, Tensor? other, str op) -> Tensor");
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) { m.impl("quant_gemm", &quant_gemm); }
