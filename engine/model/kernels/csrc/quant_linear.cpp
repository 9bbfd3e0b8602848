// quant_linear: `x @ W.T` with W held in llama.cpp's 32-weight block quantizations, read as they are.
//
// A weight [N, K] of kind q8_0, q4_0 or q4_1 is three arrays, one row of blocks per output row
// (engine/loader/gguf_tensors.py repacks the file's interleaved blocks into them once at load):
//   qs  uint8 [N, K]    q8_0: the file's int8 value + 128 (so every kind is unsigned)
//       uint8 [N, K/2]  q4_0/q4_1: the file's 16 bytes per block, byte j = element j (low nibble)
//                       and element j + 16 (high nibble), as ggml packs them
//   d   fp16  [N, K/32] the block's scale
//   m   fp16  [N, K/32] q4_1's block minimum (absent for the others)
// and a weight is w = d * (q - z) + m with the zero point z = 128 (q8_0), 8 (q4_0), 0 (q4_1).
// Bytes per weight: q8_0 1.0625, q4_0 0.5625, q4_1 0.625 (the file's own sizes).
//
// quant_linear (1 to 4 rows, decode): each row of x is quantized per 32-block to int8 (amax / 127
// scale, round half away from zero, as llama.cpp's q8_0/q8_1 activations), and each weight block is
// dotted with it in integers (AVX-512 VNNI `vpdpbusd`: unsigned weight bytes x signed activation
// bytes, 4 products per int32 lane), then
//   y = sum_b  d_b * (da_b * dot_b - z * da_b * sa_b)  +  m_b * da_b * sa_b
// with da_b the activation block's scale and sa_b the sum of its int8 values. Each weight block is
// loaded and unpacked once for all the rows. Without VNNI the same integer sums run in plain C.
//   op "none" y = x W^T + b; "add" y = other + x W^T + b; "swiglu": W = [gate; up] (2n rows),
//   y = silu(x G^T + bg) * (x U^T + bu).
// quant_dequant (many rows: prefill, batched decode): rows [r0, r1) of W as fp32, for the Python side
// to multiply tile by tile (engine/model/native/quant.py), so the whole fp32 matrix never exists.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;
enum Kind : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

inline int zero_point(int64_t kind) { return kind == Q8_0 ? 128 : (kind == Q4_0 ? 8 : 0); }
inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// One row of x quantized per block, in the order the kernel reads weights: for q4 kinds, within each
// pair of blocks (64 values) the order is [b0 0..15, b1 0..15, b0 16..31, b1 16..31] (low nibbles of
// both blocks, then high nibbles); for q8_0, the natural order. Zero-padded to whole pairs.
// c1/c0/c2 hold, per int32 lane of a pair (16 lanes), da_b, -z da_b sa_b / 8 and da_b sa_b / 8 of the
// lane's block (8 lanes per block), so a pair's contribution is lane-wise arithmetic.
struct Activation {
  std::vector<int8_t> q;
  std::vector<float> c1, c0, c2;
};

inline int lane_block(int64_t kind, int lane) {  // which block of a pair an int32 lane belongs to
  return kind == Q8_0 ? lane / 8 : (lane / 4) % 2;
}

Activation quantize_row(const float* x, int64_t k, int64_t kind) {
  const int64_t nb = k / 32, pairs = (nb + 1) / 2;
  Activation a;
  a.q.assign(pairs * 64, 0);
  a.c1.assign(pairs * 16, 0.f);
  a.c0.assign(pairs * 16, 0.f);
  a.c2.assign(pairs * 16, 0.f);
  const int z = zero_point(kind);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float da = amax / 127.f, inv = da != 0.f ? 1.f / da : 0.f;
    int8_t q[32];
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      q[i] = static_cast<int8_t>(std::round(xb[i] * inv));
      sum += q[i];
    }
    const int64_t pair = b / 2, half = b % 2;
    int8_t* dst = a.q.data() + pair * 64;
    if (kind == Q8_0) {
      std::memcpy(dst + half * 32, q, 32);
    } else {
      std::memcpy(dst + half * 16, q, 16);
      std::memcpy(dst + 32 + half * 16, q + 16, 16);
    }
    for (int lane = 0; lane < 16; ++lane) {
      if (lane_block(kind, lane) != half) continue;
      a.c1[pair * 16 + lane] = da;
      a.c0[pair * 16 + lane] = -static_cast<float>(z) * da * static_cast<float>(sum) / 8.f;
      a.c2[pair * 16 + lane] = da * static_cast<float>(sum) / 8.f;
    }
  }
  return a;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kVnni = true;

// The 64 unsigned weight bytes of pair p of a row (the second block zero when `half`).
inline __m512i load_pair(const uint8_t* qs, int64_t kind, int64_t p, bool half) {
  if (kind == Q8_0) {
    const uint8_t* src = qs + p * 64;
    return half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src) : _mm512_loadu_si512(src);
  }
  const uint8_t* src = qs + p * 32;
  const __m256i v = half ? _mm256_maskz_loadu_epi8(0xFFFFu, src) : _mm256_loadu_si256((const __m256i*)src);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Two fp16 block values (d or m of a pair) spread over the 16 lanes by block.
inline __m512 load_scales(const c10::Half* s, int64_t p, bool half, const __m512i& idx) {
  const __m128i raw = _mm_maskz_loadu_epi16(half ? 0x1 : 0x3, s + p * 2);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(raw)));
}

template <int M>
void dot_rows(const uint8_t* qs, const c10::Half* d, const c10::Half* mn, int64_t kind, int64_t nb,
              const Activation* act, float* out) {
  const int64_t pairs = (nb + 1) / 2;
  const __m512i idx = kind == Q8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bool half = 2 * p + 1 == nb;
    const __m512i w = load_pair(qs, kind, p, half);
    const __m512 dv = load_scales(d, p, half, idx);
    __m512 mv = _mm512_setzero_ps();
    if (mn) mv = load_scales(mn, p, half, idx);
    for (int r = 0; r < M; ++r) {
      const Activation& a = act[r];
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(a.q.data() + p * 64));
      const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.c1.data() + p * 16),
                                       _mm512_loadu_ps(a.c0.data() + p * 16));
      acc[r] = _mm512_fmadd_ps(f, dv, acc[r]);
      if (mn) acc[r] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(a.c2.data() + p * 16), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#else
constexpr bool kVnni = false;

template <int M>
void dot_rows(const uint8_t* qs, const c10::Half* d, const c10::Half* mn, int64_t kind, int64_t nb,
              const Activation* act, float* out) {
  for (int r = 0; r < M; ++r) {
    const Activation& a = act[r];
    float s = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t p = b / 2, half = b % 2;
      int dot = 0;
      if (kind == Q8_0) {
        for (int i = 0; i < 32; ++i) dot += int(qs[b * 32 + i]) * a.q[p * 64 + half * 32 + i];
      } else {
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = qs[b * 16 + j];
          dot += int(byte & 0x0F) * a.q[p * 64 + half * 16 + j] + int(byte >> 4) * a.q[p * 64 + 32 + half * 16 + j];
        }
      }
      const int lane = kind == Q8_0 ? half * 8 : half * 4;  // any lane of block b holds its constants
      const float c1 = a.c1[p * 16 + lane], c0 = 8.f * a.c0[p * 16 + lane], c2 = 8.f * a.c2[p * 16 + lane];
      s += static_cast<float>(d[b]) * (c1 * static_cast<float>(dot) + c0);
      if (mn) s += static_cast<float>(mn[b]) * c2;
    }
    out[r] = s;
  }
}
#endif

struct Weight {
  const uint8_t* qs;
  const c10::Half* d;
  const c10::Half* m;
  int64_t kind, n, k, row_bytes;
};

Weight weight_of(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t kind) {
  TORCH_CHECK(kind == Q8_0 || kind == Q4_0 || kind == Q4_1, "quant: kind must be 0 (q8_0), 1 (q4_0) or 2 (q4_1)");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.scalar_type() == at::kByte, "quant: qs must be contiguous uint8 [N, bytes]");
  TORCH_CHECK(d.dim() == 2 && d.is_contiguous() && d.scalar_type() == at::kHalf && d.size(0) == qs.size(0),
              "quant: d must be contiguous fp16 [N, K/32]");
  const int64_t nb = d.size(1), k = nb * 32;
  TORCH_CHECK(qs.size(1) == (kind == Q8_0 ? k : k / 2), "quant: qs has the wrong row length for its kind");
  const bool has_m = m.has_value() && m->defined();
  TORCH_CHECK(has_m == (kind == Q4_1), "quant: m is given exactly for q4_1");
  if (has_m)
    TORCH_CHECK(m->is_contiguous() && m->scalar_type() == at::kHalf && m->sizes() == d.sizes(), "quant: m must be like d");
  return {qs.data_ptr<uint8_t>(), d.data_ptr<c10::Half>(), has_m ? m->data_ptr<c10::Half>() : nullptr,
          kind, qs.size(0), k, qs.size(1)};
}

template <int M>
void run_rows(const Weight& w, const std::vector<Activation>& act, const float* bias, const float* other, float* y,
              int64_t n_out, bool swiglu) {
  const int64_t nb = w.k / 32;
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    float a[M], b[M];
    for (int64_t n = n0; n < n1; ++n) {
      dot_rows<M>(w.qs + n * w.row_bytes, w.d + n * nb, w.m ? w.m + n * nb : nullptr, w.kind, nb, act.data(), a);
      if (swiglu) {
        const int64_t u = n + n_out;
        dot_rows<M>(w.qs + u * w.row_bytes, w.d + u * nb, w.m ? w.m + u * nb : nullptr, w.kind, nb, act.data(), b);
        const float bg = bias ? bias[n] : 0.f, bu = bias ? bias[u] : 0.f;
        for (int r = 0; r < M; ++r) y[r * n_out + n] = silu(a[r] + bg) * (b[r] + bu);
        continue;
      }
      const float bn = bias ? bias[n] : 0.f;
      for (int r = 0; r < M; ++r) y[r * n_out + n] = a[r] + bn + (other ? other[r * n_out + n] : 0.f);
    }
  });
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m,
                        int64_t kind, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& other,
                        c10::string_view op_view) {
  const std::string op(op_view);
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", "quant_linear: op must be none, add or swiglu");
  const Weight w = weight_of(qs, d, m, kind);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) >= 1 &&
                  x.size(0) <= kMaxRows && x.size(1) == w.k,
              "quant_linear: x must be contiguous float32 [rows <= 4, K]");
  const bool swiglu = op == "swiglu";
  TORCH_CHECK(!swiglu || w.n % 2 == 0, "quant_linear: swiglu needs [gate; up] rows");
  const int64_t n_out = swiglu ? w.n / 2 : w.n;
  at::Tensor b, o;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == w.n, "quant_linear: bias must have one value per weight row");
  }
  if (op == "add") {
    TORCH_CHECK(other.has_value(), "quant_linear: op add needs `other`");
    o = other->to(at::kFloat).contiguous();
    TORCH_CHECK(o.dim() == 2 && o.size(0) == x.size(0) && o.size(1) == n_out, "quant_linear: `other` must be [rows, N]");
  }
  const int64_t rows = x.size(0);
  std::vector<Activation> act;
  for (int64_t r = 0; r < rows; ++r) act.push_back(quantize_row(x.data_ptr<float>() + r * w.k, w.k, kind));
  auto y = at::empty({rows, n_out}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* op_ = o.defined() ? o.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  switch (rows) {
    case 1: run_rows<1>(w, act, bp, op_, yp, n_out, swiglu); break;
    case 2: run_rows<2>(w, act, bp, op_, yp, n_out, swiglu); break;
    case 3: run_rows<3>(w, act, bp, op_, yp, n_out, swiglu); break;
    default: run_rows<4>(w, act, bp, op_, yp, n_out, swiglu); break;
  }
  return y;
}

at::Tensor quant_dequant(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t kind,
                         int64_t r0, int64_t r1) {
  const Weight w = weight_of(qs, d, m, kind);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= w.n, "quant_dequant: rows out of range");
  auto out = at::empty({r1 - r0, w.k}, qs.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t nb = w.k / 32;
  const float z = static_cast<float>(zero_point(kind));
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      const uint8_t* q = w.qs + n * w.row_bytes;
      float* dst = op + (n - r0) * w.k;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const float dd = static_cast<float>(w.d[n * nb + blk]), mm = w.m ? static_cast<float>(w.m[n * nb + blk]) : 0.f;
        float* o = dst + blk * 32;
        if (kind == Q8_0) {
          for (int i = 0; i < 32; ++i) o[i] = dd * (static_cast<float>(q[blk * 32 + i]) - z) + mm;
        } else {
          for (int j = 0; j < 16; ++j) {
            const uint8_t byte = q[blk * 16 + j];
            o[j] = dd * (static_cast<float>(byte & 0x0F) - z) + mm;
            o[j + 16] = dd * (static_cast<float>(byte >> 4) - z) + mm;
          }
        }
      }
    }
  });
  return out;
}

bool quant_linear_fast() { return kVnni; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("quant_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, int kind, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("quant_dequant(Tensor qs, Tensor d, Tensor? m, int kind, int r0, int r1) -> Tensor");
  m.def("quant_linear_fast() -> bool", &quant_linear_fast);
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequant", &quant_dequant);
}
