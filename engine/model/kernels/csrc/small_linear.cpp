// small_linear: `x @ W.T` for a few rows (decode steps), streaming each weight row once for all of them.
//
// At one to four rows a linear is a pass over its weight: the time is how fast the weight streams
// from memory. oneDNN's packed kernels are built for many rows and stream a [N, K] bf16 weight at
// about half the speed of a plain row-dot loop on a 2-core AVX512-BF16 CPU (measured: LM head
// 32000x512, 519 us against 407 us; an MLP weight 512x1408, 27 us against 14 us). This kernel reads
// the model's own weights in place (no packed copy), row by row, with one accumulator per input row:
//   op "none"    y = x @ cat(W).T + b          (Q|K|V from three weights, the LM head)
//   op "add"     y = other + x @ W.T + b       (the residual adds after attention and the MLP)
//   op "swiglu"  y = silu(x @ G.T + bg) * (x @ U.T + bu), weights = [G, U]   (the MLP's first half)
// Sums and the epilogue are fp32; the result is rounded once to x's dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;  // rows per call; the Python side sends more to oneDNN

// dots[m] = x[m] . w for up to kMaxRows rows x (stride k) and one weight row w.
template <int M>
inline void dots(const float* x, const float* w, int64_t k, float* out) {
  int64_t d = 0;
  float s[M] = {};
#if defined(__AVX512F__)
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (; d + 16 <= k; d += 16) {
    const __m512 wv = _mm512_loadu_ps(w + d);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + d), wv, acc[m]);
  }
  for (int m = 0; m < M; ++m) s[m] = _mm512_reduce_add_ps(acc[m]);
#endif
  for (; d < k; ++d)
    for (int m = 0; m < M; ++m) s[m] += x[m * k + d] * w[d];
  for (int m = 0; m < M; ++m) out[m] = s[m];
}

template <int M>
inline void dots(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k, float* out) {
  int64_t d = 0;
  float s[M] = {};
#if defined(__AVX512BF16__)
  // bf16 pairs multiplied and summed into fp32 lanes in one instruction
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (; d + 32 <= k; d += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + d);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * k + d), wv);
  }
  for (int m = 0; m < M; ++m) s[m] = _mm512_reduce_add_ps(acc[m]);
#endif
  for (; d < k; ++d)
    for (int m = 0; m < M; ++m) s[m] += static_cast<float>(x[m * k + d]) * static_cast<float>(w[d]);
  for (int m = 0; m < M; ++m) out[m] = s[m];
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// Output columns [n0, n1) of every row; `rows[j]` is the weight row of output column j.
template <typename T, int M>
void columns(const T* x, const std::vector<const T*>& parts, const std::vector<int64_t>& starts, const float* bias,
             const T* other, T* y, int64_t k, int64_t n_out, const std::string& op, int64_t n0, int64_t n1) {
  const bool swiglu = op == "swiglu";
  float a[M], b[M];
  size_t p = 0;
  for (int64_t n = n0; n < n1; ++n) {
    if (swiglu) {  // column n: gate row n and up row n
      dots<M>(x, parts[0] + n * k, k, a);
      dots<M>(x, parts[1] + n * k, k, b);
      const float bg = bias ? bias[n] : 0.f, bu = bias ? bias[n_out + n] : 0.f;
      for (int m = 0; m < M; ++m) y[m * n_out + n] = static_cast<T>(silu(a[m] + bg) * (b[m] + bu));
      continue;
    }
    while (p + 1 < starts.size() && n >= starts[p + 1]) ++p;  // which of the concatenated weights
    dots<M>(x, parts[p] + (n - starts[p]) * k, k, a);
    const float bn = bias ? bias[n] : 0.f;
    for (int m = 0; m < M; ++m) {
      float v = a[m] + bn;
      if (other) v += static_cast<float>(other[m * n_out + n]);
      y[m * n_out + n] = static_cast<T>(v);
    }
  }
}

template <typename T>
void run(const at::Tensor& x, const std::vector<at::Tensor>& weights, const float* bias, const T* other, at::Tensor& y,
         const std::string& op) {
  const int64_t rows = x.size(0), k = x.size(1), n_out = y.size(1);
  std::vector<const T*> parts;
  std::vector<int64_t> starts;
  int64_t start = 0;
  for (const auto& w : weights) {
    parts.push_back(w.data_ptr<T>());
    starts.push_back(start);
    start += w.size(0);
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // 16 output columns per task at least: each is a whole weight row (K values), enough to amortize
  at::parallel_for(0, n_out, 16, [&](int64_t n0, int64_t n1) {
    switch (rows) {
      case 1: columns<T, 1>(xp, parts, starts, bias, other, yp, k, n_out, op, n0, n1); break;
      case 2: columns<T, 2>(xp, parts, starts, bias, other, yp, k, n_out, op, n0, n1); break;
      case 3: columns<T, 3>(xp, parts, starts, bias, other, yp, k, n_out, op, n0, n1); break;
      default: columns<T, 4>(xp, parts, starts, bias, other, yp, k, n_out, op, n0, n1); break;
    }
  });
}

at::Tensor small_linear(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& other, c10::string_view op_view) {
  const std::string op(op_view);
  TORCH_CHECK(op == "none" || op == "add" || op == "swiglu", "small_linear: op must be none, add or swiglu, got ", op);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "small_linear: x must be a contiguous [rows, K] tensor with 1 to ", kMaxRows, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "small_linear: only float32 and bfloat16 are supported, got ", x.scalar_type());
  TORCH_CHECK(!weights.empty() && (op != "swiglu" || weights.size() == 2),
              "small_linear: give the weights to concatenate (swiglu: exactly [gate, up])");
  int64_t n_total = 0;
  std::vector<at::Tensor> ws;
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) && w.scalar_type() == x.scalar_type(),
                "small_linear: every weight must be a contiguous [N, K] tensor of x's dtype and K");
    n_total += w.size(0);
    ws.push_back(w);
  }
  if (op == "swiglu")
    TORCH_CHECK(ws[0].size(0) == ws[1].size(0), "small_linear: swiglu's gate and up weights must have the same rows");
  const int64_t n_out = op == "swiglu" ? ws[0].size(0) : n_total;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.numel() == n_total, "small_linear: bias must have one value per weight row");
  }
  at::Tensor o;
  if (op == "add") {
    TORCH_CHECK(other.has_value(), "small_linear: op add needs `other`");
    o = other->contiguous();
    TORCH_CHECK(o.scalar_type() == x.scalar_type() && o.dim() == 2 && o.size(0) == x.size(0) && o.size(1) == n_out,
                "small_linear: `other` must be [rows, N] of x's dtype");
  }
  auto y = at::empty({x.size(0), n_out}, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, ws, bp, o.defined() ? o.data_ptr<float>() : nullptr, y, op);
  } else {
    run<c10::BFloat16>(x, ws, bp, o.defined() ? o.data_ptr<c10::BFloat16>() : nullptr, y, op);
  }
  return y;
}

// Whether this build streams weights with vector instructions for `dtype` (else the loops are scalar
// and the Python side keeps oneDNN).
bool small_linear_fast(c10::string_view dtype) {
#if defined(__AVX512BF16__)
  if (dtype == "bfloat16") return true;
#endif
#if defined(__AVX512F__)
  if (dtype == "float32") return true;
#endif
  return false;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cellserve, m) {
  m.def("small_linear(Tensor x, Tensor[] weights, Tensor? bias, Tensor? other, str op) -> Tensor");
  m.def("small_linear_fast(str dtype) -> bool", &small_linear_fast);
}

TORCH_LIBRARY_IMPL(cellserve, CPU, m) {
  m.impl("small_linear", &small_linear);
}
