// quant_linear: `x @ W.T` with W held in llama.cpp's block quantizations, read as they are.
//
// A weight [N, K] of kind q8_0, q4_0, q4_1 (32-weight blocks), q4_k, q5_k or q6_k (256-weight
// super-blocks of 32- or 16-weight groups) is up to six arrays, one row of blocks per output row
// (engine/loader/gguf_tensors.py repacks the file's blocks into them once at load and documents them):
//   qs  uint8 [N, K] (q8_0: the int8 value + 128) or [N, K/2] (every other kind: per 32 weights,
//       byte j = element j (low nibble) | element j + 16 (high nibble), Q4_0's own layout)
//   d   fp16  [N, K/32] the block's scale, or [N, K/256] the super-block's d (K-quants)
//   m   fp16  q4_1: [N, K/32] the block minimum; q4_k/q5_k: [N, K/256] dmin
//   sc  q4_k/q5_k uint8 [N, K/32] 6-bit scales; q6_k int8 [N, K/16]
//   mn  q4_k/q5_k uint8 [N, K/32] 6-bit mins
//   qh  high bits per 64 weights in the order below: q5_k 8 bytes (bit 4), q6_k 16 (bit 4, bit 5 planes)
// The kernels read the weights two 32-blocks ("a pair", 64 weights) at a time, in this order:
// q8_0 the natural one; the others [b0 0..15, b1 0..15, b0 16..31, b1 16..31] (low nibbles of both
// blocks, then high nibbles). Each 16 consecutive positions ("a chunk") are 16 weights of one block
// (a q6_k scale group), and each int32 lane (4 positions) lies in one chunk. Per lane the weight is
//   w = dv * (q - z) + mv
// with z = 128 (q8_0), 8 (q4_0), 32 (q6_k), else 0; dv = d (32-weight kinds), d * sc_j (q4_k, q5_k),
// d * sc_g (q6_k); mv = m (q4_1), -dmin * mn_j (q4_k, q5_k), else 0.
//
// quant_linear (1 to 8 rows: decode, batched decode): each row of x is quantized per 32-block to int8 (amax / 127
// scale, round half away from zero, as llama.cpp's q8_0/q8_K activations), each weight pair is dotted
// with it in integers (AVX-512 VNNI `vpdpbusd`: unsigned weight bytes x signed activation bytes, 4
// products per int32 lane), and per lane
//   y += dv * (da * dot - z * da * s16 / 4) + mv * da * s16 / 4
// with da the activation block's scale and s16 the sum of the int8 activations of the lane's chunk
// (4 lanes a chunk: the chunk's terms sum to z * da * s16 and mv * da * s16). Each weight pair is
// loaded and unpacked once for all the rows. Without VNNI the same integer sums run in plain C.
//   op "none" y = x W^T + b; "add" y = other + x W^T + b; "swiglu": W = [gate; up] (2n rows),
//   y = silu(x G^T + bg) * (x U^T + bu).
// quant_dequant (many rows: prefill, batched decode): rows [r0, r1) of W as fp32 (dv * (q - z) + mv,
// no fused multiply-add: equal to gguf-py's dequantize), for the Python side to multiply tile by tile
// (engine/model/native/quant.py), so the whole fp32 matrix never exists.
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

constexpr int64_t kMaxRows = 8;
enum Kind : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

inline int zero_point(int64_t kind) {
  switch (kind) {
    case Q8_0: return 128;
    case Q4_0: return 8;
    case Q6_K: return 32;
    default: return 0;
  }
}
inline bool super_blocks(int64_t kind) { return kind >= Q4_K; }
inline float silu(float v) { return v / (1.f + std::exp(-v)); }
// which block of the pair chunk c (positions 16c..16c+15) belongs to, and which half of that block
inline int chunk_block(int64_t kind, int c) { return kind == Q8_0 ? c / 2 : c % 2; }
inline int chunk_half(int64_t kind, int c) { return kind == Q8_0 ? c % 2 : c / 2; }

// One row of x quantized per block, in the kernels' order of a pair (zero-padded to whole pairs);
// per int32 lane (16 a pair): c1 = da, c2 = da * s16 / 4, c0 = -z * c2 (the lane's block and chunk).
struct Activation {
  std::vector<int8_t> q;
  std::vector<float> c1, c0, c2;
};

Activation quantize_row(const float* x, int64_t k, int64_t kind) {
  const int64_t nb = k / 32, pairs = (nb + 1) / 2;
  Activation a;
  a.q.assign(pairs * 64, 0);
  a.c1.assign(pairs * 16, 0.f);
  a.c0.assign(pairs * 16, 0.f);
  a.c2.assign(pairs * 16, 0.f);
  const float z = static_cast<float>(zero_point(kind));
  std::vector<float> da(nb);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    da[b] = amax / 127.f;
    const float inv = da[b] != 0.f ? 1.f / da[b] : 0.f;
    const int64_t pair = b / 2, blk = b % 2;
    int8_t* dst = a.q.data() + pair * 64;
    for (int i = 0; i < 32; ++i) {
      const int8_t v = static_cast<int8_t>(std::round(xb[i] * inv));
      const int pos = kind == Q8_0 ? blk * 32 + i : (i / 16) * 32 + blk * 16 + i % 16;
      dst[pos] = v;
    }
  }
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int c = 0; c < 4; ++c) {
      const int64_t b = pair * 2 + chunk_block(kind, c);
      if (b >= nb) continue;
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += a.q[pair * 64 + c * 16 + i];
      for (int lane = 4 * c; lane < 4 * c + 4; ++lane) {
        a.c1[pair * 16 + lane] = da[b];
        a.c2[pair * 16 + lane] = da[b] * static_cast<float>(sum) / 4.f;
        a.c0[pair * 16 + lane] = -z * a.c2[pair * 16 + lane];
      }
    }
  }
  return a;
}

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

// Pair p of a row in plain C: its 64 unsigned values in the kernels' order and per lane dv, mv.
void unpack_pair(int64_t kind, const Row& r, int64_t p, int64_t nb, uint8_t* q, float* dv, float* mv) {
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
  if (kind == Q5_K || kind == Q6_K) {
    const int planes = kind == Q5_K ? 1 : 2;
    for (int pl = 0; pl < planes; ++pl) {
      uint64_t bits;
      std::memcpy(&bits, r.qh + p * 8 * planes + 8 * pl, 8);
      for (int i = 0; i < 64; ++i) q[i] |= static_cast<uint8_t>(((bits >> i) & 1) << (4 + pl));
    }
  }
  for (int lane = 0; lane < 16; ++lane) {
    const int c = lane / 4, blk = chunk_block(kind, c);
    const int64_t b = 2 * p + blk;
    dv[lane] = 0.f;
    mv[lane] = 0.f;
    if (b >= nb) continue;
    if (!super_blocks(kind)) {
      dv[lane] = static_cast<float>(r.d[b]);
      if (r.m) mv[lane] = static_cast<float>(r.m[b]);
    } else if (kind == Q6_K) {
      const int64_t g = 2 * b + chunk_half(kind, c);
      dv[lane] = static_cast<float>(r.d[b / 8]) * static_cast<float>(static_cast<int8_t>(r.sc[g]));
    } else {
      dv[lane] = static_cast<float>(r.d[b / 8]) * static_cast<float>(r.sc[b]);
      mv[lane] = -(static_cast<float>(r.m[b / 8]) * static_cast<float>(r.mn[b]));
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kVnni = true;

inline float half_to_float(const c10::Half& h) { return _cvtsh_ss(h.x); }

// The 64 unsigned weight values of pair p (the second block zero when `half`), in the kernels' order.
template <int KIND>
inline __m512i load_pair(const Row& r, int64_t p, bool half) {
  if (KIND == Q8_0) {
    const uint8_t* src = r.qs + p * 64;
    return half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, src) : _mm512_loadu_si512(src);
  }
  const uint8_t* src = r.qs + p * 32;
  const __m256i v = half ? _mm256_maskz_loadu_epi8(0xFFFFu, src) : _mm256_loadu_si256((const __m256i*)src);
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  if (KIND == Q5_K || KIND == Q6_K) {
    constexpr int planes = KIND == Q5_K ? 1 : 2;
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

// Two fp16 block values (d or m of a pair) spread over the 16 lanes by block.
inline __m512 load_scales(const c10::Half* s, int64_t p, bool half, const __m512i& idx) {
  const __m128i raw = _mm_maskz_loadu_epi16(half ? 0x1 : 0x3, s + p * 2);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(raw)));
}

// `count` bytes at `src` (unsigned, or signed when SIGNED) as floats spread over the lanes by `idx`.
template <bool SIGNED>
inline __m512 load_bytes(const uint8_t* src, int count, const __m512i& idx) {
  int32_t raw = 0;
  std::memcpy(&raw, src, count);
  const __m128i v = _mm_cvtsi32_si128(raw);
  const __m512i i32 = SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
  return _mm512_permutexvar_ps(idx, _mm512_cvtepi32_ps(i32));
}

template <int KIND, int M>
void dot_rows(const Row& r, int64_t nb, const Activation* act, float* out) {
  const int64_t pairs = (nb + 1) / 2;
  // lane -> block of the pair; lane -> q6_k group of the pair (chunk c: block c % 2, half c / 2)
  const __m512i idx = KIND == Q8_0 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i idx6 = _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0);
  constexpr bool has_m = KIND == Q4_1 || KIND == Q4_K || KIND == Q5_K;
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const bool half = 2 * p + 1 == nb;
    const __m512i w = load_pair<KIND>(r, p, half);
    __m512 dv, mv = _mm512_setzero_ps();
    if (KIND == Q8_0 || KIND == Q4_0 || KIND == Q4_1) {
      dv = load_scales(r.d, p, half, idx);
      if (KIND == Q4_1) mv = load_scales(r.m, p, half, idx);
    } else if (KIND == Q6_K) {
      dv = _mm512_mul_ps(load_bytes<true>(r.sc + p * 4, 4, idx6), _mm512_set1_ps(half_to_float(r.d[p / 4])));
    } else {
      dv = _mm512_mul_ps(load_bytes<false>(r.sc + p * 2, 2, idx), _mm512_set1_ps(half_to_float(r.d[p / 4])));
      mv = _mm512_mul_ps(load_bytes<false>(r.mn + p * 2, 2, idx), _mm512_set1_ps(-half_to_float(r.m[p / 4])));
    }
    for (int i = 0; i < M; ++i) {
      const Activation& a = act[i];
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(a.q.data() + p * 64));
      const __m512 c1 = _mm512_loadu_ps(a.c1.data() + p * 16);
      const __m512 f = KIND == Q4_1 || KIND == Q4_K || KIND == Q5_K
                           ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot), c1)
                           : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), c1, _mm512_loadu_ps(a.c0.data() + p * 16));
      acc[i] = _mm512_fmadd_ps(f, dv, acc[i]);
      if (has_m) acc[i] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(a.c2.data() + p * 16), acc[i]);
    }
  }
  for (int i = 0; i < M; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#else
constexpr bool kVnni = false;

template <int KIND, int M>
void dot_rows(const Row& r, int64_t nb, const Activation* act, float* out) {
  uint8_t q[64];
  float dv[16], mv[16];
  for (int i = 0; i < M; ++i) out[i] = 0.f;
  for (int64_t p = 0; p < (nb + 1) / 2; ++p) {
    unpack_pair(KIND, r, p, nb, q, dv, mv);
    for (int i = 0; i < M; ++i) {
      const Activation& a = act[i];
      float s = 0.f;
      for (int lane = 0; lane < 16; ++lane) {
        int dot = 0;
        for (int j = 4 * lane; j < 4 * lane + 4; ++j) dot += int(q[j]) * a.q[p * 64 + j];
        const int64_t l = p * 16 + lane;
        s += dv[lane] * (a.c1[l] * static_cast<float>(dot) + a.c0[l]) + mv[lane] * a.c2[l];
      }
      out[i] += s;
    }
  }
}
#endif

const uint8_t* bytes_of(const at::Tensor& t, at::ScalarType type, int64_t n, int64_t row, const char* what) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == type && t.size(0) == n && t.size(1) == row,
              "quant: ", what, " has the wrong dtype or shape for its kind");
  return static_cast<const uint8_t*>(t.data_ptr());
}

// w = [qs, d, m, sc, mn, qh] (engine/loader/gguf_tensors.py's FIELDS; empty tensors where absent).
Weight weight_of(at::TensorList w, int64_t kind) {
  TORCH_CHECK(kind >= Q8_0 && kind <= Q6_K, "quant: kind must be 0..5 (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)");
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
  out.qh_row = kind == Q5_K ? k / 8 : k / 4;
  out.qs = qs.data_ptr<uint8_t>();
  out.d = reinterpret_cast<const c10::Half*>(bytes_of(w[1], at::kHalf, n, out.d_row, "d"));
  out.m = reinterpret_cast<const c10::Half*>(bytes_of(w[2], at::kHalf, n, out.d_row, "m"));
  out.sc = bytes_of(w[3], kind == Q6_K ? at::kChar : at::kByte, n, out.sc_row, "sc");
  out.mn = bytes_of(w[4], at::kByte, n, out.sc_row, "mn");
  out.qh = bytes_of(w[5], at::kByte, n, out.qh_row, "qh");
  const bool need_m = kind == Q4_1 || kind == Q4_K || kind == Q5_K;
  TORCH_CHECK(out.d != nullptr, "quant: d is required");
  TORCH_CHECK((out.m != nullptr) == need_m, "quant: m is given exactly for q4_1, q4_k and q5_k");
  TORCH_CHECK((out.sc != nullptr) == sup, "quant: sc is given exactly for the K-quants");
  TORCH_CHECK((out.mn != nullptr) == (kind == Q4_K || kind == Q5_K), "quant: mn is given exactly for q4_k and q5_k");
  TORCH_CHECK((out.qh != nullptr) == (kind == Q5_K || kind == Q6_K), "quant: qh is given exactly for q5_k and q6_k");
  return out;
}

template <int KIND, int M>
void run_rows(const Weight& w, const std::vector<Activation>& act, const float* bias, const float* other, float* y,
              int64_t n_out, bool swiglu) {
  const int64_t nb = w.k / 32;
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    float a[M], b[M];
    for (int64_t n = n0; n < n1; ++n) {
      dot_rows<KIND, M>(row_of(w, n), nb, act.data(), a);
      if (swiglu) {
        const int64_t u = n + n_out;
        dot_rows<KIND, M>(row_of(w, u), nb, act.data(), b);
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
void run_kind(const Weight& w, const std::vector<Activation>& act, const float* bias, const float* other, float* y,
              int64_t n_out, bool swiglu) {
  switch (act.size()) {
    case 1: run_rows<KIND, 1>(w, act, bias, other, y, n_out, swiglu); break;
    case 2: run_rows<KIND, 2>(w, act, bias, other, y, n_out, swiglu); break;
    case 3: run_rows<KIND, 3>(w, act, bias, other, y, n_out, swiglu); break;
    case 4: run_rows<KIND, 4>(w, act, bias, other, y, n_out, swiglu); break;
    case 5: run_rows<KIND, 5>(w, act, bias, other, y, n_out, swiglu); break;
    case 6: run_rows<KIND, 6>(w, act, bias, other, y, n_out, swiglu); break;
    case 7: run_rows<KIND, 7>(w, act, bias, other, y, n_out, swiglu); break;
    default: run_rows<KIND, 8>(w, act, bias, other, y, n_out, swiglu); break;
  }
}

at::Tensor quant_linear(const at::Tensor& x, at::TensorList wl, int64_t kind, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& other, c10::string_view op_view) {
  const std::string op(op_view);
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", "quant_linear: op must be none, add or swiglu");
  const Weight w = weight_of(wl, kind);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(0) >= 1 &&
                  x.size(0) <= kMaxRows && x.size(1) == w.k,
              "quant_linear: x must be contiguous float32 [rows <= 8, K]");
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
  switch (kind) {
    case Q8_0: run_kind<Q8_0>(w, act, bp, op_, yp, n_out, swiglu); break;
    case Q4_0: run_kind<Q4_0>(w, act, bp, op_, yp, n_out, swiglu); break;
    case Q4_1: run_kind<Q4_1>(w, act, bp, op_, yp, n_out, swiglu); break;
    case Q4_K: run_kind<Q4_K>(w, act, bp, op_, yp, n_out, swiglu); break;
    case Q5_K: run_kind<Q5_K>(w, act, bp, op_, yp, n_out, swiglu); break;
    default: run_kind<Q6_K>(w, act, bp, op_, yp, n_out, swiglu); break;
  }
  return y;
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

bool quant_linear_fast() { return kVnni; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("quant_linear(Tensor x, Tensor[] w, int kind, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("quant_dequant(Tensor[] w, int kind, int r0, int r1) -> Tensor");
  m.def("quant_linear_fast() -> bool", &quant_linear_fast);
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequant", &quant_dequant);
}
