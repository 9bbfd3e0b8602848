// packed_linear: `x @ W.T` for one to four rows, read straight from oneDNN's packed copy of W (the only copy).
//
// The float linears keep one weight: the oneDNN-packed one that many-row calls need (its blocked layout is
// 1.2-1.6x faster than a plain weight at 8-32 rows). At one row a plain row-dot loop used to stream the
// model's own weight (a second copy); this kernel streams the packed one instead, which is as good a layout
// for it: oneDNN packs a [N, K] weight into panels of output columns, each contiguous over K.
//   float32, oneDNN tag AB16b64a:   panel p = columns [64p, 64p+64), stored [Kp][64]
//   bfloat16, oneDNN tag AB16b32a2b: panel p = columns [32p, 32p+32), stored [Kp/2][32][2] (k pairs, VNNI)
// Kp is K rounded up to the tag's K block (zero padded), N to the panel width. `packed_bytes` exposes the
// packed buffer as a plain uint8 tensor (sharing its memory); the Python side checks, once per weight,
// that the bytes are exactly this layout (engine/model/native/linear.py) and keeps a plain weight otherwise.
//   op "none"    y = x @ W.T + b
//   op "add"     y = other + x @ W.T + b
//   op "swiglu"  y = silu(x @ G.T + bg) * (x @ U.T + bu), panels = [G, U]
// Sums and the epilogue are fp32; the result is rounded once to x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace at::native {  // libtorch_cpu's accessors of an opaque oneDNN tensor (ATen/native/mkldnn/MKLDNNCommon.h)
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

constexpr int64_t kMaxRows = 4;

// acc[m][0..W) = x[m] . panel columns, over k in [0, K); x rows have stride k_stride.
template <int M>
inline void panel_dots(const float* x, int64_t k_stride, const float* panel, int64_t K, float (*acc)[64]) {
#if defined(__AVX512F__)
  __m512 a[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) a[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * 64;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
                 w3 = _mm512_loadu_ps(w + 48);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * k_stride + k]);
      a[m][0] = _mm512_fmadd_ps(xv, w0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(xv, w1, a[m][1]);
      a[m][2] = _mm512_fmadd_ps(xv, w2, a[m][2]);
      a[m][3] = _mm512_fmadd_ps(xv, w3, a[m][3]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc[m] + 16 * j, a[m][j]);
#else
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 64; ++j) acc[m][j] = 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 64; ++j) acc[m][j] += x[m * k_stride + k] * panel[k * 64 + j];
#endif
}

template <int M>
inline void panel_dots(const c10::BFloat16* x, int64_t k_stride, const c10::BFloat16* panel, int64_t K,
                       float (*acc)[64]) {
  const int64_t pairs = K / 2;
#if defined(__AVX512BF16__)
  __m512 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    const c10::BFloat16* w = panel + q * 64;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int m = 0; m < M; ++m) {  // (x[2q], x[2q+1]) in every 32-bit lane
      int32_t pair;
      std::memcpy(&pair, x + m * k_stride + 2 * q, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      a[m][0] = _mm512_dpbf16_ps(a[m][0], xv, w0);
      a[m][1] = _mm512_dpbf16_ps(a[m][1], xv, w1);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(acc[m], a[m][0]);
    _mm512_storeu_ps(acc[m] + 16, a[m][1]);
  }
#else
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 32; ++j) acc[m][j] = 0.f;
  for (int64_t q = 0; q < pairs; ++q)
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 32; ++j)
        acc[m][j] += static_cast<float>(x[m * k_stride + 2 * q]) * static_cast<float>(panel[q * 64 + 2 * j]) +
                     static_cast<float>(x[m * k_stride + 2 * q + 1]) * static_cast<float>(panel[q * 64 + 2 * j + 1]);
#endif
  if (K % 2)  // the last k alone: its pair's second weight is padding, x has no value there
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 32; ++j)
        acc[m][j] += static_cast<float>(x[m * k_stride + K - 1]) * static_cast<float>(panel[pairs * 64 + 2 * j]);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

template <typename T>
constexpr int64_t width() { return std::is_same_v<T, float> ? 64 : 32; }

// Panels [p0, p1) of every row.
template <typename T, int M>
void panels_range(const T* x, const std::vector<const T*>& ws, int64_t panel_elems, const float* bias,
                  const T* other, T* y, int64_t K, int64_t n_out, bool swiglu, int64_t p0, int64_t p1) {
  constexpr int64_t W = width<T>();
  float a[M][64], b[M][64];
  for (int64_t p = p0; p < p1; ++p) {
    panel_dots<M>(x, K, ws[0] + p * panel_elems, K, a);
    if (swiglu) panel_dots<M>(x, K, ws[1] + p * panel_elems, K, b);
    const int64_t n0 = p * W, n1 = std::min(n_out, n0 + W);
    for (int m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        float v = a[m][n - n0] + (bias ? bias[n] : 0.f);
        if (swiglu) {
          v = silu(v) * (b[m][n - n0] + (bias ? bias[n_out + n] : 0.f));
        } else if (other) {
          v += static_cast<float>(other[m * n_out + n]);
        }
        y[m * n_out + n] = static_cast<T>(v);
      }
  }
}

template <typename T>
void run(const at::Tensor& x, const std::vector<at::Tensor>& panels, const float* bias, const T* other, at::Tensor& y,
         bool swiglu) {
  const int64_t rows = x.size(0), K = x.size(1), n_out = y.size(1);
  std::vector<const T*> ws;
  for (const auto& p : panels) ws.push_back(p.data_ptr<T>());
  const int64_t n_panels = panels[0].size(0), panel_elems = panels[0].stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, n_panels, 1, [&](int64_t p0, int64_t p1) {
    switch (rows) {
      case 1: panels_range<T, 1>(xp, ws, panel_elems, bias, other, yp, K, n_out, swiglu, p0, p1); break;
      case 2: panels_range<T, 2>(xp, ws, panel_elems, bias, other, yp, K, n_out, swiglu, p0, p1); break;
      case 3: panels_range<T, 3>(xp, ws, panel_elems, bias, other, yp, K, n_out, swiglu, p0, p1); break;
      default: panels_range<T, 4>(xp, ws, panel_elems, bias, other, yp, K, n_out, swiglu, p0, p1); break;
    }
  });
}

// panels: [P, Kp * 64] float32 or [P, Kp / 2 * 64] bfloat16 (the packed bytes viewed as such), one tensor
// (or [gate, up] for swiglu); n_out: the weight's true row count (the last panel may be padding).
at::Tensor packed_linear(const at::Tensor& x, at::TensorList panels, int64_t n_out, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& other, c10::string_view op_view) {
  const std::string op(op_view);
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", "packed_linear: op must be none, add or swiglu, got ", op);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "packed_linear: x must be a contiguous [rows, K] tensor with 1 to ", kMaxRows, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "packed_linear: only float32 and bfloat16 are supported, got ", x.scalar_type());
  const bool swiglu = op == "swiglu";
  TORCH_CHECK(panels.size() == (swiglu ? 2u : 1u), "packed_linear: one packed weight (swiglu: [gate, up])");
  const int64_t W = x.scalar_type() == at::kFloat ? 64 : 32, K = x.size(1);
  const int64_t k_pad = x.scalar_type() == at::kFloat ? (K + 15) / 16 * 16 : (K + 31) / 32 * 32;
  for (const auto& p : panels) {
    TORCH_CHECK(p.dim() == 2 && p.is_contiguous() && p.scalar_type() == x.scalar_type() &&
                    p.size(0) == (n_out + W - 1) / W && p.size(1) == k_pad * W,
                "packed_linear: a packed weight must be [ceil(N/", W, "), ", k_pad * W, "] of x's dtype");
  }
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.numel() == n_out * (swiglu ? 2 : 1), "packed_linear: bias: one value per row");
  }
  at::Tensor o;
  if (op == "add") {
    TORCH_CHECK(other.has_value(), "packed_linear: op add needs `other`");
    o = other->contiguous();
    TORCH_CHECK(o.scalar_type() == x.scalar_type() && o.dim() == 2 && o.size(0) == x.size(0) && o.size(1) == n_out,
                "packed_linear: `other` must be [rows, N] of x's dtype");
  }
  auto y = at::empty({x.size(0), n_out}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  std::vector<at::Tensor> ps(panels.begin(), panels.end());
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, ps, bp, o.defined() ? o.data_ptr<float>() : nullptr, y, swiglu);
  } else {
    run<c10::BFloat16>(x, ps, bp, o.defined() ? o.data_ptr<c10::BFloat16>() : nullptr, y, swiglu);
  }
  return y;
}

// The packed (opaque oneDNN) tensor's bytes as a uint8 tensor sharing its memory; it keeps `packed` alive.
at::Tensor packed_bytes(const at::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn(), "packed_bytes: give a oneDNN-packed tensor (torch.ops.mkldnn._reorder_linear_weight)");
  void* data = at::native::data_ptr_from_mkldnn(packed);
  const int64_t n = at::native::nbytes_from_mkldnn(packed);
  at::Tensor owner = packed;
  return at::from_blob(data, {n}, [owner](void*) mutable { owner.reset(); }, at::TensorOptions().dtype(at::kByte));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("packed_linear(Tensor x, Tensor[] panels, int n_out, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("packed_bytes(Tensor packed) -> Tensor", &packed_bytes);
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
