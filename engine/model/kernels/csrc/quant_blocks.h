// quant_blocks.h: the repacked block quantizations as the kernels read them (quant_linear.cpp: the row
// kernel (decode, up to INVARIANT_ROWS rows) and dequantization; quant_krows.cpp: the K-quants' row kernel;
// quant_gemm.cpp: many rows).
//
// A weight [N, K] of kind q8_0, q4_0, q4_1, q5_0, q5_1 (32-weight blocks), q4_k, q5_k or q6_k (256-weight
// super-blocks of 32- or 16-weight groups) is up to six arrays, one row of blocks per output row
// (engine/loader/gguf_tensors.py repacks the file's blocks into them once at load and documents them):
//   qs  uint8 [N, K] (q8_0: the int8 value + 128) or [N, K/2] (every other kind: per 32 weights,
//       byte j = element j (low nibble) | element j + 16 (high nibble), Q4_0's own layout)
//   d   fp16  [N, K/32] the block's scale, or [N, K/256] the super-block's d (K-quants)
//   m   fp16  q4_1/q5_1: [N, K/32] the block minimum; q4_k/q5_k: [N, K/256] dmin
//   sc  q4_k/q5_k uint8 [N, K/32] 6-bit scales; q6_k int8 [N, K/16]
//   mn  q4_k/q5_k uint8 [N, K/32] 6-bit mins
//   qh  high bits per 64 weights in the order below: q5_0/q5_1/q5_k 8 bytes (bit 4), q6_k 16 (bit 4, bit 5 planes);
//       [N, 8 * pairs] (a K of an odd block count ends in a whole pair's 8 bytes) or [N, K/4]
// The kernels read the weights two 32-blocks ("a pair", 64 weights) at a time, in this order:
// q8_0 the natural one; the others [b0 0..15, b1 0..15, b0 16..31, b1 16..31] (low nibbles of both
// blocks, then high nibbles). Each 16 consecutive positions ("a chunk") are 16 weights of one block
// (a q6_k scale group), and each int32 lane (4 positions) lies in one chunk. Per lane the weight is
//   w = dv * (q - z) + mv
// with z = 128 (q8_0), 8 (q4_0), 16 (q5_0), 32 (q6_k), else 0; dv = d (32-weight kinds), d * sc_j (q4_k, q5_k),
// d * sc_g (q6_k); mv = m (q4_1, q5_1), -dmin * mn_j (q4_k, q5_k), else 0.
// Activations are rounded to int8 (scale da = amax / 127, round half away from zero) per 32-block for the
// 32-weight kinds (llama.cpp's q8_0) and per 256-weight super-block for the K-quants (llama.cpp's q8_K),
// and laid out in the same pair order, so a weight pair and an activation pair dot lane by lane.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CELLSERVE_QUANT_VNNI 1
#endif

namespace cq {

// Q5_0 / Q5_1 (Gemma 3's Q4_K_M files: llama-quantize's fallback where a row is not whole super-blocks) came
// last: Q4_0 / Q4_1's nibbles plus q5_k's bit-4 plane, so their ids follow the K-quants'.
enum Kind : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5, Q5_0 = 6, Q5_1 = 7 };
constexpr int64_t kKinds = 8;

inline int zero_point(int64_t kind) {
  switch (kind) {
    case Q8_0: return 128;
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q6_K: return 32;
    default: return 0;
  }
}
constexpr bool super_blocks(int64_t kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K; }
constexpr bool has_mins(int64_t kind) { return kind == Q4_1 || kind == Q5_1 || kind == Q4_K || kind == Q5_K; }
// the kinds whose bit 4 is a plane beside the nibbles (qh: 8 bytes a pair)
constexpr bool five_bits(int64_t kind) { return kind == Q5_0 || kind == Q5_1 || kind == Q5_K; }
inline float silu(float v) { return v / (1.f + std::exp(-v)); }
// which block of the pair chunk c (positions 16c..16c+15) belongs to, and which half of that block
inline int chunk_block(int64_t kind, int c) { return kind == Q8_0 ? c / 2 : c % 2; }
inline int chunk_half(int64_t kind, int c) { return kind == Q8_0 ? c % 2 : c / 2; }
// position in the pair of element i of the pair's block blk
inline int pair_pos(int64_t kind, int blk, int i) { return kind == Q8_0 ? blk * 32 + i : (i / 16) * 32 + blk * 16 + i % 16; }

struct Weight {
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  const uint8_t* sc;
  const uint8_t* mn;
  const uint8_t* qh;
  int64_t kind, n, k;
  int64_t qs_row, d_row, sc_row, qh_row;  // elements a row, per array
};

struct Row {  // one output row's arrays
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  const uint8_t* sc;
  const uint8_t* mn;
  const uint8_t* qh;
};

inline Row row_of(const Weight& w, int64_t n) {
  return {w.qs + n * w.qs_row, w.d + n * w.d_row, w.m ? w.m + n * w.d_row : nullptr,
          w.sc ? w.sc + n * w.sc_row : nullptr, w.mn ? w.mn + n * w.sc_row : nullptr,
          w.qh ? w.qh + n * w.qh_row : nullptr};
}

// dv and mv of block b of a row (q6_k: dv of 16-weight group `half` of the block)
inline float block_dv(int64_t kind, const Row& r, int64_t b, int half) {
  if (!super_blocks(kind)) return static_cast<float>(r.d[b]);
  if (kind == Q6_K) return static_cast<float>(r.d[b / 8]) * static_cast<float>(static_cast<int8_t>(r.sc[2 * b + half]));
  return static_cast<float>(r.d[b / 8]) * static_cast<float>(r.sc[b]);
}
inline float block_mv(int64_t kind, const Row& r, int64_t b) {
  if (kind == Q4_1 || kind == Q5_1) return static_cast<float>(r.m[b]);
  if (kind == Q4_K || kind == Q5_K) return -(static_cast<float>(r.m[b / 8]) * static_cast<float>(r.mn[b]));
  return 0.f;
}

// Pair p of a row in plain C: its 64 unsigned values in the kernels' order.
inline void unpack_values(int64_t kind, const Row& r, int64_t p, int64_t nb, uint8_t* q) {
  const bool half = 2 * p + 1 == nb;
  std::memset(q, 0, 64);
  if (kind == Q8_0) {
    std::memcpy(q, r.qs + p * 64, half ? 32 : 64);
  } else {
    for (int blk = 0; blk < (half ? 1 : 2); ++blk) {
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = r.qs[(2 * p + blk) * 16 + j];
        q[blk * 16 + j] = byte & 0x0F;
        q[32 + blk * 16 + j] = byte >> 4;
      }
    }
  }
  if (five_bits(kind) || kind == Q6_K) {
    const int planes = kind == Q6_K ? 2 : 1;
    for (int pl = 0; pl < planes; ++pl) {
      uint64_t bits;
      std::memcpy(&bits, r.qh + p * 8 * planes + 8 * pl, 8);
      for (int i = 0; i < 64; ++i) q[i] |= static_cast<uint8_t>(((bits >> i) & 1) << (4 + pl));
    }
  }
}

// Pair p of a row in plain C: its 64 unsigned values in the kernels' order and per lane dv, mv.
inline void unpack_pair(int64_t kind, const Row& r, int64_t p, int64_t nb, uint8_t* q, float* dv, float* mv) {
  unpack_values(kind, r, p, nb, q);
  for (int lane = 0; lane < 16; ++lane) {
    const int c = lane / 4;
    const int64_t b = 2 * p + chunk_block(kind, c);
    dv[lane] = b < nb ? block_dv(kind, r, b, chunk_half(kind, c)) : 0.f;
    mv[lane] = b < nb ? block_mv(kind, r, b) : 0.f;
  }
}

#ifdef CELLSERVE_QUANT_VNNI
inline float half_to_float(const c10::Half& h) { return _cvtsh_ss(h.x); }

// 16 floats rounded half away from zero (exactly std::round) to int32
inline __m512i round_away(__m512 v) {
  const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m512 sign = _mm512_and_ps(v, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
  const __m512 frac = _mm512_abs_ps(_mm512_sub_ps(v, t));  // exact
  const __mmask16 up = _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ);
  return _mm512_cvttps_epi32(_mm512_mask_add_ps(t, up, t, _mm512_or_ps(sign, _mm512_set1_ps(1.f))));
}

// chunk c (16 values) of a pair's 64 bytes as floats
inline __m512 chunk_floats(__m512i q, int c) {
  __m128i b;
  switch (c) {
    case 0: b = _mm512_extracti32x4_epi32(q, 0); break;
    case 1: b = _mm512_extracti32x4_epi32(q, 1); break;
    case 2: b = _mm512_extracti32x4_epi32(q, 2); break;
    default: b = _mm512_extracti32x4_epi32(q, 3); break;
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

// A 4-bit pair's 32 packed bytes as its 64 unsigned values in the kernels' order (low nibbles, then high).
inline __m512i unpack_nibbles(__m256i v) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// The 64 unsigned weight values of pair p (the second block zero when `half`), in the kernels' order.
template <int KIND>
inline __m512i load_pair(const Row& r, int64_t p, bool half) {
  if (KIND == Q8_0) {
    const uint8_t* src = r.qs + p * 64;
    return half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src) : _mm512_loadu_si512(src);
  }
  const uint8_t* src = r.qs + p * 32;
  const __m256i v = half ? _mm256_maskz_loadu_epi8(0xFFFFu, src) : _mm256_loadu_si256((const __m256i*)src);
  __m512i w = unpack_nibbles(v);
  if (five_bits(KIND) || KIND == Q6_K) {
    constexpr int planes = KIND == Q6_K ? 2 : 1;
    uint64_t b4;
    std::memcpy(&b4, r.qh + p * 8 * planes, 8);
    w = _mm512_or_si512(w, _mm512_maskz_mov_epi8(_cvtu64_mask64(b4), _mm512_set1_epi8(16)));
    if (KIND == Q6_K) {
      uint64_t b5;
      std::memcpy(&b5, r.qh + p * 16 + 8, 8);
      w = _mm512_or_si512(w, _mm512_maskz_mov_epi8(_cvtu64_mask64(b5), _mm512_set1_epi8(32)));
    }
  }
  return w;
}
#endif

inline const uint8_t* bytes_of(const at::Tensor& t, at::ScalarType type, int64_t n, int64_t row, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == type && t.size(0) == n && t.size(1) == row,
              "quant: ", what, " has the wrong dtype or shape for its kind");
  return static_cast<const uint8_t*>(t.data_ptr());
}

// w = [qs, d, m, sc, mn, qh] (engine/loader/gguf_tensors.py's FIELDS; empty tensors where absent).
inline Weight weight_of(at::TensorList w, int64_t kind) {
  TORCH_CHECK(kind >= Q8_0 && kind < kKinds, "quant: kind must be 0..7 (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, q5_0, q5_1)");
  TORCH_CHECK(w.size() == 6, "quant: the weight is [qs, d, m, sc, mn, qh]");
  const at::Tensor& qs = w[0];
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.scalar_type() == at::kByte, "quant: qs must be contiguous uint8 [N, bytes]");
  const int64_t n = qs.size(0), k = kind == Q8_0 ? qs.size(1) : 2 * qs.size(1);
  TORCH_CHECK(k % (super_blocks(kind) ? 256 : 32) == 0, "quant: K must be whole blocks");
  const bool sup = super_blocks(kind);
  Weight out{};
  out.kind = kind;
  out.n = n;
  out.k = k;
  out.qs_row = qs.size(1);
  out.d_row = sup ? k / 256 : k / 32;
  out.sc_row = kind == Q6_K ? k / 16 : k / 32;
  out.qh_row = five_bits(kind) ? (k / 32 + 1) / 2 * 8 : k / 4;  // whole pairs (q5_0 / q5_1: K may end in a lone block)
  out.qs = qs.data_ptr<uint8_t>();
  out.d = reinterpret_cast<const c10::Half*>(bytes_of(w[1], at::kHalf, n, out.d_row, "d"));
  out.m = reinterpret_cast<const c10::Half*>(bytes_of(w[2], at::kHalf, n, out.d_row, "m"));
  out.sc = bytes_of(w[3], kind == Q6_K ? at::kChar : at::kByte, n, out.sc_row, "sc");
  out.mn = bytes_of(w[4], at::kByte, n, out.sc_row, "mn");
  out.qh = bytes_of(w[5], at::kByte, n, out.qh_row, "qh");
  TORCH_CHECK(out.d != nullptr, "quant: d is required");
  TORCH_CHECK((out.m != nullptr) == has_mins(kind), "quant: m is given exactly for q4_1, q5_1, q4_k and q5_k");
  TORCH_CHECK((out.sc != nullptr) == sup, "quant: sc is given exactly for the K-quants");
  TORCH_CHECK((out.mn != nullptr) == (kind == Q4_K || kind == Q5_K), "quant: mn is given exactly for q4_k and q5_k");
  TORCH_CHECK((out.qh != nullptr) == (five_bits(kind) || kind == Q6_K),
              "quant: qh is given exactly for q5_0, q5_1, q5_k and q6_k");
  return out;
}

// The checked arguments of a linear call: x [rows, K] float32, bias/other as float32, the op.
struct Call {
  Weight w;
  at::Tensor x, bias, other;
  int64_t rows, n_out;
  bool swiglu;
};

inline Call call_of(const at::Tensor& x, at::TensorList wl, int64_t kind, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& other, c10::string_view op_view, const char* name) {
  const std::string op(op_view);
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", name, ": op must be none, add or swiglu");
  Call c;
  c.w = weight_of(wl, kind);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) >= 1 && x.size(1) == c.w.k,
              name, ": x must be contiguous float32 [rows >= 1, K]");
  c.x = x;
  c.rows = x.size(0);
  c.swiglu = op == "swiglu";
  TORCH_CHECK(!c.swiglu || c.w.n % 2 == 0, name, ": swiglu needs [gate; up] rows");
  c.n_out = c.swiglu ? c.w.n / 2 : c.w.n;
  if (bias.has_value() && bias->defined()) {
    c.bias = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(c.bias.numel() == c.w.n, name, ": bias must have one value per weight row");
  }
  if (op == "add") {
    TORCH_CHECK(other.has_value(), name, ": op add needs `other`");
    c.other = other->to(at::kFloat).contiguous();
    TORCH_CHECK(c.other.dim() == 2 && c.other.size(0) == c.rows && c.other.size(1) == c.n_out,
                name, ": `other` must be [rows, N]");
  }
  return c;
}

inline const float* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// The row kernels (quant_linear.cpp: 32-weight kinds, quant_krows.cpp: K-quants) are compiled per group size M
// (1 to 8 activation rows, the accumulators in registers): f(std::integral_constant<int, M>) for M = rows.
template <class F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

constexpr int64_t kGroupRows = 8;  // activation rows a kernel call holds in registers

// Their output loop, over the output rows in parallel, for any number of activation rows. Per one or two
// weight rows rs (outputs n and n + 1; with swiglu the gate and up rows of output n; one at a time at one row),
// `dot(M, rs, nw, i0, sums)` (M a std::integral_constant) writes the dot products of activation rows
// [i0, i0 + M) with each: sums[j * rows + i0 + i]; in groups of 8 and then the rest, one after another
// while the weight rows are still in cache, so one call streams the weight from memory once whatever its
// row count (passes of 8 rows each streamed it again). A kernel keeps one accumulator per (weight row,
// activation row) and never sums across them, so a row's output takes the same operations in any group of
// any size: bitwise what a call with it alone gives (engine/model/native/rows.py). Then y = sums + b
// (+ other), or with `swiglu` (W = [gate; up], 2 n_out rows) y = silu(gate + bg) * (up + bu).
template <class Dot>
inline void rows_out(const Weight& w, int64_t rows, const float* bias, const float* other, float* y, int64_t n_out,
                     bool swiglu, const Dot& dot) {
  const int64_t full = (rows - 1) / kGroupRows, tail = rows - kGroupRows * full;  // tail: 1 to 8
  with_rows(tail, [&](auto t) {
    const auto all = [&](const Row* rs, int nw, float* sums) {
      for (int64_t g = 0; g < full; ++g)
        dot(std::integral_constant<int, kGroupRows>{}, rs, nw, kGroupRows * g, sums + kGroupRows * g);
      dot(t, rs, nw, kGroupRows * full, sums + kGroupRows * full);
    };
    // one row (decode) streams one weight row at a time: two were slower there (q8_0 2048x8192: 0.70 -> 0.85 ms)
    const bool share = rows > 1;
    at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
      // per-thread scratch kept between calls, as the attention kernel's: no malloc in an OpenMP worker (its
      // arena would hold freed pages), none at all once the widest call has run
      thread_local std::vector<float> s;
      s.resize(static_cast<size_t>(2 * rows));
      for (int64_t n = n0; n < n1; n += swiglu || !share ? 1 : 2) {
        const int nw = swiglu || (share && n + 1 < n1) ? 2 : 1;
        const Row rs[2] = {row_of(w, n), row_of(w, swiglu ? n + n_out : n + nw - 1)};
        if (share) {
          all(rs, nw, s.data());
        } else {
          for (int j = 0; j < nw; ++j) all(rs + j, 1, s.data() + j * rows);
        }
        if (swiglu) {
          const float bg = bias ? bias[n] : 0.f, bu = bias ? bias[n + n_out] : 0.f;
          for (int64_t r = 0; r < rows; ++r) y[r * n_out + n] = silu(s[r] + bg) * (s[rows + r] + bu);
          continue;
        }
        for (int j = 0; j < nw; ++j) {
          const float bn = bias ? bias[n + j] : 0.f;
          for (int64_t r = 0; r < rows; ++r)
            y[r * n_out + n + j] = s[j * rows + r] + bn + (other ? other[r * n_out + n + j] : 0.f);
        }
      }
    });
  });
}

// quant_linear.cpp: the row kernel over all the call's rows (every kind)
at::Tensor linear_rows(const Call& c);
// quant_krows.cpp: the row kernel for the K-quants: all the call's rows into y [rows, n_out]
void krows(const Call& c, float* y);

// A mixture of experts' pairs (row, expert) grouped by expert (quant_experts.cpp): group g holds pairs
// [start[g], start[g + 1]) and multiplies them by expert expert[g], the weight rows [expert * per, + per);
// `swiglu`: those rows are [gate; up] (per = 2 n_out), y = silu(gate) * up.
struct ExpertGroups {
  const int64_t* expert;
  const int64_t* start;
  int64_t groups, per, n_out;
  bool swiglu;
};
// quant_krows.cpp: the K-quants' row kernel over groups: y [pairs, n_out] = pair p's row x[src[p]] times its
// group's expert, each value bitwise a quant_linear call with that row alone on that expert's rows
void krows_experts(const Weight& w, const ExpertGroups& e, const float* x, int64_t x_rows, const int64_t* src,
                   int64_t pairs, float* y);

}  // namespace cq
