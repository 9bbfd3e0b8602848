// quant_krows: the row kernel (quant_linear.cpp's quant_linear; rows in groups of 8: rows_out) for the K-quants
// (q4_k, q5_k, q6_k), accumulating in integers over each 256-weight super-block, as llama.cpp's q4_K x q8_K.
//
// Activations (llama.cpp's q8_K): each row is rounded per super-block to int8, one scale da = amax / 127 per
// 256 inputs, half away from zero, laid out in the quad order (below); with per super-block the
// sums bs of the int8 values of each 32-block (q4_k, q5_k: for the mins) or of each 16-weight group (q6_k:
// for the zero point 32), as int16 (|bs| <= 32 * 127).
// Per super-block and row, with the weight's integer scales sc (q4_k, q5_k: 6-bit per 32-block; q6_k: int8
// per 16-weight group) and 6-bit mins mn, q the unsigned weight values, a the int8 activations:
//   isum = sum_g sc_g * sum_{k in g} q_k a_k   (q6_k: - 32 * sum_g sc_g * bs_g)
//   y   += (d * da) * isum                     (q4_k, q5_k: - (dmin * da) * sum_j mn_j * bs_j)
// With VNNI, per 128 weights (a "quad" of 4 blocks, below), the weight bytes unpacked once for all the
// rows, per row: q4_k, q5_k: two `vpdpbusd` (unsigned weight bytes x signed activation bytes, 8 products
// an int32 lane, all of one block) and one `vpdpwssd` by the lane's scale (its low int16 half; the scales
// spread once a quad by one masked `vpermb`); q6_k: per half quad (one scale group a chunk of 16 weights)
// `vpmaddubsw` (int16 sums of two products) and `vpdpwssd` by each int16 lane's scale (`vpermw`). The
// float work is once a super-block (convert, times d and da); the mins' term in a float pass per row.
// Ranges: q4_k, q5_k: an int32 lane of the two `vpdpbusd` is at most 8 * 15 * 127 = 15,240 (q4_k),
// 8 * 31 * 127 = 31,496 (q5_k) in size: it fits its low int16 half, which `vpdpwssd` multiplies (the high
// half meets a zero); times a scale (<= 63), 2 quads a super-block: <= 4.0M. q6_k: a `vpmaddubsw` lane is
// at most 2 * 63 * 127 = 16,002 (< 32,767: never saturated); times a scale (<= 128), 2 of them an int32
// lane, 2 halves x 2 quads a super-block: <= 16.4M; the zero-point term adds <= 2 * (32 * 128) * (16 * 127)
// = 16.6M. All far below 2^31.
// Without VNNI the same integers are summed in plain C (the same activation rounding), so both builds agree
// up to fp32 summation order.
#include <ATen/Parallel.h>

#include <vector>

#include "quant_blocks.h"

namespace {

using namespace cq;

// A super-block's 256 inputs in "quad order": per 128 (4 blocks of 32), the first halves (16 each) of the
// 4 blocks, then their second halves; so that one 64-byte load of the weight's nibbles (4 blocks x 16
// bytes: element j low, element j + 16 high) gives, masked, the low half of a quad and, shifted, the
// high half, with no shuffle, and the 4 chunks (128-bit lanes) of either are the quad's 4 blocks.
inline int quad_pos(int b, int i) { return (b / 4) * 128 + (i / 16) * 64 + (b % 4) * 16 + i % 16; }

// One row of x rounded per super-block (see above), quad order; bs: 16 int16 a super-block (q4_k, q5_k:
// the 8 blocks' sums, then zeros; q6_k: the 16 groups' sums, group 2 * block + half).
struct KAct {
  std::vector<int8_t> q;
  std::vector<float> da;
  std::vector<int16_t> bs;
  std::vector<float> ms;  // q4_k, q5_k: da * bs of each block (the mins' term, in floats, VNNI build)
};

// One super-block of a row: its int8 values into q and the sums into bs; returns da.
inline float quantize_super(const float* xs, int64_t kind, int8_t* q, int16_t* bs) {
#ifdef CELLSERVE_QUANT_VNNI  // vectorized, the same values (round_away is std::round)
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xs + i)));
  const float da = _mm512_reduce_max_ps(m) / 127.f;
  const __m512 inv = _mm512_set1_ps(da != 0.f ? 1.f / da : 0.f);
  for (int b = 0; b < 8; ++b) {
    int sums[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = round_away(_mm512_mul_ps(_mm512_loadu_ps(xs + b * 32 + h * 16), inv));
      sums[h] = _mm512_reduce_add_epi32(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + quad_pos(b, h * 16)), _mm512_cvtsepi32_epi8(v));
    }
#else
  float amax = 0.f;
  for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(xs[i]));
  const float da = amax / 127.f, inv = da != 0.f ? 1.f / da : 0.f;
  for (int b = 0; b < 8; ++b) {
    int sums[2] = {0, 0};
    for (int i = 0; i < 32; ++i) {
      const int8_t v = static_cast<int8_t>(std::round(xs[b * 32 + i] * inv));
      q[quad_pos(b, i)] = v;
      sums[i / 16] += v;
    }
#endif
    if (kind == Q6_K) {
      bs[2 * b] = static_cast<int16_t>(sums[0]);
      bs[2 * b + 1] = static_cast<int16_t>(sums[1]);
    } else {
      bs[b] = static_cast<int16_t>(sums[0] + sums[1]);
    }
  }
  return da;
}

KAct quantize_krow(const float* x, int64_t k, int64_t kind) {
  const int64_t sbs = k / 256;
  KAct a;
  a.q.assign(k, 0);
  a.da.assign(sbs, 0.f);
  a.bs.assign(sbs * 16, 0);
  for (int64_t s = 0; s < sbs; ++s) a.da[s] = quantize_super(x + s * 256, kind, a.q.data() + s * 256, a.bs.data() + s * 16);
  if (kind != Q6_K) {
    a.ms.assign(sbs * 8, 0.f);
    for (int64_t b = 0; b < sbs * 8; ++b) a.ms[b] = a.da[b / 8] * static_cast<float>(a.bs[(b / 8) * 16 + b % 8]);
  }
  return a;
}

#ifdef CELLSERVE_QUANT_VNNI
// Quad h of super-block s of a row, unpacked: lo = the 4 blocks' elements 0..15, hi = 16..31 (quad order).
// q5_k/q6_k: the high-bit planes hold 64 bits a pair in the pair order (quant_blocks.h), so the quad's two
// pairs' masks are recombined: their low 32 bits (the first halves) for lo, the high 32 for hi.
template <int KIND>
inline void load_quad(const Row& r, int64_t s, int h, __m512i* lo, __m512i* hi) {
  const __m512i v = _mm512_loadu_si512(r.qs + s * 128 + h * 64);
  *lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
#ifdef __GFNI__  // each byte shifted right by 4 in one instruction (the bit matrix of x >> 4)
  *hi = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
  *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
#endif
  if constexpr (KIND == Q5_K || KIND == Q6_K) {
    constexpr int planes = KIND == Q5_K ? 1 : 2;
    const uint8_t* qh = r.qh + (s * 4 + 2 * h) * 8 * planes;
    for (int pl = 0; pl < planes; ++pl) {
      uint64_t b0, b1;
      std::memcpy(&b0, qh + 8 * pl, 8);
      std::memcpy(&b1, qh + 8 * planes + 8 * pl, 8);
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(16 << pl));
      *lo = _mm512_mask_add_epi8(*lo, _cvtu64_mask64((b0 & 0xFFFFFFFFull) | (b1 << 32)), *lo, bit);
      *hi = _mm512_mask_add_epi8(*hi, _cvtu64_mask64((b0 >> 32) | (b1 & 0xFFFFFFFF00000000ull)), *hi, bit);
    }
  }
}

// The scales of a quad's lanes: chunk c (128-bit lane c, int32 lanes 4c..4c+3, int16 lanes 8c..8c+7) of
// either half of quad h is block 4h + c: q4_k, q5_k: `bytes` picks that scale byte into each int32 lane's
// low byte (the others masked to zero); q6_k: the low half's chunk c is group 2 (4h + c), the high half's
// that + 1: `words` picks it (h = 0) from the int16 scales into each int16 lane.
struct ScaleIdx {
  alignas(64) int8_t bytes[2][64];
  alignas(64) int16_t words[32];
  constexpr ScaleIdx() : bytes{}, words{} {
    for (int l = 0; l < 16; ++l)
      for (int h = 0; h < 2; ++h) bytes[h][4 * l] = static_cast<int8_t>(4 * h + l / 4);
    for (int l = 0; l < 32; ++l) words[l] = static_cast<int16_t>(2 * (l / 8));
  }
};
constexpr ScaleIdx kIdx{};

// acc[i] -= sum over the row's blocks of (dmin * mn_b) * (da * bs_b) (q4_k, q5_k: the mins' term), 16 blocks
// (two super-blocks) a step, in floats: act.ms holds da * bs_b a block.
template <int M>
inline void sub_mins(const Row& r, int64_t sbs, const KAct* const* act, __m512* acc) {
  const __m512i two = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t s = 0; s < sbs; s += 2) {
    const bool one = s + 1 == sbs;
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(one ? 0xFF : 0xFFFF, r.mn + s * 8)));
    const __m128 dm = _mm_cvtph_ps(_mm_maskz_loadu_epi16(one ? 0x1 : 0x3, r.m + s));
    const __m512 wm = _mm512_mul_ps(mn, _mm512_permutexvar_ps(two, _mm512_castps128_ps512(dm)));
    for (int i = 0; i < M; ++i)
      acc[i] = _mm512_fnmadd_ps(wm, _mm512_maskz_loadu_ps(one ? 0xFF : 0xFFFF, act[i]->ms.data() + s * 8), acc[i]);
  }
}

// Decode streams the whole weight from memory once a token, where one core's demand misses alone reached
// ~10 GB/s; prefetching the bytes of the super-block kAhead on (past a row's end: the next row's, the
// arrays being row after row; a prefetch never faults) keeps more lines in flight: a 151 MB q4_k weight
// (32768 x 8192), one row, one thread: 15 -> 9.3 ms (16.7 GB/s); 16 and 24 ahead measured a little slower.
constexpr int64_t kAhead = 32;
template <int KIND>
inline void prefetch_ahead(const Row& r, int64_t s) {
  const char* qs = reinterpret_cast<const char*>(r.qs + s * 128);
  _mm_prefetch(qs, _MM_HINT_T0);
  _mm_prefetch(qs + 64, _MM_HINT_T0);
  if constexpr (KIND != Q4_K) _mm_prefetch(reinterpret_cast<const char*>(r.qh + s * (KIND == Q5_K ? 32 : 64)), _MM_HINT_T0);
}

template <int KIND, int M>
void dot_krows(const Row& r, int64_t sbs, const KAct* const* act, float* out) {
  constexpr int A = KIND == Q6_K && M <= 4 ? 2 : 1;  // int32 accumulators a row (two: shorter chains)
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  if constexpr (KIND != Q6_K) sub_mins<M>(r, sbs, act, acc);
  alignas(64) float dw[16];  // d of 16 super-blocks as floats, read back as broadcasts
  for (int64_t s = 0; s < sbs; ++s) {
    if (s % 16 == 0) {
      const int64_t n = std::min<int64_t>(16, sbs - s);
      _mm512_store_ps(dw, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), r.d + s)));
    }
    prefetch_ahead<KIND>(r, s + kAhead);
    __m512i raw;  // the super-block's scales: bytes [0, 8) (q4_k, q5_k), or int16 lanes [0, 16) (q6_k)
    if constexpr (KIND == Q6_K) {
      raw = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.sc + s * 16))));
    } else {
      raw = _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.sc + s * 8)));
    }
    __m512i iacc[M][A];
    for (int i = 0; i < M; ++i)
      for (int t = 0; t < A; ++t) iacc[i][t] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      __m512i lo, hi, slo, shi;
      load_quad<KIND>(r, s, h, &lo, &hi);
      if constexpr (KIND == Q6_K) {
        const __m512i at = _mm512_add_epi16(_mm512_load_si512(kIdx.words), _mm512_set1_epi16(static_cast<int16_t>(8 * h)));
        slo = _mm512_permutexvar_epi16(at, raw);
        shi = _mm512_permutexvar_epi16(_mm512_add_epi16(at, _mm512_set1_epi16(1)), raw);
      } else {
        slo = shi = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, _mm512_load_si512(kIdx.bytes[h]), raw);
      }
      for (int i = 0; i < M; ++i) {
        const int8_t* aq = act[i]->q.data() + s * 256 + h * 128;
        if constexpr (KIND == Q6_K) {
          iacc[i][0] = _mm512_dpwssd_epi32(iacc[i][0], _mm512_maddubs_epi16(lo, _mm512_loadu_si512(aq)), slo);
          iacc[i][A - 1] = _mm512_dpwssd_epi32(iacc[i][A - 1], _mm512_maddubs_epi16(hi, _mm512_loadu_si512(aq + 64)), shi);
        } else {  // both halves' chunk c is one block: 8 products an int32 lane, then times its scale
          __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(aq));
          t = _mm512_dpbusd_epi32(t, hi, _mm512_loadu_si512(aq + 64));
          iacc[i][0] = _mm512_dpwssd_epi32(iacc[i][0], t, slo);
        }
      }
    }
    if constexpr (A == 2)
      for (int i = 0; i < M; ++i) iacc[i][0] = _mm512_add_epi32(iacc[i][0], iacc[i][1]);
    if constexpr (KIND == Q6_K) {
      const __m512i zsc = _mm512_mullo_epi16(raw, _mm512_set1_epi16(-32));  // -32 * sc_g, |.| <= 4,096
      for (int i = 0; i < M; ++i) {
        const __m512i bs = _mm512_maskz_loadu_epi16(0xFFFF, act[i]->bs.data() + s * 16);  // zeros above 16
        iacc[i][0] = _mm512_dpwssd_epi32(iacc[i][0], zsc, bs);
      }
    }
    const __m512 d = _mm512_set1_ps(dw[s % 16]);
    for (int i = 0; i < M; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(iacc[i][0]), d), _mm512_set1_ps(act[i]->da[s]), acc[i]);
  }
  for (int i = 0; i < M; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#else
template <int KIND, int M>
void dot_krows(const Row& r, int64_t sbs, const KAct* const* act, float* out) {
  uint8_t q[64];
  for (int i = 0; i < M; ++i) out[i] = 0.f;
  for (int64_t s = 0; s < sbs; ++s) {
    int64_t isum[M] = {}, msum[M] = {};
    for (int b = 0; b < 8; ++b) {
      const int64_t blk = s * 8 + b;
      if (b % 2 == 0) unpack_values(KIND, r, blk / 2, 8 * sbs, q);  // the pair order
      for (int half = 0; half < 2; ++half) {  // a scale group (q6_k) or half a block
        const int sc = KIND == Q6_K ? static_cast<int8_t>(r.sc[2 * blk + half]) : r.sc[blk];
        for (int i = 0; i < M; ++i) {
          const int8_t* a = act[i]->q.data() + s * 256;
          int dot = 0;
          for (int e = 16 * half; e < 16 * half + 16; ++e) dot += int(q[pair_pos(KIND, b % 2, e)]) * a[quad_pos(b, e)];
          isum[i] += sc * dot;
        }
      }
    }
    for (int i = 0; i < M; ++i) {
      const int16_t* bs = act[i]->bs.data() + s * 16;
      for (int g = 0; g < 16 && KIND == Q6_K; ++g) isum[i] -= 32 * static_cast<int8_t>(r.sc[s * 16 + g]) * bs[g];
      for (int b = 0; b < 8 && KIND != Q6_K; ++b) msum[i] += r.mn[s * 8 + b] * bs[b];
      const float da = act[i]->da[s];
      out[i] += static_cast<float>(r.d[s]) * da * static_cast<float>(isum[i]);
      if (KIND != Q6_K) out[i] -= static_cast<float>(r.m[s]) * da * static_cast<float>(msum[i]);
    }
  }
}
#endif

template <int KIND>
void run_kkind(const Weight& w, const std::vector<KAct>& act, const float* bias, const float* other, float* y,
               int64_t n_out, bool swiglu) {
  const int64_t sbs = w.k / 256;
  std::vector<const KAct*> ptrs(act.size());
  for (size_t i = 0; i < act.size(); ++i) ptrs[i] = &act[i];
  rows_out(w, static_cast<int64_t>(act.size()), bias, other, y, n_out, swiglu,
           [&](auto m, const Row* r, int nw, int64_t i0, float* sums) {
             const int64_t rows = static_cast<int64_t>(act.size());
             for (int j = 0; j < nw; ++j) dot_krows<KIND, decltype(m)::value>(r[j], sbs, ptrs.data() + i0, sums + j * rows);
           });
}

// The grouped row kernel (krows_experts): parallel over (group, 16 output rows); each (pair, output) takes
// dot_krows' operations and rows_out's epilogue (a zero bias and `other`), as a quant_linear call of the
// pair's row alone on its expert's weight: bitwise the same value, whatever the other pairs are.
template <int KIND>
void run_experts(const Weight& w, const ExpertGroups& e, const KAct* const* act, float* y) {
  constexpr int64_t chunk = 16;
  const int64_t sbs = w.k / 256, per_group = (e.n_out + chunk - 1) / chunk;
  at::parallel_for(0, e.groups * per_group, 1, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> s;  // as rows_out's scratch: no malloc in an OpenMP worker once grown
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / per_group, n0 = (u % per_group) * chunk, n1 = std::min(e.n_out, n0 + chunk);
      const int64_t p0 = e.start[g], m = e.start[g + 1] - p0, base = e.expert[g] * e.per;
      s.resize(static_cast<size_t>(2 * m));
      for (int64_t n = n0; n < n1; ++n) {
        const Row rs[2] = {row_of(w, base + n), row_of(w, base + n + (e.swiglu ? e.n_out : 0))};
        for (int j = 0; j < (e.swiglu ? 2 : 1); ++j)
          for (int64_t i0 = 0; i0 < m; i0 += kGroupRows)
            with_rows(std::min(kGroupRows, m - i0), [&](auto t) {
              dot_krows<KIND, decltype(t)::value>(rs[j], sbs, act + p0 + i0, s.data() + j * m + i0);
            });
        for (int64_t i = 0; i < m; ++i)
          y[(p0 + i) * e.n_out + n] = e.swiglu ? silu(s[i] + 0.f) * (s[m + i] + 0.f) : s[i] + 0.f + 0.f;
      }
    }
  });
}

}  // namespace

void cq::krows_experts(const Weight& w, const ExpertGroups& e, const float* x, int64_t x_rows, const int64_t* src,
                       int64_t pairs, float* y) {
  std::vector<KAct> act(x_rows);
  at::parallel_for(0, x_rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) act[r] = quantize_krow(x + r * w.k, w.k, w.kind);
  });
  std::vector<const KAct*> ptrs(pairs);
  for (int64_t p = 0; p < pairs; ++p) ptrs[p] = &act[src[p]];
  switch (w.kind) {
    case Q4_K: run_experts<Q4_K>(w, e, ptrs.data(), y); break;
    case Q5_K: run_experts<Q5_K>(w, e, ptrs.data(), y); break;
    default: run_experts<Q6_K>(w, e, ptrs.data(), y); break;
  }
}

void cq::krows(const Call& c, float* y) {
  const Weight& w = c.w;
  std::vector<KAct> act(c.rows);
  const float* x = c.x.data_ptr<float>();
  // rows apart in parallel: each row's rounding is its own, whatever thread does it
  at::parallel_for(0, c.rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) act[r] = quantize_krow(x + r * w.k, w.k, w.kind);
  });
  const float* bp = ptr_or_null(c.bias);
  const float* op = ptr_or_null(c.other);
  switch (w.kind) {
    case Q4_K: run_kkind<Q4_K>(w, act, bp, op, y, c.n_out, c.swiglu); break;
    case Q5_K: run_kkind<Q5_K>(w, act, bp, op, y, c.n_out, c.swiglu); break;
    default: run_kkind<Q6_K>(w, act, bp, op, y, c.n_out, c.swiglu); break;
  }
}
