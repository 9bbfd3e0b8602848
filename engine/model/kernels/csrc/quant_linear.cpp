// quant_linear: `x @ W.T` with W held in llama.cpp's block quantizations, read as they are.
//
// The block layouts, the pair order and the per-lane arithmetic: quant_blocks.h.
//
// quant_linear (the row kernel for weights in the row layout: the K-quants, and the 32-weight kinds where K is
// an odd number of blocks (QuantLinear keeps the others in quant_tiles.cpp's tiles); decode and speculative
// verification, up to INVARIANT_ROWS rows, each row computed bitwise as alone; any number of rows without VNNI, in groups of 8 per weight row: quant_blocks.h's
// rows_out), the 32-weight kinds (q8_0, q4_0, q4_1, q5_0, q5_1; the K-quants: quant_krows.cpp, in integers per super-block): each row
// of x is quantized per 32-block to int8 (amax / 127 scale, round half away from zero, as llama.cpp's q8_0
// activations), each weight pair is dotted
// with it in integers (AVX-512 VNNI `vpdpbusd`: unsigned weight bytes x signed activation bytes, 4
// products per int32 lane), and per lane
//   y += dv * (da * dot - z * da * s16 / 4) + mv * da * s16 / 4
// with da the activation block's scale and s16 the sum of the int8 activations of the lane's chunk
// (4 lanes a chunk: the chunk's terms sum to z * da * s16 and mv * da * s16). Each weight pair is
// loaded and unpacked once for a group of up to 8 rows; past one row, two weight rows share each
// activation load. That per-lane float work for every row makes it ~2x slower than quant_gemm at 9-16
// rows (engine/bench/quant_kernels.py), the price of row invariance. Without VNNI the same integer sums
// run in plain C.
//   op "none" y = x W^T + b; "add" y = other + x W^T + b; "swiglu": W = [gate; up] (2n rows),
//   y = silu(x G^T + bg) * (x U^T + bu).
// Many rows with VNNI: quant_gemm.cpp.
// quant_dequant (the fp32-tile path): rows [r0, r1) of W as fp32 (dv * (q - z) + mv,
// no fused multiply-add: equal to gguf-py's dequantize), for the Python side to multiply tile by tile
// (engine/model/native/quant.py), so the whole fp32 matrix never exists. quant_dequant_bf16 (the
// bf16-tile path, prefill on CPUs with native bf16 matmuls): the same values rounded to bf16, vectorized.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "quant_blocks.h"

namespace {

using namespace cq;

// One pair (64 inputs) of one row of x quantized per block, in the kernels' order of a pair; per int32 lane
// (16 a pair): c1 = da, c2 = da * s16 / 4, c0 = -z * c2 (the lane's block and chunk). A call's rows lie
// pair-major ([pair][row]), so a group of rows is read at fixed offsets from one pointer (one array per row
// and field ran the compiler out of registers), the group's records of a pair one after another.
struct alignas(64) PairAct {
  int8_t q[64];
  float c1[16], c0[16], c2[16];
};

// One row of x into act[p * stride] for each pair p (zero-padded to whole pairs: act starts zeroed).
void quantize_row(const float* x, int64_t k, int64_t kind, PairAct* act, int64_t stride) {
  const int64_t nb = k / 32, pairs = (nb + 1) / 2;
  const float z = static_cast<float>(zero_point(kind));
  std::vector<float> da(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    da[b] = amax / 127.f;
    const float inv = da[b] != 0.f ? 1.f / da[b] : 0.f;
    const int64_t pair = b / 2, blk = b % 2;
    int8_t* dst = act[pair * stride].q;
    for (int i = 0; i < 32; ++i) {
      const int8_t v = static_cast<int8_t>(std::round(xb[i] * inv));
      dst[pair_pos(kind, static_cast<int>(blk), i)] = v;
    }
  }
  for (int64_t pair = 0; pair < pairs; ++pair) {
    PairAct& a = act[pair * stride];
    for (int c = 0; c < 4; ++c) {
      const int64_t b = pair * 2 + chunk_block(kind, c);
      if (b >= nb) continue;
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += a.q[c * 16 + i];
      for (int lane = 4 * c; lane < 4 * c + 4; ++lane) {
        a.c1[lane] = da[b];
        a.c2[lane] = da[b] * static_cast<float>(sum) / 4.f;
        a.c0[lane] = -z * a.c2[lane];
      }
    }
  }
}

#ifdef CELLSERVE_QUANT_VNNI
constexpr bool kVnni = true;

// Two fp16 block values (d or m of a pair) spread over the 16 lanes by block.
inline __m512 load_scales(const c10::Half* s, int64_t p, bool half, const __m512i& idx) {
  const __m128i raw = _mm_maskz_loadu_epi16(half ? 0x1 : 0x3, s + p * 2);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(raw)));
}

// M rows of x (act: the first one's pair 0; stride: rows a pair) times W weight rows r[0..W): out[j * ostride + i].
// Past a few rows this kernel streams the activations from L2 (192 bytes a pair and row, for every weight
// row), so two weight rows share each activation load. Each (weight row, row of x) takes the same operations
// in the same order whatever W and M are.
template <int KIND, int M, int W>
void dot_rows(const Row* r, int64_t nb, const PairAct* act, int64_t stride, float* out, int64_t ostride) {
  const int64_t pairs = (nb + 1) / 2;
  // lane -> block of the pair; lane -> q6_k group of the pair (chunk c: block c % 2, half c / 2)
  static_assert(!super_blocks(KIND), "the K-quants: quant_krows.cpp");
  const __m512i idx = KIND == Q8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  constexpr bool has_m = has_mins(KIND);
  __m512 acc[W][M];
  for (int j = 0; j < W; ++j)
    for (int i = 0; i < M; ++i) acc[j][i] = _mm512_setzero_ps();
  constexpr int64_t pair_bytes = KIND == Q8_0 ? 64 : 32;
  for (int64_t p = 0; p < pairs; ++p) {
    const bool half = 2 * p + 1 == nb;
    __m512i w[W];
    __m512 dv[W], mv[W];
    for (int j = 0; j < W; ++j) {
      // as quant_krows.cpp: one core's demand misses alone stream ~10 GB/s; prefetching 4 KiB ahead (past a
      // row's end: the next row's, the rows lying one after another; a prefetch never faults) keeps more in flight
      _mm_prefetch(reinterpret_cast<const char*>(r[j].qs + (p + 4096 / pair_bytes) * pair_bytes), _MM_HINT_T0);
      if (five_bits(KIND)) _mm_prefetch(reinterpret_cast<const char*>(r[j].qh + (p + 4096 / pair_bytes) * 8), _MM_HINT_T0);
      w[j] = load_pair<KIND>(r[j], p, half);
      dv[j] = load_scales(r[j].d, p, half, idx);
      mv[j] = has_m ? load_scales(r[j].m, p, half, idx) : _mm512_setzero_ps();
    }
    const PairAct* ap = act + p * stride;
    for (int i = 0; i < M; ++i) {
      const PairAct& a = ap[i];
      const __m512i q = _mm512_load_si512(a.q);
      const __m512 c1 = _mm512_load_ps(a.c1), c = _mm512_load_ps(has_m ? a.c2 : a.c0);
      for (int j = 0; j < W; ++j) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], q);
        const __m512 f = has_m ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot), c1)
                             : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), c1, c);
        acc[j][i] = _mm512_fmadd_ps(f, dv[j], acc[j][i]);
        if (has_m) acc[j][i] = _mm512_fmadd_ps(mv[j], c, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < W; ++j)
    for (int i = 0; i < M; ++i) out[j * ostride + i] = _mm512_reduce_add_ps(acc[j][i]);
}
#else
constexpr bool kVnni = false;

template <int KIND, int M>
void dot_one(const Row& r, int64_t nb, const PairAct* act, int64_t stride, float* out) {
  uint8_t q[64];
  float dv[16], mv[16];
  for (int i = 0; i < M; ++i) out[i] = 0.f;
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    unpack_pair(KIND, r, p, nb, q, dv, mv);
    for (int i = 0; i < M; ++i) {
      const PairAct& a = act[p * stride + i];
      float s = 0.f;
      for (int lane = 0; lane < 16; ++lane) {
        int dot = 0;
        for (int j = 4 * lane; j < 4 * lane + 4; ++j) dot += int(q[j]) * a.q[j];
        s += dv[lane] * (a.c1[lane] * static_cast<float>(dot) + a.c0[lane]) + mv[lane] * a.c2[lane];
      }
      out[i] += s;
    }
  }
}

template <int KIND, int M, int W>
void dot_rows(const Row* r, int64_t nb, const PairAct* act, int64_t stride, float* out, int64_t ostride) {
  for (int j = 0; j < W; ++j) dot_one<KIND, M>(r[j], nb, act, stride, out + j * ostride);
}
#endif

template <int KIND>
void run_kind(const Weight& w, const std::vector<PairAct>& act, int64_t rows, const float* bias, const float* other,
              float* y, int64_t n_out, bool swiglu) {
  const int64_t nb = w.k / 32;
  rows_out(w, rows, bias, other, y, n_out, swiglu, [&](auto m, const Row* r, int nw, int64_t i0, float* sums) {
    constexpr int M = decltype(m)::value;
    if (nw == 2) return dot_rows<KIND, M, 2>(r, nb, act.data() + i0, rows, sums, rows);
    dot_rows<KIND, M, 1>(r, nb, act.data() + i0, rows, sums, rows);
  });
}

// all the call's rows into y
void run_rows(const Call& c, float* y) {
  const Weight& w = c.w;
  if (super_blocks(w.kind)) return krows(c, y);
  std::vector<PairAct> act((w.k / 32 + 1) / 2 * c.rows);  // zeroed
  const float* x = c.x.data_ptr<float>();
  // rows apart in parallel: each row's rounding is its own, whatever thread does it
  at::parallel_for(0, c.rows, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) quantize_row(x + r * w.k, w.k, w.kind, act.data() + r, c.rows);
  });
  const float* bp = ptr_or_null(c.bias);
  const float* op = ptr_or_null(c.other);
  switch (w.kind) {
    case Q8_0: run_kind<Q8_0>(w, act, c.rows, bp, op, y, c.n_out, c.swiglu); break;
    case Q4_0: run_kind<Q4_0>(w, act, c.rows, bp, op, y, c.n_out, c.swiglu); break;
    case Q5_0: run_kind<Q5_0>(w, act, c.rows, bp, op, y, c.n_out, c.swiglu); break;
    case Q5_1: run_kind<Q5_1>(w, act, c.rows, bp, op, y, c.n_out, c.swiglu); break;
    default: run_kind<Q4_1>(w, act, c.rows, bp, op, y, c.n_out, c.swiglu); break;
  }
}

at::Tensor quant_linear(const at::Tensor& x, at::TensorList wl, int64_t kind, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& other, c10::string_view op) {
  return cq::linear_rows(call_of(x, wl, kind, bias, other, op, "quant_linear"));
}

// fp32 rows; no contraction into a fused multiply-add, so each value rounds as gguf-py's does
__attribute__((optimize("fp-contract=off"))) void dequant_rows(const Weight& w, int64_t r0, int64_t a, int64_t b,
                                                                float* out) {
  const int64_t nb = w.k / 32;
  const float z = static_cast<float>(zero_point(w.kind));
  uint8_t q[64];
  float dv[16], mv[16];
  for (int64_t n = a; n < b; ++n) {
    const Row r = row_of(w, n);
    float* dst = out + (n - r0) * w.k;
    for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
      unpack_pair(w.kind, r, p, nb, q, dv, mv);
      for (int i = 0; i < 64; ++i) {
        const int c = i / 16, lane = i / 4;
        const int64_t blk = 2 * p + chunk_block(w.kind, c);
        if (blk >= nb) continue;
        const float v = dv[lane] * (static_cast<float>(q[i]) - z);
        dst[blk * 32 + chunk_half(w.kind, c) * 16 + i % 16] = w.m ? v + mv[lane] : v;
      }
    }
  }
}

at::Tensor quant_dequant(at::TensorList wl, int64_t kind, int64_t r0, int64_t r1) {
  const Weight w = weight_of(wl, kind);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n, "quant_dequant: rows out of range");
  auto out = at::empty({r1 - r0, w.k}, wl[0].options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequant_rows(w, r0, a, b, op); });
  return out;
}

#if defined(CELLSERVE_QUANT_VNNI) && defined(__AVX512BF16__)
constexpr bool kBf16 = true;

// rows [a, b) of W as bf16: the fp32 values quant_dequant gives (dv * (q - z), then + mv; no fused
// multiply-add), each rounded to nearest even
template <int KIND>
__attribute__((optimize("fp-contract=off"))) void dequant_bf16_rows(const Weight& w, int64_t r0, int64_t a, int64_t b,
                                                                     at::BFloat16* out) {
  const int64_t nb = w.k / 32;
  const __m512 z = _mm512_set1_ps(static_cast<float>(zero_point(KIND)));
  for (int64_t n = a; n < b; ++n) {
    const Row r = row_of(w, n);
    at::BFloat16* dst = out + (n - r0) * w.k;
    for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
      const __m512i q = load_pair<KIND>(r, p, 2 * p + 1 == nb);
      for (int c = 0; c < 4; ++c) {
        const int64_t blk = 2 * p + chunk_block(KIND, c);
        if (blk >= nb) continue;
        const int half = chunk_half(KIND, c);
        __m512 v = _mm512_mul_ps(_mm512_set1_ps(block_dv(KIND, r, blk, half)), _mm512_sub_ps(chunk_floats(q, c), z));
        if (has_mins(KIND)) v = _mm512_add_ps(v, _mm512_set1_ps(block_mv(KIND, r, blk)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + blk * 32 + half * 16), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

at::Tensor quant_dequant_bf16(at::TensorList wl, int64_t kind, int64_t r0, int64_t r1) {
  const Weight w = weight_of(wl, kind);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n, "quant_dequant_bf16: rows out of range");
  auto out = at::empty({r1 - r0, w.k}, wl[0].options().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) {
    switch (kind) {
      case Q8_0: dequant_bf16_rows<Q8_0>(w, r0, a, b, op); break;
      case Q4_0: dequant_bf16_rows<Q4_0>(w, r0, a, b, op); break;
      case Q4_1: dequant_bf16_rows<Q4_1>(w, r0, a, b, op); break;
      case Q5_0: dequant_bf16_rows<Q5_0>(w, r0, a, b, op); break;
      case Q5_1: dequant_bf16_rows<Q5_1>(w, r0, a, b, op); break;
      case Q4_K: dequant_bf16_rows<Q4_K>(w, r0, a, b, op); break;
      case Q5_K: dequant_bf16_rows<Q5_K>(w, r0, a, b, op); break;
      default: dequant_bf16_rows<Q6_K>(w, r0, a, b, op); break;
    }
  });
  return out;
}
#else
constexpr bool kBf16 = false;

at::Tensor quant_dequant_bf16(at::TensorList wl, int64_t kind, int64_t r0, int64_t r1) {
  return quant_dequant(wl, kind, r0, r1).to(at::kBFloat16);  // correct, not fast
}
#endif

bool quant_linear_fast() { return kVnni; }
// whether quant_dequant_bf16 is vectorized and the CPU multiplies bf16 natively (AVX512-BF16)
bool quant_bf16_fast() { return kBf16; }

}  // namespace

at::Tensor cq::linear_rows(const Call& c) {
  auto y = at::empty({c.rows, c.n_out}, c.x.options());
  run_rows(c, y.data_ptr<float>());
  return y;
}

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("quant_linear(Tensor x, Tensor[] w, int kind, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("quant_dequant(Tensor[] w, int kind, int r0, int r1) -> Tensor");
  m.def("quant_dequant_bf16(Tensor[] w, int kind, int r0, int r1) -> Tensor");
  m.def("quant_linear_fast() -> bool", &quant_linear_fast);
  m.def("quant_bf16_fast() -> bool", &quant_bf16_fast);
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequant", &quant_dequant);
  m.impl("quant_dequant_bf16", &quant_dequant_bf16);
}
