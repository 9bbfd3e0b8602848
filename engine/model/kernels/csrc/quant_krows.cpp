// quant_krows: the 1-to-8-row kernel (quant_linear.cpp's quant_linear, 8 rows at a time) for the K-quants
// (q4_k, q5_k, q6_k), accumulating in integers over each 256-weight super-block, as llama.cpp's q4_K x q8_K.
//
// Activations (llama.cpp's q8_K): each row is rounded per super-block to int8, one scale da = amax / 127 per
// 256 inputs, half away from zero, laid out in the pair order (quant_blocks.h); with per super-block the
// sums bs of the int8 values of each 32-block (q4_k, q5_k: for the mins) or of each 16-weight group (q6_k:
// for the zero point 32), as int16 (|bs| <= 32 * 127).
// Per super-block and row, with the weight's integer scales sc (q4_k, q5_k: 6-bit per 32-block; q6_k: int8
// per 16-weight group) and 6-bit mins mn, q the unsigned weight values, a the int8 activations:
//   isum = sum_g sc_g * sum_{k in g} q_k a_k   (q6_k: - 32 * sum_g sc_g * bs_g)
//   y   += (d * da) * isum                     (q4_k, q5_k: - (dmin * da) * sum_j mn_j * bs_j)
// With VNNI, per pair of 32-blocks: `vpmaddubsw` (unsigned weight bytes x signed activation bytes -> int16
// sums of two products), then `vpdpwssd` by each 16-bit lane's integer scale (the super-block's scales as
// int16, spread over a pair's lanes once a pair with one `vpermw`, shared by the rows) into one int32
// accumulator a row; the float work (two conversions and multiply-adds, the mins' `vpmaddwd`) is once a
// super-block, not once a pair. The weight unpacking is shared by the rows, as in quant_linear.cpp.
// Ranges: a `vpmaddubsw` lane is at most 2 * 15 * 127 = 3,810 (q4_k), 2 * 31 * 127 = 7,874 (q5_k),
// 2 * 63 * 127 = 16,002 (q6_k) in size: below 32,767, so never saturated. An int32 lane takes two of them
// times a scale (<= 63; q6_k <= 128) per pair, 4 pairs a super-block: <= 4 * 2 * 16,002 * 128 = 16.4M;
// q6_k's zero-point term adds <= 2 * (32 * 128) * (16 * 127) = 16.6M; the mins' dot <= 2 * 63 * 4,064
// a lane. All far below 2^31.
// Without VNNI the same integers are summed in plain C (the same activation rounding), so both builds agree
// up to fp32 summation order.
#include <ATen/Parallel.h>

#include <vector>

#include "quant_blocks.h"

namespace {

using namespace cq;

// One row of x rounded per super-block (see above); bs: 16 int16 a super-block (q4_k, q5_k: the 8 blocks'
// sums, then zeros; q6_k: the 16 groups' sums, group 2 * block + half).
struct KAct {
  std::vector<int8_t> q;
  std::vector<float> da;
  std::vector<int16_t> bs;
};

KAct quantize_krow(const float* x, int64_t k, int64_t kind) {
  const int64_t sbs = k / 256;
  KAct a;
  a.q.assign(k, 0);
  a.da.assign(sbs, 0.f);
  a.bs.assign(sbs * 16, 0);
  for (int64_t s = 0; s < sbs; ++s) {
    const float* xs = x + s * 256;
    float amax = 0.f;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(xs[i]));
    const float da = amax / 127.f, inv = da != 0.f ? 1.f / da : 0.f;
    a.da[s] = da;
    for (int b = 0; b < 8; ++b) {
      int8_t* dst = a.q.data() + (s * 4 + b / 2) * 64;
      int sums[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        const int8_t v = static_cast<int8_t>(std::round(xs[b * 32 + i] * inv));
        dst[pair_pos(kind, b % 2, i)] = v;
        sums[i / 16] += v;
      }
      int16_t* bs = a.bs.data() + s * 16;
      if (kind == Q6_K) {
        bs[2 * b] = static_cast<int16_t>(sums[0]);
        bs[2 * b + 1] = static_cast<int16_t>(sums[1]);
      } else {
        bs[b] = static_cast<int16_t>(sums[0] + sums[1]);
      }
    }
  }
  return a;
}

#ifdef CELLSERVE_QUANT_VNNI
// Per pair place j in the super-block, the scale index of each 16-bit lane l of the pair: chunk c = l / 8
// is half c / 2 of the pair's block c % 2, so sub-block 2j + c % 2 (q4_k, q5_k) or group 4j + 2 (c % 2) + c / 2
// (q6_k). Pair j's index is kIdx + j * kStep.
template <int KIND>
struct ScaleIdx {
  alignas(64) int16_t v[32];
  constexpr ScaleIdx() : v{} {
    for (int l = 0; l < 32; ++l) v[l] = static_cast<int16_t>(KIND == Q6_K ? 2 * (l / 8 % 2) + l / 16 : l / 8 % 2);
  }
};
template <int KIND>
constexpr ScaleIdx<KIND> kIdx{};
template <int KIND>
constexpr int16_t kStep = KIND == Q6_K ? 4 : 2;

template <int KIND, int M>
void dot_krows(const Row& r, int64_t sbs, const KAct* act, float* out) {
  const __m512i idx = _mm512_load_si512(kIdx<KIND>.v);
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t s = 0; s < sbs; ++s) {
    // the super-block's scales as int16 in lanes [0, 8) (q4_k, q5_k) or [0, 16) (q6_k), zeros above
    __m512i sc16;
    if constexpr (KIND == Q6_K) {
      sc16 = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.sc + s * 16))));
    } else {
      sc16 = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.sc + s * 8))));
    }
    __m512i iacc[M];
    for (int i = 0; i < M; ++i) iacc[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const int64_t p = s * 4 + j;
      const __m512i w = load_pair<KIND>(r, p, false);
      const __m512i scj = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(kStep<KIND> * j)), sc16);
      for (int i = 0; i < M; ++i) {
        const __m512i prod = _mm512_maddubs_epi16(w, _mm512_loadu_si512(act[i].q.data() + p * 64));
        iacc[i] = _mm512_dpwssd_epi32(iacc[i], prod, scj);
      }
    }
    const float d = half_to_float(r.d[s]);
    if constexpr (KIND == Q6_K) {
      const __m512i zsc = _mm512_mullo_epi16(sc16, _mm512_set1_epi16(-32));  // -32 * sc_g, |.| <= 4,096
      for (int i = 0; i < M; ++i) {
        const __m512i bs = _mm512_maskz_loadu_epi16(0xFFFF, act[i].bs.data() + s * 16);
        iacc[i] = _mm512_dpwssd_epi32(iacc[i], zsc, bs);
      }
    }
    for (int i = 0; i < M; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[i]), _mm512_set1_ps(d * act[i].da[s]), acc[i]);
    if constexpr (KIND != Q6_K) {
      const float dmin = half_to_float(r.m[s]);
      const __m512i mn16 =
          _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.mn + s * 8))));
      for (int i = 0; i < M; ++i) {
        const __m512i bs = _mm512_maskz_loadu_epi16(0xFF, act[i].bs.data() + s * 16);
        const __m512 md = _mm512_cvtepi32_ps(_mm512_madd_epi16(mn16, bs));  // lanes [0, 4): the pairs of blocks
        acc[i] = _mm512_fmadd_ps(md, _mm512_set1_ps(-dmin * act[i].da[s]), acc[i]);
      }
    }
  }
  for (int i = 0; i < M; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#else
template <int KIND, int M>
void dot_krows(const Row& r, int64_t sbs, const KAct* act, float* out) {
  uint8_t q[64];
  for (int i = 0; i < M; ++i) out[i] = 0.f;
  for (int64_t s = 0; s < sbs; ++s) {
    int64_t isum[M] = {}, msum[M] = {};
    for (int64_t p = s * 4; p < s * 4 + 4; ++p) {
      unpack_values(KIND, r, p, 8 * sbs, q);
      for (int c = 0; c < 4; ++c) {  // chunk c: 16 weights of one scale group
        const int64_t b = 2 * p + chunk_block(KIND, c);
        const int sc = KIND == Q6_K ? static_cast<int8_t>(r.sc[2 * b + chunk_half(KIND, c)]) : r.sc[b];
        for (int i = 0; i < M; ++i) {
          int dot = 0;
          for (int e = 16 * c; e < 16 * c + 16; ++e) dot += int(q[e]) * act[i].q[p * 64 + e];
          isum[i] += sc * dot;
        }
      }
    }
    for (int i = 0; i < M; ++i) {
      const int16_t* bs = act[i].bs.data() + s * 16;
      for (int g = 0; g < 16 && KIND == Q6_K; ++g) isum[i] -= 32 * static_cast<int8_t>(r.sc[s * 16 + g]) * bs[g];
      for (int b = 0; b < 8 && KIND != Q6_K; ++b) msum[i] += r.mn[s * 8 + b] * bs[b];
      const float da = act[i].da[s];
      out[i] += static_cast<float>(r.d[s]) * da * static_cast<float>(isum[i]);
      if (KIND != Q6_K) out[i] -= static_cast<float>(r.m[s]) * da * static_cast<float>(msum[i]);
    }
  }
}
#endif

template <int KIND, int M>
void run_krows(const Weight& w, const std::vector<KAct>& act, const float* bias, const float* other, float* y,
               int64_t n_out, bool swiglu) {
  const int64_t sbs = w.k / 256;
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    float a[M], b[M];
    for (int64_t n = n0; n < n1; ++n) {
      dot_krows<KIND, M>(row_of(w, n), sbs, act.data(), a);
      if (swiglu) {
        const int64_t u = n + n_out;
        dot_krows<KIND, M>(row_of(w, u), sbs, act.data(), b);
        const float bg = bias ? bias[n] : 0.f, bu = bias ? bias[u] : 0.f;
        for (int r = 0; r < M; ++r) y[r * n_out + n] = silu(a[r] + bg) * (b[r] + bu);
        continue;
      }
      const float bn = bias ? bias[n] : 0.f;
      for (int r = 0; r < M; ++r) y[r * n_out + n] = a[r] + bn + (other ? other[r * n_out + n] : 0.f);
    }
  });
}

template <int KIND>
void run_kkind(const Weight& w, const std::vector<KAct>& act, const float* bias, const float* other, float* y,
               int64_t n_out, bool swiglu) {
  switch (act.size()) {
    case 1: run_krows<KIND, 1>(w, act, bias, other, y, n_out, swiglu); break;
    case 2: run_krows<KIND, 2>(w, act, bias, other, y, n_out, swiglu); break;
    case 3: run_krows<KIND, 3>(w, act, bias, other, y, n_out, swiglu); break;
    case 4: run_krows<KIND, 4>(w, act, bias, other, y, n_out, swiglu); break;
    case 5: run_krows<KIND, 5>(w, act, bias, other, y, n_out, swiglu); break;
    case 6: run_krows<KIND, 6>(w, act, bias, other, y, n_out, swiglu); break;
    case 7: run_krows<KIND, 7>(w, act, bias, other, y, n_out, swiglu); break;
    default: run_krows<KIND, 8>(w, act, bias, other, y, n_out, swiglu); break;
  }
}

}  // namespace

void cq::krows_eight(const Call& c, int64_t r0, int64_t count, float* y) {
  const Weight& w = c.w;
  std::vector<KAct> act;
  for (int64_t r = r0; r < r0 + count; ++r) act.push_back(quantize_krow(c.x.data_ptr<float>() + r * w.k, w.k, w.kind));
  const float* bp = ptr_or_null(c.bias);
  const float* op = c.other.defined() ? c.other.data_ptr<float>() + r0 * c.n_out : nullptr;
  float* yp = y + r0 * c.n_out;
  switch (w.kind) {
    case Q4_K: run_kkind<Q4_K>(w, act, bp, op, yp, c.n_out, c.swiglu); break;
    case Q5_K: run_kkind<Q5_K>(w, act, bp, op, yp, c.n_out, c.swiglu); break;
    default: run_kkind<Q6_K>(w, act, bp, op, yp, c.n_out, c.swiglu); break;
  }
}
